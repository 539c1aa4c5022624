"""How short can the first use of `local` calibrate? The full `coconet calibrate` against a shortened run
(half the samples, collectives to 4 MiB instead of 16, memory streams of 64 MiB instead of 256), in
alternating rounds on this machine.

    python benchmarks/first_calibration.py [--rounds 3] [--out benchmarks/results/first_calibration.json]

Per round each kind runs once (which goes first alternates). Reported per kind: seconds, and the figures the
cost model prices collectives and kernels with (gloo's α and β per collective, memory bandwidth, matmul rate,
compiled call). Per figure, the spread of each kind over its rounds (max/min) and the ratio of the medians,
short over full: a short run would do where its ratio sits within the full run's own spread. The plot
(same name, .png) draws the ratios against that spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from coconet.tuner.calibrate import Settings, calibrate
from coconet.tuner.fingerprint import detect_local
from coconet.tuner.plots import COLOURS, figure, write_figure

SHORT = Settings(repeats=5, max_log2=22, memory_bytes=2**26)


def figures(topo) -> dict[str, float]:
    out = {}
    for op, fit in topo.measured.get("gloo", {}).items():
        out[f"gloo {op} alpha_s"] = fit.alpha_s
        out[f"gloo {op} beta_s_per_byte"] = fit.beta_s_per_byte
    out["memory_bandwidth_GBps"] = topo.memory_bandwidth_GBps
    out["matmul_TFLOPS"] = topo.matmul_TFLOPS["float32"]
    out["compiled_launch_s"] = topo.compiled_launch_s or 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/first_calibration.json")
    args = ap.parse_args()
    kinds = {"full": Settings(), "short": SHORT}
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for k in order:
            t0 = time.perf_counter()
            cal = calibrate(kinds[k])
            runs[k].append({"seconds": time.perf_counter() - t0, "figures": figures(cal.topology)})
            print(f"round {r} {k}: {runs[k][-1]['seconds']:.1f} s", flush=True)
    names = list(runs["full"][0]["figures"])
    summary = {}
    for name in names:
        row = {}
        for k in kinds:
            vals = [x["figures"][name] for x in runs[k]]
            row[f"{k}_median"] = statistics.median(vals)
            row[f"{k}_spread"] = max(vals) / min(vals) if min(vals) > 0 else None
        row["ratio_short_over_full"] = row["short_median"] / row["full_median"] if row["full_median"] else None
        summary[name] = row
    seconds = {k: statistics.median(x["seconds"] for x in runs[k]) for k in kinds}
    report = {
        "machine": detect_local().text(),
        "rounds": args.rounds,
        "settings": {k: dataclasses.asdict(v) for k, v in kinds.items()},
        "seconds_median": seconds,
        "time_ratio_short_over_full": seconds["short"] / seconds["full"],
        "figures": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps({"seconds_median": seconds, "figures": summary}, indent=1))


def plot(report: dict, out: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    names = list(report["figures"])
    rows = [report["figures"][n] for n in names]
    fig = figure()
    for i, r in enumerate(rows):  # the full run's own spread over its rounds, around 1
        fig.add_trace(
            go.Scatter(
                x=[1 / r["full_spread"], r["full_spread"]],
                y=[names[i], names[i]],
                mode="lines",
                line={"color": "black", "width": 4},
                opacity=0.5,
                name="full run's spread (max/min)",
                legendgroup="spread",
                showlegend=i == 0,
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[r["ratio_short_over_full"] for r in rows],
            y=names,
            mode="markers",
            marker={"color": COLOURS[1], "size": 8},
            name="short / full (medians)",
        )
    )
    fig.add_vline(x=1.0, line={"color": "grey", "width": 1})
    s = report["seconds_median"]
    fig.update_layout(
        title={
            "text": f"calibration: short run {s['short']:.0f} s vs full {s['full']:.0f} s (medians of "
            f"{report['rounds']} rounds)<br>{report['machine']}",
            "font": {"size": 11},
        },
        xaxis={"type": "log"},
        yaxis={"tickfont": {"size": 9}, "categoryorder": "array", "categoryarray": names},
    )
    write_figure(fig, out, width=900, height=450)


if __name__ == "__main__":
    main()
