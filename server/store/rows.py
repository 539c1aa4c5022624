"""What the parts of the store share: records made from rows, checks of what a caller gives, filters on a key,
and inserts of many rows at once."""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence, TypeVar

from sqlalchemy import Table, select, text
from sqlalchemy.orm import Session

from coconet.errors import CoconetError, StoreError
from coconet.schedules import shardable as shard
from coconet.server.keys import sizes_key
from coconet.server.models import Base, JobRow, ProgramRow

_R = TypeVar("_R")


def utc(value: Any) -> Any:
    # SQLite keeps no zone; every time we write is UTC.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def record(cls: type[_R], row: Base) -> _R:
    return cls(**{f.name: utc(getattr(row, f.name)) for f in fields(cls)})  # type: ignore[arg-type]


def sorted_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    return {k: sizes[k] for k in sorted(sizes)}


def check_shardable(text: Any) -> None:
    try:
        shard.check(text)
    except CoconetError as e:
        raise StoreError(str(e)) from None


def check_world(world: Any) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise StoreError(f"world {world!r} must be a positive integer")


def require_programs(s: Session, hashes: set[str]) -> None:
    known = set(s.scalars(select(ProgramRow.hash).where(ProgramRow.hash.in_(hashes))))
    missing = sorted(hashes - known)
    if missing:
        raise StoreError(
            f"unknown program {missing[0]}: record the program (add_program) before its jobs and measurements",
            program_hash=missing[0],
        )


def require_jobs(s: Session, ids: set[int]) -> None:
    known = set(s.scalars(select(JobRow.id).where(JobRow.id.in_(ids)))) if ids else set()
    missing = sorted(ids - known)
    if missing:
        raise StoreError(f"no job {missing[0]}", job_id=missing[0])


def world_backend(q: Any, model: Any, world: int | None, backend: str | None) -> Any:
    if world is not None:
        q = q.where(model.world == world)
    if backend is not None:
        q = q.where(model.backend == backend)
    return q


def key_filter(
    q: Any,
    model: Any,
    program_hash: str,
    sizes: Mapping[str, int] | None,
    topology: str | None,
    world: int | None,
    backend: str | None,
) -> Any:
    q = q.where(model.program_hash == program_hash)
    if sizes is not None:
        q = q.where(model.sizes_key == sizes_key(sizes))
    if topology is not None:
        q = q.where(model.topology == topology)
    return world_backend(q, model, world, backend)


def insert_rows(s: Session, table: Table, values: Sequence[dict[str, Any]]) -> list[int]:
    """Insert rows with Core's executemany (the ORM's per-object bookkeeping would dominate a 10,000-row sweep);
    their ids, in order."""
    conn = s.connection()
    if conn.dialect.name == "postgresql":
        # psycopg parses a multi-row INSERT … RETURNING in Python (5 s for 10,000 rows); ids drawn from the
        # sequence first let the rows go as a plain pipelined executemany (under 1 s).
        draw = text("SELECT nextval(pg_get_serial_sequence(:t, 'id')) FROM generate_series(1, :n)")
        ids = list(conn.execute(draw, {"t": table.name, "n": len(values)}).scalars())
        conn.execute(table.insert(), [{**v, "id": i} for v, i in zip(values, ids)])
        return ids
    result = conn.execute(table.insert().returning(table.c.id, sort_by_parameter_order=True), values)
    return list(result.scalars())
