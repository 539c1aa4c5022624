"""A tensor as the ranks hold it: the rows of a Sliced dim each rank holds, a value cut into the ranks' pieces
and put back together, its concrete shape at given sizes, and a float rounded to a dtype as torch stores it."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from coconet.errors import SizeError
from coconet.schedules.types import Local, Replicated, Sliced, TensorType

Pieces = list[np.ndarray]  # one array per rank of the stage group


def slice_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of a dim of extent ``n`` that ``rank`` holds when Sliced over ``world`` ranks."""
    chunk = -(-n // world)
    lo = min(rank * chunk, n)
    return lo, min(lo + chunk, n)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype``'s precision (returned as float64)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x
    if dtype == "float32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        # Round-to-nearest-even on the high 16 bits of the float32 pattern.
        bits = np.ascontiguousarray(x.astype(np.float32)).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64).reshape(np.shape(x))  # 0-d stays 0-d
    if dtype == "int64":
        return np.asarray(x).astype(np.int64)
    if dtype == "bool":
        return np.asarray(x).astype(bool)
    raise ValueError(dtype)


def concrete_shape(t: TensorType, sizes: Mapping[str, int]) -> tuple[int, ...]:
    shape = tuple(d.evaluate(sizes) for d in t.shape)
    for d, n in zip(t.shape, shape):
        if n <= 0:
            raise SizeError(f"dim {d} evaluates to {n} with sizes {dict(sizes)}; sizes must be positive")
    return shape


def local_region(t: TensorType, shape: tuple[int, ...], world: int, rank: int) -> tuple[slice, ...]:
    """The region of the global value that ``rank`` holds."""
    region = [slice(0, n) for n in shape]
    if isinstance(t.layout, Sliced):
        d = t.layout.dim
        region[d] = slice(*slice_bounds(shape[d], world, rank))
    return tuple(region)


def distribute(t: TensorType, value: np.ndarray, shape: tuple[int, ...], world: int) -> Pieces:
    """Global value → per-rank pieces (a Local value arrives as ``(world, *shape)``). The pieces are views of
    ``value``, and a Replicated value is one array on every rank: nothing here writes an array it was given."""
    value = np.asarray(value)
    if isinstance(t.layout, Local):
        return [value[r] for r in range(world)]
    if isinstance(t.layout, Replicated):
        return [value] * world
    return [value[local_region(t, shape, world, r)] for r in range(world)]


def assemble(t: TensorType, pieces: Pieces) -> np.ndarray:
    """Per-rank pieces → the global value (Local: stacked as ``(world, *shape)``)."""
    if isinstance(t.layout, Local):
        return np.stack(pieces)
    if isinstance(t.layout, Sliced):
        return np.concatenate(pieces, axis=t.layout.dim)
    return pieces[0]
