"""The tables as booktabs LaTeX that drops into a paper: one ``table*`` per dataset (split
further where its metrics would not fit the text block), published values beneath the
reproduced ones, the footnotes under the last, then the paired tests."""

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
from harness.reports.tables.latex_widths import TEXT_WIDTH_PT, tabular_chunks
from harness.reports.tables.layout import Cell, Row, TableBody, table_body
from harness.reports.tables.render import TableContent, TableRenderer
from harness.reports.tables.verdicts import AT_CHANCE, FEW_SEEDS

__all__ = ["LATEX_PACKAGES", "LatexRenderer", "latex_escape", "render_latex"]

#: What a LaTeX table needs in the preamble (written in its comment header).
LATEX_PACKAGES = ("booktabs",)

_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "§": r"\S{}",
    # characters the notes may hold that pdflatex has no glyph for by default
    "–": "--",
    "—": "---",
    "×": r"$\times$",
    "≤": r"$\le$",
    "≥": r"$\ge$",
    "±": r"$\pm$",
    "→": r"$\to$",
    "≈": r"$\approx$",
    "Δ": r"$\Delta$",
    "λ": r"$\lambda$",
    "·": r"$\cdot$",
    "†": r"$^\dagger$",
    "‡": r"$^\ddagger$",
    "’": "'",
    "“": "``",
    "”": "''",
}
#: Columns of the paired-tests tables.
_TEST_HEAD = [
    "Metric",
    "$n$",
    "$\\Delta$ [95\\% CI]",
    "$p_{\\mathrm{adj}}$",
    "$\\Delta_q$ [95\\% CI]",
    "$p_{q,\\mathrm{adj}}$",
]
#: The superscript on a p-value that cannot mark its cell, by the reason (``unmarked``).
UNMARKED_SYMBOLS = {FEW_SEEDS: "s", AT_CHANCE: "c"}


def latex_escape(text: str) -> str:
    """Plain text to LaTeX: every special character escaped, ``->`` as an arrow."""
    return r"$\to$".join(
        "".join(_LATEX_SPECIALS.get(ch, ch) for ch in part) for part in text.split("->")
    )


