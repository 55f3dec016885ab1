"""How wide a LaTeX tabular prints, estimated from its characters' widths, so that a
dataset's metrics are split over as many tabulars as fit the text block."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from harness.reports.tables.labels import row_label
from harness.reports.tables.layout import Cell, TableBody

__all__ = ["TEXT_WIDTH_PT", "text_pt", "tabular_chunks"]

#: ``\textwidth`` of a standard one-column ``article`` (10pt, letter or A4 paper): the
#: narrowest text block a table must fit; a two-column article's (``table*``) is 469pt.
TEXT_WIDTH_PT = 345.0
#: Widths at ``\footnotesize`` (cmr8, in pt) of what cells print, for :func:`text_pt`;
#: a mark is a superscript symbol; ``\tabcolsep`` is 6pt on each side of a column.
_GLYPH_PT = {
    **dict.fromkeys("0123456789", 4.25),
    ".": 2.4,
    " ": 2.8,
    "(": 3.3,
    ")": 3.3,
    "±": 6.6,
    "+": 6.6,
    "-": 6.6,
}
_LETTER_PT, _MARK_PT, _COLSEP_PT = 4.6, 4.5, 12.0


def text_pt(text: str) -> float:
    """The printed width of ``text`` at ``\\footnotesize`` (pt)."""
    return sum(_GLYPH_PT.get(ch, _LETTER_PT) for ch in text)


def _estimated_width(cell: Cell | None) -> float:
    """The printed width of a cell's widest line (pt): the reproduced value with its marks,
    or the published value with the difference beneath it."""
    if cell is None:
        return text_pt("--")
    reproduced = not math.isnan(cell.mean)
    ours = (
        text_pt(f"{cell.mean:.2f}±{cell.half_width:.2f}") + len(cell.marks) * _MARK_PT
        if reproduced
        else 0
    )
    theirs = (
        text_pt(f"{cell.published:.2f} (+{abs(cell.mean - cell.published):.2f})")
        if not math.isnan(cell.published) and reproduced
        else text_pt(f"{cell.published:.2f}")
    )
    return max(ours, theirs)


def tabular_chunks(body: TableBody, labels: Mapping[str, str]) -> list[list[int]]:
    """Column indices of each tabular: one dataset per tabular, its metrics split so that
    every tabular fits :data:`TEXT_WIDTH_PT` (by the cells' estimated widths)."""
    rows = [row for block in body.blocks for row in block.rows]
    label = max(
        [text_pt(row_label(row.method, row.setting, labels)) for row in rows]
        + [text_pt("published") + 10.0]
    )  # the published rows' label is indented by \quad
    fixed = label + text_pt("2--3") + 2 * _COLSEP_PT  # the label and n columns
    widths = [
        max([_estimated_width(row.cells[i]) for row in rows] + [text_pt("MAP@R")]) + _COLSEP_PT
        for i in range(len(body.columns))
    ]

    def fits(part: list[int]) -> bool:
        return fixed + sum(widths[j] for j in part) <= TEXT_WIDTH_PT

    chunks: list[list[int]] = []
    for dataset in dict.fromkeys(d for d, _ in body.columns):
        indices = [i for i, (d, _) in enumerate(body.columns) if d == dataset]
        greedy: list[list[int]] = []
        for i in indices:
            if greedy and fits([*greedy[-1], i]):
                greedy[-1].append(i)
            else:
                greedy.append([i])
        # as many parts as filling them in order needs, their sizes evened out where that fits
        even = [[int(i) for i in part] for part in np.array_split(indices, len(greedy))]
        chunks += even if all(fits(part) for part in even) else greedy
    return chunks
