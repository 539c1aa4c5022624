"""What a tuning let its schedules leave sharded (as_slice): part of a job's key and of a winner's.

A winner answers only the questions its search covered. Every row written before this searched every
schedule, so they get ``*`` (every state).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_TABLES = ("coconet_jobs", "coconet_winners")


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(table, sa.Column("shardable", sa.String(500), nullable=False, server_default="*"))


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("shardable")