class LatexRenderer(TableRenderer):
    """Cells as ``mean$\\pm$half-width`` with superscript marks, the seed counts in their
    own column and the published values in a row beneath their method's."""

    marks = {
        "flagged": "$^\\dagger$",
        "code": "$^\\S$",
        "tied": "$^{\\approx}$",
        "t_up": "$^{\\uparrow}$",
        "t_down": "$^{\\downarrow}$",
        "boot_up": "$^{\\Uparrow}$",
        "boot_down": "$^{\\Downarrow}$",
        "incomplete": "$^{\\ddagger}$",
        "reproduced": "$^{\\surd}$",
    }
    plus_minus, percent = "$\\pm$", "\\%"
    interval_formula = "$t_{0.975,\\,n-1}\\,s/\\sqrt{n}$, $s$ the sample standard deviation"
    prediction_formula = "$t_{0.975,\\,n-1}\\,s\\sqrt{1+1/n}$"
    two_seed_quantile = "$t_{0.975,\\,1} = 12.7$"
    ttest_name = "ttest\\_rel"
    seeds_legend = "$n$: the number of seeds (its column)"
    published_legend = (
        "; a row \\emph{published} beneath a method: the paper's value, reproduced minus published "
        "in parentheses"
    )

    def math(self, text: str) -> str:
        return f"${text}$"

    def signed(self, value: float) -> str:
        """LaTeX's plus and minus signs (not a hyphen) in math mode."""
        text = f"{value:+.2f}"
        return f"${text[0]}${text[1:]}"

    def escape(self, text: str) -> str:
        return latex_escape(text)

    def p_value(self, raw: float, adjusted: float, unmarked: str, correction: str) -> str:
        """The p that decides the mark, to fit a paper's column: the adjusted p; where no p
        can mark the cell, the test's own p with a superscript (:data:`UNMARKED_SYMBOLS`,
        explained under the table). The Markdown table prints both."""
        if math.isnan(raw):
            return self.p_text(raw)
        if unmarked:
            return f"{self.p_text(raw)}$^{{{UNMARKED_SYMBOLS.get(unmarked, '*')}}}$"
        return self.p_text(raw if correction == "none" or math.isnan(adjusted) else adjusted)

    def p_text(self, value: float) -> str:
        """``$<$0.001`` below that, ``--`` when not computed."""
        return "--" if math.isnan(value) else ("$<$0.001" if value < 0.001 else f"{value:.3f}")

    def render(self, content: TableContent) -> str:
        """A comment header naming the packages the table needs (:data:`LATEX_PACKAGES`), one
        ``table*`` per dataset or part of one with the footnotes under the last, then the
        paired tests, rows in the same order."""
        labels = content.row_labels()
        body = table_body(content.cells, content.metrics, content.tests, content.reference)
        chunks = tabular_chunks(body, labels)
        lines = _header(content.caption)
        for k, chunk in enumerate(chunks):
            notes = self.footnotes(content, labels) if k == len(chunks) - 1 else []
            lines += self._dataset_table(body, chunks, chunk, content.caption, labels, notes)
        if content.has_tests:
            lines += self.tests_tables(content.ordered_tests(), labels, content.caption)
        return "\n".join(lines) + "\n"

    def _dataset_table(
        self,
        body: TableBody,
        chunks: list[list[int]],
        chunk: list[int],
        caption: str,
        labels: Mapping[str, str],
        notes: list[str],
    ) -> list[str]:
        """One ``table*``: the tabular of ``chunk``'s columns, captioned with its dataset (and
        part), ``notes`` beneath it."""
        dataset = body.columns[chunk[0]][0]
        same = [c for c in chunks if body.columns[c[0]][0] == dataset]  # a dataset split into parts
        part = "" if len(same) == 1 else f", part {same.index(chunk) + 1} of {len(same)}"
        title = f"{caption or 'Reproduced results'} ({label(DATASET_LABELS, dataset)}{part})"
        return [
            "",
            "\\begin{table*}[tp]",
            "\\centering",
            "\\footnotesize",
            f"\\caption{{{latex_escape(title)}}}",
            *self._tabular(body, chunk, labels),
            *(
                f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\footnotesize {note}}}"
                for note in notes
            ),
            "\\end{table*}",
        ]

    def _tabular(self, body: TableBody, chunk: list[int], labels: Mapping[str, str]) -> list[str]:
        """One dataset's tabular: a row per method (mean +- half-width and marks, n) and, where
        published values exist, a row of them with the difference beneath it."""
        dataset = latex_escape(label(DATASET_LABELS, body.columns[chunk[0]][0]))
        width = 2 + len(chunk)
        lines = [
            f"\\begin{{tabular}}{{@{{}}lc{'c' * len(chunk)}@{{}}}}",
            "\\toprule",
            f" & & \\multicolumn{{{len(chunk)}}}{{c}}{{{dataset}}} \\\\",
            f"\\cmidrule(l){{3-{width}}}",
            " & ".join(
                [
                    "Method",
                    "$n$",
                    *(latex_escape(label(METRIC_LABELS, body.columns[i][1])) for i in chunk),
                ]
            )
            + " \\\\",
        ]
        for block in body.blocks:
            shown = [row for row in block.rows if any(row.cells[i] is not None for i in chunk)]
            if not shown:
                continue
            block_name = latex_escape(block_label(block.backbone, block.loss))
            lines += [
                "\\midrule",
                f"\\multicolumn{{{width}}}{{@{{}}l}}{{\\emph{{{block_name}}}}} \\\\",
            ]
            for row in shown:
                lines += self._method_rows(row, chunk, labels)
        return [*lines, "\\bottomrule", "\\end{tabular}"]

    def _method_rows(self, row: Row, chunk: list[int], labels: Mapping[str, str]) -> list[str]:
        """A method's row, and its published values' row where it has any."""
        cells = [row.cells[i] for i in chunk]
        lines = [
            " & ".join(
                [
                    latex_escape(row_label(row.method, row.setting, labels)),
                    _seed_counts(cells),
                    *(self.reproduced(c) for c in cells),
                ]
            )
            + " \\\\"
        ]
        if any(c is not None and not math.isnan(c.published) for c in cells):
            lines.append(
                " & ".join(["\\quad published", "", *(self.published(c) for c in cells)]) + " \\\\"
            )
        return lines

    def reproduced(self, cell: Cell | None) -> str:
        """A reproduced cell: mean (bold when best beyond the intervals) +- half-width and its marks."""
        if cell is None or math.isnan(cell.mean):
            return "--"
        text = f"{cell.mean:.2f}"
        text = f"\\textbf{{{text}}}" if cell.bold else text
        if not math.isnan(cell.half_width):
            text += f"$\\pm${cell.half_width:.2f}"
        return text + "".join(self.mark(m) for m in cell.marks)

    def published(self, cell: Cell | None) -> str:
        """A published cell: the value, and reproduced minus published in parentheses."""
        if cell is None or math.isnan(cell.published):
            return "--"
        if math.isnan(cell.mean):
            return f"{cell.published:.2f}"
        return f"{cell.published:.2f} ({self.signed(round(cell.mean, 2) - cell.published)})"

    def tests_tables(
        self, tests: pd.DataFrame, labels: Mapping[str, str], caption: str = ""
    ) -> list[str]:
        """The paired tests as one ``table*`` per dataset: per block and comparison, for each
        metric the seeds, the mean paired difference (percent points) with its 95% t-interval
        and the t-test's p, and the class bootstrap's difference with its 95% interval and p."""
        lines = []
        for dataset, part in tests.groupby("dataset", sort=False):
            title = "Paired tests against the baseline row" + (f" ({caption})" if caption else "")
            lines += [
                "",
                "\\begin{table*}[tp]",
                "\\centering",
                "\\footnotesize",
                "\\setlength{\\tabcolsep}{4pt}",
                f"\\caption{{{latex_escape(title)}: {latex_escape(label(DATASET_LABELS, dataset))}}}",
                f"\\begin{{tabular}}{{@{{}}l{'c' * (len(_TEST_HEAD) - 1)}@{{}}}}",
                "\\toprule",
                " & ".join(_TEST_HEAD) + " \\\\",
            ]
            queries = sorted(set(part.loc[part["boot_queries"] > 0, "boot_queries"]))
            for (backbone, loss, method, setting), rows in part.groupby(
                ["backbone", "loss", "method", "setting"], sort=False
            ):
                versus = (
                    f"{row_label(method, setting, labels)} vs {labels[rows['baseline'].iloc[0]]}"
                )
                lines += [
                    "\\midrule",
                    f"\\multicolumn{{{len(_TEST_HEAD)}}}{{@{{}}l}}{{\\emph{{"
                    f"{latex_escape(block_label(backbone, loss))}}}: {latex_escape(versus)}}} \\\\",
                ]
                lines += [
                    self._test_row(t, several_q=len(queries) > 1)
                    for t in rows.itertuples(index=False)
                ]
            lines += ["\\bottomrule", "\\end{tabular}", _tests_note(queries), "\\end{table*}"]
        return lines

    def _test_row(self, t, *, several_q: bool) -> str:
        """One metric's paired tests; the bootstrap's query count when the table's differ."""
        boot = (
            "--"
            if t.boot_queries == 0
            else self.interval(t.boot_difference, t.boot_low, t.boot_high)
        )
        if t.boot_queries and several_q:
            boot += f" ($Q$={t.boot_queries})"
        return (
            " & ".join(
                [
                    latex_escape(label(METRIC_LABELS, t.metric)),
                    str(t.pairs),
                    self.interval(t.difference, t.low, t.high),
                    self.p_value(t.p_t, t.p_t_adjusted, t.unmarked, t.correction),
                    boot,
                    self.p_value(t.p_boot, t.p_boot_adjusted, t.unmarked, t.correction),
                ]
            )
            + " \\\\"
        )

    def deviations_block(self, notes: Sequence[str]) -> str:
        if not notes:
            return ""
        title = "Deviations from the paper or the authors' code"
        # Long option names (smoke_methods_agrouping_...) may break after an underscore.
        items = "\n".join(
            f"  \\item {latex_escape(n)}".replace("\\_", "\\_\\allowbreak{}") for n in notes
        )
        return (
            f"\n% {title} (python -m harness deviations)\n{{\\footnotesize\\sloppy\n\\paragraph{{{title}.}}\n"
            f"\\begin{{itemize}}\n{items}\n\\end{{itemize}}\n}}\n"
        )


