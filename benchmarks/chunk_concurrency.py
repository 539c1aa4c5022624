"""What rate ZeRO-1 Adam's chunk kernel can reach on this machine when several ranks run it at once, against
the kernels the bench's floor is measured with.

    python benchmarks/chunk_concurrency.py [--world 4] [--size N=2^24] [--processes 1,2,4]
                                           [--calls 10] [--rounds 3] [--out benchmarks/results/chunk_concurrency.json]

The floor of ``coconet bench`` is the step's bytes at the best rate of its probe's kernels on all cores
(coconet.tuner.bandwidth): ``a.add_(b)``, three streams, and a C pass updating three states from one gradient,
seven. One rank's chunk of the shm backend's ZeRO-1 Adam (the generated module's C kernel, as
``native_chunk.py`` builds it) reads world gradient parts and m, v, w, writes m, v, w and streams w's rows into
world - 1 peers' copies: 2·world + 5 streams. Here P processes (one thread each, as ranks run) call the chunk
at once, each on its own rows, and then each of the probe's kernels on about the same bytes; each call starts
at a barrier and lasts from the first process's start to the last one's end. Reported per P: the aggregate
rates (the bytes all P moved over that span), the chunk's paired ratio to each kernel, and the chunk against the
floor's best rate, sampled in this process between rounds. P above the cores shows what time-sharing them costs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
KINDS = ("chunk", "add", "states")  # the chunk, then the probe's kernels in the order kernels() gives them


def _worker(index: int, world: int, n: int, calls: int, barriers: dict, orders, results) -> None:
    import torch

    from coconet.codegen.lower import lower
    from coconet.loader import load_file
    from coconet.schedules.schedule import Schedule
    from coconet.tuner.bandwidth import kernels

    torch.set_num_threads(1)
    source = lower(Schedule.parse(SCHEDULE, load_file(str(ROOT / "examples" / "adam.py"))), "shm").source
    ns: dict = {"__name__": f"coconet_chunk_concurrency_{index}"}
    exec(compile(source, "adam_zero1_shm", "exec"), ns)
    chunk = ns["_chunk0"]
    gen = torch.Generator().manual_seed(index)
    parts = [torch.randn(n, generator=gen) for _ in range(world)]
    m, v, w = torch.zeros(n), torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    peers = [torch.zeros(n) for _ in range(world - 1)]
    scalars = [torch.tensor(x) for x in (0.9, 0.999, 0.1, 0.001, 0.5, 0.6, 1e-3, 1e-8)]
    nbytes = (2 * world + 5) * 4 * n
    # the probe's a += b moves 1.5x its buffers' bytes: sized to move what the chunk moves; its C kernel only
    # where there is a C compiler
    probe = kernels(nbytes * 2 // 3)
    run = {
        "chunk": (lambda: chunk(peers, m, v, w, parts, *scalars), nbytes),
        **{kind: (k.run, k.nbytes) for kind, k in zip(KINDS[1:], probe)},
    }
    for fn, _ in run.values():  # compiles the C kernels (once per machine), faults every page in
        fn()
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")  # as _native_library looks
    moved = {k: b for k, (_, b) in run.items()}
    results.put(("ready", index, (moved, "C" if compiler else "Inductor's (no C compiler)")))
    while True:
        order = orders.get()
        if order is None:
            return
        kind, procs = order
        spans = []
        for _ in range(calls):
            barriers[procs].wait()
            t0 = time.perf_counter()
            run[kind][0]()
            spans.append((t0, time.perf_counter()))
        results.put((kind, index, spans))


def _get(results, procs):
    """The next report of a worker; an error naming the one that died instead of waiting for it."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"worker {dead[0]} exited with code {procs[dead[0]].exitcode}") from None


def main(argv: list[str] | None = None) -> dict:
    from coconet.schedules.dims import parse_sizes
    from coconet.tuner.bandwidth import memory_bandwidth

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--size", default="N=2^24")
    ap.add_argument("--processes", default=None, help="Comma-separated counts (default 1, 2, ..., world).")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    counts = sorted({int(p) for p in args.processes.split(",")}) if args.processes else list(range(1, args.world + 1))
    if counts[0] < 1:
        raise SystemExit(f"--processes {args.processes}: counts must be positive")
    n = parse_sizes([args.size])["N"] // args.world

    if str(Path(__file__).parent) not in sys.path:  # spawned processes import this module by its name
        sys.path.insert(0, str(Path(__file__).parent))
    # spawned, not forked: this process runs torch's threads (the floor kernel), which a fork does not carry
    ctx = mp.get_context("spawn")
    barriers = {p: ctx.Barrier(p) for p in counts}
    orders = [ctx.Queue() for _ in range(max(counts))]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(i, args.world, n, args.calls, barriers, orders[i], results), daemon=True)
        for i in range(max(counts))
    ]
    for p in procs:
        p.start()
    try:
        nbytes: dict[str, int] = {}
        kernel = ""
        for _ in procs:
            _, _, (nbytes, kernel) = _get(results, procs)
        kinds = list(nbytes)  # the chunk and the probe's kernels this machine has
        rates: dict[tuple[str, int], list[float]] = {(k, p): [] for k in kinds for p in counts}
        floor_samples = []
        for _ in range(args.rounds):
            floor_samples.append(memory_bandwidth())
            for p in counts:
                for kind in kinds:
                    for i in range(p):
                        orders[i].put((kind, p))
                    got = [_get(results, procs)[2] for _ in range(p)]
                    for call in zip(*got):
                        span = max(t1 for _, t1 in call) - min(t0 for t0, _ in call)
                        rates[kind, p].append(p * nbytes[kind] / span)
        floor_samples.append(memory_bandwidth())
    finally:
        for q in orders:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
    floor = max(floor_samples)

    def over(p: int, kind: str) -> float:
        return statistics.median(c / a for c, a in zip(rates["chunk", p], rates[kind, p]))

    report = {
        "world": args.world,
        "rows_per_process": n,
        "bytes_per_call_per_process": nbytes,
        "calls": args.calls,
        "rounds": args.rounds,
        "chunk_kernel": kernel,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "floor_kernel": "the best of the probe's kernels (a.add_(b), and the C states kernel where a C "
        "compiler is), all threads, one process (coconet bench's floor)",
        "floor_kernel_GBps": floor / 1e9,
        "floor_kernel_median_GBps": statistics.median(floor_samples) / 1e9,
        "floor_kernel_samples_GBps": [b / 1e9 for b in floor_samples],
        "processes": {
            str(p): {
                **{f"{k}_GBps": statistics.median(rates[k, p]) / 1e9 for k in kinds},
                **{f"{k}_best_GBps": max(rates[k, p]) / 1e9 for k in kinds},
                **{f"chunk_over_{k}": over(p, k) for k in kinds[1:]},
                "chunk_over_floor_kernel": statistics.median(rates["chunk", p]) / floor,
            }
            for p in counts
        },
    }
    print(
        f"floor kernel: {report['floor_kernel_GBps']:.1f} GB/s (best of {len(floor_samples)}; their median "
        f"{report['floor_kernel_median_GBps']:.1f})"
    )
    for p, r in report["processes"].items():
        print(
            f"{p} process(es), medians (best): "
            + ", ".join(f"{k} {r[f'{k}_GBps']:.1f} ({r[f'{k}_best_GBps']:.1f}) GB/s" for k in kinds)
            + "; "
            + ", ".join(f"chunk/{k} {r[f'chunk_over_{k}']:.3f}" for k in kinds[1:])
            + f", chunk/floor kernel {r['chunk_over_floor_kernel']:.3f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
