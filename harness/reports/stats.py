"""Statistics behind every table cell: intervals over seeds and paired comparisons.

Three pure functions, each a textbook procedure named where it is used:

* :func:`t_interval`: mean and the half-width of the two-sided 95% Student t-interval
  over seeds, ``t_{0.975, n-1} * s / sqrt(n)`` (``s`` the sample standard deviation).
  Seeds are few (3-5), so the t quantile, not 1.96 (Musgrave et al. 2020 report the
  same interval over their 10 reproductions).
* :func:`paired_t_test`: a method against its baseline over the seeds both have
  (``scipy.stats.ttest_rel``, two-sided). Pairing is by seed: in the harness one seed
  fixes the split, the initialisation and the batch order of both runs.
* :func:`paired_bootstrap`: the same comparison over the *test set*, from the per-query
  values runs store (:data:`harness.components.evaluation.PER_QUERY_ARTIFACT`): the mean per-query
  difference, its 95% percentile interval from ``resamples`` resamples (seeded), and a
  two-sided p-value. Queries of one class share their relevant items and are not
  independent, so the table resamples *classes* (all queries of a drawn class together:
  the cluster bootstrap, Davison & Hinkley 1997, Sec. 3.8) rather than queries. This
  measures how much the test set's sampling of classes could move the difference, which
  the t-test over 3-5 seeds cannot; it says nothing about the spread over training runs.
* :func:`adjust_p_values`: a table makes many comparisons; its p-values are adjusted as
  one family, by Holm's step-down procedure (Holm 1979: family-wise error at the level,
  under any dependence between the tests) or Benjamini & Hochberg's step-up procedure
  (1995: false discovery rate; Benjamini & Yekutieli 2001 show it holds under the
  positive dependence of comparisons against one shared baseline).
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
    "adjust_p_values",
    "CORRECTIONS",
    "CONFIDENCE",
    "RESAMPLES",
]

#: Level of every interval the harness prints.
CONFIDENCE = 0.95
#: The multiple-comparison corrections :func:`adjust_p_values` knows, by the name
#: ``harness table --correction`` takes, and what a table's notes call them.
CORRECTIONS = {
    "holm": "Holm's step-down correction (family-wise error)",
    "bh": "the Benjamini-Hochberg correction (false discovery rate)",
    "none": "no correction for multiple comparisons",
}
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
    """Paired bootstrap over the test set: the observed mean difference, its percentile
    interval and a two-sided p-value; ``queries``: how many values entered the mean;
    ``classes``: how many classes were resampled (0 when queries were resampled one by one)."""

    mean: float
    low: float
    high: float
    p: float
    queries: int
    resamples: int
    classes: int = 0


def paired_bootstrap(
    differences, *, classes=None, resamples: int = RESAMPLES, seed: int = 0
) -> Bootstrap:
    """Resample per-query differences (method - baseline) ``resamples`` times
    (``numpy.random.default_rng(seed)``), seeded so that a table prints the same numbers
    every time. With ``classes`` (each query's class label), the classes are drawn with
    replacement and each drawn class brings all its queries (the cluster bootstrap); each
    resample's statistic is the mean over the queries it holds, as the metric itself is.
    Without, queries are drawn one by one.

    Interval: the 2.5th and 97.5th percentiles of the resampled means (percentile
    bootstrap, Efron & Tibshirani 1993, Sec. 13.3). p: twice the smaller tail of the
    resampled means beyond 0, ``2 * min(#(mean* <= 0) + 1, #(mean* >= 0) + 1) / (B + 1)``
    capped at 1 (the smallest level at which the percentile interval excludes 0; the +1
    keeps p > 0 with finitely many resamples)."""
    diff = np.asarray(differences, dtype=np.float64)
    keep = ~np.isnan(diff)
    diff = diff[keep]
    q = len(diff)
    if q == 0:
        return Bootstrap(math.nan, math.nan, math.nan, math.nan, 0, 0)
    if classes is None:
        sums, counts = diff, np.ones(q)
    else:
        codes = np.unique(np.asarray(classes)[keep], return_inverse=True)[1]
        sums = np.bincount(codes, weights=diff).astype(np.float64)
        counts = np.bincount(codes).astype(np.float64)
    means = _resampled_means(sums, counts, resamples, np.random.default_rng(seed))
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
        0 if classes is None else len(sums),
    )


def _resampled_means(
    sums: np.ndarray, counts: np.ndarray, resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """``resamples`` means of the units drawn with replacement: per resample, the drawn
    units' summed values over their summed counts (a unit: a query, or a class)."""
    units = len(sums)
    means = np.empty(resamples, np.float64)
    per_batch = max(1, _DRAWS_PER_BATCH // units)
    for start in range(0, resamples, per_batch):
        stop = min(resamples, start + per_batch)
        drawn = rng.integers(0, units, size=(stop - start, units))
        means[start:stop] = sums[drawn].sum(1) / counts[drawn].sum(1)
    return means


def adjust_p_values(p_values, correction: str = "holm") -> np.ndarray:
    """The p-values of one family adjusted for multiple comparisons (NaNs, tests not
    made, stay NaN and are not counted): ``holm``, Holm's step-down adjusted p-values
    ``max_{j <= i} min(1, (m - j + 1) p_(j))`` over the sorted p-values; ``bh``,
    Benjamini-Hochberg's ``min_{j >= i} min(1, m p_(j) / j)``; ``none``, unchanged. A
    comparison is significant at level alpha when its adjusted p is below alpha."""
    if correction not in CORRECTIONS:
        raise ValueError(
            f"unknown correction {correction!r}: expected one of {', '.join(CORRECTIONS)}"
        )
    p = np.asarray(p_values, dtype=np.float64)
    out = p.copy()
    made = np.flatnonzero(~np.isnan(p))
    m = len(made)
    if correction == "none" or m == 0:
        return out
    order = made[np.argsort(p[made], kind="stable")]
    ranked = p[order]
    if correction == "holm":
        adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * ranked))
    else:
        scaled = np.minimum(1.0, m * ranked / np.arange(1, m + 1))
        adjusted = np.minimum.accumulate(scaled[::-1])[::-1]
    out[order] = adjusted
    return out


def pool_query_differences(
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, str]:
    """Per-query differences from per-seed ``(method values, baseline values, query labels)``.

    When every seed scored the same queries (the same labels in the same order: the
    harness's test set does not depend on the seed), each query's difference is averaged
    over the seeds ("averaged over seeds"). Otherwise every (seed, query) difference is one
    sample ("pooled over seeds"). Returns the differences, each one's class label (for the
    class bootstrap: a class's queries of every seed stay together) and which of the two
    it did."""
    if not pairs:
        return np.empty(0), np.empty(0, np.int64), "none"
    first_labels = pairs[0][2]
    same = all(
        len(lab) == len(first_labels) and np.array_equal(lab, first_labels) for _, _, lab in pairs
    )
    diffs = [np.asarray(m, np.float64) - np.asarray(b, np.float64) for m, b, _ in pairs]
    if same:
        return np.mean(diffs, axis=0), np.asarray(first_labels), "averaged over seeds"
    labels = np.concatenate([np.asarray(lab) for _, _, lab in pairs])
    return np.concatenate(diffs), labels, "pooled over seeds"
