"""Does the cost model order schedules as the machine does? Kendall τ of predicted against measured.

    nice -n 19 python benchmarks/cost_model.py [--topology local] [--rounds 2] [--repeats 15]
        [--workload adam] [--out benchmarks/results/cost_model_local.json]

Every schedule of the Adam step (N=2^22) and of the Megatron layer (B=2, S=256, H=512) runs on 2 local
ranks with gloo and with shm (``coconet.tuner.launch.run_schedules``: checked, then timed; a sample
is the slowest rank's step). Each round is one launch per (program, backend), the rounds one after the
other; a schedule's time is the median of its per-round medians (on a shared machine the load comes
and goes between rounds, and one quiet or busy round should not decide). The model predicts each
schedule on the topology (``local``: what ``coconet calibrate`` measured here), and the report gives τ
per program and backend — against the median of rounds, against the lowest of them, against each round
— and how well the rounds agree with one another, the ceiling noise puts on any model's τ. Then how
fast the model predicts: every example's schedules at a range of sizes on every shipped topology,
≥10,000 keys, with cold plans (first sight of each schedule) and warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import statistics
import time
from pathlib import Path

from scipy.stats import kendalltau

from coconet.schedules.space import generate
from coconet.tuner import cost
from coconet.tuner.calibrate import local_topology
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.topology import list_topologies, load_topology

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = (("adam", {"N": 2**22}), ("megatron_mlp", {"B": 2, "S": 256, "H": 512}))


def _measure(space, sizes, backend: str, args) -> list[dict]:
    opts = Options(world=2, sizes=sizes, backend=backend, repeats=args.repeats, warmup=args.warmup, timeout_s=600)
    return [r.to_json() for r in run_schedules(list(space), opts)]


def _speed(min_keys: int = 10_000) -> dict:
    spaces = [generate(runpy.run_path(str(f))["program"]) for f in sorted((ROOT / "examples").glob("*.py"))]
    topos = [load_topology(n) for n in list_topologies()]
    keys = []
    for space in spaces:
        dims = space[0].program.dims
        if dims == ("B", "S", "H"):
            points = [{"B": b, "S": s, "H": h} for b in (1, 8) for s in (512, 2048) for h in (1024, 3072, 12288)]
        else:
            points = [{d: 2**k for d in dims} for k in range(10, 28)]
        for t in topos:
            for b in t.backends:
                keys += [(s, p, t, b) for p in points for s in space]
    while len(keys) < min_keys:
        keys += keys
    cost._plan.cache_clear()
    t0 = time.perf_counter()
    for s, p, t, b in keys:
        cost.predict(s, p, t, b)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s, p, t, b in keys:
        cost.predict(s, p, t, b)
    warm = time.perf_counter() - t0
    return {
        "keys": len(keys),
        "cold_s": cold,
        "warm_s": warm,
        "predictions_per_s_cold": len(keys) / cold,
        "predictions_per_s_warm": len(keys) / warm,
        "us_per_prediction_warm": warm / len(keys) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="local")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cost_model_local.json")
    ap.add_argument(
        "--workload",
        action="append",
        choices=[name for name, _ in WORKLOADS],
        help="Only these (repeatable; default every one).",
    )
    ap.add_argument(
        "--skip-measure", type=Path, default=None, help="reuse the measurements of an earlier report (re-predict only)"
    )
    args = ap.parse_args()
    topo = local_topology() if args.topology == "local" else load_topology(args.topology)  # local: calibrated here
    earlier = json.loads(args.skip_measure.read_text()) if args.skip_measure else None
    report = {
        "topology": topo.name,
        "topology_digest": topo.digest,
        "topology_fingerprint": dict(topo.fingerprint),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "rounds": args.rounds,
        "repeats": args.repeats,
        "world": 2,
        "results": [],
    }
    for name, sizes in WORKLOADS:
        if args.workload and name not in args.workload:
            continue
        space = generate(runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"])
        for backend in ("gloo", "shm"):
            if earlier:
                old = next(r for r in earlier["results"] if r["program"] == name and r["backend"] == backend)
                rounds = old["rounds_median_s"]
            else:
                rounds = []
                for _ in range(args.rounds):
                    rows = _measure(space, sizes, backend, args)
                    rounds.append([r["median_s"] if r["status"] == "ok" else None for r in rows])
            preds = [cost.predict(s, sizes, topo, backend) for s in space]
            seen = [[r[i] for r in rounds if r[i] is not None] for i in range(len(space))]
            measured = [statistics.median(v) if v else None for v in seen]
            ok = [i for i, m in enumerate(measured) if m is not None]
            predicted = [preds[i].seconds for i in ok]
            tau = float(kendalltau([measured[i] for i in ok], predicted)[0])
            tau_min = float(kendalltau([min(seen[i]) for i in ok], predicted)[0])
            per_round = [
                float(
                    kendalltau(
                        [r[i] for i in ok if r[i] is not None], [preds[i].seconds for i in ok if r[i] is not None]
                    )[0]
                )
                for r in rounds
            ]
            # how well the measurement agrees with itself: a ceiling on what any model can reach
            pairs = [
                (a, b)
                for a in range(len(rounds))
                for b in range(a + 1, len(rounds))
                if None not in rounds[a] + rounds[b]
            ]
            between = [float(kendalltau(rounds[a], rounds[b])[0]) for a, b in pairs]
            row = {
                "program": name,
                "backend": backend,
                "sizes": sizes,
                "schedules": len(space),
                "kendall_tau": tau,
                "kendall_tau_lowest_of_rounds": tau_min,
                "kendall_tau_per_round": per_round,
                "kendall_tau_between_rounds": between,
                "kendall_tau_between_rounds_mean": statistics.mean(between) if between else None,
                "rounds_median_s": rounds,
                "schedules_detail": [
                    {"schedule": s.text, "measured_s": measured[i], "predicted": preds[i].to_json()}
                    for i, s in enumerate(space)
                ],
            }
            report["results"].append(row)
            print(
                f"{name:14s} {backend:5s} tau={tau:.3f} (lowest of rounds {tau_min:.3f})  per round "
                f"{[round(x, 3) for x in per_round]}  rounds vs each other {[round(x, 3) for x in between]}",
                flush=True,
            )
    report["speed"] = _speed()
    print(
        f"speed: {report['speed']['keys']} predictions, {report['speed']['predictions_per_s_cold']:.0f}/s cold, "
        f"{report['speed']['predictions_per_s_warm']:.0f}/s warm "
        f"({report['speed']['us_per_prediction_warm']:.1f} us each)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
