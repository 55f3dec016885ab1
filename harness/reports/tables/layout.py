"""Where each number goes, the same in every format: blocks of rows, (dataset, metric)
columns, and each cell with what it is marked by (best, tied, paired tests, flags)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from harness.base.errors import HarnessError
from harness.reports.tables.chance import CHANCE
from harness.reports.tables.columns import BLOCK, SIGNIFICANCE
from harness.reports.tables.labels import BACKBONE_LABELS, DATASET_LABELS, LOSS_LABELS, method_order

__all__ = ["Cell", "Row", "Block", "TableBody", "table_body", "ordered_tests", "distinct_in_order"]


@dataclass(frozen=True)
class Cell:
    """One reproduced (and published) value of a row and column: the mean over seeds in
    percent, the half-width of its 95% t-interval, the number of seeds, the published value
    (NaN where there is none; ``mean`` is NaN for a published row without runs), whether it
    is the best of its block and column beyond the intervals, and the names of its marks in
    print order (``tied``, ``t_up`` / ``t_down``, ``boot_up`` / ``boot_down``,
    ``incomplete``, ``flagged``, ``code``, ``reproduced``): each renderer draws them its
    own way."""

    mean: float
    half_width: float
    n: int
    published: float
    bold: bool = False
    marks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Row:
    """A method's row in a block: one cell per column, None where it has no value."""

    method: str
    setting: str
    cells: tuple[Cell | None, ...]


@dataclass(frozen=True)
class Block:
    """The rows of one backbone + loss, in table order."""

    backbone: str
    loss: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class TableBody:
    """The blocks of a table and its (dataset, metric) columns, in print order."""

    blocks: tuple[Block, ...]
    columns: tuple[tuple[str, str], ...]


def distinct_in_order(values: Iterable, known: Sequence = ()) -> list:
    """Distinct values: those in ``known`` first in its order, then the rest as they appear."""
    seen = list(dict.fromkeys(v for v in values if isinstance(v, str | tuple)))
    rank = {v: i for i, v in enumerate(known)}
    return sorted(seen, key=lambda v: (rank.get(v, len(rank)), seen.index(v)))


def _layout(cells: pd.DataFrame, metrics: Sequence[str] | None, baseline: str):
    """Row blocks, rows (method, setting), datasets and (dataset, metric) columns: the known
    labels' order, then first appearance (methods: :func:`~harness.reports.tables.labels.method_order`)."""
    if cells.empty:
        raise HarnessError("nothing to tabulate: no finished runs and no published values")
    backbones = distinct_in_order(cells["backbone"], list(BACKBONE_LABELS))
    losses = distinct_in_order(cells["loss"], list(LOSS_LABELS))
    blocks = distinct_in_order(
        zip(cells["backbone"], cells["loss"], strict=True),
        [(b, lo) for b in backbones for lo in losses],
    )
    methods = distinct_in_order(cells["method"], method_order(baseline))
    rows = sorted(
        dict.fromkeys(zip(cells["method"], cells["setting"], strict=True)),
        key=lambda r: (methods.index(r[0]), r[1] != "", r[1]),
    )
    datasets = distinct_in_order(cells["dataset"], list(DATASET_LABELS))
    present = distinct_in_order(cells["metric"])
    metric_order = [m for m in (metrics or present) if m in present]
    columns = [
        (d, m)
        for d in datasets
        for m in metric_order
        if ((cells["dataset"] == d) & (cells["metric"] == m)).any()
    ]
    return blocks, rows, datasets, columns


def _cell_key(row) -> tuple:
    return (
        row["backbone"],
        row["loss"],
        row["method"],
        row["setting"],
        row["dataset"],
        row["metric"],
    )


def _best(cells: pd.DataFrame) -> tuple[set[tuple], set[tuple]]:
    """``(bold, tied)`` cell keys per block and column. Only method rows with an interval
    (n >= 2; not the chance row) compete, and only when at least two do. The best mean is bold when its interval lies
    above every other row's (lower end above their upper ends); otherwise it and every row
    whose interval reaches its interval are tied."""
    bold: set[tuple[Any, ...]] = set()
    tied: set[tuple[Any, ...]] = set()
    have = cells[cells["method"] != CHANCE].dropna(subset=["mean", "half_width"])
    for _, group in have.groupby([*BLOCK, "metric"], sort=False):
        if len(group) < 2:
            continue
        top = group.loc[group["mean"].idxmax()]
        reach = group[
            (group.index != top.name)
            & (group["mean"] + group["half_width"] >= top["mean"] - top["half_width"])
        ]
        if reach.empty:
            bold.add(_cell_key(top))
        else:
            tied.update(_cell_key(r) for _, r in pd.concat([top.to_frame().T, reach]).iterrows())
    return bold, tied


