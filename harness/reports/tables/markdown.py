"""The tables as GitHub Markdown: the comparison with its footnotes, then the paired tests."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd

from harness.reports.tables.labels import (
    DATASET_LABELS,
    METRIC_LABELS,
    block_label,
    label,
    row_label,
)
from harness.reports.tables.layout import Cell, table_body
from harness.reports.tables.render import TableContent, TableRenderer

__all__ = ["MarkdownRenderer", "TEST_HEADER", "render_markdown"]

TEST_HEADER = [
    "Block",
    "Dataset",
    "Metric",
    "Comparison",
    "Seeds",
    "Δ (seeds) [95% CI]",
    "p (paired t)",
    "Δ over test classes [95% CI]",
    "p (bootstrap)",
]


class MarkdownRenderer(TableRenderer):
    """Cells as ``mean ± half-width`` with their marks and ``(n=…)``, then ``/ published
    (difference)``; one table row per method row, a block's title row above its rows."""

    marks = {
        "flagged": "†",
        "code": "§",
        "tied": "≈",
        "t_up": "↑",
        "t_down": "↓",
        "boot_up": "⇑",
        "boot_down": "⇓",
        "incomplete": "‡",
        "reproduced": "✓",
    }
    plus_minus, percent = "±", "%"
    interval_formula = "t(0.975, n-1) s / sqrt(n), s the sample std"
    prediction_formula = "t(0.975, n-1) s sqrt(1 + 1/n)"
    two_seed_quantile = "t(0.975, 1) = 12.7"
    ttest_name = "ttest_rel"
    seeds_legend = "n: the number of seeds"
    published_legend = " / published value (reproduced minus published)"

    def math(self, text: str) -> str:
        return text

    def signed(self, value: float) -> str:
        return f"{value:+.2f}"

    def p_text(self, value: float) -> str:
        """``<0.001`` below that, ``–`` when not computed."""
        return "–" if math.isnan(value) else ("<0.001" if value < 0.001 else f"{value:.3f}")

    def render(self, content: TableContent) -> str:
        labels = content.row_labels()
        lines = [f"**{content.caption}**", ""] if content.caption else []
        lines += self._comparison(content, labels)
        for note in self.footnotes(content, labels):  # one paragraph each
            lines += ["", note]
        if content.has_tests:
            lines += [
                "",
                "**Paired tests against the baseline row**",
                "",
                _line(TEST_HEADER),
                "|" + "|".join([":---"] * 4 + [":---:"] * 5) + "|",
            ]
            lines += [_line(r) for r in self.test_rows(content.ordered_tests(), labels)]
        return "\n".join(lines) + "\n"

    def _comparison(self, content: TableContent, labels: Mapping[str, str]) -> list[str]:
        """The main table: header, then per block its title row and its method rows."""
        body = table_body(content.cells, content.metrics, content.tests, content.reference)
        header = [
            "Method",
            *(f"{label(DATASET_LABELS, d)} {label(METRIC_LABELS, m)}" for d, m in body.columns),
        ]
        lines = [_line(header), "|" + "|".join([":---", *[":---:"] * len(body.columns)]) + "|"]
        for block in body.blocks:
            lines.append(
                _line([f"*{block_label(block.backbone, block.loss)}*", *[""] * len(body.columns)])
            )
            lines += [
                _line(
                    [
                        row_label(row.method, row.setting, labels),
                        *(self.cell_text(c) for c in row.cells),
                    ]
                )
                for row in block.rows
            ]
        return lines

    def cell_text(self, cell: Cell | None) -> str:
        """``mean ± half-width`` (bold when best beyond the intervals), its marks (tie, paired
        tests, deviations, evaluation code), ``n``, then ``/ published (difference)``."""
        if cell is None:
            return "–"
        if math.isnan(cell.mean):
            ours = "–"
        else:
            ours = f"{cell.mean:.2f}"
            if cell.bold:
                ours = f"**{ours}**"
            if not math.isnan(cell.half_width):
                ours += f" ± {cell.half_width:.2f}"
            ours += "".join(self.mark(m) for m in cell.marks) + f" (n={cell.n})"
        if math.isnan(cell.published):
            return ours
        diff = "" if math.isnan(cell.mean) else f" ({round(cell.mean, 2) - cell.published:+.2f})"
        return f"{ours} / {cell.published:.2f}{diff}"

    def test_rows(self, tests: pd.DataFrame, labels: Mapping[str, str]) -> list[list[str]]:
        """Plain-text rows of the paired-tests table."""
        rows = []
        for t in tests.itertuples(index=False):
            boot = (
                "–"
                if t.boot_queries == 0
                else f"{t.boot_difference:+.2f} [{t.boot_low:+.2f}, {t.boot_high:+.2f}] "
                f"(Q={t.boot_queries}, {t.boot_classes} classes)"
            )
            rows.append(
                [
                    block_label(t.backbone, t.loss),
                    label(DATASET_LABELS, t.dataset),
                    label(METRIC_LABELS, t.metric),
                    f"{row_label(t.method, t.setting, labels)} vs {labels[t.baseline]}",
                    str(t.pairs),
                    self.interval(t.difference, t.low, t.high),
                    self.p_value(t.p_t, t.p_t_adjusted, t.unmarked, t.correction),
                    boot,
                    self.p_value(t.p_boot, t.p_boot_adjusted, t.unmarked, t.correction),
                ]
            )
        return rows

    def deviations_block(self, notes: Sequence[str]) -> str:
        if not notes:
            return ""
        return (
            "\n**Deviations from the paper or the authors' code**\n\n"
            + "\n".join(f"- {n}" for n in notes)
            + "\n"
        )


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_markdown(cells: pd.DataFrame, **content) -> str:
    """Cells (``CELL_COLUMNS``) and paired tests (``TEST_COLUMNS``) -> GitHub Markdown
    (``content``: the other fields of :class:`~harness.reports.tables.render.TableContent`)."""
    return MarkdownRenderer().render(TableContent(cells, **content))
