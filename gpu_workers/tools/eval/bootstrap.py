"""Bootstrap 95% intervals over files, shared by every ``tessera eval``: files are resampled with replacement,
so a few unusual files cannot make a difference look certain; models or variants measured on the same files
share the same resamples, which makes their differences paired."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BOOTSTRAP_RESAMPLES = 1000

# A statistic maps file indices [R, F] (R resamples of F files) to R values.
Statistic = Callable[[np.ndarray], np.ndarray]


def file_resamples(num_files: int, seed: int = 0) -> np.ndarray:
    """[BOOTSTRAP_RESAMPLES, num_files] file indices, drawn with replacement from one seeded generator."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, num_files, size=(BOOTSTRAP_RESAMPLES, num_files))


def estimate(stat: Statistic, resamples: np.ndarray) -> tuple[float, list[float]]:
    """The statistic on all files and its 95% percentile interval over ``resamples``."""
    num_files = resamples.shape[1]
    point = float(stat(np.arange(num_files)[None, :])[0])
    lo, hi = np.percentile(stat(resamples), [2.5, 97.5])
    # The percentile interval of a skewed statistic can miss the point by rounding; widen to it.
    return point, [float(min(lo, point)), float(max(hi, point))]


def ratio(numerator: np.ndarray, denominator: np.ndarray, transform: Callable = lambda x: x) -> Statistic:
    """transform(sum of the resampled files' numerators / sum of their denominators)."""

    def stat(idx: np.ndarray) -> np.ndarray:
        return transform(numerator[idx].sum(-1) / np.maximum(denominator[idx].sum(-1), 1e-300))

    return stat


def pooled_quantile(per_file: list[np.ndarray], q: float) -> Statistic:
    """The q-quantile of the resampled files' pooled values."""

    def stat(idx: np.ndarray) -> np.ndarray:
        return np.array([np.quantile(np.concatenate([per_file[i] for i in row]), q) for row in idx])

    return stat


def token_statistics(
    nll: list[np.ndarray], kl: list[np.ndarray], top1: list[np.ndarray], base_nll: list[np.ndarray]
) -> dict[str, Statistic]:
    """The per-token metrics of one variant over its units (files or chunks), each unit's arrays per position:
    perplexity, its change vs the baseline in % (paired), mean and p99 KL(baseline || variant), top-1 agreement."""
    tokens = np.array([len(x) for x in base_nll], dtype=float)
    nll_sum, base_sum = (np.array([x.sum() for x in arrays]) for arrays in (nll, base_nll))
    return {
        "perplexity": ratio(nll_sum, tokens, np.exp),
        "perplexity_delta_pct": ratio(nll_sum - base_sum, tokens, lambda x: 100 * np.expm1(x)),
        "kl_mean": ratio(np.array([x.sum() for x in kl]), tokens),
        "kl_p99": pooled_quantile(kl, 0.99),
        "top1_agreement": ratio(np.array([x.sum() for x in top1], dtype=float), tokens),
    }
