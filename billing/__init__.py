"""Usage ledger, price book, invoices and Prometheus meters.

The ledger API: ``BillingConsumer`` charges the request-outcome stream into the ledger (its own consumer
group; exactly-once charging over at-least-once delivery), ``record_events`` writes priced events and their
rollups in one transaction, ``usage_report`` / ``list_events`` read them back per tenant, ``quality_report``
reads latency percentiles, outcomes and 429s by limit (``billing.quality``), and the price book (``set_price``,
``list_prices``, ``PriceBook``) holds versioned prices in integer micro-USD per million tokens.
Invoices (``get_invoice``, ``list_invoices``) bill each event on the period its insert decided, drafts until
the grace window ends, then final; ``reconcile`` proves ledger = rollups = invoices.

Rounding rule: each token kind of each request is rounded half up to a whole micro-USD,
``(tokens * price_per_mtok + 500_000) // 1_000_000``; every total is a sum of those integers.
"""

from billing.consumer import GROUP, BillingConsumer, billing_dead_letters
from billing.invoices import (
    DEFAULT_GRACE,
    KINDS,
    BadPeriod,
    InvoiceSummary,
    InvoiceView,
    Line,
    Mismatch,
    Reconciliation,
    finalize,
    get_invoice,
    list_invoices,
    parse_period,
    reconcile,
)
from billing.ledger import UsageEvent, price_row, record_events
from billing.pagination import InvalidCursor, Page
from billing.prices import (
    DEFAULT_MODEL,
    DEFAULT_PRICES,
    PriceBook,
    PriceSpec,
    amount,
    list_prices,
    seed_defaults,
    set_price,
    usd,
)
from billing.quality import Quality, flush_rejections, quality_report, rejection_field, rejections_key
from billing.rollups import UsageLine, list_events, usage_report
from billing.schema import (
    NO_KEY,
    Invoice,
    InvoiceLine,
    InvoiceSum,
    LatencyBucket,
    LedgerEvent,
    OutcomeCount,
    Price,
    RejectionCount,
    RejectionFlush,
    Rollup,
    metadata,
)

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_MODEL",
    "DEFAULT_PRICES",
    "GROUP",
    "KINDS",
    "NO_KEY",
    "BadPeriod",
    "BillingConsumer",
    "Invoice",
    "InvoiceLine",
    "InvoiceSum",
    "InvoiceSummary",
    "InvalidCursor",
    "InvoiceView",
    "LatencyBucket",
    "LedgerEvent",
    "Line",
    "Mismatch",
    "OutcomeCount",
    "Page",
    "Price",
    "PriceBook",
    "PriceSpec",
    "Quality",
    "Reconciliation",
    "RejectionCount",
    "RejectionFlush",
    "Rollup",
    "UsageEvent",
    "UsageLine",
    "amount",
    "billing_dead_letters",
    "finalize",
    "flush_rejections",
    "get_invoice",
    "list_events",
    "list_invoices",
    "list_prices",
    "metadata",
    "parse_period",
    "price_row",
    "quality_report",
    "reconcile",
    "record_events",
    "rejection_field",
    "rejections_key",
    "seed_defaults",
    "set_price",
    "usage_report",
    "usd",
]
