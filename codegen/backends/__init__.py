"""The backends a schedule is lowered for, as objects (``Backend``): ``get(name)`` and ``BACKENDS``, their names.
Each backend is a module of its own (``gloo``, ``nccl``, ``shm``)."""

from __future__ import annotations

from coconet.codegen.backends.base import Backend
from coconet.codegen.backends.gloo import GLOO
from coconet.codegen.backends.nccl import NCCL
from coconet.codegen.backends.shm import SHM
from coconet.errors import BackendError

_REGISTRY = {b.name: b for b in (GLOO, NCCL, SHM)}
BACKENDS = tuple(_REGISTRY)

__all__ = ["BACKENDS", "Backend", "get"]


def get(name: str) -> Backend:
    """The backend called ``name``; a BackendError naming the known ones for any other."""
    found = _REGISTRY.get(name)
    if found is None:
        raise BackendError(f"unknown backend {name!r} (use {', '.join(BACKENDS)})", kind="compile_error")
    return found
