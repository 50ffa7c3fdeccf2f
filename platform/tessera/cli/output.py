"""What the database commands print: rows as a table (rich, the terminal's width, never cut when piped) or,
with ``--json``, one JSON object per line; notes go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any


def json_option() -> argparse.ArgumentParser:
    """The parent parser of every command that prints rows: ``--json``."""
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return as_json


def emit(args: argparse.Namespace, rows: list[dict[str, Any]], title: str) -> None:
    if args.json:
        for row in rows:
            print(json.dumps(row, default=json_default))
        return
    if not rows:
        print(f"{title}: none", file=sys.stderr)
        return
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(rows[0]):
        table.add_column(column, no_wrap=i == 0)  # the first column names the row: never cut it
    for row in rows:
        table.add_row(*(cell(v) for v in row.values()))
    rich_console().print(table)


def rich_console():
    """A console for tables: the terminal's width, or unlimited when piped, so no value is cut."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=1000)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M UTC")
    return str(value)


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")
