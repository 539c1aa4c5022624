"""What a priced lowering plan is made of (``coconet.tuner.pricing`` builds it, ``coconet.tuner.cost``
evaluates it): terms of symbolic extents, the kernels and collectives of each unit of the step, and the plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from coconet.schedules.dims import Dim

# A term is ``coef × Π extent_elems[i]`` (times a function of the world R when it has a third item, a
# PerWorld marker); an extent is a shape, with the dim that is sliced (or -1).
Term = tuple  # (float, tuple[int, ...]) or (float, tuple[int, ...], float)


@dataclass(frozen=True)
class Kernel:
    """One kernel or a run of eager ops: ``launches`` dispatches moving ``read`` + ``write`` bytes."""

    what: str
    launches: int
    read: tuple[Term, ...] = ()
    write: tuple[Term, ...] = ()
    fresh: tuple[Term, ...] = ()  # newly allocated buffers it fills, one term each
    # of read + write, the bytes that come from or go to memory whatever the cache holds: the
    # program's inputs and state (a temporary written by the kernel before may still be in cache)
    cold: tuple[Term, ...] = ()
    flops: tuple[Term, ...] = ()
    ops: tuple[Term, ...] = ()  # elementwise integer/float operations (compute-bound fused work)
    dtype: str = "float32"
    compiled: bool = False


@dataclass(frozen=True)
class Comm:
    """Collectives of one kind issued as ``launches`` messages (chunks), or, with ``cap``, as the
    bucket's launches of at most ``cap`` bytes over ``members`` (one term per buffer)."""

    op: str
    members: tuple[Term, ...]
    launches: int = 1
    cap: int | None = None
    shm: bool = False
    between_stages: bool = False
    flatten: bool = False  # gloo's coalesced collectives copy the buffers into one and back
    parts: bool = False  # members are this rank's parts of all_gathers (the shm bucket groups those)


@dataclass(frozen=True)
class Unit:
    what: str
    kernels: tuple[Kernel, ...]
    comms: tuple[Comm, ...] = ()
    chunks: int = 1  # > 1: the collectives are in flight while the kernels of later chunks run


@dataclass(frozen=True)
class Plan:
    dims: tuple[Dim, ...]
    extents: tuple[tuple[tuple[int, ...], int], ...]  # (indices into dims, sliced position or -1)
    units: tuple[Unit, ...]
    pipeline: bool


class PerWorld:
    """Factors of a buffer's bytes that depend on the world R, bound only at evaluation (a plan serves
    every world): markers in a term's third item."""

    PEERS_FRACTION = -1.0  # (R - 1) / R
    TWO_PEERS = -2.0  # 2 (R - 1): a reduction reads its own and every peer's rows, pairwise
    PEERS = -3.0  # R - 1
    ALL = -4.0  # R


def scaled(terms: Iterable[Term], marker: float) -> tuple[Term, ...]:
    # a term's coefficient carries the marker in a second slot: (coef, idx, marker)
    return tuple((c, idx, marker) for c, idx in terms)  # type: ignore[misc]
