"""Read queries the service needs beyond the Store API (listing programs, finding a schedule by its hash,
a program's jobs, a job already under way for a key). They run inside the store's own transaction helper so
errors leave as StoreError like every other store call."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Mapping

from sqlalchemy import func, select

from coconet.server.keys import sizes_key
from coconet.server.models import JobRow, MeasurementRow, ProgramRow, WinnerRow
from coconet.server.records import JobRecord, MeasurementRecord
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
