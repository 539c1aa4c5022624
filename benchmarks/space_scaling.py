"""What the schedule space costs for a program of many tensors: reorders applied together against one by one.

    python benchmarks/space_scaling.py [--tensors 10 --tensors 30 ...] [--rounds 3]
                                       [--out benchmarks/results/space_scaling.json]

The program is Adam over k tensors, each with an allreduce of its own (a model's parameter list without
buckets). For each k and round, in alternating order, each way generates the space (``generate``, the
default depth) and reads every schedule back from its text (``Schedule.parse``, what ``tune`` does when it
resumes, the service for ``/code`` and ``run --schedule best``). "together": as coconet runs, the reorders of
a step in one rebuild (``Reorder.apply_all``); "one by one": ``apply_all`` refused, so each reorder rebuilds
the program. Both ways must give the same schedules and the same programs, names included, or the script
stops. Medians over the rounds; the ratio is one by one over together.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

from coconet.tuner.plots import COLOURS, figure, write_figure

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("together", "one by one")


def adam_over(tensors: int):
    import coconet as cc

    p = cc.Program(f"adam_{tensors}", dims=("H",))
    lr, beta1, beta2, eps = p.scalars("lr beta1 beta2 eps")
    for i in range(tensors):
        g = p.tensor(f"g{i}", ("H",), layout=cc.Local)
        w, m, v = (p.tensor(f"{n}{i}", ("H",), layout=cc.Replicated) for n in "wmv")
        avg = cc.allreduce(g)
        m1, v1 = beta1 * m + (1 - beta1) * avg, beta2 * v + (1 - beta2) * avg * avg
        p.update(m, m1)
        p.update(v, v1)
        p.update(w, w - lr * m1 / (cc.sqrt(v1) + eps))
    return p.ir


@contextmanager
def _way(way: str):
    from coconet.schedules.transforms import Reorder

    if way == "together":
        yield
        return
    batched = Reorder.__dict__["apply_all"]
    Reorder.apply_all = classmethod(lambda cls, program, transforms: None)
    try:
        yield
    finally:
        Reorder.apply_all = batched


def _once(prog) -> tuple[float, float, list]:
    from coconet.schedules.schedule import Schedule
    from coconet.schedules.space import generate

    t0 = time.perf_counter()
    space = generate(prog)
    t1 = time.perf_counter()
    read = [Schedule.parse(s.text, prog).scheduled for s in space]
    t2 = time.perf_counter()
    assert all(r == s.scheduled for r, s in zip(read, space)), "a schedule read back is not the one generated"
    return t1 - t0, t2 - t1, [(s.text, s.scheduled) for s in space]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, action="append")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/space_scaling.json")
    args = ap.parse_args(argv)
    counts = args.tensors or [10, 30, 60, 120]
    report = {
        "program": "Adam over k tensors, one allreduce each",
        "depth": "default",
        "rounds": args.rounds,
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "points": [],
    }
    for k in counts:
        prog = adam_over(k)
        times: dict[str, dict[str, list[float]]] = {w: {"generate_s": [], "read_back_s": []} for w in WAYS}
        spaces = {}
        for r in range(args.rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                with _way(way):
                    gen, read, spaces[way] = _once(prog)
                times[way]["generate_s"].append(gen)
                times[way]["read_back_s"].append(read)
        together, alone = spaces[WAYS[0]], spaces[WAYS[1]]
        assert len(together) == len(alone) and all(
            a == b and pa == pb and pa.locations == pb.locations for (a, pa), (b, pb) in zip(together, alone)
        ), f"k={k}: the two ways give different schedules"
        point = {
            "tensors": k,
            "statements": len(prog),
            "schedules": len(together),
            "longest_schedule_transforms": max(len(t.split(";")) for t, _ in together),
        }
        for way in WAYS:
            point[way] = {m: statistics.median(v) for m, v in times[way].items()} | {"rounds": times[way]}
        for m in ("generate_s", "read_back_s"):
            point[f"{m[:-2]}_one_by_one_over_together"] = point[WAYS[1]][m] / point[WAYS[0]][m]
        report["points"].append(point)
        print(
            f"k={k:4d} ({len(prog)} statements, {len(together)} schedules): generate "
            f"{point[WAYS[0]]['generate_s']:.2f} s together, {point[WAYS[1]]['generate_s']:.2f} s one by one; "
            f"read back {point[WAYS[0]]['read_back_s']:.2f} s / {point[WAYS[1]]['read_back_s']:.2f} s",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return report


def _plot(report, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    ks = [p["tensors"] for p in report["points"]]
    fig = figure(1, 2, subplot_titles=("generate the space", "read every schedule back"))
    for col, metric in enumerate(("generate_s", "read_back_s"), start=1):
        for i, (way, symbol, dash) in enumerate(zip(WAYS, ("circle", "square"), ("solid", "dash"))):
            fig.add_trace(
                go.Scatter(
                    x=ks,
                    y=[p[way][metric] for p in report["points"]],
                    name=way,
                    legendgroup=way,
                    showlegend=col == 1,
                    mode="lines+markers",
                    marker={"symbol": symbol, "size": 8},
                    line={"color": COLOURS[i], "dash": dash},
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(type="log", title_text="tensors (one allreduce each)", row=1, col=col)
        fig.update_yaxes(type="log", title_text="seconds (median)", row=1, col=col)
    fig.update_layout(title=report["program"])
    write_figure(fig, path, width=1000, height=420)


if __name__ == "__main__":
    main()
