"""Monthly spend budgets per tenant and per key: ``quota_limits.monthly_spend`` in micro-USD (null: unlimited).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("quota_limits", sa.Column("monthly_spend", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("quota_limits") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("monthly_spend")
