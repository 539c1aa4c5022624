"""The floor under a step's time: the bytes it must move once, at the machine's memory bandwidth.

Every input is read once (a Local input once per rank: each rank holds its own), every updated
state and every output written once. Collectives, padding and temporaries are what a schedule adds
on top; a perfect single-node schedule approaches this floor, none goes under it.
"""

from __future__ import annotations

import math
import time
from typing import Mapping

from coconet.schedules import interp
from coconet.schedules.ir import Program
from coconet.schedules.types import ITEMSIZE, Local



def _nbytes(t, sizes: Mapping[str, int]) -> int:
    return math.prod(interp.concrete_shape(t, sizes)) * ITEMSIZE.get(t.dtype or "float32", 4)


def bytes_moved_once(program: Program, sizes: Mapping[str, int], world: int) -> int:
    total = 0
    for s in program.inputs:
        if s.op == "input":
            total += _nbytes(s.type, sizes) * (world if isinstance(s.type.layout, Local) else 1)
    for target in program.updates:
        total += _nbytes(program[target].type, sizes)
    for value in program.outputs.values():
        total += _nbytes(program[value].type, sizes)
    return total


def memory_bandwidth(nbytes: int = 2**28, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes per second that an in-place read-modify-write (``a += b``: read a and b, write a) moves
    through this machine's memory, all threads; the best of ``repeats``.

    The update kernels this floor stands under are in-place read-modify-writes too, so this is the
    rate they could reach; a plain copy writes to fresh pages and, on a loaded machine, reads low.
    The best sample, not the median: the floor must not sit above what the machine can do.
    """
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.ones(nbytes // 4, dtype=torch.float32)
        b = torch.ones_like(a)
        a.add_(b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a.add_(b)
            best = min(best, time.perf_counter() - t0)
        return 3 * nbytes / best
    finally:
        torch.set_num_threads(old)
