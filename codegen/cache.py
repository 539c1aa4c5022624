"""Generated modules on disk, one file per (schedule hash, backend): readable, importable, reused.

The directory is ``$COCONET_CACHE_DIR``, else ``$XDG_CACHE_HOME/coconet``, else
``~/.cache/coconet``; files are written atomically, so concurrent ranks and
runs never read half a module.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from coconet.codegen.lower import Generated


def cache_dir() -> Path:
    from coconet.codegen.prelude import _cache_dir  # the prelude imports torch: seconds that most callers skip

    return Path(_cache_dir())


def module_path(gen: Generated) -> Path:
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
