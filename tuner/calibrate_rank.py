"""A calibration rank (``python -m coconet.tuner.calibrate_rank JOB RANK FD``, started by
``coconet.tuner.calibrate``): joins the gloo group, measures each figure of the machine in turn (the
collectives of gloo and shm over the sizes, memory streams, fresh buffers, eager and compiled rates, matmul and
overlap) and reports them through its pipe."""

from __future__ import annotations

import math
import pickle
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from coconet.tuner.calibrate import OPS, Settings
from coconet.tuner.cost import DROPOUT_PER_BLOCK
from coconet.tuner.rank import die_with_parent, keep_freed_memory


def main(argv: list[str]) -> int:
    die_with_parent()
    keep_freed_memory()  # the allocator the ranks run with: what a fresh buffer costs there
    job_path, rank, fd = argv[0], int(argv[1]), int(argv[2])
    conn = Connection(fd, readable=False)
    try:
        with open(job_path, "rb") as f:
            job = pickle.load(f)
        result = _measure(job, rank)
        if rank == 0:
            conn.send(("result", result))
        return 0
    except Exception as e:  # reported to the parent, which stops every rank
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    finally:
        conn.close()


class _Timer:
    """Samples that every rank takes together: barrier, run, this rank's time; the slowest rank's
    time per sample once the run is over (one all-reduce for the lot)."""

    def __init__(self, dist, torch):
        self.dist, self.torch = dist, torch

    def samples(self, fn, repeats: int, warmup: int = 2) -> list[float]:
        local = []
        for i in range(warmup + repeats):
            self.dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                local.append(dt)
        t = self.torch.tensor(local, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def median(self, fn, repeats: int, warmup: int = 2) -> float:
        s = sorted(self.samples(fn, repeats, warmup))
        return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2

    def best(self, fn, repeats: int, warmup: int = 1) -> float:
        return min(self.samples(fn, repeats, warmup))


def _measure(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    s: Settings = job["settings"]
    R = s.world
    torch.set_num_threads(job["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job['port']}",
        rank=rank,
        world_size=R,
        timeout=timedelta(seconds=max(60.0, s.timeout_s)),
    )
    try:
        return _measure_all(s, R, rank, job["threads"], dist, torch)
    finally:
        dist.destroy_process_group()


def _reps(nbytes: int, repeats: int) -> int:
    # large sizes take long and vary less: fewer samples there keep calibration within a minute or two
    return max(3, repeats if nbytes <= 2**20 else repeats // 2)


def _measure_all(s: Settings, R: int, rank: int, threads: int, dist, torch) -> dict[str, Any]:
    timer = _Timer(dist, torch)
    # the transports a calibration measures, by name: each has its own measurement (_collectives)
    out: dict[str, Any] = {"torch": str(torch.__version__), "threads": threads, "collectives": {"gloo": {}, "shm": {}}}
    _collectives(s, R, timer, dist, torch, out)
    _memory(s, timer, torch, out)
    _fresh_buffers(s, timer, torch, out)
    _eager_rates(s, timer, torch, out)
    _matmul_and_overlap(timer, dist, torch, out)
    return out


def _collectives(s: Settings, R: int, timer: _Timer, dist, torch, out: dict[str, Any]) -> None:
    """Each collective of gloo and shm over the sizes, and shm's barrier."""
    # import torch: after the ranks' set-up
    from coconet.kernels import collectives, context, segments, shm

    sizes = [2**k for k in range(s.min_log2, s.max_log2 + 1)]

    def gloo_op(op, n):
        elems = max(R, (n // 4) // R * R)
        if op == "allreduce":
            x = torch.ones(elems)
            return lambda: dist.all_reduce(x)
        if op == "reduce_scatter":
            x, y = torch.ones(elems), torch.empty(elems // R)
            return lambda: collectives.reduce_scatter_tensor(y, x)
        x, y = torch.ones(elems // R), torch.empty(elems)
        return lambda: collectives.all_gather_into_tensor(y, x)

    c = context.Ctx(None, torch.device("cpu"))
    c.shm = segments.Shm.of(None, 2, sizes[-1] + 4 * R)

    def shm_op(op, n):
        elems = max(R, (n // 4) // R * R)
        if op == "allreduce":
            x = torch.ones(elems)
            return lambda: shm.allreduce(c, x, "sum")
        if op == "reduce_scatter":
            x = torch.ones(elems)
            return lambda: shm.reduce_scatter(c, x, 0, elems, "sum")
        x = torch.ones(elems // R)
        return lambda: shm.all_gather(c, x, 0, elems)

    for backend, make in (("gloo", gloo_op), ("shm", shm_op)):
        for op in OPS:
            points = []
            for n in sizes:
                nbytes = max(R, (n // 4) // R * R) * 4
                points.append((nbytes, timer.median(make(op, n), _reps(n, s.repeats))))
            out["collectives"][backend][op] = points
    out["shm_barrier_s"] = timer.median(c.shm.barrier, s.repeats * 5)
    c.shm.close()


def _memory(s: Settings, timer: _Timer, torch, out: dict[str, Any]) -> None:
    # memory: every rank streams at once, as the ranks of a step do; from tensors that fit the cache
    # to ones that do not. DRAM's figure is the largest size's, the cache's the best small one's, and
    # the cache ends where the rate falls below the geometric mean of the two.
    sweep = []
    for k in range(16, int(math.log2(s.memory_bytes)) + 1, 2):
        a, b = torch.ones(2**k // 4), torch.ones(2**k // 4)
        reps = max(1, 2**24 // 2**k)

        def stream():
            for _ in range(reps):
                a.add_(b)

        sweep.append((3 * 2**k, 3 * 2**k * reps / timer.best(stream, 5)))
    dram = sweep[-1][1]
    top = max(rate for _, rate in sweep[:-1]) if len(sweep) > 1 else dram
    edge = math.sqrt(top * dram)
    fits = [n for n, rate in sweep[:-1] if rate >= edge]
    out["memory_bandwidth"] = dram
    out["cache_bandwidth"] = top
    out["cache_bytes"] = max(fits) if fits and top > 1.2 * dram else 0
    out["memory_sweep"] = sweep


def _fresh_buffers(s: Settings, timer: _Timer, torch, out: dict[str, Any]) -> None:
    # fresh buffers: eager ops whose results stay alive a while, as a program's temporaries do, against
    # the same ops writing into buffers made once: the excess per byte, by buffer size.
    excess = []
    for k in range(20, int(math.log2(s.memory_bytes)) - 1):
        x = torch.ones(2**k // 4)
        bufs = [torch.empty_like(x) for _ in range(8)]

        def fresh():
            keep = []
            y = x
            for _ in range(8):
                y = y + x
                keep.append(y)
                if len(keep) > 4:
                    keep.pop(0)

        def reused():
            y = x
            for i in range(8):
                torch.add(y, x, out=bufs[i])
                y = bufs[i]

        extra = (timer.best(fresh, 5) - timer.best(reused, 5)) / 8
        excess.append((2**k, max(extra, 0.0) / 2**k))
    # per byte, the cost cannot fall as buffers grow (more of them are fresh pages, not fewer): a
    # running maximum smooths the sweep's noise
    smooth, top = [], 0.0
    for n, e in excess:
        top = max(top, e)
        smooth.append((n, top))
    out["alloc_sweep"] = smooth


def _eager_rates(s: Settings, timer: _Timer, torch, out: dict[str, Any]) -> None:
    """An eager op's dispatch, dropout's integer rate eager and compiled, a compiled kernel's call."""
    # dispatch: an eager op on one element
    one, two = torch.ones(1), torch.ones(1)

    def tiny():
        for _ in range(1000):
            one.add_(two)

    out["launch_s"] = timer.best(tiny, 5) / 1000
    # dropout as the generated code runs it unfused on CPU: Philox rounds in eager int64 ops, a call per
    # four elements, then the mask
    from coconet.kernels.dropout import dropout_words, dropped

    value = torch.ones(2**18)
    # the median: interference from other work on the machine slows these long runs of ops as it slows
    # a step's (a best-of would credit the eager ops with a quiet machine the steps never see)
    per = timer.median(lambda: dropped(value, 0.1, dropout_words(1234, (2**18,), -1, 0, 0, value.device)), 5)
    out["eager_ops"] = 2**18 * DROPOUT_PER_BLOCK.passes / per
    if s.compiled:
        kernel = torch.compile(lambda u, v: u * v + 1.0, dynamic=False, fullgraph=True)
        kernel(one, two)

        def calls():
            for _ in range(200):
                kernel(one, two)

        out["compiled_launch_s"] = timer.best(calls, 5) / 200
        # the integer rate of a compiled dropout, as the generated CPU code runs it: a Philox call per block
        # of four elements, the words through a buffer, the mask applied; the seed a tensor, as the generated
        # code passes it (Inductor makes a slower loop of constant keys)
        rows, seed = value.view(2**8, 2**10), torch.tensor(1234, dtype=torch.int64)
        drop = torch.compile(
            lambda x, k: dropped(x, 0.1, dropout_words(k, tuple(x.shape), 0, 0, x.shape[0], x.device)),
            dynamic=False,
            fullgraph=True,
        )
        drop(rows, seed)
        out["elementwise_ops"] = 2**18 * DROPOUT_PER_BLOCK.fused_ops / timer.best(lambda: drop(rows, seed), 5)
    else:  # no compiler run: in-cache eager ops, with their dispatch taken off, stand in for it
        n = 2**16
        x, y, z = (torch.ones(n, dtype=torch.int64) for _ in range(3))

        def xor():
            for _ in range(200):
                torch.bitwise_xor(x, y, out=z)

        per = timer.best(xor, 5) / 200
        out["elementwise_ops"] = n / max(per - out["launch_s"], per / 10)


def _matmul_and_overlap(timer: _Timer, dist, torch, out: dict[str, Any]) -> None:
    from coconet.kernels.ops import matmul

    # matmul
    m = 1024
    ma, mb = torch.randn(m, m), torch.randn(m, m)
    out["matmul_flops"] = 2 * m**3 / timer.best(lambda: matmul(ma, mb), 5)
    # overlap: an allreduce in flight while the rank multiplies, against each alone; and while it streams
    # memory (over loopback, gloo's transfer is itself memory traffic on the same cores)
    g = torch.ones(2**22 // 4)
    comm = timer.median(lambda: dist.all_reduce(g), 7)

    def hidden(work) -> float:
        alone = timer.median(work, 7)

        def both():
            handle = dist.all_reduce(g, async_op=True)
            work()
            handle.wait()

        together = timer.median(both, 7)
        return min(1.0, max(0.0, (comm + alone - together) / min(comm, alone)))

    # Under compute, measured as the generated code overlaps: the matmul in 4 chunks, each chunk's result
    # allreduced asynchronously as soon as it is computed, against the whole matmul and then its allreduce.
    # A collective in flight beside one other matmul can look free while these chunks gain nothing: on a
    # CPU whose every core runs a rank, the collective's own threads take their time from the matmul.
    alone_mm = timer.median(lambda: matmul(ma, mb), 7)  # its result is as large as g: comm times it

    def sequential():
        dist.all_reduce(matmul(ma, mb))

    def chunked():
        works = [dist.all_reduce(matmul(ak, mb), async_op=True) for ak in torch.tensor_split(ma, 4)]
        for w in works:
            w.wait()

    saved = timer.median(sequential, 7) - timer.median(chunked, 7)
    out["overlap"] = min(1.0, max(0.0, saved / (min(alone_mm, comm) * 3 / 4)))
    sa, sb = torch.ones(2**24 // 4), torch.ones(2**24 // 4)
    per_add = 3 * 2**24 / out["memory_bandwidth"]
    j = max(1, round(comm / per_add))
    out["overlap_memory"] = hidden(lambda: [sa.add_(sb) for _ in range(j)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
