"""Indexes for finding a schedule by its hash: GET /schedules/{hash}/code without ?program= scanned the
measurements (nothing indexed schedule_hash alone), and its winner-first join scanned the winners
(nothing indexed winners.measurement_id).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Built inside the upgrade's transaction (not CONCURRENTLY on PostgreSQL): on a store of a million rows
    # writers wait the few seconds this takes, once, when a newer coconet first opens it.
    op.create_index("ix_coconet_measurements_schedule_hash", "coconet_measurements", ["schedule_hash"])
    op.create_index("ix_coconet_winners_measurement_id", "coconet_winners", ["measurement_id"])


def downgrade() -> None:
    op.drop_index("ix_coconet_winners_measurement_id", table_name="coconet_winners")
    op.drop_index("ix_coconet_measurements_schedule_hash", table_name="coconet_measurements")
