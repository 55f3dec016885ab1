"""Runs -> cells: per row, dataset and metric, the mean over seeds in percent with its 95%
Student t-interval, and the flags a cell carries; blocks that mix protocol fingerprints
are refused."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from harness.base.errors import HarnessError
from harness.reports.stats import t_interval
from harness.reports.tables.columns import BLOCK, CELL_COLUMNS, DEFAULT_METRICS, ROW

__all__ = ["summarize", "REPRODUCED"]

#: The verdicts of ``harness rerun`` (:mod:`harness.reports.reruns`) that mark a cell reproduced.
REPRODUCED = ("IDENTICAL", "WITHIN NOISE")


def summarize(runs: pd.DataFrame, metrics: Sequence[str] = DEFAULT_METRICS) -> pd.DataFrame:
    """Runs -> cells (``CELL_COLUMNS`` without ``published``): over seeds, in percent, the
    mean, the half-width of the 95% Student t-interval, the sample std and the number of
    runs; ``flagged`` when any run of the cell has deviations or test-set selection,
    ``code_flagged`` when the runs of its block differ in evaluation code or lack the tag,
    ``reproduced`` when every run of the cell was re-run (``harness rerun``) with the
    verdict IDENTICAL or WITHIN NOISE. Raises if a block mixes protocol fingerprints."""
    if runs.empty:
        return pd.DataFrame(columns=CELL_COLUMNS[:-1])
    runs = runs.copy()
    if "setting" not in runs:
        runs["setting"] = ""
    _check_fingerprints(runs)
    code_flags = _code_flags(runs)
    rows = []
    for key, cell in runs.groupby([*ROW, "dataset"], sort=False):
        flagged = bool(((cell["deviations"] != "none") | cell["test_set_selection"]).any())
        block = (key[0], key[1], key[4])
        reproduced = (
            bool(cell["rerun_last"].isin(REPRODUCED).all()) if "rerun_last" in cell else False
        )
        for metric in metrics:
            summary = _over_seeds(cell, metric)
            if summary is not None:
                rows.append(
                    {
                        **dict(zip([*ROW, "dataset"], key, strict=True)),
                        "metric": metric,
                        **summary,
                        "flagged": flagged,
                        "code_flagged": code_flags[block],
                        "reproduced": reproduced,
                    }
                )
    return pd.DataFrame(rows, columns=CELL_COLUMNS[:-1])


def _over_seeds(cell: pd.DataFrame, metric: str) -> dict | None:
    """``mean``, ``half_width``, ``std`` and ``n`` of one cell's runs in percent; None when
    none of them has the metric."""
    column = f"test_{metric}"
    values = (cell[column].dropna() * 100.0) if column in cell else pd.Series(dtype=float)
    if values.empty:
        return None
    mean, half, n = t_interval(values)
    return {
        "mean": mean,
        "half_width": half,
        "std": float(values.std(ddof=1)) if len(values) > 1 else math.nan,
        "n": n,
    }


def _check_fingerprints(runs: pd.DataFrame) -> None:
    """One protocol per block. A tuned grid's rows differ in what their search chose (the
    learning rates, the loss's arguments): they are compared by the protocol they were
    searched under (``tune_protocol``), which must then be one."""
    searched = runs["tune_protocol"].fillna("") if "tune_protocol" in runs else None
    for (backbone, loss, dataset), block in runs.groupby(BLOCK, sort=False):
        prints_of = block["fingerprint"]
        if searched is not None:
            prints_of = searched[block.index].where(searched[block.index] != "", prints_of)
        block = block.assign(fingerprint=prints_of)
        prints = sorted(set(block["fingerprint"]))
        if len(prints) > 1:
            a, b = prints[0], prints[1]
            na, nb = (int((block["fingerprint"] == p).sum()) for p in (a, b))
            raise HarnessError(
                f"refusing to compare runs of different protocols in block {backbone} + {loss} on "
                f"{dataset}: protocol fingerprints {a} ({na} runs) and {b} ({nb} runs); method options set "
                f"in a protocol or by --set change it too; table one protocol at a time (one experiment, "
                f"or delete the odd runs from it)"
            )


def _code_flags(runs: pd.DataFrame) -> dict[tuple, bool]:
    """Per block: True when its runs were scored by different evaluation code (the
    ``evaluation_code`` tag differs) or some lack the tag."""
    codes = (
        runs["evaluation_code"] if "evaluation_code" in runs else pd.Series("", index=runs.index)
    )
    return {
        key: bool(len(set(codes[block.index])) > 1 or (codes[block.index] == "").any())
        for key, block in runs.groupby(BLOCK, sort=False)
    }
