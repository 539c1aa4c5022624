"""What a launch costs before its first step: ranks forked from the fork server against fresh interpreters.

    python benchmarks/launch_startup.py [--program examples/adam.py] [--world 2 --world 4] [--size N=1000]
                                        [--schedules 1 | --schedule TEXT ...] [--rounds 5]
                                        [--kernels eager|compiled]
                                        [--out benchmarks/results/launch_startup.json]

Each round launches the program's first ``--schedules`` schedules once each way, in alternating order
(``run_schedules``, checked, not timed: a launch as ``coconet run`` makes it, whose work is the ranks'
start, the group's forming and a step or two at a small size), and times it from the call to the results.
The fork server's first launch of the run, which starts the server too (it serves every world after),
is reported apart. With ``--kernels compiled`` the ranks compile their kernels (found in Inductor's
on-disk cache after the first launch), the server's second launch (which warms Inductor in the server
first) is reported apart too, and a third way is the fork server without that warm-up
(``ForkServer.warm`` a no-op, a server of its own). And ``--cold K`` times K whole ``coconet run``
commands each way (one launch, the program as written and the baseline, in a new process: the server
starts for it and ends with it), which is what a single command pays. Every launch's
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
COLD = "fork server, Inductor not warmed"
WAYS = {"fork server": None, COLD: None, "fresh interpreters": "0"}  # way -> its fork-server switch


def _env(way: str) -> dict[str, str]:
    """This process's environment with the way's fork-server switch."""
    from coconet.tuner.forkserver import ENV_SWITCH

    env = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
    if WAYS[way] is not None:
        env[ENV_SWITCH] = WAYS[way]
    return env


def _order(i: int, ways: list[str]) -> list[str]:
    return ways if i % 2 == 0 else ways[::-1]


def _launch(schedules, opts, way: str, registries: dict) -> float:
    from contextlib import ExitStack
    from unittest import mock

    from coconet.tuner import forkserver
    from coconet.tuner.launch import run_schedules

    with ExitStack() as patches:
        patches.enter_context(mock.patch.dict(os.environ, _env(way), clear=True))  # the launch reads the switch
        # each way its own servers, kept across rounds: one registry would close the other way's idle server
        registry = registries.setdefault(way, forkserver.Servers())
        patches.enter_context(mock.patch.object(forkserver, "_SERVERS", registry))
        if way == COLD:
            patches.enter_context(mock.patch.object(forkserver.ForkServer, "warm", lambda self: None))
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

    cmd = [
        sys.executable,
        "-m",
        "coconet",
        "run",
        str(args.program),
        "--world",
        str(world),
        "--size",
        args.size,
        "--backend",
        args.backend,
        "--kernels",
        args.kernels,
        "--repeats",
        "2",
        "--json",
    ]
    ways = [w for w in WAYS if w != COLD]  # a new process: its server warms nothing before its second launch
    samples: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(args.cold):
        for way in _order(i, ways):
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=_env(way), capture_output=True, text=True)
            samples[way].append(time.perf_counter() - t0)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} ({way}): exit {done.returncode}: {done.stderr[-2000:]}")
    medians = {way: statistics.median(s) for way, s in samples.items()}
    print(
        f"coconet run, world {world}, whole command: fork server {medians['fork server']:.2f} s, "
        f"fresh interpreters {medians['fresh interpreters']:.2f} s",
        flush=True,
    )
    return {
        "world": world,
        "command": cmd[1:],
        "samples_s": samples,
        "median_s": medians,
        "fresh / fork server": medians["fresh interpreters"] / medians["fork server"],
    }


def main(argv: list[str] | None = None) -> dict:
    from coconet.loader import load_file
    from coconet.schedules.dims import parse_sizes
    from coconet.schedules.schedule import Schedule
    from coconet.schedules.space import generate
    from coconet.tuner.launch import Options

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--program", type=Path, default=ROOT / "examples" / "adam.py")
    ap.add_argument("--world", type=int, action="append", default=None)
    ap.add_argument("--size", default="N=1000")
    ap.add_argument("--schedules", type=int, default=1, help="schedules per launch (the first of the space)")
    ap.add_argument("--schedule", action="append", default=None, help="these schedules' texts instead")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernels", choices=("eager", "compiled"), default="eager")
    ap.add_argument("--cold", type=int, default=0, help="whole `coconet run` commands timed each way")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    prog = load_file(args.program)
    sizes = parse_sizes(args.size, prog.dims)
    schedules = (
        [Schedule.parse(text, prog) for text in args.schedule]
        if args.schedule
        else list(generate(prog))[: args.schedules]
    )
    report = {
        "program": prog.name,
        "sizes": sizes,
        "schedules": len(schedules),
        "backend": args.backend,
        "kernels": args.kernels,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "worlds": [],
    }
    ways = [w for w in WAYS if args.kernels == "compiled" or w != COLD]
    registries: dict = {}
    for world in args.world or [2, 4]:
        opts = Options(world=world, sizes=sizes, backend=args.backend, time=False, timeout_s=300, kernels=args.kernels)
        if "fork server's first launch_s" not in report:
            report["fork server's first launch_s"] = {
                "world": world,
                "s": _launch(schedules, opts, "fork server", registries),
            }
            if COLD in ways:  # its server's start too, apart; and the launch that warms the other's
                report["fork server's first launch_s"][COLD] = _launch(schedules, opts, COLD, registries)
                report["fork server's second launch_s"] = {
                    "world": world,
                    "s": _launch(schedules, opts, "fork server", registries),
                }
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for i in range(args.rounds):
            for way in _order(i, ways):
                samples[way].append(_launch(schedules, opts, way, registries))
        medians = {way: statistics.median(s) for way, s in samples.items()}
        point = {
            "world": world,
            "samples_s": samples,
            "median_s": medians,
            "fresh / fork server": medians["fresh interpreters"] / medians["fork server"],
        }
        if COLD in ways:
            point["not warmed / warmed"] = medians[COLD] / medians["fork server"]
        report["worlds"].append(point)
        print(
            f"world {world}: "
            + ", ".join(f"{way} {m:.3f} s" for way, m in medians.items())
            + f": fresh / fork server {point['fresh / fork server']:.1f}x",
            flush=True,
        )
    if args.cold:
        report["coconet run, whole command"] = _commands(args, report["worlds"][0]["world"])
    first = report["fork server's first launch_s"]
    print(f"the fork server's first launch (world {first['world']}, starting the server): {first['s']:.2f} s")
    second = report.get("fork server's second launch_s")
    if second:
        print(f"its second launch (warming Inductor first): {second['s']:.2f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
