"""Audit log for tenant, key and quota changes; Workers-AI async batches and their items.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=True),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(20), nullable=False),
        sa.Column("target_type", sa.String(20), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index("ix_audit_events_tenant_id_id", "audit_events", ["tenant_id", "id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("items", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_batches_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name=op.f("fk_batches_key_id_api_keys"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index(op.f("ix_batches_tenant_id"), "batches", ["tenant_id"])
    op.create_table(
        "batch_items",
        sa.Column("batch_id", sa.String(32), nullable=False),
        sa.Column("index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("external_reference", sa.String(200), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("claimed_by", sa.String(64), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_batch_items_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("batch_id", "index", name=op.f("pk_batch_items")),
    )
    op.create_index("ix_batch_items_status_claimed_by", "batch_items", ["status", "claimed_by"])


def downgrade() -> None:
    op.drop_index("ix_batch_items_status_claimed_by", table_name="batch_items")
    op.drop_table("batch_items")
    op.drop_index(op.f("ix_batches_tenant_id"), table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_audit_events_tenant_id_id", table_name="audit_events")
    op.drop_table("audit_events")
