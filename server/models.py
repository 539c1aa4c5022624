"""Tables of the results store, where a tuning run ends (docs/architecture.md, "Data flow").

Every name starts with ``coconet_``: Optuna's RDB storage keeps its own tables
(``studies``, ``trials``, ``alembic_version``…) in the same database.
Measurements and winners are append-only; only jobs change after insert.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Double, ForeignKey, Index, Integer, MetaData, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from coconet.schedules.shardable import EVERY

VERSION_TABLE = "coconet_alembic_version"
JOB_STATES = ("queued", "running", "done", "failed", "interrupted")
# killed: a rank's process ended without reporting an error (a signal: the OOM killer, an operator, a crash)
STATUSES = ("ok", "compile_error", "runtime_error", "wrong_result", "timeout", "killed")
SOURCES = ("measured", "model")


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic's filter: the tables that are the store's (Optuna's share the database)."""
    return type_ != "table" or (name or "").startswith("coconet_")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    # Named constraints, so that migrations can refer to them on every backend.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True), float: Double}


class ProgramRow(Base):
    __tablename__ = "coconet_programs"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    ir: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TopologyRow(Base):
    __tablename__ = "coconet_topologies"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    fingerprint: Mapped[dict[str, Any]]
    source: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobRow(Base):
    __tablename__ = "coconet_jobs"
    __table_args__ = (Index("ix_coconet_jobs_state", "state", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    program_hash: Mapped[str] = mapped_column(ForeignKey("coconet_programs.hash"))
    sizes: Mapped[dict[str, Any]]
    sizes_key: Mapped[str] = mapped_column(String(500))
    topology: Mapped[str] = mapped_column(String(200))
    world: Mapped[int]
    # what the job may leave sharded (coconet.schedules.shardable's text): part of its key
    shardable: Mapped[str] = mapped_column(String(500), default=EVERY, server_default=EVERY)
    budget: Mapped[int | None]
    backends: Mapped[list[Any]]
    state: Mapped[str] = mapped_column(String(20))
    trials_done: Mapped[int] = mapped_column(default=0)
    trials_total: Mapped[int | None]
    trials_failed: Mapped[int] = mapped_column(default=0)
    best_s: Mapped[float | None]
    error: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime | None]
    # the process running it (coconet.server.driver): on its machine, seen gone at once, not only when stale
    driver: Mapped[str | None] = mapped_column(String(300))


class MeasurementRow(Base):
    __tablename__ = "coconet_measurements"
    __table_args__ = (
        # Serves measurements() by key and done_keys() (schedule_hash last, so resume reads the index only).
        Index("ix_coconet_measurements_key", "program_hash", "sizes_key", "topology", "schedule_hash"),
        Index("ix_coconet_measurements_job_id", "job_id"),
        # Serves a schedule's code by its hash alone (GET /schedules/{hash}/code without ?program=).
        Index("ix_coconet_measurements_schedule_hash", "schedule_hash"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("coconet_jobs.id"))
    program_hash: Mapped[str] = mapped_column(ForeignKey("coconet_programs.hash"))
    sizes: Mapped[dict[str, Any]]
    sizes_key: Mapped[str] = mapped_column(String(500))
    topology: Mapped[str] = mapped_column(String(200))
    world: Mapped[int]
    backend: Mapped[str] = mapped_column(String(50))
    schedule: Mapped[str] = mapped_column(Text)
    schedule_hash: Mapped[str] = mapped_column(String(64))
    schedule_json: Mapped[dict[str, Any] | None]
    knobs: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(20))
    error: Mapped[str | None] = mapped_column(Text)
    samples: Mapped[list[Any]]
    n: Mapped[int]
    median_s: Mapped[float | None]
    ci_lo_s: Mapped[float | None]
    ci_hi_s: Mapped[float | None]
    max_rel_err: Mapped[float | None]
    source: Mapped[str] = mapped_column(String(20))
    versions: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WinnerRow(Base):
    __tablename__ = "coconet_winners"
    __table_args__ = (
        Index("ix_coconet_winners_key", "program_hash", "topology", "sizes_key", "created_at"),
        # The winner-first lookup of a schedule by its hash joins from the measurements to their winners.
        Index("ix_coconet_winners_measurement_id", "measurement_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    program_hash: Mapped[str] = mapped_column(ForeignKey("coconet_programs.hash"))
    sizes: Mapped[dict[str, Any]]
    sizes_key: Mapped[str] = mapped_column(String(500))
    topology: Mapped[str] = mapped_column(String(200))
    world: Mapped[int]
    # what the search that found it allowed to stay sharded: the questions it answers
    shardable: Mapped[str] = mapped_column(String(500), default=EVERY, server_default=EVERY)
    backend: Mapped[str] = mapped_column(String(50))
    measurement_id: Mapped[int] = mapped_column(ForeignKey("coconet_measurements.id"))
    runner_up_id: Mapped[int | None] = mapped_column(ForeignKey("coconet_measurements.id"))
    baseline_id: Mapped[int | None] = mapped_column(ForeignKey("coconet_measurements.id"))
    speedup: Mapped[float | None]
    source: Mapped[str] = mapped_column(String(20))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("coconet_jobs.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # the re-timing beside the runner-up found this one faster where the search had found it slower
    order_reversed: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
