"""Atomic writes: a run killed at any moment leaves either the old file/folder or the new one.

Everything is first written next to its destination under a temporary name, then moved into
place with ``os.replace`` (atomic on one file system).  A folder that already exists is moved
aside first and deleted only once the new one is in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_directory(destination: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``destination`` in one step."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # mkdtemp makes the folder private (0700); a checkpoint should read like any other folder.
    os.chmod(staging, 0o755)
    old = None
    if destination.exists():
        old = destination.parent / f".{destination.name}.old-{os.getpid()}"
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
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
