"""Invoices: finalised periods and their line items; each ledger event's invoice period.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Events already in the ledger are billed on their own month's invoice, a draft until finalised.
    op.add_column("billing_ledger", sa.Column("invoice_period", sa.String(7), nullable=True))
    postgres = op.get_bind().dialect.name == "postgresql"
    month = "to_char(day, 'YYYY-MM')" if postgres else "substr(day, 1, 7)"
    op.execute(f"UPDATE billing_ledger SET invoice_period = {month}")
    with op.batch_alter_table("billing_ledger") as batch:  # SQLite: NOT NULL needs the table rebuilt
        batch.alter_column("invoice_period", existing_type=sa.String(7), nullable=False)
    op.create_index("ix_billing_ledger_finished", "billing_ledger", ["finished_at", "request_id"])
    op.create_index(
        "ix_billing_ledger_tenant_invoice_period", "billing_ledger", ["tenant_id", "invoice_period"]
    )
    op.create_table(
        "billing_invoices",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("total", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("tenant_id", "period", name=op.f("pk_billing_invoices")),
    )
    op.create_table(
        "billing_invoice_lines",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("usage_period", sa.String(7), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("price_id", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("unit_price_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id", "period"],
            ["billing_invoices.tenant_id", "billing_invoices.period"],
            name="fk_billing_invoice_lines_invoice",
        ),
        sa.ForeignKeyConstraint(
            ["price_id"],
            ["billing_prices.id"],
            name=op.f("fk_billing_invoice_lines_price_id_billing_prices"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_billing_invoice_lines")),
    )
    op.create_index(
        "ix_billing_invoice_lines_tenant_period", "billing_invoice_lines", ["tenant_id", "period"]
    )
    op.create_table(
        "billing_invoice_sums",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("usage_period", sa.String(7), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("price_id", sa.Integer(), autoincrement=False, nullable=False),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in (
                "requests",
                "cached_input_tokens",
                "fresh_input_tokens",
                "output_tokens",
                "cached_input_cost",
                "fresh_input_cost",
                "output_cost",
            )
        ),
        sa.PrimaryKeyConstraint(
            "tenant_id", "period", "usage_period", "model", "price_id", name=op.f("pk_billing_invoice_sums")
        ),
    )
    op.execute(
        "INSERT INTO billing_invoice_sums SELECT tenant_id, invoice_period, "
        f"{month}, model, coalesce(price_id, 0), count(*), sum(cached_input_tokens), sum(fresh_input_tokens), "
        "sum(output_tokens), sum(cached_input_cost), sum(fresh_input_cost), sum(output_cost) "
        f"FROM billing_ledger GROUP BY tenant_id, invoice_period, {month}, model, coalesce(price_id, 0)"
    )
    op.execute(
        "INSERT INTO billing_invoices (tenant_id, period, status, created_at) "
        "SELECT DISTINCT tenant_id, invoice_period, 'draft', CURRENT_TIMESTAMP FROM billing_ledger"
    )


def downgrade() -> None:
    op.drop_index("ix_billing_invoice_lines_tenant_period", table_name="billing_invoice_lines")
    op.drop_table("billing_invoice_lines")
    op.drop_table("billing_invoice_sums")
    op.drop_table("billing_invoices")
    op.drop_index("ix_billing_ledger_tenant_invoice_period", table_name="billing_ledger")
    op.drop_index("ix_billing_ledger_finished", table_name="billing_ledger")
    with op.batch_alter_table("billing_ledger") as batch:
        batch.drop_column("invoice_period")
