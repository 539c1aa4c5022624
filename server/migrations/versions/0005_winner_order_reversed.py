"""Whether a winner's re-timing reversed the search's order: the search found the runner-up faster, and
timed again beside it (alternating, with the baseline), the winner was. Rows written before this say
false, which is what they were taken to mean.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "coconet_winners", sa.Column("order_reversed", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    with op.batch_alter_table("coconet_winners") as batch:
        batch.drop_column("order_reversed")
