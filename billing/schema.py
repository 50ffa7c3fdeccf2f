"""Billing's tables, on billing's own metadata (``billing`` imports neither plane, so not tessera's Base).

Alembic creates them (``migrations/versions/0004_billing.py``; ``migrations/env.py`` targets both metadatas).
No foreign keys to tessera's tables: money records outlive a deleted tenant or key.
"""

from __future__ import annotations

from datetime import date, datetime, timezone

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NO_KEY = ""  # key_id of usage without an API key, in rollups (a primary-key column cannot be NULL)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every database (SQLite stores naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one (e.g. datetime.now(timezone.utc))")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class BillingBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), date: Date()}


metadata = BillingBase.metadata


class Price(BillingBase):
    """One version of a model's price: micro-USD per million tokens of each kind, from ``effective_from`` on."""

    __tablename__ = "billing_prices"
    __table_args__ = (UniqueConstraint("model", "version", name="uq_billing_prices_model_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))  # "*": the default for models without a price
    version: Mapped[int] = mapped_column(Integer)
    effective_from: Mapped[datetime]
    fresh_input_per_mtok: Mapped[int] = mapped_column(BigInteger)  # micro-USD per 1e6 tokens
    cached_input_per_mtok: Mapped[int] = mapped_column(BigInteger)
    output_per_mtok: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class LedgerEvent(BillingBase):
    """One priced usage event per request id: written once, never updated."""

    __tablename__ = "billing_ledger"
    __table_args__ = (
        Index("ix_billing_ledger_tenant_finished", "tenant_id", "finished_at", "request_id"),
        Index("ix_billing_ledger_finished", "finished_at", "request_id"),  # the admin's list across tenants
        Index("ix_billing_ledger_tenant_invoice_period", "tenant_id", "invoice_period"),
    )

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(32))
    deployment: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    fresh_input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    price_id: Mapped[int | None] = mapped_column(ForeignKey("billing_prices.id"))  # None: no price applied
    cached_input_cost: Mapped[int] = mapped_column(BigInteger)  # micro-USD
    fresh_input_cost: Mapped[int] = mapped_column(BigInteger)
    output_cost: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[int] = mapped_column(BigInteger)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    duration_s: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime]
    day: Mapped[date]  # finished_at's UTC day: the rollup it counts in
    # The "YYYY-MM" invoice it is billed on, decided at insert (billing.invoices): its own month's, unless
    # that one was already closed, then the next open one's (an adjustment line naming day's month).
    invoice_period: Mapped[str] = mapped_column(String(7))
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)


class Rollup(BillingBase):
    """Sums of the ledger per (tenant, UTC day, model, key), kept in the ledger insert's transaction."""

    __tablename__ = "billing_rollups"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    day: Mapped[date] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # NO_KEY for keyless usage
    requests: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    fresh_input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[int] = mapped_column(BigInteger)  # micro-USD


class Invoice(BillingBase):
    """A tenant's invoice of one calendar month (``period``, "YYYY-MM"): ``draft`` (its lines are computed
    from the ledger on every read) until finalised, then ``final`` with stored lines that never change."""

    __tablename__ = "billing_invoices"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)
    status: Mapped[str] = mapped_column(String(8))  # "draft" or "final"
    total: Mapped[int | None] = mapped_column(BigInteger)  # micro-USD, stored when final
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finalized_at: Mapped[datetime | None]


NO_PRICE = 0  # price_id of invoice sums of usage without a price (a primary-key column cannot be NULL)


class InvoiceSum(BillingBase):
    """Sums of the ledger per invoice: (tenant, the period billed on, the period used in, model, price
    version), kept in the ledger insert's transaction like the rollups; a draft invoice's lines are read
    from here, and finalising copies them into ``InvoiceLine``."""

    __tablename__ = "billing_invoice_sums"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)
    usage_period: Mapped[str] = mapped_column(String(7), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    price_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # or NO_PRICE
    requests: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    fresh_input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_cost: Mapped[int] = mapped_column(BigInteger)  # micro-USD
    fresh_input_cost: Mapped[int] = mapped_column(BigInteger)
    output_cost: Mapped[int] = mapped_column(BigInteger)


class InvoiceLine(BillingBase):
    """One stored line of a final invoice: a model's tokens of one kind at one price version, used in
    ``usage_period`` (the invoice's own period, or an earlier one for an adjustment)."""

    __tablename__ = "billing_invoice_lines"
    __table_args__ = (
        ForeignKeyConstraint(
            ["tenant_id", "period"],
            ["billing_invoices.tenant_id", "billing_invoices.period"],
            name="fk_billing_invoice_lines_invoice",
        ),
        Index("ix_billing_invoice_lines_tenant_period", "tenant_id", "period"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    period: Mapped[str] = mapped_column(String(7))
    usage_period: Mapped[str] = mapped_column(String(7))
    model: Mapped[str] = mapped_column(String(200))
    price_id: Mapped[int | None] = mapped_column(ForeignKey("billing_prices.id"))
    kind: Mapped[str] = mapped_column(String(16))  # "cached_input", "fresh_input" or "output"
    requests: Mapped[int] = mapped_column(BigInteger)
    quantity: Mapped[int] = mapped_column(BigInteger)  # tokens
    unit_price_per_mtok: Mapped[int] = mapped_column(BigInteger)  # micro-USD per 1e6 tokens
    amount: Mapped[int] = mapped_column(BigInteger)  # micro-USD: the sum of the requests' rounded amounts


# --- quality: latency histograms, outcomes and 429s per (tenant, day, model, key); see billing.quality ---


class LatencyBucket(BillingBase):
    """Requests whose ``metric`` ("ttft": time to first token, "tpot": time per output token after the
    first) fell in histogram bucket ``bucket`` (billing.quality.BOUNDS), kept in the ledger insert's
    transaction like the rollups."""

    __tablename__ = "billing_latency"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    day: Mapped[date] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # NO_KEY for keyless usage
    metric: Mapped[str] = mapped_column(String(8), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    requests: Mapped[int] = mapped_column(BigInteger)


NO_ERROR = ""  # error_code of requests that ended without one, in outcome counts (a primary-key column)


class OutcomeCount(BillingBase):
    """Ended requests per how they ended (status, error code), kept in the ledger insert's transaction."""

    __tablename__ = "billing_outcomes"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    day: Mapped[date] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    error_code: Mapped[str] = mapped_column(String(64), primary_key=True)  # NO_ERROR for none
    requests: Mapped[int] = mapped_column(BigInteger)


class RejectionCount(BillingBase):
    """Requests the gateway refused with 429, per the limit that refused them (never reach the ledger)."""

    __tablename__ = "billing_rejections"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    day: Mapped[date] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    limit_name: Mapped[str] = mapped_column(String(32), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)


class RejectionFlush(BillingBase):
    """One batch of 429 counters moved from Redis into ``billing_rejections``, by its token: committed with
    the counts, so a batch taken again after a crash is recognised and not added twice."""

    __tablename__ = "billing_rejection_flushes"

    token: Mapped[str] = mapped_column(String(32), primary_key=True)
    flushed_at: Mapped[datetime] = mapped_column(default=utcnow)
