"""What the dashboard plots, read from the store and shaped as plain JSON (no plotting here: the page does that)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from coconet.codegen.lower import lower
from coconet.schedules import shardable as shard
from coconet.schedules.schedule import Schedule, sharded_by
from coconet.schedules.serialize import load
from coconet.server.records import Best, MeasurementDigest, answer_source
from coconet.server.store import Store

# A sweep records model predictions for hundreds of schedules; a plot with that many lines says nothing.
MAX_SCHEDULES_PER_PLOT = 12
BASELINE = "baseline"
_Series = tuple[str, str]  # (backend, schedule text)


def program_list(store: Store) -> list[dict[str, Any]]:
    counts = store.result_counts()
    return [{"hash": p.hash, "name": p.name, "created_at": p.created_at.isoformat(),
             "results": counts.get(p.hash, 0)} for p in store.programs(newest_first=True)]


def program_view(store: Store, program_hash: str) -> dict[str, Any] | None:
    record = store.program(program_hash)
    if record is None:
        return None
    results = store.results(program_hash)
    measured = store.measurement_digests(program_hash)
    return {
        "hash": record.hash,
        "name": record.name,
        "results": [_result(b) for b in results],
        "timings": _timings(measured, results),
        "speedups": _speedups(results),
        "studies": _studies(store, program_hash, measured),
    }


def winner_code(store: Store, program_hash: str, measurement_id: int, backend: str | None = None) -> str | None:
    record = store.program(program_hash)
    m = store.measurement(measurement_id)
    if record is None or m is None or m.program_hash != program_hash or m.schedule_json is None:
        return None
    schedule = Schedule.from_json(m.schedule_json, load(record.ir))
    return lower(schedule, backend or m.backend, "compiled").source


def elements(sizes: dict[str, int]) -> int:
    """The x of a size plot: one number per size binding (the product of its dims)."""
    return math.prod(sizes.values()) if sizes else 1


def context(topology: str, world: int, backend: str) -> str:
    return f"{plot_context(topology, world)} · {backend}"


def plot_context(topology: str, world: int) -> str:
    return f"{topology} · {world} ranks"


def _winner_context(b: Best, by_shardable: bool) -> str:
    """A winner's plot series: its topology, world and backend, and, where searches of the program allowed
    different state to stay sharded, what its search allowed (two answers, not one series going back and forth)."""
    w = b.winner
    if not by_shardable:
        return context(w.topology, w.world, w.backend)
    allowed = "all state whole" if w.shardable == "" else f"{shard.words(w.shardable)} sharded"
    return f"{context(w.topology, w.world, w.backend)} · {allowed}"


def _result(b: Best) -> dict[str, Any]:
    m, base = b.measurement, b.baseline
    return {
        "winner_id": b.winner.id,
        "measurement_id": m.id,
        "sizes": b.sizes,
        "sizes_key": b.winner.sizes_key,
        "elements": elements(b.sizes),
        "topology": b.winner.topology,
        "world": b.winner.world,
        "backend": b.winner.backend,
        "context": context(b.winner.topology, b.winner.world, b.winner.backend),
        "schedule": m.schedule,
        "sharded": sharded_by(m.schedule),
        "shardable": b.winner.shardable,
        "shardable_words": shard.words(b.winner.shardable),
        "median_s": m.median_s,
        "ci95_s": [m.ci_lo_s, m.ci_hi_s],
        "baseline_median_s": base.median_s if base else None,
        "speedup": b.speedup,
        "source": answer_source(b.source),
        "job_id": b.winner.job_id,
    }


def _timings(measured: list[MeasurementDigest], results: list[Best]) -> list[dict[str, Any]]:
    """Per (topology, world): time vs size, one series per (backend, schedule) with its newest timing per size.
    Backends share a plot because the tuner races them against each other (a shm winner vs the gloo baseline)."""
    points: dict[str, dict[_Series, dict[str, tuple[int, float, str]]]] = defaultdict(lambda: defaultdict(dict))
    for m in measured:  # oldest first: a later timing (a re-time) replaces an earlier one
        if m.status == "ok" and m.median_s:
            points[plot_context(m.topology, m.world)][(m.backend, m.schedule)][m.sizes_key] = (
                elements(m.sizes), m.median_s, answer_source(m.source))
    winners: dict[str, set[_Series]] = defaultdict(set)
    for b in results:
        winners[plot_context(b.winner.topology, b.winner.world)].add((b.winner.backend, b.schedule))
    out = []
    for ctx, by_series in points.items():
        chosen = _pick(by_series, winners[ctx])
        series = []
        for backend, schedule in chosen:
            pts = sorted(by_series[(backend, schedule)].values())
            series.append({"name": f"{backend}: {schedule}", "backend": backend, "schedule": schedule,
                           "x": [p[0] for p in pts], "median_s": [p[1] for p in pts],
                           "source": sorted({p[2] for p in pts})})
        out.append({"context": ctx, "dims": _dims(measured), "series": series,
                    "schedules": len(by_series), "shown": len(chosen)})
    return out


def _pick(by_series: dict[_Series, dict[str, tuple[int, float, str]]], winners: set[_Series]) -> list[_Series]:
    """The baselines and the winners first, then the fastest others, up to MAX_SCHEDULES_PER_PLOT."""
    first = sorted(k for k in by_series if k[1] == BASELINE) + sorted(
        k for k in winners if k in by_series and k[1] != BASELINE)
    rest = sorted((k for k in by_series if k not in first), key=lambda k: min(p[1] for p in by_series[k].values()))
    return (first + rest)[:MAX_SCHEDULES_PER_PLOT]


def _dims(measured: Iterable[MeasurementDigest]) -> str:
    names = next((sorted(m.sizes) for m in measured), [])
    return "·".join(names) or "size"


def _speedups(results: list[Best]) -> list[dict[str, Any]]:
    by_ctx: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    several = len({b.winner.shardable for b in results}) > 1
    for b in results:
        if b.speedup is not None:
            ctx = _winner_context(b, several)
            by_ctx[ctx].append((elements(b.sizes), b.speedup, b.schedule))
    return [{"context": ctx, "x": [p[0] for p in pts], "speedup": [p[1] for p in pts], "schedule": [p[2] for p in pts]}
            for ctx, pts in ((c, sorted(v)) for c, v in by_ctx.items())]


def _studies(store: Store, program_hash: str, measured: list[MeasurementDigest]) -> list[dict[str, Any]]:
    """One tuning job = one study's run: its measurements in the order they were recorded (trials, then the
    re-timing of the two fastest), newest job first."""
    by_job: dict[int, list[MeasurementDigest]] = defaultdict(list)
    for m in measured:
        if m.job_id is not None:
            by_job[m.job_id].append(m)
    jobs = {j.id: j for j in store.jobs(program_hash=program_hash)}
    out = []
    for job_id in sorted(set(by_job) | set(jobs), reverse=True):
        trials = by_job.get(job_id, [])
        job = jobs.get(job_id)
        sizes = job.sizes if job else (trials[0].sizes if trials else {})
        out.append({
            "job_id": job_id,
            "state": job.state if job else None,
            "sizes": sizes,
            "topology": job.topology if job else trials[0].topology,
            "world": job.world if job else trials[0].world,
            "trials": [{"schedule": t.schedule, "backend": t.backend, "status": t.status, "median_s": t.median_s,
                        "error": t.error} for t in sorted(trials, key=lambda t: (t.created_at, t.id))],
        })
    return out
