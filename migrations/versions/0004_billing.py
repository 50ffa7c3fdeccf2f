"""Billing: the price book (seeded with the shipped defaults), the usage ledger and its rollups.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# billing.prices.DEFAULT_PRICES at the time of this revision (micro-USD per million tokens), effective from
# billing.prices.EPOCH; tests check they agree.
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)
DEFAULTS = [
    ("@tessera/pycode-tiny", 100_000, 20_000, 400_000),
    ("*", 100_000, 20_000, 400_000),
]


def upgrade() -> None:
    prices = op.create_table(
        "billing_prices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fresh_input_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("output_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_billing_prices")),
        sa.UniqueConstraint("model", "version", name="uq_billing_prices_model_version"),
    )
    op.create_table(
        "billing_ledger",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("deployment", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("cached_input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("fresh_input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("price_id", sa.Integer(), nullable=True),
        sa.Column("cached_input_cost", sa.BigInteger(), nullable=False),
        sa.Column("fresh_input_cost", sa.BigInteger(), nullable=False),
        sa.Column("output_cost", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.BigInteger(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["price_id"], ["billing_prices.id"], name=op.f("fk_billing_ledger_price_id_billing_prices")
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_billing_ledger")),
    )
    op.create_index(
        "ix_billing_ledger_tenant_finished", "billing_ledger", ["tenant_id", "finished_at", "request_id"]
    )
    op.create_table(
        "billing_rollups",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("fresh_input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "day", "model", "key_id", name=op.f("pk_billing_rollups")),
    )
    now = datetime.now(timezone.utc)
    naive = op.get_bind().dialect.name == "sqlite"  # SQLite stores naive UTC (billing.schema.UTCDateTime)
    op.bulk_insert(
        prices,
        [
            {
                "model": model,
                "version": 1,
                "effective_from": EPOCH.replace(tzinfo=None) if naive else EPOCH,
                "fresh_input_per_mtok": fresh,
                "cached_input_per_mtok": cached,
                "output_per_mtok": output,
                "created_at": now.replace(tzinfo=None) if naive else now,
            }
            for model, fresh, cached, output in DEFAULTS
        ],
    )


def downgrade() -> None:
    op.drop_table("billing_rollups")
    op.drop_index("ix_billing_ledger_tenant_finished", table_name="billing_ledger")
    op.drop_table("billing_ledger")
    op.drop_table("billing_prices")
