"""What a launch costs before its first step: ranks forked from the fork server against fresh interpreters.

    python benchmarks/launch_startup.py [--program examples/adam.py] [--world 2 --world 4] [--size N=1000]
                                        [--schedules 1] [--rounds 5] [--out benchmarks/results/launch_startup.json]

Each round launches the program's first ``--schedules`` schedules once each way, in alternating order
(``run_schedules``, checked, not timed: a launch as ``coconet run`` makes it, whose work is the ranks'
start, the group's forming and a step or two at a small size), and times it from the call to the results.
The fork server's first launch of the run, which starts the server too (it serves every world after),
is reported apart. And ``--cold K`` times K whole ``coconet run`` commands each way (one launch, the
program as written and the baseline, in a new process: the server starts for it and ends with it), which is
what a single command pays. Every launch's
results must be correct, or the script stops: a fast launch of a wrong step is no figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"fork server": None, "fresh interpreters": "0"}


def _env(way: str) -> dict[str, str]:
    """This process's environment with the way's fork-server switch."""
    from coconet.codegen.forkserver import ENV_SWITCH

    env = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
    if WAYS[way] is not None:
        env[ENV_SWITCH] = WAYS[way]
    return env


def _order(i: int) -> list[str]:
    return list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]


def _launch(schedules, opts, way: str) -> float:
    from unittest import mock

    from coconet.codegen.launch import run_schedules

    with mock.patch.dict(os.environ, _env(way), clear=True):  # the launch reads the switch from here
        t0 = time.perf_counter()
        results = run_schedules(schedules, opts)
        elapsed = time.perf_counter() - t0
    bad = [r for r in results if r.status != "ok"]
    if bad:
        raise SystemExit(f"{bad[0].schedule}: {bad[0].status}: {bad[0].error}")
    return elapsed


def _commands(args, world: int) -> dict:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "coconet", "run", str(args.program), "--world", str(world), "--size", args.size,
           "--backend", args.backend, "--repeats", "2", "--json"]
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(args.cold):
        for way in _order(i):
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=_env(way), capture_output=True, text=True)
            samples[way].append(time.perf_counter() - t0)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} ({way}): exit {done.returncode}: {done.stderr[-2000:]}")
    medians = {way: statistics.median(s) for way, s in samples.items()}
    print(f"coconet run, world {world}, whole command: fork server {medians['fork server']:.2f} s, "
          f"fresh interpreters {medians['fresh interpreters']:.2f} s", flush=True)
    return {"world": world, "command": cmd[1:], "samples_s": samples, "median_s": medians,
            "fresh / fork server": medians["fresh interpreters"] / medians["fork server"]}


def main(argv: list[str] | None = None) -> dict:
    from coconet.codegen.launch import Options
    from coconet.loader import load_file
    from coconet.schedules.dims import parse_sizes
    from coconet.schedules.space import generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--program", type=Path, default=ROOT / "examples" / "adam.py")
    ap.add_argument("--world", type=int, action="append", default=None)
    ap.add_argument("--size", default="N=1000")
    ap.add_argument("--schedules", type=int, default=1, help="schedules per launch (the first of the space)")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", type=int, default=0, help="whole `coconet run` commands timed each way")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    prog = load_file(args.program)
    sizes = parse_sizes(args.size, prog.dims)
    schedules = list(generate(prog))[:args.schedules]
    report = {"program": prog.name, "sizes": sizes, "schedules": len(schedules), "backend": args.backend,
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
              "worlds": []}
    for world in args.world or [2, 4]:
        opts = Options(world=world, sizes=sizes, backend=args.backend, time=False, timeout_s=120, kernels="eager")
        if "fork server's first launch_s" not in report:
            report["fork server's first launch_s"] = {"world": world, "s": _launch(schedules, opts, "fork server")}
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for i in range(args.rounds):
            for way in _order(i):
                samples[way].append(_launch(schedules, opts, way))
        medians = {way: statistics.median(s) for way, s in samples.items()}
        point = {"world": world, "samples_s": samples, "median_s": medians,
                 "fresh / fork server": medians["fresh interpreters"] / medians["fork server"]}
        report["worlds"].append(point)
        print(f"world {world}: fork server {medians['fork server']:.3f} s, "
              f"fresh interpreters {medians['fresh interpreters']:.3f} s: "
              f"{point['fresh / fork server']:.1f}x", flush=True)
    if args.cold:
        report["coconet run, whole command"] = _commands(args, report["worlds"][0]["world"])
    first = report["fork server's first launch_s"]
    print(f"the fork server's first launch (world {first['world']}, starting the server): {first['s']:.2f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
