"""User code loaded by name: ``package.module:function`` or ``path/file.py:function`` -- reward
functions, tools, environments, tool parsers -- one way for all of them (docs/design.md, "Rewards")."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from ppo_rlhf.config import ConfigError


def import_module(module_name: str):
    """A module by dotted name, or a ``.py`` file by path.

    The current folder is searched too (after everything else), as ``python -m`` would: the
    ``ppo-rlhf`` console script does not put it on ``sys.path``, and a reward module sitting
    beside the data is the common case.
    """
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ImportError(f"no file {path}")
        name = _file_module_name(path)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # so what it defines can be pickled and found again
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        cwd = os.getcwd()
        if error.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)


def _file_module_name(path: Path) -> str:
    """The name a user's file is registered under in ``sys.modules``: its stem, unless that names
    another module (``json.py``, ``torch.py``): then a name of its own, so that the real module is
    not replaced for everything imported after it (docs/design.md, "Rewards")."""
    name = path.stem
    other = sys.modules.get(name)
    if other is None:
        try:
            other = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            other = None
    if other is None:
        return name
    origin = getattr(other, "__file__", None) or getattr(other, "origin", None)
    if origin and os.path.exists(origin) and Path(origin).resolve() == path.resolve():
        return name  # the same file, loaded again
    return f"ppo_rlhf_reward_file_{name}"


def load_function(dotted_path: str, what: str = "reward function", also: tuple[type, ...] = ()):
    """``package.module:function``, ``package.module.function`` or ``path/file.py:function`` -> the
    function (or class: anything callable; or an object of a type in ``also``: a dict of
    environments); ``what`` names it in the errors."""
    module_name, sep, attribute = dotted_path.rpartition(":")
    if not sep:
        module_name, _, attribute = dotted_path.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(f"{what} must look like 'package.module:function', got {dotted_path!r}")
    try:
        module = import_module(module_name)
    except Exception as error:  # noqa: BLE001 -- whatever the user's module raises on import, named
        raise ConfigError(f"cannot import module {module_name!r} for {what} {dotted_path!r}: "
                          f"{type(error).__name__}: {error}") from None
    function = getattr(module, attribute, None)
    if not callable(function) and not isinstance(function, also):
        raise ConfigError(f"{module_name!r} has no function {attribute!r} ({what} {dotted_path!r})")
    return function


# How a run records an object given in Python that has no import path (a class defined inside a
# function, a lambda, a functools.partial): named for people, refused where a later run would
# have to load it or check it is the same one (a resume).
UNNAMED = "<python object "


def recorded_name(obj) -> str:
    """What a run's config records for ``obj``, given in Python where a flag takes
    ``module:function``: that import path where it leads back to ``obj`` itself (a script run as
    ``python train.py``: its file's path, ``train.py:Class``), else an UNNAMED description."""
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    module = sys.modules.get(module_name) if module_name else None
    found = module
    for part in (qualname or "<").split("."):
        found = getattr(found, part, None) if "<" not in part else None
    if module is None or found is not obj:
        label = qualname or type(obj).__qualname__
        return f"{UNNAMED}{module_name + '.' if module_name else ''}{label}: no import path>"
    if module_name == "__main__":
        file = getattr(module, "__file__", None)
        if not file:  # an interactive session
            return f"{UNNAMED}__main__.{qualname}: no import path>"
        return f"{Path(file).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"


def is_unnamed(value) -> bool:
    """Whether a recorded ``value`` stands for an object without an import path (``recorded_name``)."""
    return isinstance(value, str) and value.startswith(UNNAMED)
