"""The usage ledger: one priced event per request id, its rollups and its invoice sums, written in one
transaction.

``record_events`` first gives each row the invoice period it is billed on (``billing.invoices.
assign_invoice_periods``, which share-locks those invoices until the commit), inserts with ``INSERT ... ON
CONFLICT (request_id) DO NOTHING RETURNING request_id`` (SQLite and PostgreSQL alike), adds only the rows it
really inserted to ``billing_rollups`` (per tenant, day, model, key), ``billing_invoice_sums`` (per
tenant, invoice period, usage period, model, price version) and the quality counts (``billing.quality``:
latency buckets and outcomes per tenant, day, model, key) with ``INSERT ... ON CONFLICT DO UPDATE SET x = x +
excluded.x``, and commits once: an event seen again (duplicate emission, redelivery, a consumer restarted
after the commit but before its XACK) changes nothing, and the ledger, the rollups and the invoices can
never disagree.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import date, datetime, timedelta, timezone
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Table, text
from sqlalchemy.orm import Session

from billing import quality
from billing.invoices import DEFAULT_GRACE, assign_invoice_periods
from billing.prices import PriceBook
from billing.schema import NO_KEY, NO_PRICE, InvoiceSum, LedgerEvent, Rollup, utcnow
from billing.upserts import add_to_sums, insert_for

ROLLUP_SUMS = ("requests", "cached_input_tokens", "fresh_input_tokens", "output_tokens", "cost")


class UsageEvent(BaseModel):
    """A request's usage as the outcome stream carries it (tessera's ``RequestOutcome`` JSON; extra fields
    ignored). ``prompt_tokens`` includes ``cached_tokens``; fresh input is the difference."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    request_id: str = Field(min_length=1, max_length=64)
    tenant_id: str = Field(min_length=1, max_length=32)
    key_id: str | None = Field(None, max_length=32)
    deployment: str = Field(max_length=200)
    model: str = Field(max_length=200)
    status: Literal["completed", "failed", "cancelled"]
    error_code: str | None = Field(None, max_length=64)
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(ge=0)
    started_at: AwareDatetime
    first_token_at: AwareDatetime | None = None
    finished_at: AwareDatetime

    @model_validator(mode="after")
    def _consistent(self) -> UsageEvent:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )
        return self

    @property
    def fresh_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def price_row(event: UsageEvent, book: PriceBook) -> dict[str, Any]:
    """The ledger row for ``event``, priced from ``book`` (see billing.prices for the rounding rule).

    A request that failed before producing a token bills no tokens: the tenant got nothing and saw no usage
    (its quotas are released in full too); the row still records that it happened."""
    billed = event.status != "failed" or event.output_tokens > 0
    cached_tokens, fresh_tokens = (event.cached_tokens, event.fresh_tokens) if billed else (0, 0)
    price, cached, fresh, output = book.cost(
        event.model, event.started_at, cached_tokens, fresh_tokens, event.output_tokens
    )
    finished: datetime = event.finished_at
    return {
        "request_id": event.request_id,
        "tenant_id": event.tenant_id,
        "key_id": event.key_id,
        "deployment": event.deployment,
        "model": event.model,
        "status": event.status,
        "error_code": event.error_code,
        "cached_input_tokens": cached_tokens,
        "fresh_input_tokens": fresh_tokens,
        "output_tokens": event.output_tokens,
        "price_id": price.id if price else None,
        "cached_input_cost": cached,
        "fresh_input_cost": fresh,
        "output_cost": output,
        "cost": cached + fresh + output,
        "ttft_s": (event.first_token_at - event.started_at).total_seconds() if event.first_token_at else None,
        "duration_s": (finished - event.started_at).total_seconds(),
        "started_at": event.started_at,
        "finished_at": finished,
        "day": finished.astimezone(timezone.utc).date(),
    }


