"""Paper-style comparison tables from the tracking store alone (no retraining).

``python -m harness table --experiment NAME [--published CSV --table 3]`` reads the
FINISHED runs of one or more MLflow experiments, groups them into rows (backbone, loss,
method and its setting) and dataset columns, and prints for each ``test/<metric>`` metric the
mean over seeds in percent, the half-width of its 95% Student t-interval and the number
of seeds, a paired comparison with the block's baseline row, and the published number
with the difference beside it.

One module per step, each step a plain function that is easy to test;
:func:`~harness.reports.tables.compose.make_table` runs them for a
:class:`~harness.reports.tables.compose.TableRequest`:

1. :mod:`~harness.reports.tables.load` (tracking store -> one row per run, the newest per
   seed and setting),
2. :mod:`~harness.reports.tables.summary` (runs -> one row per cell, refusing blocks that
   mix protocol fingerprints) and :mod:`~harness.reports.tables.published` (the transcribed
   published numbers, joined to the cells),
3. :mod:`~harness.reports.tables.paired` (each method row against the baseline row of its
   block: paired t-test over seeds, and a paired bootstrap over the test set's classes where
   runs stored per-query results; :mod:`harness.reports.stats`),
   :mod:`~harness.reports.tables.chance` (the chance row: the same evaluation on random
   embeddings of the same test set) and :mod:`~harness.reports.tables.verdicts` (which
   comparisons may be marked: every p-value of the table corrected as one family, no mark
   below 3 seeds or between two rows at chance),
4. :mod:`~harness.reports.tables.notes` (what the footnotes say about the runs and the
   published values),
5. one renderer per format, :class:`~harness.reports.tables.markdown.MarkdownRenderer` and
   :class:`~harness.reports.tables.latex.LatexRenderer` (cells + tests -> string; pure),
   over the layout both share (:mod:`~harness.reports.tables.layout`).

Layout (A-grouping Table 3): rows are blocks of backbone + loss, one row per method
(and setting) inside a block; columns are dataset x metric. What a row compares:

* Runs of one method that differ in method options, in being tuned (tagged by
  ``harness tune``) or in starting from another run's weights (``--init-from`` while
  training) are separate rows, labelled by what differs; never merged, never one
  superseding the other.
* Bold: the best mean of its block and column when its interval lies above every other
  row's; when intervals overlap the best, every row whose interval overlaps it is
  marked tied instead. Marks and the selection of the numbers are explained in
  footnotes.
* Rows whose runs were computed by different evaluation code (the ``evaluation_code``
  tag: sources of ``harness/evaluation`` and the versions of faiss, scikit-learn,
  numpy), or that lack that tag, are flagged.
"""

from harness.reports.tables.chance import (
    CHANCE,
    CHANCE_LABEL,
    chance_cells,
    chance_frame,
    chance_levels,
    split_labels,
)
from harness.reports.tables.columns import (
    CELL_COLUMNS,
    DEFAULT_METRICS,
    MIN_SEEDS_FOR_MARK,
    SIGNIFICANCE,
    TEST_COLUMNS,
    VERDICT_COLUMNS,
)
from harness.reports.tables.compose import (
    RENDERERS,
    Table,
    TableRequest,
    make_table,
    write_atomic,
)
from harness.reports.tables.labels import (
    DATASET_LABELS,
    METRIC_LABELS,
    block_label,
    method_labels,
    recorded_options,
    row_label,
)
from harness.reports.tables.latex import LATEX_PACKAGES, LatexRenderer, render_latex
from harness.reports.tables.layout import Cell, ordered_tests
from harness.reports.tables.load import label_settings, load_runs
from harness.reports.tables.markdown import MarkdownRenderer, render_markdown
from harness.reports.tables.notes import paper_deviation_notes, variant_notes
from harness.reports.tables.paired import (
    PerQueryLoader,
    artifact_per_query,
    has_per_query_values,
    missing_results,
    paired_tests,
)
from harness.reports.tables.published import (
    attach_published,
    load_published,
    locate_published,
    parse_published_row,
    published_deltas,
    published_dir,
)
from harness.reports.tables.render import TableContent, TableRenderer
from harness.reports.tables.summary import summarize
from harness.reports.tables.verdicts import AT_CHANCE, FEW_SEEDS, judge

__all__ = [
    "load_runs",
    "label_settings",
    "summarize",
    "paired_tests",
    "load_published",
    "locate_published",
    "published_dir",
    "parse_published_row",
    "attach_published",
    "published_deltas",
    "render_latex",
    "render_markdown",
    "write_atomic",
    "make_table",
    "TableRequest",
    "Table",
    "TableContent",
    "TableRenderer",
    "MarkdownRenderer",
    "LatexRenderer",
    "RENDERERS",
    "Cell",
    "block_label",
    "row_label",
    "ordered_tests",
    "missing_results",
    "has_per_query_values",
    "artifact_per_query",
    "PerQueryLoader",
    "method_labels",
    "recorded_options",
    "variant_notes",
    "paper_deviation_notes",
    "DEFAULT_METRICS",
    "CELL_COLUMNS",
    "TEST_COLUMNS",
    "VERDICT_COLUMNS",
    "SIGNIFICANCE",
    "MIN_SEEDS_FOR_MARK",
    "judge",
    "FEW_SEEDS",
    "AT_CHANCE",
    "CHANCE",
    "CHANCE_LABEL",
    "chance_cells",
    "chance_frame",
    "chance_levels",
    "split_labels",
    "LATEX_PACKAGES",
    "DATASET_LABELS",
    "METRIC_LABELS",
]
