"""What every table format shares: the content a renderer takes, and the renderer
interface with the footnotes that explain a table's marks, worded once and printed in
each format's notation."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from harness.reports.tables.columns import SIGNIFICANCE
from harness.reports.tables.labels import all_labels
from harness.reports.tables.layout import ordered_tests

__all__ = ["TableContent", "TableRenderer"]


@dataclass(frozen=True, eq=False)
class TableContent:
    """What a table shows: ``cells`` (``CELL_COLUMNS``), their ``metrics`` in column order
    (None: as the cells have them), the ``caption``, the protocol ``deviations`` the †
    footnote lists, the paired ``tests`` (``TEST_COLUMNS``), further ``notes``, row
    ``labels`` by method (:func:`~harness.reports.tables.labels.method_labels`; the plugins'
    defaults where missing) and the ``baseline`` method whose row leads each block."""

    cells: pd.DataFrame
    metrics: Sequence[str] | None = None
    caption: str = ""
    deviations: Sequence[str] = ()
    tests: pd.DataFrame | None = None
    notes: Sequence[str] = ()
    labels: Mapping[str, str] | None = None
    baseline: str = "plain"

    @property
    def has_tests(self) -> bool:
        return self.tests is not None and not self.tests.empty

    @property
    def reference(self) -> str:
        """The method the paired tests compare with: theirs when there are tests."""
        if self.tests is None or self.tests.empty:
            return self.baseline
        return str(self.tests["baseline"].iloc[0])

    def ordered_tests(self) -> pd.DataFrame | None:
        """The paired tests in the comparison's order: dataset, block, row, metric."""
        return ordered_tests(self.tests, self.cells, self.metrics, self.reference)

    def row_labels(self) -> dict[str, str]:
        """Row labels for every method the cells and tests name."""
        return all_labels(self.cells, self.tests, self.labels)


class TableRenderer(ABC):
    """One output format of the tables. A format draws the marks (:attr:`marks`, by the
    names :class:`~harness.reports.tables.layout.Cell` carries), writes math and signed
    numbers its own way, and words the footnotes' formula and legends; :meth:`render`
    lays out the whole table and :meth:`deviations_block` the list every table ends with."""

    #: Each mark's glyph, by name.
    marks: Mapping[str, str]
    #: The plus-minus sign and the percent sign.
    plus_minus: str
    percent: str
    #: The half-width's formula, the t-test's scipy name, the seed count's legend, and what
    #: a published value beside a cell means.
    interval_formula: str
    ttest_name: str
    seeds_legend: str
    published_legend: str

    @abstractmethod
    def render(self, content: TableContent) -> str:
        """The table's text: the comparison, its footnotes, the paired tests."""

    @abstractmethod
    def deviations_block(self, notes: Sequence[str]) -> str:
        """The last block of every table's text: where its runs depart from the paper or
        the authors' code, one item per reason (empty when none does)."""

    @abstractmethod
    def math(self, text: str) -> str:
        """``text`` (``p < 0.05``) set as mathematics."""

    @abstractmethod
    def signed(self, value: float) -> str:
        """``+1.25`` / ``-1.25`` with this format's plus and minus signs."""

    def escape(self, text: str) -> str:
        """Plain text as this format prints it."""
        return text

    def mark(self, name: str) -> str:
        return self.marks[name]

    def interval(self, mean: float, low: float, high: float) -> str:
        """``+1.25 [-0.50, +3.00]``; the mean alone when there is no interval."""
        if math.isnan(low) or math.isnan(high):
            return self.signed(mean)
        return f"{self.signed(mean)} [{self.signed(low)}, {self.signed(high)}]"

    def footnotes(self, content: TableContent, labels: Mapping[str, str]) -> list[str]:
        """The notes under the comparison, one paragraph each: what a cell holds and its
        marks, the paired tests' marks, the given notes, then the deviations mark."""
        out = [self._cells_legend(content.cells)]
        if content.has_tests:
            out += self._tests_legend(content.tests, labels)
        out += [self.escape(n) for n in content.notes]
        if content.cells["flagged"].any():
            what = (
                "; ".join(content.deviations)
                if content.deviations
                else "see the runs' deviations tags"
            )
            out.append(
                f"{self.mark('flagged')} runs with protocol deviations or test-set model selection "
                f"({self.escape(what)})."
            )
        if content.cells["reproduced"].any():
            out.append(
                f"{self.mark('reproduced')} cells whose every run was trained again from its "
                f"record (harness rerun) with the verdict IDENTICAL or WITHIN NOISE."
            )
        return out

    def _cells_legend(self, cells: pd.DataFrame) -> str:
        published = self.published_legend if cells["published"].notna().any() else ""
        return (
            f"Cells: mean over seeds {self.plus_minus} half-width of the 95{self.percent} Student t-interval "
            f"over seeds ({self.interval_formula}), in percent; {self.seeds_legend}{published}. "
            f"Bold: the best mean of its block and column when its interval lies above every other row's; "
            f"{self.mark('tied')}: tied for best (the intervals overlap the best one's). Cells with "
            f"{self.math('n < 2')} have no interval and are neither."
        )

    def _tests_legend(self, tests: pd.DataFrame, labels: Mapping[str, str]) -> list[str]:
        significant = self.math(f"p < {SIGNIFICANCE}")
        text = (
            f"{self.mark('t_up')}/{self.mark('t_down')}: above/below the block's baseline row "
            f"({labels[tests['baseline'].iloc[0]]}) in a paired t-test over seeds (same seed: same split and "
            f"initialisation; scipy.stats.{self.ttest_name}, two-sided), {significant}."
        )
        boot = tests[tests["boot_queries"] > 0]
        if not boot.empty:
            pooling = ", ".join(sorted(set(boot["boot_pooling"])))
            text += (
                f" {self.mark('boot_up')}/{self.mark('boot_down')}: the same in a paired bootstrap "
                f"over test queries (per-query differences {pooling}; 10,000 resamples, seed 0, "
                f"percentile interval), {significant}."
            )
        out = [text + " Differences and p-values: the table of paired tests."]
        if "boot_missing" in tests and (tests["boot_missing"] != "").any():
            runs = len({r for ids in tests["boot_missing"] for r in ids.split()})
            out.append(
                f"{self.mark('incomplete')}: paired bootstrap over test queries not computed: the "
                f"per-query results of {runs} run(s) are missing (harness table names each run and "
                f"what is missing on stderr)."
            )
        return out