def _postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _json_rows(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {"rows": json.dumps(rows, default=_iso)}


def _iso(value: Any) -> str:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _upsert_sql(table: str, keys: tuple[str, ...], sums: tuple[str, ...], select: str) -> str:
    added = ", ".join(f"{n} = {table}.{n} + excluded.{n}" for n in sums)
    order = ", ".join(str(i + 1) for i in range(len(keys)))  # one lock order for every writer
    return (
        f"INSERT INTO {table} ({', '.join(keys + sums)}) {select} GROUP BY {order} ORDER BY {order} "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {added}"
    )


ROLLUP_KEYS = ("tenant_id", "day", "model", "key_id")
INVOICE_KEYS = ("tenant_id", "period", "usage_period", "model", "price_id")
INVOICE_SUMS = (
    "requests",
    "cached_input_tokens",
    "fresh_input_tokens",
    "output_tokens",
    "cached_input_cost",
    "fresh_input_cost",
    "output_cost",
)
# PostgreSQL: the batch as one JSON array (one short statement the driver parses once, instead of a VALUES
# list of thousands of parameters), inserted, and only the rows really inserted summed into the rollups and
# the invoice sums and the quality counts, all in one statement (data-modifying CTEs): one round trip per batch.
_RECORD_PG = text(
    "WITH new AS (INSERT INTO billing_ledger SELECT * FROM "
    "json_populate_recordset(NULL::billing_ledger, CAST(:rows AS json)) "
    "ON CONFLICT (request_id) DO NOTHING RETURNING *), "
    "rollups AS ("
    + _upsert_sql(
        "billing_rollups",
        ROLLUP_KEYS,
        ROLLUP_SUMS,
        f"SELECT tenant_id, day, model, coalesce(key_id, '{NO_KEY}'), count(*), sum(cached_input_tokens), "
        "sum(fresh_input_tokens), sum(output_tokens), sum(cost) FROM new",
    )
    + "), invoices AS ("
    + _upsert_sql(
        "billing_invoice_sums",
        INVOICE_KEYS,
        INVOICE_SUMS,
        f"SELECT tenant_id, invoice_period, to_char(day, 'YYYY-MM'), model, coalesce(price_id, {NO_PRICE}), "
        "count(*), sum(cached_input_tokens), sum(fresh_input_tokens), sum(output_tokens), "
        "sum(cached_input_cost), sum(fresh_input_cost), sum(output_cost) FROM new",
    )
    + "), latency AS ("
    + _upsert_sql("billing_latency", quality.LATENCY_KEYS, ("requests",), quality.PG_LATENCY_SELECT)
    + "), outcomes AS ("
    + _upsert_sql("billing_outcomes", quality.OUTCOME_KEYS, ("requests",), quality.PG_OUTCOME_SELECT)
    + ") SELECT request_id FROM new"
)


def record_events(
    session: Session,
    events: Iterable[UsageEvent],
    *,
    grace: timedelta = DEFAULT_GRACE,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """Price and store ``events``, update the rollups, commit; returns the rows newly inserted (events already
    in the ledger, or repeated within ``events``, are left out and change nothing). ``grace`` is how long an
    invoice stays open after its month; ``now`` (default: the clock) decides which invoices have closed."""
    rows: dict[str, dict[str, Any]] = {}
    events = list(events)
    book = PriceBook(session)
    book.load({event.model for event in events})
    for event in events:
        rows.setdefault(event.request_id, price_row(event, book))
    if not rows:
        return []
    now = now or utcnow()
    try:
        assign_invoice_periods(session, rows.values(), now=now, grace=grace)
        table = LedgerEvent.__table__
        # In request-id order: concurrent writers of overlapping batches lock rows in one order (no deadlock).
        ordered = [{**rows[request_id], "recorded_at": now} for request_id in sorted(rows)]
        if _postgres(session):
            inserted = set(session.scalars(_RECORD_PG, _json_rows(ordered)))
            new = [row for request_id, row in rows.items() if request_id in inserted]
        else:
            stmt = insert_for(session, table).on_conflict_do_nothing(index_elements=["request_id"])
            inserted = set(session.scalars(stmt.returning(table.c.request_id), ordered))
            new = [row for request_id, row in rows.items() if request_id in inserted]
            _add_sums(session, Rollup.__table__, ROLLUP_KEYS, ROLLUP_SUMS, new, _rollup_key)
            _add_sums(session, InvoiceSum.__table__, INVOICE_KEYS, INVOICE_SUMS, new, _invoice_key)
            quality.add_ledger_rows(session, new)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return new


def _rollup_key(row: dict[str, Any]) -> tuple:
    return (row["tenant_id"], row["day"], row["model"], row["key_id"] or NO_KEY)


def _invoice_key(row: dict[str, Any]) -> tuple:
    day = row["day"]
    usage_period = f"{day.year:04d}-{day.month:02d}"
    return (row["tenant_id"], row["invoice_period"], usage_period, row["model"], row["price_id"] or NO_PRICE)


def _add_sums(
    session: Session,
    table: Table,
    keys: tuple[str, ...],
    sums: tuple[str, ...],
    rows: list[dict[str, Any]],
    key_of: Callable[[dict[str, Any]], tuple],
) -> None:
    """Add ``rows`` to ``table``'s sums per key (SQLite: summed here, one multi-row upsert)."""
    grouped: dict[tuple, dict[str, int]] = defaultdict(lambda: dict.fromkeys(sums, 0))
    for row in rows:
        total = grouped[key_of(row)]
        total["requests"] += 1
        for name in sums[1:]:
            total[name] += row[name]
    values = [
        {**dict(zip(keys, key, strict=True)), **total}
        for key, total in sorted(grouped.items())  # one order everywhere: no deadlocks between writers
    ]
    add_to_sums(session, table, keys, sums, values)
