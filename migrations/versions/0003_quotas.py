"""Quota limits per tenant and per-key overrides (enforced in Redis by tessera.quotas).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_limits",
        sa.Column("scope", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("concurrency", sa.Integer(), nullable=True),
        sa.Column("daily_tokens", sa.BigInteger(), nullable=True),
        sa.Column("monthly_tokens", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_quota_limits_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name=op.f("fk_quota_limits_key_id_api_keys"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("scope", name=op.f("pk_quota_limits")),
    )
    op.create_index(op.f("ix_quota_limits_tenant_id"), "quota_limits", ["tenant_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_quota_limits_tenant_id"), table_name="quota_limits")
    op.drop_table("quota_limits")
