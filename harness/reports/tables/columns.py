"""The long frames the table steps pass on: their columns, the keys rows and blocks are
grouped by, the default metrics and the significance level of the paired tests."""

from __future__ import annotations

__all__ = [
    "DEFAULT_METRICS",
    "KEYS",
    "ROW",
    "BLOCK",
    "CELL_COLUMNS",
    "TEST_COLUMNS",
    "SIGNIFICANCE",
]

#: Metrics of A-grouping's Tables 3 and 4 (Roth's class-wise mAP is ``map_at_c``), then MAP@R
#: (Musgrave et al. 2020, Sec. 3.2: R-precision averaged over the first R ranks).
DEFAULT_METRICS = (
    "recall_at_1",
    "recall_at_2",
    "nmi",
    "f1",
    "map_at_c",
    "mean_average_precision_at_r",
)
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
