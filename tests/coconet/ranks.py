"""Runs a function on every rank of a gloo group on this machine: ``run(fn, world, *args)`` returns each
rank's ``fn(rank, world, *args)``. Ranks are forked by multiprocessing's fork server, which imports torch and
coconet once for the session; a rank that raises fails the call with its traceback."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import time
import traceback
from datetime import timedelta

from coconet.tuner.launch import free_port

PRELOAD = [
    "torch",
    "torch.distributed",
    "coconet.step",
    "coconet.optim",
    "coconet.codegen.lower",
    "coconet.kernels.compiled",
    "tests.coconet.ranks",
]


def run(fn, world: int, *args, timeout_s: float = 120.0) -> list:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(fn, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, ok, value = pickle.loads(out.get(timeout=0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    late = sorted(set(range(world)) - set(got))
                    raise AssertionError(
                        f"ranks {late} gave no answer"
                        + (f" (rank {dead[0]} exited with {procs[dead[0]].exitcode})" if dead else f" in {timeout_s} s")
                    ) from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
            if p.exitcode is None:
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


def _rank(fn, rank: int, world: int, port: int, args: tuple, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        answer = (rank, True, fn(rank, world, *args))
    except BaseException:
        answer = (rank, False, traceback.format_exc())
    # plain pickle: torch's reduction of a tensor on a multiprocessing queue shares its memory through this
    # process, which may have exited by the time the caller reads it
    out.put(pickle.dumps(answer))
    if dist.is_initialized():
        dist.destroy_process_group()
