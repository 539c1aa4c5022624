"""Non-temporal against ordinary stores in the shm backend's large copies, on the schedule they serve.

    python benchmarks/shm_copies.py [--world 2] [--size N=2^22 --size N=2^24 --size N=2^25] [--rounds 4]
                                    [--out benchmarks/results/shm_copies_adam_w2.json]

ZeRO-1 Adam's fused collective on shm, the best Adam schedule on this machine: each rank publishes its
peers' rows of the gradient and copies their rows of w in, both large copies. Launches alternate between
the default (copies larger than the rank's share of the last-level cache stream past the cache) and no
streaming (``COCONET_SHM_STREAM_BYTES`` above any copy), ``rounds`` times per size: a machine whose speed
drifts between launches drifts for both, each pair's ratio is taken within the pair, and which of the two
runs first alternates from pair to pair. The report gives every launch's median step and, per size, the
median of the paired ratios (ordinary / streaming). At sizes whose copies all stay under the threshold
both sides run the same code: their ratio shows the noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import runpy
import statistics
from pathlib import Path

from coconet.schedules.dims import parse_sizes
from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.plots import can_write, figure, write_figure

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
NEVER = str(1 << 62)  # no copy is this large: every copy ordinary


def launch(sched: Schedule, sizes: dict, world: int, repeats: int, threshold: str | None) -> float:
    old = os.environ.get("COCONET_SHM_STREAM_BYTES")
    if threshold is None:
        os.environ.pop("COCONET_SHM_STREAM_BYTES", None)
    else:
        os.environ["COCONET_SHM_STREAM_BYTES"] = threshold  # the ranks inherit this process's environment
    try:
        (res,) = run_schedules(
            [sched], Options(world=world, sizes=sizes, backend="shm", warmup=3, repeats=repeats, timeout_s=300)
        )
    finally:
        if old is None:
            os.environ.pop("COCONET_SHM_STREAM_BYTES", None)
        else:
            os.environ["COCONET_SHM_STREAM_BYTES"] = old
    if res.status != "ok":
        raise SystemExit(f"{sched.text} at {sizes}: {res.status}: {res.error}")
    return res.median_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/shm_copies_adam_w2.json")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.plot:
        can_write(args.plot)  # before the launches whose figure it is
    prog = runpy.run_path(str(ROOT / "examples/adam.py"))["program"].ir
    sched = Schedule.parse(SCHEDULE, prog).with_knobs(fc_chunks=4)
    report = {
        "workload": prog.name,
        "schedule": sched.text,
        "world": args.world,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "points": [],
    }
    for text in args.size or ["N=2^22", "N=2^24", "N=2^25"]:
        sizes = parse_sizes([text], prog.dims)
        pairs = []
        for k in range(args.rounds):
            # the order alternates: a launch may run slower for following another (a warm page cache, the
            # machine's own drift), and that must not count for either side
            first, second = (None, NEVER) if k % 2 == 0 else (NEVER, None)
            times = {first: launch(sched, sizes, args.world, args.repeats, first)}
            times[second] = launch(sched, sizes, args.world, args.repeats, second)
            pairs.append({"streaming_s": times[None], "ordinary_s": times[NEVER], "streaming_first": k % 2 == 0})
            print(json.dumps({"sizes": sizes, **pairs[-1]}), flush=True)
        ratios = [p["ordinary_s"] / p["streaming_s"] for p in pairs]
        report["points"].append(
            {
                "sizes": sizes,
                "pairs": pairs,
                "ordinary_over_streaming": statistics.median(ratios),
                "streaming_faster_in": sum(r > 1 for r in ratios),
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    for p in report["points"]:
        print(
            f"{p['sizes']}: ordinary / streaming {p['ordinary_over_streaming']:.2f}x (median of "
            f"{len(p['pairs'])} pairs; streaming faster in {p['streaming_faster_in']})"
        )


def plot(report: dict, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    fig = figure()
    labels = [",".join(f"{n}={v}" for n, v in p["sizes"].items()) for p in report["points"]]
    for k, p in enumerate(report["points"]):
        for j, pair in enumerate(p["pairs"]):
            fig.add_trace(
                go.Scatter(
                    x=[k - 0.1, k + 0.1],
                    y=[pair["ordinary_s"] * 1e3, pair["streaming_s"] * 1e3],
                    mode="lines+markers",
                    line={"color": "gray"},
                    opacity=0.6,
                    name="one pair: ordinary -> streaming",
                    legendgroup="pairs",
                    showlegend=k == j == 0,
                )
            )
        fig.add_annotation(
            x=k,
            y=math.log10(max(q["ordinary_s"] for q in p["pairs"]) * 1e3),  # a log axis places text by its log
            text=f"{p['ordinary_over_streaming']:.2f}x",
            showarrow=False,
            yshift=12,
        )
    fig.update_xaxes(tickvals=list(range(len(labels))), ticktext=labels)
    fig.update_layout(
        title=f"{report['workload']} ZeRO-1 on shm, world {report['world']}: large copies",
        yaxis={"type": "log", "title": "step time (ms), median of a launch"},
    )
    write_figure(fig, path, width=600, height=400)


if __name__ == "__main__":
    main()