def _header(caption: str) -> list[str]:
    return [
        f"% {caption}" if caption else "% Table from the harness's tracking store",
        "% Needs in the preamble: " + " ".join(f"\\usepackage{{{p}}}" for p in LATEX_PACKAGES),
        f"% Each tabular fits \\textwidth of a one-column article ({TEXT_WIDTH_PT:.0f}pt) and spans both "
        f"columns of a two-column one (table*); text at \\footnotesize.",
    ]


def _seed_counts(cells: list[Cell | None]) -> str:
    """The ``n`` column: the seed count of the row's cells, or their range."""
    counts = sorted({int(c.n) for c in cells if c is not None and c.n})
    return (
        "--" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}--{counts[-1]}"
    )


def _tests_note(queries: list[int]) -> str:
    """What the paired-tests table's columns hold."""
    over = f"$Q$ = {queries[0]} test queries" if len(queries) == 1 else "$Q$ test queries"
    return (
        "\\par\\smallskip\\parbox{\\linewidth}{\\footnotesize $n$: seeds both rows have; $\\Delta$, $p$: "
        "mean paired difference over seeds (percent points), its 95\\% Student t-interval and the paired "
        f"t-test; $\\Delta_q$, $p_q$: the paired bootstrap over {over}, the classes resampled with all their "
        "queries (10,000 resamples, percentile interval); adj: the p-values after the table's correction for "
        "multiple comparisons (the Markdown table gives each test's own p beside them); a p with $^s$ (fewer "
        "than 3 seeds) or $^c$ (both rows at chance) is the test's own and marks nothing; "
        "--: not computed (a clustering metric, or per-query results missing).}"
    )


def render_latex(cells: pd.DataFrame, **content) -> str:
    """Cells (``CELL_COLUMNS``) and paired tests (``TEST_COLUMNS``) -> booktabs LaTeX
    (``content``: the other fields of :class:`~harness.reports.tables.render.TableContent`)."""
    return LatexRenderer().render(TableContent(cells, **content))
