"""Initial schema: tenants, API keys, deployments and their audit log, request records.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Aware UTC datetimes (tessera.models.UTCDateTime stores naive UTC on SQLite).
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("salt", sa.String(32), nullable=False),
        sa.Column("scopes", sa.String(200), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("revoked_at", Timestamp, nullable=True),
        sa.Column("last_used_at", Timestamp, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index(op.f("ix_api_keys_prefix"), "api_keys", ["prefix"], unique=True)
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "deployments",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("checkpoint", sa.String(1000), nullable=False),
        sa.Column("mode", sa.String(20), nullable=False),
        sa.Column("dtype", sa.String(20), nullable=False),
        sa.Column("prefill_kv", sa.String(20), nullable=False),
        sa.Column("decode_kv", sa.String(20), nullable=False),
        sa.Column("prefill_weights", sa.String(20), nullable=False),
        sa.Column("decode_weights", sa.String(20), nullable=False),
        sa.Column("page_size", sa.Integer(), nullable=False),
        sa.Column("kv_budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("max_num_seqs", sa.Integer(), nullable=False),
        sa.Column("max_model_len", sa.Integer(), nullable=True),
        sa.Column("max_tokens_limit", sa.Integer(), nullable=False),
        sa.Column("integrity_check", sa.Boolean(), nullable=False),
        sa.Column("prefix_cache", sa.Boolean(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_deployments")),
    )
    op.create_table(
        "deployment_audit",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment", sa.String(200), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(20), nullable=False),
        sa.Column("changes", sa.JSON(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployment_audit")),
    )
    op.create_index(
        "ix_deployment_audit_deployment_created_at", "deployment_audit", ["deployment", "created_at"]
    )

    op.create_table(
        "request_records",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("deployment", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name=op.f("fk_request_records_key_id_api_keys"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_request_records_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_request_records")),
    )
    op.create_index("ix_request_records_tenant_id_created_at", "request_records", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_request_records_tenant_id_created_at", table_name="request_records")
    op.drop_table("request_records")
    op.drop_index("ix_deployment_audit_deployment_created_at", table_name="deployment_audit")
    op.drop_table("deployment_audit")
    op.drop_table("deployments")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_index(op.f("ix_api_keys_prefix"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
