"""Keyset pagination, the one way every list of the platform pages: a cursor is an opaque string encoding the
sort key of the last row served, so rows inserted or removed meanwhile never shift a page (offsets would repeat
or skip them), and each page is one indexed range scan. ``InvalidCursor`` is a cursor (or page size) the caller
must fix. Here, below both planes' users, because billing imports neither plane and the control plane pages
its own tables the same way.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, tuple_
from sqlalchemy.orm import Session

T = TypeVar("T")
MAX_PAGE = 200  # the admin lists' largest page


class InvalidCursor(ValueError):
    """A cursor this server did not hand out, or a page size out of range (HTTP 400)."""


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None  # None: this is the last page


def keyset(
    session: Session,
    query: Select,
    order: Sequence[Any],
    cursor: str | None,
    limit: int,
    *,
    descending: bool = False,
    max_limit: int = MAX_PAGE,
    entities: bool = True,
) -> Page:
    """The page of ``query`` after ``cursor`` in ``order`` (columns, all ascending or all descending).
    ``entities``: the query selects one ORM entity per row (else rows, whose ``order`` columns name the cursor)."""
    if not 1 <= limit <= max_limit:
        raise InvalidCursor(f"limit must be between 1 and {max_limit}, got {limit}")
    if cursor is not None:
        after = decode_cursor(cursor, [column_kind(column) for column in order])
        key, value = (order[0], after[0]) if len(order) == 1 else (tuple_(*order), tuple(after))
        query = query.where(key < value if descending else key > value)
    query = query.order_by(*(column.desc() if descending else column for column in order))
    query = query.limit(limit + 1)
    rows = list(session.scalars(query) if entities else session.execute(query))
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = encode_cursor([getattr(rows[-1], column.key) for column in order]) if more else None
    return Page(rows, next_cursor)


def column_kind(column: Any) -> type:
    """The Python type a column's values have (what its cursor part decodes to)."""
    column_type = column.type
    # UTCDateTime, a TypeDecorator, reports python_type ``object``: ask its implementation.
    return getattr(column_type, "impl_instance", column_type).python_type


def encode_cursor(values: Sequence[Any]) -> str:
    plain = [v.isoformat() if isinstance(v, date) else v for v in values]
    return base64.urlsafe_b64encode(json.dumps(plain).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, kinds: Sequence[type]) -> list[Any]:
    """The values ``encode_cursor`` encoded, one of each type of ``kinds`` (datetimes: aware only)."""
    invalid = InvalidCursor(
        f"invalid cursor {cursor[:40]!r}: pass the next_cursor of the previous page unchanged, "
        "or omit it for the first page"
    )
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise invalid from None
    if not isinstance(values, list) or len(values) != len(kinds):
        raise invalid
    decoded = []
    for kind, value in zip(kinds, values, strict=True):
        try:
            if kind is datetime:
                value = datetime.fromisoformat(value)
                if value.tzinfo is None:
                    raise ValueError("naive")
            elif kind is date:
                value = date.fromisoformat(value)
            elif not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError("wrong type")
        except (TypeError, ValueError):
            raise invalid from None
        decoded.append(value)
    return decoded


def offset_page(session: Session, query: Select, limit: int | None, offset: int) -> list:
    """The rows of an ordered ``query`` from ``offset``, at most ``limit`` (None: all): the CLI's lists."""
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query.offset(offset)))
