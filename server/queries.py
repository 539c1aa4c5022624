"""Read queries the service needs beyond the Store API (listing programs, finding a schedule by its hash,
a program's jobs, a job already under way for a key, the exact /best lookup). They go through the store's
engine, and its errors leave as StoreError like every other store call."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, Mapping

from sqlalchemy import bindparam, func, select
from sqlalchemy.exc import SQLAlchemyError

from coconet.errors import StoreError
from coconet.server.keys import parse_sizes_key, size_distance, sizes_key
from coconet.server.models import JobRow, MeasurementRow, ProgramRow, WinnerRow
from coconet.server.records import Best, JobRecord, MeasurementRecord, WinnerRecord
from coconet.server.store import Store, _job, _record, _utc

ACTIVE = ("queued", "running")


@dataclass(frozen=True)
class ProgramSummary:
    hash: str
    name: str
    dims: list[str]
    statements: int
    created_at: datetime


def programs(store: Store, limit: int = 1000) -> list[ProgramSummary]:
    with store._tx("programs") as s:
        rows = s.scalars(select(ProgramRow).order_by(ProgramRow.created_at, ProgramRow.hash).limit(limit))
        return [ProgramSummary(r.hash, r.name, list(r.ir.get("dims", [])), len(r.ir.get("statements", [])),
                               _utc(r.created_at)) for r in rows]


def schedule_measurement(store: Store, schedule_hash: str, program_hash: str | None = None) -> MeasurementRecord | None:
    """A measurement of the schedule with this hash that kept its JSON; a winner's first (the schedules people
    ask code for), else any. The hash is not indexed: without ``program_hash`` this scans the measurements."""
    m = MeasurementRow
    with store._tx("schedule") as s:
        won = select(m).join(WinnerRow, WinnerRow.measurement_id == m.id).where(
            m.schedule_hash == schedule_hash, m.schedule_json.is_not(None))
        anyq = select(m).where(m.schedule_hash == schedule_hash, m.schedule_json.is_not(None))
        if program_hash is not None:
            won, anyq = won.where(m.program_hash == program_hash), anyq.where(m.program_hash == program_hash)
        row = s.scalars(won.limit(1)).first() or s.scalars(anyq.limit(1)).first()
        return _record(MeasurementRecord, row) if row is not None else None


def program_jobs(store: Store, program_hash: str, limit: int = 1000) -> list[JobRecord]:
    with store._tx("program_jobs") as s:
        q = select(JobRow).where(JobRow.program_hash == program_hash).order_by(JobRow.id.desc()).limit(limit)
        return [_job(r) for r in s.scalars(q)]


def active_job(store: Store, program_hash: str, sizes: Mapping[str, int], topology: str, world: int) -> JobRecord | None:
    """A queued or running job for this key: asking twice tunes once."""
    with store._tx("active_job") as s:
        q = select(JobRow).where(JobRow.program_hash == program_hash, JobRow.sizes_key == sizes_key(sizes),
                                 JobRow.topology == topology, JobRow.world == world, JobRow.state.in_(ACTIVE))
        row = s.scalars(q.order_by(JobRow.id).limit(1)).first()
        return _job(row) if row is not None else None


def measurement_count(store: Store, program_hash: str) -> int:
    with store._tx("measurement_count") as s:
        return s.scalar(select(func.count()).select_from(MeasurementRow).where(
            MeasurementRow.program_hash == program_hash)) or 0


def measurements_page(store: Store, program_hash: str, *, sizes: Mapping[str, int] | None = None,
                      topology: str | None = None, after: int = 0, limit: int = 1000) -> list[MeasurementRecord]:
    """Measurements of a program by id, ``limit`` at a time after id ``after`` (a sweep may have millions)."""
    m = MeasurementRow
    with store._tx("measurements_page") as s:
        q = select(m).where(m.program_hash == program_hash, m.id > after)
        if sizes is not None:
            q = q.where(m.sizes_key == sizes_key(sizes))
        if topology is not None:
            q = q.where(m.topology == topology)
        return [_record(MeasurementRecord, r) for r in s.scalars(q.order_by(m.id).limit(limit))]


# The exact /best lookup, the API's hot path, in SQLAlchemy Core with statements built once: the same rule as
# Store.best (the newest winner whose measurement is ok and timed) at a fraction of the ORM's per-call cost.
_W, _M = WinnerRow.__table__, MeasurementRow.__table__


def _exact_statement(by_world: bool, by_backend: bool) -> Any:
    q = select(_W).join(_M, _M.c.id == _W.c.measurement_id).where(
        _W.c.program_hash == bindparam("program"), _W.c.topology == bindparam("topology"),
        _W.c.sizes_key == bindparam("key"), _M.c.status == "ok", _M.c.median_s.is_not(None))
    if by_world:
        q = q.where(_W.c.world == bindparam("world"))
    if by_backend:
        q = q.where(_W.c.backend == bindparam("backend"))
    return q.order_by(_W.c.created_at.desc(), _W.c.id.desc()).limit(1)


_EXACT = {(w, b): _exact_statement(w, b) for w in (False, True) for b in (False, True)}
_BY_IDS = select(_M).where(_M.c.id.in_(bindparam("ids", expanding=True)))


def best_exact(store: Store, program_hash: str, sizes: Mapping[str, int], topology: str, world: int | None = None,
               backend: str | None = None) -> Best | None:
    """``store.best`` when the answer is exact; None when it is not (ask ``store.best`` for the nearest)."""
    params = {"program": program_hash, "topology": topology, "key": sizes_key(sizes), "world": world,
              "backend": backend}
    try:
        with store._engine.connect() as conn:
            row = conn.execute(_EXACT[world is not None, backend is not None], params).mappings().first()
            if row is None:
                return None
            ids = [i for i in (row["measurement_id"], row["runner_up_id"], row["baseline_id"]) if i is not None]
            found = {m["id"]: m for m in conn.execute(_BY_IDS, {"ids": ids}).mappings()}
    except SQLAlchemyError as err:
        raise StoreError(f"best on {store.url}: {' '.join(str(getattr(err, 'orig', err)).split())[:500]}",
                         url=store.url) from err

    def record(cls: type, values: Mapping[str, Any]) -> Any:
        return cls(**{f.name: _utc(values[f.name]) for f in fields(cls)})

    def measurement(i: int | None) -> MeasurementRecord | None:
        return record(MeasurementRecord, found[i]) if i is not None and i in found else None

    return Best(exact=True, distance=0.0, winner=record(WinnerRecord, row),
                measurement=measurement(row["measurement_id"]), runner_up=measurement(row["runner_up_id"]),
                baseline=measurement(row["baseline_id"]))


def _keys_statement(by_world: bool, by_backend: bool) -> Any:
    q = select(_W.c.sizes_key).distinct().where(_W.c.program_hash == bindparam("program"),
                                                _W.c.topology == bindparam("topology"))
    if by_world:
        q = q.where(_W.c.world == bindparam("world"))
    if by_backend:
        q = q.where(_W.c.backend == bindparam("backend"))
    return q


_KEYS = {(w, b): _keys_statement(w, b) for w in (False, True) for b in (False, True)}


def best_or_nearest(store: Store, program_hash: str, sizes: Mapping[str, int], topology: str,
                    world: int | None = None, backend: str | None = None) -> Best | None:
    """``store.best`` on the Core path: the exact winner, else the nearest tuned sizes' (same rule, same order:
    smallest sum of |log2| differences, then the key's text), flagged ``exact=False``."""
    found = best_exact(store, program_hash, sizes, topology, world, backend)
    if found is not None:
        return found
    params = {"program": program_hash, "topology": topology, "world": world, "backend": backend}
    try:
        with store._engine.connect() as conn:
            keys = list(conn.execute(_KEYS[world is not None, backend is not None], params).scalars())
    except SQLAlchemyError as err:
        raise StoreError(f"best on {store.url}: {' '.join(str(getattr(err, 'orig', err)).split())[:500]}",
                         url=store.url) from err
    near = sorted((d, k) for k in keys if (d := size_distance(sizes, parse_sizes_key(k))) is not None)
    for d, key in near:
        found = best_exact(store, program_hash, parse_sizes_key(key), topology, world, backend)
        if found is not None:
            return replace(found, exact=False, distance=d)
    return None
