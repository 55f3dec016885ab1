"""What every table format shares: the content a renderer takes, and the renderer
interface with the footnotes that explain a table's marks, worded once and printed in
each format's notation."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from harness.reports.stats import CORRECTIONS
from harness.reports.tables.chance import CHANCE, CHANCE_DIM, CHANCE_LABEL
from harness.reports.tables.columns import MIN_SEEDS_FOR_MARK, SIGNIFICANCE
from harness.reports.tables.labels import all_labels
from harness.reports.tables.layout import ordered_tests
from harness.reports.tables.verdicts import AT_CHANCE, FEW_SEEDS, is_judged, judge

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
    #: The multiple-comparison correction of the paired tests (:data:`harness.reports.stats.CORRECTIONS`).
    correction: str = "holm"
    #: The chance levels (``dataset, metric, mean, half_width, draws``); the cells then hold
    #: the chance row (:func:`~harness.reports.tables.chance.chance_cells`).
    chance: pd.DataFrame | None = None

    def __post_init__(self):
        # Tests not judged yet are judged here, so that no renderer marks a raw p-value.
        if self.tests is not None and not is_judged(self.tests):
            judged = judge(self.tests, correction=self.correction, chance=self.chance)
            object.__setattr__(self, "tests", judged)

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
        """Row labels for every method the cells and tests name (the chance row's too)."""
        return {**all_labels(self.cells, self.tests, self.labels), CHANCE: CHANCE_LABEL}


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
    #: The chance row's prediction half-width, and the t quantile of two seeds.
    prediction_formula: str
    two_seed_quantile: str
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

    def p_value(self, raw: float, adjusted: float, unmarked: str, correction: str) -> str:
        """A paired test's p as the tests table prints it: the test's own p, then the
        adjusted one that decides the mark, or why no p can mark the cell."""
        text = self.p_text(raw)
        if math.isnan(raw):
            return text
        if unmarked:
            return f"{text} ({self.escape(unmarked)})"
        if correction == "none" or math.isnan(adjusted):
            return text
        return f"{text} (adj. {self.p_text(adjusted)})"

    @abstractmethod
    def p_text(self, value: float) -> str:
        """A p-value to three decimals, below 0.001 as such, a dash when not computed."""

    def footnotes(self, content: TableContent, labels: Mapping[str, str]) -> list[str]:
        """The notes under the comparison, one paragraph each: what a cell holds and its
        marks, the paired tests' marks, the given notes, then the deviations mark."""
        out = [self._cells_legend(content.cells)]
        if content.chance is not None and not content.chance.empty:
            out.append(self._chance_legend(content.chance))
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

    def _chance_legend(self, chance: pd.DataFrame) -> str:
        draws = int(chance["draws"].max())
        return (
            f"{CHANCE_LABEL}: the same evaluation of the same test set on {draws} draws of random "
            f"{CHANCE_DIM}-d Gaussian embeddings; mean {self.plus_minus} half-width of the "
            f"95{self.percent} prediction interval of one draw "
            f"({self.prediction_formula}), n: the draws. A row at or below its "
            f"upper end retrieves no better than random embeddings."
        )

    def _tests_legend(self, tests: pd.DataFrame, labels: Mapping[str, str]) -> list[str]:
        correction = str(tests["correction"].iloc[0])
        significant = ("" if correction == "none" else "adjusted ") + self.math(
            f"p < {SIGNIFICANCE}"
        )
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
                f"over the test set's classes (each drawn class brings all its queries; per-query "
                f"differences {pooling}; 10,000 resamples, seed 0, percentile interval), {significant}."
            )
        out = [
            text + " Differences and p-values: the table of paired tests.",
            self._family_legend(tests),
        ]
        if "boot_missing" in tests and (tests["boot_missing"] != "").any():
            runs = len({r for ids in tests["boot_missing"] for r in ids.split()})
            out.append(
                f"{self.mark('incomplete')}: paired bootstrap over the test set not computed: the "
                f"per-query results of {runs} run(s) are missing (harness table names each run and "
                f"what is missing on stderr)."
            )
        return out

    def _family_legend(self, tests: pd.DataFrame) -> str:
        """What the marks were corrected for, and the comparisons no mark can reach."""
        correction, family = str(tests["correction"].iloc[0]), int(tests["family"].iloc[0])
        few = int((tests["unmarked"] == FEW_SEEDS).sum())
        at_chance = int((tests["unmarked"] == AT_CHANCE).sum())
        text = (
            f"Multiple comparisons: {CORRECTIONS[correction]} over the table's {family} p-values "
            f"(paired t-tests and bootstraps with at least {MIN_SEEDS_FOR_MARK} seeds, adjusted as "
            f"one family)."
            if family
            else f"No comparison has {MIN_SEEDS_FOR_MARK} seeds: none is tested for a mark."
        )
        text += (
            f" No mark with fewer than {MIN_SEEDS_FOR_MARK} seeds ({few} comparison(s): the "
            f"interval is shown; with 2 seeds {self.two_seed_quantile})."
        )
        if at_chance:
            text += (
                f" No mark where neither the row nor the baseline lies above the chance interval "
                f"({at_chance} comparison(s))."
            )
        return text