def _test_marks(test) -> tuple[str, ...]:
    """The marks a judged paired test (``TEST_COLUMNS`` and ``VERDICT_COLUMNS``,
    :func:`~harness.reports.tables.verdicts.judge`) puts on its cell: up or down where its
    adjusted p is below the level and no rule leaves it unmarked."""
    if test is None:
        return ()
    marks = []
    if not test.unmarked:
        if not math.isnan(test.p_t_adjusted) and test.p_t_adjusted < SIGNIFICANCE:
            marks.append("t_up" if test.difference > 0 else "t_down")
        if not math.isnan(test.p_boot_adjusted) and test.p_boot_adjusted < SIGNIFICANCE:
            marks.append("boot_up" if test.boot_difference > 0 else "boot_down")
    if getattr(test, "boot_missing", ""):
        marks.append("incomplete")
    return tuple(marks)


def _cell(record, key: tuple, bold: set[tuple], tied: set[tuple], test) -> Cell:
    """A ``CELL_COLUMNS`` record as a :class:`Cell` of the table."""
    marks = (("tied",) if key in tied else ()) + _test_marks(test)
    marks += ("flagged",) if bool(record.flagged) else ()
    marks += ("code",) if bool(record.code_flagged) else ()
    marks += ("reproduced",) if bool(getattr(record, "reproduced", False)) else ()
    return Cell(
        mean=record.mean,
        half_width=record.half_width,
        n=record.n,
        published=record.published,
        bold=key in bold,
        marks=marks,
    )


def table_body(
    cells: pd.DataFrame, metrics: Sequence[str] | None, tests: pd.DataFrame | None, baseline: str
) -> TableBody:
    """Cells (``CELL_COLUMNS``) and paired tests (``TEST_COLUMNS``) -> the table's blocks
    and columns, each cell marked."""
    blocks, rows, _, columns = _layout(cells, metrics, baseline)
    bold, tied = _best(cells)
    index = {_cell_key(r._asdict()): r for r in cells.itertuples(index=False)}
    test_index = (
        {} if tests is None else {_cell_key(t._asdict()): t for t in tests.itertuples(index=False)}
    )
    body = []
    for backbone, loss in blocks:
        in_block = cells[(cells["backbone"] == backbone) & (cells["loss"] == loss)]
        present = set(zip(in_block["method"], in_block["setting"], strict=True))
        block_rows = []
        for method, setting in [r for r in rows if r in present]:
            keys = [
                (backbone, loss, method, setting, dataset, metric) for dataset, metric in columns
            ]
            block_rows.append(
                Row(
                    method,
                    setting,
                    tuple(
                        None
                        if key not in index
                        else _cell(index[key], key, bold, tied, test_index.get(key))
                        for key in keys
                    ),
                )
            )
        body.append(Block(backbone, loss, tuple(block_rows)))
    return TableBody(tuple(body), tuple(columns))


def ordered_tests(
    tests: pd.DataFrame, cells: pd.DataFrame, metrics: Sequence[str] | None, baseline: str
) -> pd.DataFrame:
    """The paired tests in the main table's order: dataset, block, row, metric."""
    if tests is None or tests.empty:
        return tests
    blocks, rows, datasets, columns = _layout(cells, metrics, baseline)
    metric_order = list(dict.fromkeys(m for _, m in columns))

    def rank(values: Sequence, value) -> int:
        return values.index(value) if value in values else len(values)

    keys = [
        (
            rank(datasets, t.dataset),
            rank(blocks, (t.backbone, t.loss)),
            rank(rows, (t.method, t.setting)),
            rank(metric_order, t.metric),
        )
        for t in tests.itertuples(index=False)
    ]
    order = sorted(range(len(tests)), key=lambda i: keys[i])
    return tests.iloc[order].reset_index(drop=True)
