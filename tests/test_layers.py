"""The layers of docs/design.md ("Layers"), held against the code's own imports: every module of
src/ppo_rlhf stands on one layer, imports only from its own layer and the ones below, and no
import closes a circle between files.  The table is read from the design text, where it is
written once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ppo_rlhf"


def layer_table() -> dict[str, int]:
    """Each entry of the design's layer table (a folder ``name/`` or a file ``name.py``) -> its layer."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for number, modules in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.MULTILINE):
        for entry in re.findall(r"`([^`]+)`", modules):
            layers[entry] = int(number)
    return layers


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    return {module_name(path): path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py" or
            path.parent != PACKAGE}


def layer_of(path: Path, table: dict[str, int]) -> int | None:
    relative = path.relative_to(PACKAGE)
    entry = f"{relative.parts[0]}/" if len(relative.parts) > 1 else relative.name
    return table.get(entry)


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """The package's modules ``path`` imports, anywhere in it (a function's own imports too), with
    the line of each; ``from ppo_rlhf.x import name`` counts the module x.name where that is one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                found.append((target if target in known else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return [(target, line) for target, line in found if target in known]


def test_every_module_stands_on_a_layer_of_the_design():
    table = layer_table()
    assert table, "docs/design.md's layer table was not found"
    missing = [str(path.relative_to(PACKAGE)) for path in modules().values() if layer_of(path, table) is None]
    assert not missing, f"modules on no layer of docs/design.md (\"Layers\"): {missing}"
    stale = [entry for entry in table if not (PACKAGE / entry).exists()]
    assert not stale, f"docs/design.md's layer table names what is not in src/ppo_rlhf: {stale}"


def test_no_import_points_up_a_layer():
    table, known = layer_table(), modules()
    upward = []
    for name, path in known.items():
        for target, line in imports(path, known):
            if layer_of(known[target], table) > layer_of(path, table):
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {target} "
                              f"(layer {layer_of(path, table)} -> {layer_of(known[target], table)})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_import_closes_a_circle():
    known = modules()
    edges = {name: {target for target, _ in imports(path, known) if target != name} for name, path in known.items()}
    circles, state = [], {}

    def visit(name: str, path: list[str]) -> None:  # depth first; a grey node met again closes a circle
        state[name] = "grey"
        for target in sorted(edges[name]):
            if state.get(target) == "grey":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "black"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not circles, "imports that close a circle:\n" + "\n".join(circles)
