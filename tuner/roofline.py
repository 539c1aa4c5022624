"""The floor under a step's time: the larger of the bytes it must move once, at the machine's memory
bandwidth, and its matmuls' flops on the busiest rank, at that rank's matmul rate.

Every input is read once (a Local input once per rank: each rank holds its own), every updated
state and every output written once. Collectives, padding and temporaries are what a schedule adds
on top; a perfect single-node schedule approaches this floor, none goes under it. Matmuls run on each
rank's piece (a Sliced operand holds 1/R of its dim), the ranks in parallel, and every schedule of
the space keeps them: where they dominate (the Megatron layer), the compute floor bounds every speed-up.
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


def matmul_flops_per_rank(program: Program, sizes: Mapping[str, int], world: int) -> float:
    """2·M·N·K of every matmul, on the pieces rank 0 holds (a Sliced dim: its first, largest, share)."""
    def local(t) -> list[int]:
        shape = interp.concrete_shape(t, sizes)
        return [len(range(n)[r]) for n, r in zip(shape, interp.local_region(t, shape, world, 0))]

    total = 0.0
    for s in program.stmts:
        if s.op == "matmul":
            a, out = local(program[s.args[0]].type), interp.concrete_shape(s.type, sizes)
            total += 2.0 * math.prod(out) * a[-1]
    return total


def compute_floor(program: Program, sizes: Mapping[str, int], world: int, rate_per_thread: float,
                  cpus: int, threads: int) -> float:
    """Seconds the matmuls take at least: the busiest rank's flops at ``threads`` threads, or every rank's
    flops on the ``cpus`` cores when the ranks outnumber them."""
    flops = matmul_flops_per_rank(program, sizes, world)
    return flops * world / (rate_per_thread * min(cpus, world * threads)) if flops else 0.0


def matmul_rate(threads: int = 1, m: int = 1024, k: int = 2048, n: int = 1024, repeats: int = 3) -> float:
    """Flops per second of a float32 matmul at ``threads`` threads (as one rank runs it); the best of
    ``repeats``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * m * k * n / best
    finally:
        torch.set_num_threads(old)


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
