"""Conditional disaggregation: ``deployments.local_prefill_max_tokens``, the longest prompt the decode pool
prefills itself instead of taking it through the prefill pool and a KV hand-off (0, the default: none).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(
            sa.Column("local_prefill_max_tokens", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("local_prefill_max_tokens")
