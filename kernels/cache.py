"""coconet's folder for what is built once per machine and reused: compiled C (``coconet.kernels.copier``),
generated modules (``coconet.codegen.cache``)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """``$COCONET_CACHE_DIR``, else ``$XDG_CACHE_HOME/coconet``, else ``~/.cache/coconet``."""
    root = os.environ.get("COCONET_CACHE_DIR")
    if root:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "coconet")
