"""``coconet bench`` of one workload by two checkouts in turn, for a change that must not move the figures.

    python benchmarks/bench_between.py --before /work/main --after . --rounds 3 --runs DIR \\
        [--out benchmarks/results/X.json] [--plot X.png] -- adam --size N=2^22 --world 2 --schedule ...

Each checkout runs with its own ``.venv/bin/coconet`` from its own folder; the rounds alternate (before, after,
before, …), so that load on a shared machine, which comes and goes between minutes, weighs on both alike.
Per round, schedule and backend: the ratio after / before of the median step time, and the same ratio with
each run's time divided by the run's own torch baseline (``coconet bench`` times it in the same launch), which
cancels load that changes from one run to the next. The report gives every round's ratios and their median.
``--summarize DIR`` reads runs already in DIR (``<workload>_<before|after>_r<k>.json``) instead of running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from coconet.tuner.plots import COLOURS, can_write, figure, write_figure


def run_one(tree: Path, args: list[str], out: Path) -> None:
    done = subprocess.run(
        [str(tree / ".venv" / "bin" / "coconet"), "bench", *args, "--json", "-o", str(out)],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"bench_between: coconet bench in {tree} failed:\n{done.stderr[-3000:]}")


def times(report: dict) -> dict[str, tuple[float, float]]:
    """(schedule on backend) -> (its median step time, that over the run's torch baseline), first point."""
    pt = report["points"][0]
    torch_s = pt["torch"]["median_s"]
    return {
        f"{r['schedule']} [{r['backend']}]": (r["median_s"], r["median_s"] / torch_s)
        for r in pt["results"]
        if r.get("status") == "ok"
    }


def summarize(runs: Path, workload: str) -> dict:
    rounds = sorted(int(p.stem.rsplit("_r", 1)[1]) for p in runs.glob(f"{workload}_before_r*.json"))
    per: dict[str, dict[str, list[float]]] = {}
    for k in rounds:
        before = times(json.loads((runs / f"{workload}_before_r{k}.json").read_text()))
        after = times(json.loads((runs / f"{workload}_after_r{k}.json").read_text()))
        for key in before.keys() & after.keys():
            row = per.setdefault(
                key, {"after_over_before": [], "after_over_before_vs_torch": [], "before_s": [], "after_s": []}
            )
            row["after_over_before"].append(after[key][0] / before[key][0])
            row["after_over_before_vs_torch"].append(after[key][1] / before[key][1])
            row["before_s"].append(before[key][0])
            row["after_s"].append(after[key][0])
    for row in per.values():
        row["median_ratio"] = statistics.median(row["after_over_before"])
        row["median_ratio_vs_torch"] = statistics.median(row["after_over_before_vs_torch"])
    return {"workload": workload, "rounds": len(rounds), "schedules": per}


def plot(report: dict, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    keys = sorted(report["schedules"])
    fig = figure()
    for i, key in enumerate(keys):
        row = report["schedules"][key]
        n = len(row["after_over_before"])
        for ys, shift, name, symbol, colour in (
            ("after_over_before", 0.0, "raw", "circle", COLOURS[0]),
            ("after_over_before_vs_torch", 0.2, "over torch's time in the same run", "x", COLOURS[1]),
        ):
            fig.add_trace(
                go.Scatter(
                    x=row[ys],
                    y=[i + shift] * n,
                    mode="markers",
                    marker={"symbol": symbol, "color": colour, "size": 8},
                    name=name,
                    legendgroup=name,
                    showlegend=i == 0,
                )
            )
    fig.add_vline(x=1.0, line={"color": "grey", "width": 1})
    fig.update_yaxes(
        tickvals=list(range(len(keys))),
        ticktext=[k if len(k) <= 70 else k[:48] + "…" + k[-21:] for k in keys],
        tickfont={"size": 9},
    )
    fig.update_layout(
        title={"text": f"{report['workload']}: {report.get('args', '')}"[:110], "font": {"size": 11}},
        xaxis_title="step time after / before, per round",
    )
    write_figure(fig, path, width=900, height=int(50 * len(keys) + 150))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=Path, required=True, help="folder for each run's coconet bench report")
    ap.add_argument("--summarize", action="store_true", help="read the runs in --runs, run nothing")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv[:split])
    bench = argv[split + 1 :]
    if not bench:
        ap.error("give coconet bench's arguments after --")
    workload = bench[0]
    if args.plot:
        can_write(args.plot)  # before the rounds whose figure it is
    args.runs.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        for k in range(1, args.rounds + 1):
            for side, tree in (("before", args.before), ("after", args.after)):
                run_one(tree.resolve(), bench, args.runs / f"{workload}_{side}_r{k}.json")
    report = summarize(args.runs, workload)
    report.update(before=str(args.before), after=str(args.after), args=" ".join(bench))
    for key, row in sorted(report["schedules"].items()):
        print(f"{key[:80]:80} after/before {row['median_ratio']:.3f} (over torch {row['median_ratio_vs_torch']:.3f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
