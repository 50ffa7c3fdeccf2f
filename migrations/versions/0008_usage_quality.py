"""Usage quality: latency histogram buckets, outcome counts and 429 counts per (tenant, day, model, key), and
the tokens of the 429 counter batches already moved from Redis (billing.quality).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SCOPE = ("tenant_id", "day", "model", "key_id")


def _scope() -> list[sa.Column]:
    return [
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "billing_latency",
        *_scope(),
        sa.Column("metric", sa.String(8), nullable=False),
        sa.Column("bucket", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*SCOPE, "metric", "bucket", name=op.f("pk_billing_latency")),
    )
    op.create_table(
        "billing_outcomes",
        *_scope(),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*SCOPE, "status", "error_code", name=op.f("pk_billing_outcomes")),
    )
    op.create_table(
        "billing_rejections",
        *_scope(),
        sa.Column("limit_name", sa.String(32), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*SCOPE, "limit_name", name=op.f("pk_billing_rejections")),
    )
    op.create_table(
        "billing_rejection_flushes",
        sa.Column("token", sa.String(32), nullable=False),
        sa.Column("flushed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("token", name=op.f("pk_billing_rejection_flushes")),
    )


def downgrade() -> None:
    for table in ("billing_rejection_flushes", "billing_rejections", "billing_outcomes", "billing_latency"):
        op.drop_table(table)
