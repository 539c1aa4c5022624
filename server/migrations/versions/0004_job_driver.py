"""The process running a job (coconet.server.driver's text): on its own machine a tuner or a restarted
server sees at once that a job's driver is gone, instead of waiting for its heartbeat to go stale. Rows
written before this have none, and only their heartbeat tells.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("coconet_jobs", sa.Column("driver", sa.String(300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("coconet_jobs") as batch:
        batch.drop_column("driver")
