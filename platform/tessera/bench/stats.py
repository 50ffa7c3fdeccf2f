"""The statistics every bench reports: quantiles, medians over repetitions, and spreads (median, min, max).

Figures that go into a report are rounded (three decimals; percent quartiles two) so reports read cleanly.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linearly interpolated between the two nearest ranks."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def quartiles_pct(changes: Sequence[float]) -> dict:
    """Median and quartiles of relative changes, in percent."""
    return {
        name: round(100 * quantile(changes, q), 2)
        for name, q in (("median", 0.5), ("p25", 0.25), ("p75", 0.75))
    }


def median(values: Iterable[float], ndigits: int | None = 3) -> float:
    """The median, rounded to ``ndigits`` decimals (None: exact)."""
    middle = statistics.median(list(values))
    return middle if ndigits is None else round(middle, ndigits)


def spread(values: Iterable[float]) -> dict:
    """Median, min and max: how a figure varied over repetitions or rounds."""
    values = list(values)
    return {"median": median(values), "min": round(min(values), 3), "max": round(max(values), 3)}


def format_spread(spread: dict, fmt: str, bounds_fmt: str | None = None, unit: str = "") -> str:
    """``median[unit] [min, max]``, each formatted with ``fmt`` (the bounds with ``bounds_fmt`` if given)."""
    bounds_fmt = bounds_fmt or fmt
    return f"{spread['median']:{fmt}}{unit} [{spread['min']:{bounds_fmt}}, {spread['max']:{bounds_fmt}}]"


def format_pct(spread: dict) -> str:
    """A spread of changes in percent: ``+1.23 [-0.5, +2.1]``."""
    return format_spread(spread, "+.2f", "+.1f")


def format_ratio(spread: dict) -> str:
    """A spread of ratios: ``1.23x [1.10, 1.31]``."""
    return format_spread(spread, ".2f", unit="x")
