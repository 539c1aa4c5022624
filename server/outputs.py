"""The API's answers made from the store's records: a winner (``BestOut``), a measurement, a job."""

from __future__ import annotations

from typing import Any

from coconet.schedules import shardable as shard
from coconet.schedules.schedule import sharded_by
from coconet.server.driver import describe as describe_driver
from coconet.server.records import Best, JobRecord, MeasurementRecord, answer_source, machines_of, prediction_of
from coconet.server.schemas import BestOut, JobOut, MachinesOut, PredictionOut, ProgressOut, ScheduleOut, Stats


def shardable_out(text: str) -> list[str] | str:
    spelled = shard.spelled(text)
    return shard.ALL if spelled == (shard.ALL,) else list(spelled)


def _stats(m: MeasurementRecord) -> Stats:
    ci = (m.ci_lo_s, m.ci_hi_s) if m.ci_lo_s is not None and m.ci_hi_s is not None else None
    return Stats(median_s=m.median_s, ci95_s=ci, n=m.n)


def schedule_fields(m: MeasurementRecord) -> dict[str, Any]:
    return dict(
        measurement_id=m.id,
        schedule=m.schedule,
        schedule_hash=m.schedule_hash,
        backend=m.backend,
        knobs=m.knobs,
        sharded=sharded_by(m.schedule),
        status=m.status,
        error=m.error,
        stats=_stats(m),
        source=answer_source(m.source),
        prediction=_prediction(m),
        machines=_machines(m),
        job_id=m.job_id,
        created_at=m.created_at,
    )


def _prediction(m: MeasurementRecord) -> PredictionOut | None:
    found = prediction_of(m)
    return PredictionOut(**found) if found is not None else None


def _machines(m: MeasurementRecord) -> MachinesOut | None:
    found = machines_of(m)
    return MachinesOut(**found) if found is not None else None


def _schedule_out(m: MeasurementRecord | None) -> ScheduleOut | None:
    return ScheduleOut(**schedule_fields(m)) if m is not None else None


def best_out(b: Best, asked: dict[str, int]) -> BestOut:
    m, w = b.measurement, b.winner
    return BestOut(
        program=w.program_hash,
        sizes=asked,
        tuned_sizes=w.sizes,
        exact=b.exact,
        distance=b.distance,
        topology=w.topology,
        world=w.world,
        backend=w.backend,
        schedule=m.schedule,
        schedule_hash=m.schedule_hash,
        schedule_json=m.schedule_json,
        sharded=sharded_by(m.schedule),
        shardable=shardable_out(w.shardable),
        stats=_stats(m),
        source=answer_source(w.source),
        prediction=_prediction(m),
        machines=_machines(m),
        order_reversed=w.order_reversed,
        speedup=w.speedup,
        runner_up=_schedule_out(b.runner_up),
        baseline=_schedule_out(b.baseline),
        winner_id=w.id,
        job=w.job_id,
        created_at=w.created_at,
    )


def job_out(j: JobRecord, show_driver: bool = False) -> JobOut:
    """The job as the API shows it; which process drives it (pid and host name) only to a caller with the token."""
    p = j.progress
    return JobOut(
        id=j.id,
        program=j.program_hash,
        sizes=j.sizes,
        topology=j.topology,
        world=j.world,
        shardable=shardable_out(j.shardable),
        budget=j.budget,
        backends=j.backends,
        state=j.state,
        progress=ProgressOut(done=p.done, total=p.total, failed=p.failed, best_s=p.best_s),
        error=j.error,
        result=j.result,
        created_at=j.created_at,
        updated_at=j.updated_at,
        heartbeat_at=j.heartbeat_at,
        driver=describe_driver(j.driver) if show_driver else None,
    )
