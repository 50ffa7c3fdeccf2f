"""Batch-invariant deployments: ``deployments.batch_invariant``, a seeded request's tokens independent of the
rest of its batch (False, the default: off).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(
            sa.Column("batch_invariant", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("batch_invariant")
