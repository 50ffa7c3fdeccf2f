"""Usage reports, read from the rollups (never the ledger), and pages of raw ledger events.

Both paginate by keyset cursors: a cursor is an opaque string naming the last row of the page before, so
a page never repeats or skips a row however deep it is.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Literal

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from billing.schema import NO_KEY, LedgerEvent, Rollup

GroupBy = Literal["day", "model", "key"]
GROUP_COLUMNS = {"day": Rollup.day, "model": Rollup.model, "key": Rollup.key_id}
MAX_LIMIT = 1000


class BadCursor(ValueError):
    pass


def encode_cursor(values: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, size: int) -> list[Any]:
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except ValueError as exc:
        raise BadCursor("invalid cursor: pass the next_cursor of the previous page unchanged") from exc
    if not isinstance(values, list) or len(values) != size or not all(isinstance(v, str) for v in values):
        raise BadCursor("invalid cursor: pass the next_cursor of the previous page unchanged")
    return values


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
        .order_by(column)
        .limit(min(limit, MAX_LIMIT) + 1)
    )
    if tenant_id is not None:
        query = query.where(Rollup.tenant_id == tenant_id)
    if model is not None:
        query = query.where(Rollup.model == model)
    if key_id is not None:
        query = query.where(Rollup.key_id == key_id)
    if cursor is not None:
        (after,) = decode_cursor(cursor, 1)
        query = query.where(column > (date.fromisoformat(after) if group_by == "day" else after))
    rows = session.execute(query).all()
    more = len(rows) > min(limit, MAX_LIMIT)
    rows = rows[: min(limit, MAX_LIMIT)]
    lines = []
    for value, *sums in rows:
        group = value.isoformat() if group_by == "day" else value
        if group_by == "key" and value == NO_KEY:
            group = None
        lines.append(UsageLine(group, *(int(s or 0) for s in sums)))
    next_cursor = None
    if more and rows:
        last = rows[-1][0]
        next_cursor = encode_cursor([last.isoformat() if group_by == "day" else last])
    return lines, next_cursor


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
    limit = min(limit, MAX_LIMIT)
    query = (
        select(LedgerEvent)
        .where(
            LedgerEvent.finished_at >= _midnight(start),
            LedgerEvent.finished_at < _midnight(end + timedelta(days=1)),
        )
        .order_by(LedgerEvent.finished_at, LedgerEvent.request_id)
        .limit(limit + 1)
    )
    if tenant_id is not None:
        query = query.where(LedgerEvent.tenant_id == tenant_id)
    if model is not None:
        query = query.where(LedgerEvent.model == model)
    if key_id is not None:
        query = query.where(LedgerEvent.key_id == key_id)
    if cursor is not None:
        finished, request_id = decode_cursor(cursor, 2)
        try:
            after = datetime.fromisoformat(finished)
        except ValueError as exc:
            raise BadCursor("invalid cursor: pass the next_cursor of the previous page unchanged") from exc
        query = query.where(tuple_(LedgerEvent.finished_at, LedgerEvent.request_id) > (after, request_id))
    events = list(session.scalars(query))
    more = len(events) > limit
    events = events[:limit]
    next_cursor = encode_cursor([events[-1].finished_at.isoformat(), events[-1].request_id]) if more else None
    return events, next_cursor
