"""Atomic writes: a run killed at any moment leaves either the old file/folder or the new one.

Everything is first written next to its destination under a temporary name, then moved into
place with ``os.replace`` (atomic on one file system).  A folder that already exists is moved
aside first and deleted only once the new one is in place.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

STAGING, ASIDE = ".tmp-", ".old-"  # name parts of a folder being written, and of one moved aside


@contextlib.contextmanager
def atomic_directory(destination: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``destination`` in one step."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}{STAGING}", dir=destination.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # mkdtemp makes the folder private (0700); a checkpoint should read like any other folder.
    os.chmod(staging, 0o755)
    old = None
    if destination.exists():
        old = destination.parent / f".{destination.name}{ASIDE}{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(destination, old)
    os.replace(staging, destination)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(strict_json(data), indent=2, sort_keys=False, allow_nan=False) + "\n")


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as None, so the file is strict JSON (a bare NaN
    or Infinity is not JSON, and most readers refuse it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value



def recover_interrupted_writes(folder: str | Path) -> list[str]:
    """Finish or undo what a killed run left of its atomic writes in ``folder``; returns notices.

    A kill between the two renames of a folder swap leaves no destination, the old folder moved
    aside and the new one complete in staging (the swap starts only once staging is complete):
    the new one is put in place.  Anything else left in staging was never finished and is
    deleted, as is an old folder once its destination exists.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    notices = []
    leftovers: dict[str, dict[str, list[Path]]] = {}
    for path in folder.iterdir():
        for kind in (STAGING, ASIDE):
            if path.name.startswith(".") and kind in path.name:
                name = path.name[1:path.name.rindex(kind)]
                leftovers.setdefault(name, {STAGING: [], ASIDE: []})[kind].append(path)
    for name, found in leftovers.items():
        destination = folder / name
        if not destination.exists() and found[ASIDE]:
            complete = max(found[STAGING], key=lambda p: p.stat().st_mtime) if found[STAGING] else found[ASIDE][0]
            os.replace(complete, destination)
            notices.append(f"{destination}: a swap interrupted by a kill was completed")
        for path in found[STAGING] + found[ASIDE]:
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                notices.append(f"removed {path.name}, left unfinished by a killed run")
    return notices
