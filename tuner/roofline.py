"""The floor under a step's time: the larger of the bytes it must move once, at the machine's memory
bandwidth (``coconet.tuner.bandwidth``), and its matmuls' flops on the busiest rank, at that rank's matmul
rate.

Every input is read once (a Local input once per rank: each rank holds its own). A result is written
once where one copy serves, and once per rank where every rank must hold it after the step: the ranks
keep their tensors in private memory, so a replicated state that must stay whole (not in
``shardable``), a local state, and a replicated or local output are written on each rank.
Collectives, padding and temporaries are what a schedule adds on top; a perfect single-node
schedule approaches this floor, none goes under it. Matmuls run on each rank's piece (a Sliced
operand holds 1/R of its dim), the ranks in parallel, and every schedule of the space keeps them:
where they dominate (the Megatron layer), the compute floor bounds every speed-up.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Iterable, Mapping

from coconet.schedules import interp
from coconet.schedules.ir import CONVS, Program
from coconet.schedules.types import ITEMSIZE, Local, Replicated


def _nbytes(t, sizes: Mapping[str, int]) -> int:
    return math.prod(interp.concrete_shape(t, sizes)) * ITEMSIZE.get(t.dtype or "float32", 4)


def bytes_moved_once(program: Program, sizes: Mapping[str, int], world: int, shardable: Iterable[str] = ()) -> int:
    """``shardable``: the replicated state a schedule may leave sharded (ZeRO: each rank writes its rows)."""
    may_shard = frozenset(shardable)
    total = 0
    for s in program.inputs:
        if s.op == "input":
            total += _nbytes(s.type, sizes) * (world if isinstance(s.type.layout, Local) else 1)
    for target in program.updates:
        t = program[target].type
        per_rank = isinstance(t.layout, Local) or (isinstance(t.layout, Replicated) and target not in may_shard)
        total += _nbytes(t, sizes) * (world if per_rank else 1)
    for value in program.outputs.values():
        t = program[value].type
        total += _nbytes(t, sizes) * (world if isinstance(t.layout, (Replicated, Local)) else 1)
    return total


def matmul_flops_per_rank(program: Program, sizes: Mapping[str, int], world: int) -> float:
    """2·M·N·K of every matmul (and of every tensordot: its result's elements by its contracted extents), on
    the pieces rank 0 holds (a Sliced dim: its first, largest, share), and of
    every convolution taken as the matmul of its output by the weight's rows (input channels by taps): its
    floor is then as if it ran at the matmul rate, as a convolution lowered to a GEMM would."""

    def local(t) -> list[int]:
        shape = interp.concrete_shape(t, sizes)
        return [len(range(n)[r]) for n, r in zip(shape, interp.local_region(t, shape, world, 0))]

    total = 0.0
    for s in program.stmts:
        if s.op == "matmul":
            # the rank's own rows and columns of the product: a column-parallel one (a weight Sliced(1))
            # holds 1/R of the columns, a row-parallel one its partial sum of every element over 1/R of K
            total += 2.0 * math.prod(local(s.type)) * local(program[s.args[0]].type)[-1]
        elif s.op == "tensordot":  # each element of the result's piece, by the operand's piece of the pairs
            a = local(program[s.args[0]].type)
            total += 2.0 * math.prod(local(s.type)) * math.prod(a[d] for d in s.attr("dims")[0])
        elif s.op in CONVS:
            total += 2.0 * math.prod(local(s.type)) * math.prod(local(program[s.args[1]].type)[1:])
    return total


def compute_floor(
    program: Program, sizes: Mapping[str, int], world: int, rate_per_thread: float, cpus: int, threads: int
) -> float:
    """Seconds the matmuls take at least: the busiest rank's flops at ``threads`` threads, or every rank's
    flops on the ``cpus`` cores when the ranks outnumber them."""
    flops = matmul_flops_per_rank(program, sizes, world)
    return flops * world / (rate_per_thread * min(cpus, world * threads)) if flops else 0.0


def best_seconds(fn, repeats: int, device: str) -> float:
    """The fastest of ``repeats`` calls after one untimed call; on CUDA timed by events on the stream, so
    the host's launch does not count and the kernel's queueing does."""
    import torch

    fn()
    best = float("inf")
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(
    threads: int = 1,
    m: int | None = None,
    k: int | None = None,
    n: int | None = None,
    repeats: int = 3,
    device: str = "cpu",
) -> float:
    """Flops per second of a float32 matmul at ``threads`` threads (as one rank runs it), or on the current
    CUDA device (``threads`` unused) at torch's float32 matmul precision, which the generated code runs at;
    the best of ``repeats``, through the faster of torch.matmul and the generated code's GEMM. A GPU reaches its
    rate only on large operands (1024 x 2048 x 1024 left an H100 at two thirds of it, and a floor above a
    measured step), hence 8192 on each side there."""
    import torch

    from coconet.kernels.ops import matmul

    side = 8192 if device == "cuda" else None
    m, k, n = m or side or 1024, k or side or 2048, n or side or 1024

    old = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        return (
            2.0
            * m
            * k
            * n
            / min(best_seconds(functools.partial(mm, a, b), repeats, device) for mm in (torch.matmul, matmul))
        )
    finally:
        torch.set_num_threads(old)
