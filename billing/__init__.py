"""Usage ledger, price book, invoices and Prometheus meters.

The ledger API: ``BillingConsumer`` charges the request-outcome stream into the ledger (its own consumer
group; exactly-once charging over at-least-once delivery), ``record_events`` writes priced events and their
rollups in one transaction, ``usage_report`` / ``list_events`` read them back per tenant, and the price book
(``set_price``, ``list_prices``, ``PriceBook``) holds versioned prices in integer micro-USD per million tokens.

Rounding rule: each token kind of each request is rounded half up to a whole micro-USD,
``(tokens * price_per_mtok + 500_000) // 1_000_000``; every total is a sum of those integers.
"""

from billing.consumer import GROUP, BillingConsumer, billing_dead_letters
from billing.ledger import UsageEvent, price_row, record_events
from billing.prices import (
    DEFAULT_MODEL,
    DEFAULT_PRICES,
    PriceBook,
    PriceSpec,
    amount,
    list_prices,
    seed_defaults,
    set_price,
)
from billing.rollups import BadCursor, UsageLine, list_events, usage_report
from billing.schema import NO_KEY, LedgerEvent, Price, Rollup, metadata

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_PRICES",
    "GROUP",
    "NO_KEY",
    "BadCursor",
    "BillingConsumer",
    "LedgerEvent",
    "Price",
    "PriceBook",
    "PriceSpec",
    "Rollup",
    "UsageEvent",
    "UsageLine",
    "amount",
    "billing_dead_letters",
    "list_events",
    "list_prices",
    "metadata",
    "price_row",
    "record_events",
    "seed_defaults",
    "set_price",
    "usage_report",
]
