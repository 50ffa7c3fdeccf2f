"""The usage ledger: one priced event per request id, and its rollups, written in one transaction.

``record_events`` inserts with ``INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING request_id`` (SQLite
and PostgreSQL alike), then adds only the rows it really inserted to ``billing_rollups`` with
``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x``, and commits once: an event seen again (duplicate
emission, redelivery, a consumer restarted after the commit but before its XACK) changes nothing, and the
ledger and the rollups can never disagree. Before the insert, each row is given the invoice period it is billed
on (``billing.invoices.assign_invoice_periods``, which share-locks those invoices until the commit).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from datetime import date, datetime, timedelta, timezone
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Table, TextClause, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from billing.invoices import DEFAULT_GRACE, assign_invoice_periods
from billing.prices import PriceBook
from billing.schema import NO_KEY, LedgerEvent, Rollup, utcnow

ROLLUP_SUMS = ("requests", "cached_input_tokens", "fresh_input_tokens", "output_tokens", "cost")
ROLLUP_CHUNK = 500  # rollup rows per upsert statement (9 parameters each: well under SQLite's limit)


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
    """The ledger row for ``event``, priced from ``book`` (see billing.prices for the rounding rule)."""
    price, cached, fresh, output = book.cost(
        event.model, event.started_at, event.cached_tokens, event.fresh_tokens, event.output_tokens
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
        "cached_input_tokens": event.cached_tokens,
        "fresh_input_tokens": event.fresh_tokens,
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


def _insert(session: Session, table: Table):
    return (postgresql.insert if _postgres(session) else sqlite.insert)(table)


def _postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _bulk(table: Table, tail: str) -> TextClause:
    """PostgreSQL's bulk form of an insert: the rows as one JSON array, expanded to the table's row type by
    ``json_populate_recordset``. The statement's text is the same for any number of rows, so the driver
    parses it once, and one string parameter costs little to send (a multi-row VALUES list of a few
    thousand parameters costs more to parse and bind than to run)."""
    rows = f"json_populate_recordset(NULL::{table.name}, CAST(:rows AS json))"
    return text(f"INSERT INTO {table.name} SELECT * FROM {rows} {tail}")


def _json_rows(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {"rows": json.dumps(rows, default=_iso)}


def _iso(value: Any) -> str:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


_LEDGER_BULK = _bulk(LedgerEvent.__table__, "ON CONFLICT (request_id) DO NOTHING RETURNING request_id")
_ROLLUP_BULK = _bulk(
    Rollup.__table__,
    "ON CONFLICT (tenant_id, day, model, key_id) DO UPDATE SET "
    + ", ".join(f"{n} = billing_rollups.{n} + excluded.{n}" for n in ROLLUP_SUMS),
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
            inserted = set(session.scalars(_LEDGER_BULK, _json_rows(ordered)))
        else:
            stmt = _insert(session, table).on_conflict_do_nothing(index_elements=["request_id"])
            inserted = set(session.scalars(stmt.returning(table.c.request_id), ordered))
        new = [row for request_id, row in rows.items() if request_id in inserted]
        _add_to_rollups(session, new)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return new


def _add_to_rollups(session: Session, rows: list[dict[str, Any]]) -> None:
    sums: dict[tuple, dict[str, int]] = defaultdict(lambda: dict.fromkeys(ROLLUP_SUMS, 0))
    for row in rows:
        total = sums[(row["tenant_id"], row["day"], row["model"], row["key_id"] or NO_KEY)]
        total["requests"] += 1
        for name in ROLLUP_SUMS[1:]:
            total[name] += row[name]
    if not sums:
        return
    table = Rollup.__table__
    values = [
        {"tenant_id": t, "day": d, "model": m, "key_id": k, **total}
        for (t, d, m, k), total in sorted(sums.items())  # one order everywhere: no deadlocks between writers
    ]
    if _postgres(session):
        session.execute(_ROLLUP_BULK, _json_rows(values))
        return
    stmt = _insert(session, table)
    stmt = stmt.on_conflict_do_update(
        index_elements=["tenant_id", "day", "model", "key_id"],
        set_={name: table.c[name] + stmt.excluded[name] for name in ROLLUP_SUMS},
    )
    for start in range(0, len(values), ROLLUP_CHUNK):  # one multi-row upsert (each key once: summed above)
        session.execute(stmt.values(values[start : start + ROLLUP_CHUNK]))
