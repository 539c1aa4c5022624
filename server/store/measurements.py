"""The measurements a store records (append-only): one schedule's timing, or the cost model's prediction of it, at
one key on one backend."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Iterable, Mapping

from sqlalchemy import Text, cast, func, select

from coconet import __version__
from coconet.errors import StoreError
from coconet.server.keys import parse_sizes_key, sizes_key
from coconet.server.models import SOURCES, STATUSES, MeasurementRow, WinnerRow, utcnow
from coconet.server.records import DoneKey, MeasurementDigest, MeasurementRecord, NewMeasurement
from coconet.server.store.engine import StoreBase
from coconet.server.store.rows import (
    check_world,
    insert_rows,
    key_filter,
    record,
    require_jobs,
    require_programs,
    sorted_sizes,
    utc,
)


class Measurements(StoreBase):
    """The measurements of a store."""

    def add_measurement(self, measurement: NewMeasurement | None = None, /, **fields: Any) -> int:
        """Record one measurement, given as a ``NewMeasurement`` or as its fields; returns its id."""
        return self.add_measurements([measurement if measurement is not None else NewMeasurement(**fields)])[0]

    def add_measurements(self, rows: Iterable[NewMeasurement]) -> list[int]:
        """Record many measurements in one transaction (an offline sweep's predictions); ids in order."""
        values = [_measurement_values(m) for m in rows]
        if not values:
            return []
        table = MeasurementRow.__table__
        with self._tx("add_measurements", write=True) as s:
            require_programs(s, {v["program_hash"] for v in values})
            require_jobs(s, {v["job_id"] for v in values if v["job_id"] is not None})
            return insert_rows(s, table, values)

    def measurement_digests(self, program_hash: str) -> list[MeasurementDigest]:
        """Every measurement of a program in the order recorded, as digests: the columns a listing shows, read
        without building ORM objects or decoding the JSON ones."""
        names = [f.name for f in fields(MeasurementDigest) if f.name != "sizes"]
        with self._tx("measurement_digests") as s:
            q = select(*(getattr(MeasurementRow, n) for n in names)).where(MeasurementRow.program_hash == program_hash)
            sizes: dict[str, dict[str, int]] = {}
            out = []
            for row in s.execute(q.order_by(MeasurementRow.id)):
                values = dict(zip(names, row))
                values["created_at"] = utc(values["created_at"])
                key = values["sizes_key"]
                if key not in sizes:
                    sizes[key] = parse_sizes_key(key)
                out.append(MeasurementDigest(sizes=sizes[key], **values))
            return out

    def measurement(self, measurement_id: int) -> MeasurementRecord | None:
        with self._tx("measurement") as s:
            row = s.get(MeasurementRow, measurement_id)
            return record(MeasurementRecord, row) if row else None

    def measurements(
        self,
        program_hash: str,
        sizes: Mapping[str, int] | None = None,
        topology: str | None = None,
        job_id: int | None = None,
        *,
        world: int | None = None,
        backend: str | None = None,
        source: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[MeasurementRecord]:
        """Measurements of a program in the order they were recorded; ``after`` (an id) and ``limit`` page through
        them, as a sweep may have recorded millions."""
        with self._tx("measurements") as s:
            q = key_filter(select(MeasurementRow), MeasurementRow, program_hash, sizes, topology, world, backend)
            if job_id is not None:
                q = q.where(MeasurementRow.job_id == job_id)
            if source is not None:
                q = q.where(MeasurementRow.source == source)
            if after:
                q = q.where(MeasurementRow.id > after)
            q = q.order_by(MeasurementRow.id).limit(limit)
            return [record(MeasurementRecord, r) for r in s.scalars(q)]

    def measurement_count(
        self, program_hash: str, sizes: Mapping[str, int] | None = None, topology: str | None = None
    ) -> int:
        with self._tx("measurement_count") as s:
            q = key_filter(
                select(func.count()).select_from(MeasurementRow),
                MeasurementRow,
                program_hash,
                sizes,
                topology,
                None,
                None,
            )
            return s.scalar(q) or 0

    def schedule_measurement(self, schedule_hash: str, program_hash: str | None = None) -> MeasurementRecord | None:
        """A measurement of the schedule with this hash that kept the schedule's JSON (what its code is generated
        from): one that won first, the schedules people ask code for, else any."""
        m = MeasurementRow
        with self._tx("schedule_measurement") as s:
            # Without the JSON a measurement holds JSON null, not SQL NULL (the column's type writes None so).
            anyq = select(m).where(
                m.schedule_hash == schedule_hash, m.schedule_json.is_not(None), cast(m.schedule_json, Text) != "null"
            )
            if program_hash is not None:
                anyq = anyq.where(m.program_hash == program_hash)
            won = anyq.join(WinnerRow, WinnerRow.measurement_id == m.id)
            row = s.scalars(won.limit(1)).first() or s.scalars(anyq.limit(1)).first()
            return record(MeasurementRecord, row) if row is not None else None

    def done_keys(
        self,
        program_hash: str,
        sizes: Mapping[str, int] | None = None,
        topology: str | None = None,
        *,
        world: int | None = None,
        backend: str | None = None,
        source: str | None = None,
    ) -> set[DoneKey]:
        """The (program, sizes, topology, world, backend, schedule, source) that already have a record, any status:
        a failure is a result too, so a resumed sweep or study does not run it again."""
        m = MeasurementRow
        cols = (m.program_hash, m.sizes_key, m.topology, m.world, m.backend, m.schedule_hash, m.source)
        with self._tx("done_keys") as s:
            q = key_filter(select(*cols).distinct(), m, program_hash, sizes, topology, world, backend)
            if source is not None:
                q = q.where(m.source == source)
            return {DoneKey(*r) for r in s.execute(q)}


def _optional_float(name: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise StoreError(f"{name} {value!r} is not a number") from None
    if not math.isfinite(out):
        raise StoreError(f"{name} {value!r} is not finite")
    return out


def _measurement_values(m: NewMeasurement) -> dict[str, Any]:
    if not isinstance(m, NewMeasurement):
        raise StoreError(f"a measurement is a NewMeasurement, not {type(m).__name__}")
    if m.status not in STATUSES:
        raise StoreError(f"measurement status {m.status!r} is not one of {', '.join(STATUSES)}")
    if m.source not in SOURCES:
        raise StoreError(f"measurement source {m.source!r} is not one of {', '.join(SOURCES)}")
    check_world(m.world)
    samples = [_optional_float("sample", x) for x in m.samples]
    median = _optional_float("median_s", m.median_s)
    if m.status == "ok" and median is None:
        raise StoreError(f"an ok measurement of {m.schedule!r} needs median_s")
    return {
        "job_id": m.job_id,
        "program_hash": m.program_hash,
        "sizes": sorted_sizes(m.sizes),
        "sizes_key": sizes_key(m.sizes),
        "topology": m.topology,
        "world": m.world,
        "backend": m.backend,
        "schedule": m.schedule,
        "schedule_hash": m.schedule_hash,
        "schedule_json": dict(m.schedule_json) if m.schedule_json is not None else None,
        "knobs": dict(m.knobs),
        "status": m.status,
        "error": m.error,
        "samples": samples,
        "n": m.n if m.n is not None else len(samples),
        "median_s": median,
        "ci_lo_s": _optional_float("ci_lo_s", m.ci_lo_s),
        "ci_hi_s": _optional_float("ci_hi_s", m.ci_hi_s),
        "max_rel_err": _optional_float("max_rel_err", m.max_rel_err),
        "source": m.source,
        "versions": {"coconet": __version__, **m.versions},
        "created_at": utcnow(),
    }
