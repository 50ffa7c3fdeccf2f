"""The statistics every bench reports: quantiles, medians over repetitions, spreads (median, min, max), and
means over repeated runs with a 95% Student-t interval (of a figure, or of a ratio paired by repeat).

Figures that go into a report are rounded (three decimals; percent quartiles two; intervals four) so reports
read cleanly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

# t(0.975, df) for df = 1..30: the two-sided 95% critical values of Student's t; beyond 30 the expansion in
# ``t975`` is within 0.001 of them.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964
# How a report's intervals are made, said in the report itself.
INTERVAL_METHOD = (
    "mean over repeats with a 95% Student-t interval of the mean; a ratio's interval is over the per-repeat "
    "ratios (variant and baseline of one repeat ran back to back)"
)


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


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_interval(values: Sequence[float | None]) -> dict | None:
    """``{"mean", "values", "ci95"}``: the mean of repeated runs' values and the 95% Student-t interval of
    that mean, ``mean -+ t975(n-1) * s / sqrt(n)`` (``ci95`` None for one value); None if any value is None
    (the figure is missing from a repeat, so no mean of it is honest)."""
    if not values or any(v is None for v in values):
        return None
    mean = statistics.fmean(values)
    ci95 = None
    if len(values) > 1:
        half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
        ci95 = [round(mean - half, 4), round(mean + half, 4)]
    return {"mean": round(mean, 4), "values": [round(v, 4) for v in values], "ci95": ci95}


def ratio_interval(values: Sequence[float | None], baselines: Sequence[float | None]) -> dict | None:
    """``mean_interval`` of the per-repeat ratios ``values[r] / baselines[r]``: repeat r of both ran back to
    back, so pairing them cancels the drift a machine's load puts on both; None if a pair lacks a value."""
    if len(values) != len(baselines):
        raise ValueError(f"{len(values)} values against {len(baselines)} baselines: pair them by repeat")
    if any(v is None or not b for v, b in zip(values, baselines, strict=True)):
        return None
    return mean_interval([v / b for v, b in zip(values, baselines, strict=True)])


def format_interval(stat: dict | None, fmt: str, unit: str = "") -> str:
    """``mean (low–high)`` formatted with ``fmt``; the mean alone for one repeat; ``-`` for no figure."""
    if stat is None:
        return "-"
    if stat["ci95"] is None:
        return f"{stat['mean']:{fmt}}{unit}"
    low, high = stat["ci95"]
    return f"{stat['mean']:{fmt}}{unit} ({low:{fmt}}–{high:{fmt}})"
