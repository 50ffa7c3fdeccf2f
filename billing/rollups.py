"""Usage reports, read from the rollups (never the ledger), and pages of raw ledger events.

Both page by keyset cursors (``billing.pagination``), so a page never repeats or skips a row however deep
it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.pagination import keyset
from billing.schema import NO_KEY, LedgerEvent, Rollup

GroupBy = Literal["day", "model", "key"]
GROUP_COLUMNS = {"day": Rollup.day, "model": Rollup.model, "key": Rollup.key_id}
MAX_LIMIT = 1000


@dataclass(frozen=True)
class UsageLine:
    group: str | None  # the day (ISO), model, or key id (None: usage without a key)
    requests: int
    cached_input_tokens: int
    fresh_input_tokens: int
    output_tokens: int
    cost: int  # micro-USD


def usage_report(
    session: Session,
    tenant_id: str | None,
    *,
    start: date,
    end: date,
    group_by: GroupBy = "day",
    model: str | None = None,
    key_id: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
) -> tuple[list[UsageLine], str | None]:
    """``tenant_id``'s usage (None: every tenant's) on the UTC days ``start`` to ``end`` (both included), one
    line per group, in group order; returns (lines, the cursor of the next page or None)."""
    column = GROUP_COLUMNS[group_by]
    query = (
        select(
            column,
            func.sum(Rollup.requests),
            func.sum(Rollup.cached_input_tokens),
            func.sum(Rollup.fresh_input_tokens),
            func.sum(Rollup.output_tokens),
            func.sum(Rollup.cost),
        )
        .where(Rollup.day >= start, Rollup.day <= end)
        .group_by(column)
    )
    if tenant_id is not None:
        query = query.where(Rollup.tenant_id == tenant_id)
    if model is not None:
        query = query.where(Rollup.model == model)
    if key_id is not None:
        query = query.where(Rollup.key_id == key_id)
    limit = min(limit, MAX_LIMIT)
    page = keyset(session, query, (column,), cursor, limit, max_limit=MAX_LIMIT, entities=False)
    lines = []
    for value, *sums in page.items:
        group = value.isoformat() if group_by == "day" else value
        if group_by == "key" and value == NO_KEY:
            group = None
        lines.append(UsageLine(group, *(int(s or 0) for s in sums)))
    return lines, page.next_cursor


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(0), tzinfo=timezone.utc)


def list_events(
    session: Session,
    tenant_id: str | None,
    *,
    start: date,
    end: date,
    model: str | None = None,
    key_id: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
) -> tuple[list[LedgerEvent], str | None]:
    """``tenant_id``'s ledger events (None: every tenant's) that finished on the UTC days ``start`` to ``end``,
    oldest first. The (tenant_id, finished_at, request_id) index serves a tenant's, (finished_at, request_id)
    everyone's."""
    query = select(LedgerEvent).where(
        LedgerEvent.finished_at >= _midnight(start),
        LedgerEvent.finished_at < _midnight(end + timedelta(days=1)),
    )
    if tenant_id is not None:
        query = query.where(LedgerEvent.tenant_id == tenant_id)
    if model is not None:
        query = query.where(LedgerEvent.model == model)
    if key_id is not None:
        query = query.where(LedgerEvent.key_id == key_id)
    order = (LedgerEvent.finished_at, LedgerEvent.request_id)
    page = keyset(session, query, order, cursor, min(limit, MAX_LIMIT), max_limit=MAX_LIMIT)
    return page.items, page.next_cursor
