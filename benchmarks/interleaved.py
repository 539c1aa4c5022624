"""Generated modules stepped in turn by the same ranks, for differences smaller than this machine's drift.

    python benchmarks/interleaved.py PROGRAM --world 4 --size N=2^24 --steps 40 MODULE [MODULE ...]
                                     [--out benchmarks/results/interleaved.json] [--viewed K]

Each MODULE is a step module as ``coconet run --emit DIR`` writes it (shm or gloo), edited by hand or not;
its header names the schedule, whose layouts give each module inputs of its own (the seeded values of
``coconet run``). The ranks run a step of each module in turn, ``--steps`` turns, each step between
barriers and timed as its slowest rank; turn t begins with module t (mod their number), so that none
always has the same place in the turn. A machine whose memory bandwidth changes from one minute to the
next (this one's does, by up to 2x) then weighs on every module alike, and the paired ratio of each
module's step to the first's in the same turn is what the report gives, with its quartiles, beside each
module's median. A hand edit that breaks a step shows too: every module takes as many steps from the
same inputs, and the report gives how far its updated state (rank 0's, of the tensors that have the
first module's shape) ends from the first module's. ``--viewed K`` hands module K its tensors with views of
them held, as a flat buffer whose views are a model's parameters is (the same module twice, once viewed,
gives what keeping such buffers out of shared memory costs).
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import signal
import statistics
import sys
import time
from pathlib import Path


def _rank(
    rank: int,
    world: int,
    port: int,
    program_path: str,
    sizes: dict,
    paths: list[str],
    steps: int,
    out,
    viewed: tuple[int, ...] = (),
):
    import torch
    import torch.distributed as dist

    from coconet.loader import load_file
    from coconet.schedules.schedule import Schedule
    from coconet.tuner.launch import Options
    from coconet.tuner.rank import inputs, keep_freed_memory

    keep_freed_memory()  # as coconet's ranks do: a temporary's pages are not faulted in anew every step
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    program = load_file(program_path)
    opts = Options(world=world, sizes=sizes)
    steps_, args, views = [], [], []
    # a group per module: the shm runtime keeps a group's segments and the state moved into them, which modules
    # stepping in turn on one group would share, each moving its own state back in every turn
    groups = [dist.new_group(list(range(world))) for _ in paths]
    for path in paths:
        source = Path(path).read_text()
        text = re.search(r"^schedule: (.*)$", source, re.M).group(1)
        sched = Schedule.parse(text, program)
        ns = {"__name__": f"coconet_interleaved_{len(steps_)}"}
        exec(compile(source, path, "exec"), ns)
        steps_.append(ns["step"])
        args.append(inputs(sched.scheduled, opts, 0, rank, torch.device("cpu")))
        if len(steps_) - 1 in viewed:  # each tensor a flat buffer with views of it held, as a model's parameters
            views.append([t[: t.numel() // 2] for t in args[-1][0].values() if t.dim() == 1])
    for step, group, (tensors, scalars) in zip(steps_, groups, args):
        for _ in range(3):  # compiles, moves state and gradient into shared memory
            step(tensors, scalars, group=group, sizes=sizes)
    times = [[] for _ in paths]
    for turn in range(steps):
        # each module first in as many turns as the others, so that no place in the turn weighs on one
        # module's ratio alone (one module stepped twice in a fixed order: the second 0.99x the first)
        for k in ((turn + j) % len(paths) for j in range(len(paths))):
            step, (tensors, scalars) = steps_[k], args[k]
            dist.barrier()
            t0 = time.perf_counter()
            step(tensors, scalars, group=groups[k], sizes=sizes)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[k].append(float(dt))
    if rank == 0:  # every module took as many steps from the same inputs: its state must be the first's
        first = args[0][0]
        agree = []
        for tensors, _ in args:
            same = [k for k in program.updates if k in first and tensors[k].shape == first[k].shape]
            agree.append(
                max(
                    (float((tensors[k] - first[k]).abs().max() / first[k].abs().max().clamp_min(1e-30)) for k in same),
                    default=None,
                )
            )
        out.put((times, agree))
    dist.barrier()
    dist.destroy_process_group()


def run_processes(procs, out):
    """Starts the ranks' processes and returns what one of them puts on ``out``. A rank that dies ends the wait
    with its exit code (the others wait at a barrier gloo breaks only after its timeout); on the way out, by
    any path, every rank is stopped and the segments it left mapped by nobody are removed, as coconet's
    launcher does."""
    from coconet.tuner.launch import remove_leftover_segments

    try:
        for p in procs:
            p.start()
        while True:
            try:
                got = out.get(timeout=5)
                break
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
        for p in procs:
            p.join()
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join()
                remove_leftover_segments(p.pid)


def main(argv: list[str] | None = None) -> dict:
    import torch.multiprocessing as mp

    from coconet.loader import load_file
    from coconet.schedules.dims import parse_sizes
    from coconet.tuner.launch import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("modules", nargs="+")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--viewed",
        type=int,
        action="append",
        default=[],
        help="index of a module whose 1-d tensors are handed over with views of them held, as a flat "
        "buffer whose views are a model's parameters (repeatable)",
    )
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.size, load_file(args.program).dims)
    if str(Path(__file__).parent) not in sys.path:  # spawned processes import this module by its name
        sys.path.insert(0, str(Path(__file__).parent))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, args.world, port, args.program, sizes, args.modules, args.steps, out, tuple(args.viewed)),
        )
        for r in range(args.world)
    ]
    # stopped from outside (SIGTERM), it stops its ranks too and removes the segments they leave mapped
    # by nobody, as coconet's launcher does
    previous = signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    try:
        times, agree = run_processes(procs, out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = {"program": args.program, "world": args.world, "sizes": sizes, "steps": args.steps, "modules": []}
    for k, (path, ts, diff) in enumerate(zip(args.modules, times, agree)):
        ratios = sorted(a / b for a, b in zip(ts, times[0]))
        q = len(ratios) // 4
        report["modules"].append(
            {
                "module": path,
                "median_s": statistics.median(ts),
                "ratio_to_first": statistics.median(ratios),
                "ratio_quartiles": [ratios[q], ratios[-1 - q]],
                "state_rel_diff_to_first": diff,
                "viewed": k in args.viewed,
            }
        )
        print(
            f"{path}: {statistics.median(ts) * 1e3:.1f} ms a step, {statistics.median(ratios):.3f}x the first "
            f"[{ratios[q]:.3f}, {ratios[-1 - q]:.3f}]"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
