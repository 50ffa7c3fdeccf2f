"""The INSERT ... ON CONFLICT statements the ledger's writers share, in the session's dialect.

Sums are added with one statement per table and columns, built once per process and run with many rows
(executemany): SQLAlchemy compiles it once, where a multi-row VALUES built per batch was compiled per batch,
which made four of the SQLite ledger's statements cost more than the rest of a batch (record_events of one
event on SQLite: 6.1-6.6 ms of CPU before, 1.3-1.6 ms after; BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def insert_for(session: Session, table: Table):
    """An INSERT into ``table`` that takes ``on_conflict_do_*`` (PostgreSQL's or SQLite's)."""
    return dialect_insert(session.get_bind().dialect.name, table)


def dialect_insert(dialect: str, table: Table):
    """``insert_for`` by the dialect's name, for statements built once and cached per dialect."""
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


@functools.lru_cache(maxsize=64)
def _adding(dialect: str, table: Table, keys: tuple[str, ...], sums: tuple[str, ...]):
    insert = dialect_insert(dialect, table)
    return insert.on_conflict_do_update(
        index_elements=list(keys), set_={name: table.c[name] + insert.excluded[name] for name in sums}
    )


def add_to_sums(
    session: Session,
    table: Table,
    keys: tuple[str, ...],
    sums: tuple[str, ...],
    rows: Sequence[dict[str, Any]],
) -> None:
    """Add each row's ``sums`` columns to the stored row with its ``keys`` (inserted as it is when there is
    none). Each key once in ``rows``, sorted: writers of overlapping keys then lock rows in one order."""
    if rows:
        session.execute(_adding(session.get_bind().dialect.name, table, keys, sums), list(rows))
