"""How the benches print: a progress bar on stderr, and the report on stdout as tables or as JSON."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import Progress


@contextlib.contextmanager
def progress(total: int) -> Iterator[Callable[[], None]]:
    """A transient progress bar on stderr; the yielded function advances it by one."""
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("benchmarking", total=total)
        yield lambda: bar.advance(task)


def print_report(report: dict, as_json: bool, render: Callable[[dict], list]) -> None:
    """The report as indented JSON, or ``render(report)``'s tables and notes, then machine and date."""
    if as_json:
        print(json.dumps(report, indent=2))
        return
    # Piped into a file (as for BENCHMARKS.md) the table keeps its rows whole instead of wrapping at 80.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    for renderable in render(report):
        console.print(renderable)
    console.print(f"{report['machine']}, {report['date']}")
