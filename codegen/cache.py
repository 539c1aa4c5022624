"""Generated modules on disk, one file per (schedule hash, backend): readable, importable, reused.

The directory is ``$COCONET_CACHE_DIR``, else ``$XDG_CACHE_HOME/coconet``, else
``~/.cache/coconet``; files are written atomically, so concurrent ranks and
runs never read half a module.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol


class Module(Protocol):
    """What ``module_path`` writes: a lowering's ``Generated``, or a baseline's task."""

    @property
    def path(self) -> str: ...

    @property
    def source(self) -> str: ...


def _cache_dir():
    """coconet's on-disk cache: ``$COCONET_CACHE_DIR``, else ``$XDG_CACHE_HOME/coconet``, else
    ``~/.cache/coconet``."""
    root = os.environ.get("COCONET_CACHE_DIR")
    if root:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "coconet")


def cache_dir() -> Path:
    return Path(_cache_dir())


def module_path(gen: Module) -> Path:
    """Write the module if it is not cached yet; return its path."""
    path = Path(gen.path)
    if path.exists() and path.read_text() == gen.source:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(gen.source)
    os.replace(tmp, path)
    return path
