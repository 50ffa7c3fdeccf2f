"""Usage quality: latency histogram buckets, outcome counts and 429 counts per (tenant, day, model, key), and
the tokens of the 429 counter batches already moved from Redis (billing.quality). The ledger already there is
counted in, so the dashboard shows latency and errors for the days before the upgrade too (429s were not
recorded before).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SCOPE = ("tenant_id", "day", "model", "key_id")
# billing.quality.BOUNDS at the time of this revision (tests check they agree): 1 ms to 100 s, six per decade.
BOUNDS = tuple(1e-3 * 10 ** (i / 6) for i in range(31))
CHUNK = 1000


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
    _count_the_ledger()


def _count_the_ledger() -> None:
    """The quality counts of every ledger row, as billing.quality.add_ledger_rows makes them."""
    conn = op.get_bind()
    ledger = sa.table(
        "billing_ledger",
        *(sa.column(n) for n in ("tenant_id", "day", "model", "key_id", "status", "error_code")),
        *(sa.column(n) for n in ("ttft_s", "duration_s", "output_tokens")),
    )
    buckets: dict[tuple, int] = defaultdict(int)
    outcomes: dict[tuple, int] = defaultdict(int)
    rows = conn.execute(sa.select(ledger).execution_options(stream_results=True, yield_per=10_000))
    for tenant_id, day, model, key_id, status, error_code, ttft, duration, output in rows:
        scope = (tenant_id, day, model, key_id or "")
        outcomes[(*scope, status, error_code or "")] += 1
        if ttft is None:
            continue
        buckets[(*scope, "ttft", bisect_right(BOUNDS, max(ttft, 0.0)))] += 1
        if output > 1:
            buckets[(*scope, "tpot", bisect_right(BOUNDS, max(duration - ttft, 0.0) / (output - 1)))] += 1
    for name, keys, counts in (
        ("billing_latency", ("metric", "bucket"), buckets),
        ("billing_outcomes", ("status", "error_code"), outcomes),
    ):
        table = sa.table(name, *(sa.column(n) for n in (*SCOPE, *keys, "requests")))
        values = [dict(zip((*SCOPE, *keys, "requests"), (*k, n), strict=True)) for k, n in counts.items()]
        for start in range(0, len(values), CHUNK):
            conn.execute(table.insert(), values[start : start + CHUNK])


def downgrade() -> None:
    for table in ("billing_rejection_flushes", "billing_rejections", "billing_outcomes", "billing_latency"):
        op.drop_table(table)
