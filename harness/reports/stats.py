"""Statistics behind every table cell: intervals over seeds and paired comparisons.

Three pure functions, each a textbook procedure named where it is used:

* :func:`t_interval`: mean and the half-width of the two-sided 95% Student t-interval
  over seeds, ``t_{0.975, n-1} * s / sqrt(n)`` (``s`` the sample standard deviation).
  Seeds are few (3-5), so the t quantile, not 1.96 (Musgrave et al. 2020 report the
  same interval over their 10 reproductions).
* :func:`paired_t_test`: a method against its baseline over the seeds both have
  (``scipy.stats.ttest_rel``, two-sided). Pairing is by seed: in the harness one seed
  fixes the split, the initialisation and the batch order of both runs.
* :func:`paired_bootstrap`: the same comparison over *queries*, from the per-query
  values runs store (:data:`harness.components.evaluation.PER_QUERY_ARTIFACT`): the mean per-query
  difference, its 95% percentile interval from ``resamples`` resamples of queries with
  replacement (seeded), and a two-sided p-value. This measures how much the test
  set's sampling of queries could move the difference, which the t-test over 3-5 seeds
  cannot; it says nothing about the spread over training runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = [
    "t_interval",
    "t_half_width",
    "paired_t_test",
    "paired_bootstrap",
    "pool_query_differences",
    "Bootstrap",
    "CONFIDENCE",
    "RESAMPLES",
]

#: Level of every interval the harness prints.
CONFIDENCE = 0.95
#: Bootstrap resamples of queries.
RESAMPLES = 10_000
#: Resampled query indices held at once (memory bound: 8 bytes each).
_DRAWS_PER_BATCH = 1 << 23


def t_half_width(values) -> float:
    """Half-width of the two-sided 95% Student t-interval of the mean of ``values``;
    NaN for fewer than two values."""

    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n < 2:
        return math.nan
    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * values.std(ddof=1) / math.sqrt(n))


def t_interval(values) -> tuple[float, float, int]:
    """``(mean, half-width, n)`` of ``values`` (NaNs dropped); the interval is
    ``mean +- half-width`` (NaN half-width when n < 2)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not len(values):
        return math.nan, math.nan, 0
    return float(values.mean()), t_half_width(values), len(values)


def paired_t_test(method, baseline) -> tuple[float, float]:
    """``(mean of method - baseline, two-sided p)`` of the paired t-test (``scipy.stats.ttest_rel``)
    over aligned values (same seed at the same position). p is NaN for fewer than two pairs
    or when every difference is the same (no spread to test against)."""

    a, b = np.asarray(method, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values must align, got {a.shape} and {b.shape}")
    if len(a) == 0:
        return math.nan, math.nan
    diff = a - b
    if len(a) < 2 or np.ptp(diff) == 0:
        return float(diff.mean()), math.nan
    return float(diff.mean()), float(stats.ttest_rel(a, b).pvalue)


@dataclass(frozen=True)
class Bootstrap:
    """Paired bootstrap over queries: the observed mean difference, its percentile interval
    and a two-sided p-value; ``queries``: how many values were resampled."""

    mean: float
    low: float
    high: float
    p: float
    queries: int
    resamples: int


def paired_bootstrap(differences, *, resamples: int = RESAMPLES, seed: int = 0) -> Bootstrap:
    """Resample per-query differences (method - baseline) with replacement ``resamples``
    times (``numpy.random.default_rng(seed)``), seeded so that a table prints the same
    numbers every time.

    Interval: the 2.5th and 97.5th percentiles of the resampled means (percentile
    bootstrap, Efron & Tibshirani 1993, Sec. 13.3). p: twice the smaller tail of the
    resampled means beyond 0, ``2 * min(#(mean* <= 0) + 1, #(mean* >= 0) + 1) / (B + 1)``
    capped at 1 (the smallest level at which the percentile interval excludes 0; the +1
    keeps p > 0 with finitely many resamples)."""
    diff = np.asarray(differences, dtype=np.float64)
    diff = diff[~np.isnan(diff)]
    q = len(diff)
    if q == 0:
        return Bootstrap(math.nan, math.nan, math.nan, math.nan, 0, 0)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, np.float64)
    per_batch = max(1, _DRAWS_PER_BATCH // q)
    for start in range(0, resamples, per_batch):
        stop = min(resamples, start + per_batch)
        means[start:stop] = diff[rng.integers(0, q, size=(stop - start, q))].mean(1)
    alpha = 1 - CONFIDENCE
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    tail = min(int((means <= 0).sum()), int((means >= 0).sum())) + 1
    return Bootstrap(
        float(diff.mean()),
        float(low),
        float(high),
        min(1.0, 2 * tail / (resamples + 1)),
        q,
        resamples,
    )


def pool_query_differences(
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, str]:
    """Per-query differences from per-seed ``(method values, baseline values, query labels)``.

    When every seed scored the same queries (the same labels in the same order: the
    harness's test set does not depend on the seed), each query's difference is averaged
    over the seeds, and queries are resampled ("averaged over seeds"). Otherwise every
    (seed, query) difference is one sample ("pooled"). Returns the differences and which
    of the two it did."""
    if not pairs:
        return np.empty(0), "none"
    first_labels = pairs[0][2]
    same = all(
        len(lab) == len(first_labels) and np.array_equal(lab, first_labels) for _, _, lab in pairs
    )
    diffs = [np.asarray(m, np.float64) - np.asarray(b, np.float64) for m, b, _ in pairs]
    if same:
        return np.mean(diffs, axis=0), "averaged over seeds"
    return np.concatenate(diffs), "pooled over seeds"
