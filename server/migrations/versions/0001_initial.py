"""Initial schema: programs, topologies, jobs, measurements, winners.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _created() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), nullable=False)


def _key_columns() -> list[sa.Column]:
    return [
        sa.Column("program_hash", sa.String(64), nullable=False),
        sa.Column("sizes", sa.JSON(), nullable=False),
        sa.Column("sizes_key", sa.String(500), nullable=False),
        sa.Column("topology", sa.String(200), nullable=False),
        sa.Column("world", sa.Integer(), nullable=False),
    ]


def _fk(table: str, column: str, target: str) -> sa.ForeignKeyConstraint:
    ref_table = target.split(".")[0]
    return sa.ForeignKeyConstraint([column], [target], name=f"fk_{table}_{column}_{ref_table}")


def upgrade() -> None:
    op.create_table(
        "coconet_programs",
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("ir", sa.JSON(), nullable=False),
        _created(),
        sa.PrimaryKeyConstraint("hash", name="pk_coconet_programs"),
    )
    op.create_table(
        "coconet_topologies",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(200), nullable=False),
        _created(),
        sa.PrimaryKeyConstraint("name", name="pk_coconet_topologies"),
    )
    op.create_table(
        "coconet_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        *_key_columns(),
        sa.Column("budget", sa.Integer(), nullable=True),
        sa.Column("backends", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("trials_done", sa.Integer(), nullable=False),
        sa.Column("trials_total", sa.Integer(), nullable=True),
        sa.Column("trials_failed", sa.Integer(), nullable=False),
        sa.Column("best_s", sa.Double(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        _created(),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        _fk("coconet_jobs", "program_hash", "coconet_programs.hash"),
        sa.PrimaryKeyConstraint("id", name="pk_coconet_jobs"),
    )
    op.create_index("ix_coconet_jobs_state", "coconet_jobs", ["state", "id"])

    op.create_table(
        "coconet_measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        *_key_columns(),
        sa.Column("backend", sa.String(50), nullable=False),
        sa.Column("schedule", sa.Text(), nullable=False),
        sa.Column("schedule_hash", sa.String(64), nullable=False),
        sa.Column("schedule_json", sa.JSON(), nullable=True),
        sa.Column("knobs", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("samples", sa.JSON(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("median_s", sa.Double(), nullable=True),
        sa.Column("ci_lo_s", sa.Double(), nullable=True),
        sa.Column("ci_hi_s", sa.Double(), nullable=True),
        sa.Column("max_rel_err", sa.Double(), nullable=True),
        sa.Column("source", sa.String(20), nullable=False),
        sa.Column("versions", sa.JSON(), nullable=False),
        _created(),
        _fk("coconet_measurements", "job_id", "coconet_jobs.id"),
        _fk("coconet_measurements", "program_hash", "coconet_programs.hash"),
        sa.PrimaryKeyConstraint("id", name="pk_coconet_measurements"),
    )
    op.create_index("ix_coconet_measurements_job_id", "coconet_measurements", ["job_id"])
    op.create_index(
        "ix_coconet_measurements_key",
        "coconet_measurements",
        ["program_hash", "sizes_key", "topology", "schedule_hash"],
    )

    op.create_table(
        "coconet_winners",
        sa.Column("id", sa.Integer(), nullable=False),
        *_key_columns(),
        sa.Column("backend", sa.String(50), nullable=False),
        sa.Column("measurement_id", sa.Integer(), nullable=False),
        sa.Column("runner_up_id", sa.Integer(), nullable=True),
        sa.Column("baseline_id", sa.Integer(), nullable=True),
        sa.Column("speedup", sa.Double(), nullable=True),
        sa.Column("source", sa.String(20), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        _created(),
        _fk("coconet_winners", "program_hash", "coconet_programs.hash"),
        _fk("coconet_winners", "measurement_id", "coconet_measurements.id"),
        _fk("coconet_winners", "runner_up_id", "coconet_measurements.id"),
        _fk("coconet_winners", "baseline_id", "coconet_measurements.id"),
        _fk("coconet_winners", "job_id", "coconet_jobs.id"),
        sa.PrimaryKeyConstraint("id", name="pk_coconet_winners"),
    )
    op.create_index(
        "ix_coconet_winners_key", "coconet_winners", ["program_hash", "topology", "sizes_key", "created_at"]
    )


def downgrade() -> None:
    for table in ("coconet_winners", "coconet_measurements", "coconet_jobs", "coconet_topologies", "coconet_programs"):
        op.drop_table(table)
