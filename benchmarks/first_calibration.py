"""How short can the first use of `local` calibrate? The full `coconet calibrate` against the first-use run
(``coconet.tuner.calibrate.FIRST_USE``), in alternating rounds on this machine.

    python benchmarks/first_calibration.py [--rounds 3] [--out benchmarks/results/first_calibration.json]

Per round each kind runs once (which goes first alternates). Reported per kind: seconds, and the figures the
cost model prices collectives and kernels with (gloo's α and β per collective, memory bandwidth, matmul rate,
compiled call). Per figure, the spread of each kind over its rounds (max/min) and the ratio of the medians,
first-use over full: a first use is good enough where its ratio sits within the full run's own spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from coconet.tuner.calibrate import FIRST_USE, Settings, calibrate
from coconet.tuner.fingerprint import detect_local


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
    kinds = {"full": Settings(), "first_use": FIRST_USE}
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
        row["ratio_first_use_over_full"] = (row["first_use_median"] / row["full_median"]
                                            if row["full_median"] else None)
        summary[name] = row
    seconds = {k: statistics.median(x["seconds"] for x in runs[k]) for k in kinds}
    report = {"machine": detect_local().text(), "rounds": args.rounds, "seconds_median": seconds,
              "time_ratio_first_use_over_full": seconds["first_use"] / seconds["full"], "figures": summary,
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"seconds_median": seconds, "figures": summary}, indent=1))


if __name__ == "__main__":
    main()
