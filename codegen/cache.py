"""Generated modules on disk, one file per (schedule, backend, kernel mode, runtime): readable, importable, reused.

The directory is ``$COCONET_CACHE_DIR``, else ``$XDG_CACHE_HOME/coconet``, else
``~/.cache/coconet``; files are written atomically, so concurrent ranks and
runs never read half a module.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

from coconet.kernels.cache import cache_dir as runtime_cache_dir


class Module(Protocol):
    """What ``module_path`` writes: a lowering's ``Generated``, or a baseline's task."""

    @property
    def path(self) -> str: ...

    @property
    def source(self) -> str: ...


def cache_dir() -> Path:
    return Path(runtime_cache_dir())


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
