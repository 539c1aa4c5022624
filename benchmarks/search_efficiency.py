"""How many trials does the search need? TPE against random search on a measured landscape.

    python benchmarks/search_efficiency.py [--program examples/adam.py] [--size N=2^20] [--world 2]
        [--db sqlite:///…] [--kernels eager] [--seeds 20]

First every candidate of the space (each backend, schedule and knob value) is measured once, as
``coconet tune`` with a budget as large as the space does (an exhaustive study; skipped when the
store already holds one). Then the search is replayed on those recorded times, many seeds per
sampler: random search, TPE, and TPE started from the cost model's top 3 (what ``coconet tune``
does). Reported per arm: the trials (distinct candidates) until the best found is within 5% of
the exhaustive best — median, mean, worst over seeds. JSON and a PNG under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

from coconet.loader import load_file
from coconet.schedules.dims import format_sizes, parse_sizes
from coconet.server.store import Store
from coconet.tuner.launch import RunResult
from coconet.tuner.plots import COLOURS, figure, write_figure
from coconet.tuner.runner import Protocol
from coconet.tuner.search import Candidate, SearchSpace, search
from coconet.tuner.tune import Request, local_backends, tune

ROOT = Path(__file__).resolve().parents[1]


def landscape(store, prog, sizes, world, backends, kernels) -> dict[str, float]:
    """(backend:schedule hash) → median seconds (inf for a failure), from an exhaustive study."""
    space = SearchSpace.of(prog, backends)
    got = {
        f"{m.backend}:{m.schedule_hash}": (m.median_s if m.status == "ok" and m.median_s else math.inf)
        for m in store.measurements(prog.hash, sizes, "local", world=world)
        if m.job_id is not None
    }
    if len(got) < space.size:
        request = Request(
            prog, (sizes,), world, budget=space.size, backends=backends, protocol=Protocol(kernels=kernels)
        )
        tune(request, store, on_progress=lambda s, p: print(f"  measured {p.trials}/{p.budget}", flush=True))
        return landscape(store, prog, sizes, world, backends, kernels)
    return got


def trials_to_target(space, sizes, times, sampler, seed, prior, target) -> int:
    import optuna

    order: list[float] = []

    def measure(c: Candidate) -> RunResult:
        t = times[c.key]
        order.append(t)
        if math.isinf(t):
            return RunResult(c.text, c.schedule.hash, "runtime_error", error="failed when measured")
        return RunResult(c.text, c.schedule.hash, "ok", True, 0.0, [t] * 5)

    search(
        space,
        sizes,
        storage=optuna.storages.InMemoryStorage(),
        study="replay",
        budget=space.size,
        measure=measure,
        prior=prior,
        seed=seed,
        sampler=sampler,
    )
    best = math.inf
    for i, t in enumerate(order[:-2], start=1):  # the last two: the final re-timing
        best = min(best, t)
        if best <= target:
            return i
    return space.size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--program", default=str(ROOT / "examples/adam.py"))
    ap.add_argument("--size", default="N=2^20")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--db",
        default="sqlite:////tmp/coconet-search-landscape.db",
        help="Where the exhaustive study is kept (the landscape itself goes into the JSON).",
    )
    ap.add_argument("--kernels", default="eager")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    prog = load_file(args.program)
    sizes = parse_sizes([args.size], prog.dims)
    backends = local_backends(args.world)
    with Store.open(args.db) as store:
        times = landscape(store, prog, sizes, args.world, backends, args.kernels)
    space = SearchSpace.of(prog, backends)
    best = min(times.values())
    target = 1.05 * best
    within = sum(t <= target for t in times.values())
    prior = _cost_prior(space, sizes, args.world)
    arms = {"random": ("random", ()), "tpe": ("tpe", ()), "tpe + cost model top 3": ("tpe", tuple(prior[:3]))}
    report = {
        "program": prog.name,
        "sizes": sizes,
        "world": args.world,
        "backends": list(backends),
        "kernels": args.kernels,
        "space": space.size,
        "candidates_within_5pct": within,
        "best_s": best,
        "failed": sum(math.isinf(t) for t in times.values()),
        "cpus": os.cpu_count(),
        "arms": {},
        "landscape": {k: (None if math.isinf(t) else t) for k, t in sorted(times.items())},
    }
    for name, (sampler, pri) in arms.items():
        counts = [trials_to_target(space, sizes, times, sampler, seed, list(pri), target) for seed in range(args.seeds)]
        report["arms"][name] = {
            "trials": counts,
            "median": statistics.median(counts),
            "mean": statistics.mean(counts),
            "worst": max(counts),
        }
        print(
            f"{name:>24}: median {statistics.median(counts):g}, mean {statistics.mean(counts):.1f}, "
            f"worst {max(counts)} trials of {space.size} to within 5% of the best",
            flush=True,
        )
    # what random search needs in expectation, from the landscape alone: (n+1)/(k+1) draws without replacement
    report["random_expected"] = (space.size + 1) / (within + 1)
    out = args.out or ROOT / f"benchmarks/results/search_efficiency_{prog.name}_w{args.world}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out.with_suffix(".png"))
    print(f"wrote {out}")


def _cost_prior(space, sizes, world):
    from coconet.tuner.calibrate import local_topology
    from coconet.tuner.cost import predict

    topo = local_topology()  # this machine's, calibrated here on first use
    ranked = sorted(
        (
            (predict(s, sizes, topo, b, world=world).seconds, i, Candidate(s, b))
            for b in space.backends
            for i, s in enumerate(space.schedules)
        ),
        key=lambda x: x[:2],
    )
    return [c for *_, c in ranked]


def _plot(report, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    fig = figure()
    for i, (name, arm) in enumerate(report["arms"].items()):
        xs = sorted(arm["trials"])
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[(k + 1) / len(xs) for k in range(len(xs))],
                mode="lines",
                line={"shape": "hv", "color": COLOURS[i % len(COLOURS)]},  # a step after each seed's count
                name=f"{name} (median {arm['median']:g})",
            )
        )
    fig.update_layout(
        title={
            "text": f"{report['program']} {format_sizes(report['sizes'])}, world {report['world']}: "
            f"{report['space']} candidates, {report['candidates_within_5pct']} within 5%",
            "font": {"size": 12},
        },
        xaxis_title="trials (distinct candidates measured)",
        yaxis_title="fraction of seeds within 5% of the best",
    )
    write_figure(fig, path, width=800, height=420)


if __name__ == "__main__":
    main()
