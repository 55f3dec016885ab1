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
    "difference",
    "low",
    "high",
    "p_t",
    "boot_difference",
    "boot_low",
    "boot_high",
    "p_boot",
    "boot_queries",
    "boot_pooling",
    "boot_missing",
]
#: Level below which a paired test marks a cell.
SIGNIFICANCE = 0.05
