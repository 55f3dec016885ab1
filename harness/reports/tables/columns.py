"""The long frames the table steps pass on: their columns, the keys rows and blocks are
grouped by, the default metrics and the significance level of the paired tests."""

from __future__ import annotations

from harness.base.metric_keys import TABLE_METRICS

__all__ = [
    "DEFAULT_METRICS",
    "KEYS",
    "ROW",
    "BLOCK",
    "CELL_COLUMNS",
    "TEST_COLUMNS",
    "VERDICT_COLUMNS",
    "MIN_SEEDS_FOR_MARK",
    "SIGNIFICANCE",
]

#: The metrics of a table when neither ``--metrics`` nor the published table names them.
DEFAULT_METRICS = TABLE_METRICS
#: What a published value is matched on.
KEYS = ["backbone", "loss", "method", "dataset"]
#: A table row inside a block: the method and its setting (options / tuned / init).
ROW = ["backbone", "loss", "method", "setting"]
BLOCK = ["backbone", "loss", "dataset"]
#: Columns of the long "cell" frame the renderers take.
CELL_COLUMNS = [
    "backbone",
    "loss",
    "method",
    "setting",
    "dataset",
    "metric",
    "mean",
    "half_width",
    "std",
    "n",
    "flagged",
    "code_flagged",
    "reproduced",
    "published",
]
#: Columns of :func:`~harness.reports.tables.paired.paired_tests`.
TEST_COLUMNS = [
    "backbone",
    "loss",
    "method",
    "setting",
    "dataset",
    "metric",
    "baseline",
    "pairs",
    "row_mean",
    "baseline_mean",
    "difference",
    "low",
    "high",
    "p_t",
    "boot_difference",
    "boot_low",
    "boot_high",
    "p_boot",
    "boot_queries",
    "boot_classes",
    "boot_pooling",
    "boot_missing",
]
#: Columns :func:`~harness.reports.tables.verdicts.judge` adds to the paired tests: the
#: adjusted p-values, the correction and the size of the family it covered, and why a
#: comparison carries no mark whatever its p (empty when the p-values decide).
VERDICT_COLUMNS = ["p_t_adjusted", "p_boot_adjusted", "correction", "family", "unmarked"]
#: Level below which a paired test's adjusted p marks a cell.
SIGNIFICANCE = 0.05
#: The fewest paired seeds a marked comparison has: with two, the t quantile is
#: t(0.975, 1) = 12.7 and one lucky seed decides; the interval is shown, no mark.
MIN_SEEDS_FOR_MARK = 3
