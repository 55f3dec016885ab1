"""The chance row of a table: the same evaluation on random embeddings of the same test set.

What a metric reads at chance depends on the test set, not only on the metric: Recall@1
of random embeddings is about (class size - 1) / (test size - 1) per query, NMI of a
k-means clustering of random points with k = the number of classes is far above 0 when
classes are small (SOP's 11,316 classes of about 5 images). A table that prints no chance
level lets a reader take a difference between two models at chance for a finding.

The test set's labels come from a run's stored per-query results
(:data:`harness.components.evaluation.PER_QUERY_ARTIFACT`: every test query's class, and
for query/gallery datasets the gallery's classes), so the row is computed from the
tracking store alone. Each draw scores isotropic Gaussian embeddings of
:data:`CHANCE_DIM` dimensions (L2-normalised by the evaluation: uniform directions, every
ranking equally likely) with the harness's own evaluation (k-means seeded by the draw);
the row shows the mean over :data:`CHANCE_DRAWS` draws and the half-width of the 95%
prediction interval of one draw, ``t(0.975, n-1) s sqrt(1 + 1/n)``: the range a single
random embedding falls in, which is what a cell is held against
(:mod:`~harness.reports.tables.verdicts`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from harness.base.errors import HarnessError
from harness.components.evaluation import evaluate_embeddings, parse_metrics
from harness.reports.stats import CONFIDENCE
from harness.reports.tables.columns import CELL_COLUMNS

__all__ = [
    "CHANCE",
    "CHANCE_LABEL",
    "CHANCE_DRAWS",
    "CHANCE_DIM",
    "SplitLabels",
    "split_labels",
    "chance_levels",
    "chance_frame",
    "chance_cells",
]

#: The chance row's method name in a table's cells (no plugin registers it).
CHANCE = "chance"
#: Its row label.
CHANCE_LABEL = "Chance (random embeddings)"
#: Random embeddings scored per test set.
CHANCE_DRAWS = 5
#: Their dimension (MLRC's embedding size; the retrieval metrics of random directions do
#: not depend on it).
CHANCE_DIM = 128


@dataclass(frozen=True)
class SplitLabels:
    """A test set's classes: ``query`` (every query, lone ones included) and ``gallery``
    (None when the queries are searched against themselves)."""

    query: np.ndarray
    gallery: np.ndarray | None = None


def split_labels(per_query: dict[str, np.ndarray]) -> SplitLabels | None:
    """The test set's classes from one run's per-query arrays: the queries' labels, and
    the gallery's where the run stored them; None when the queries were searched against
    a gallery whose labels the arrays lack (their relevant counts disagree with a search
    of the queries against themselves)."""
    labels = np.asarray(per_query["label"])
    if "gallery_label" in per_query:
        return SplitLabels(labels, np.asarray(per_query["gallery_label"]))
    _, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if not np.array_equal(np.asarray(per_query["num_relevant"]), counts[codes] - 1):
        return None
    return SplitLabels(labels)


def chance_levels(
    labels: SplitLabels,
    metrics: Sequence[str],
    *,
    draws: int = CHANCE_DRAWS,
    dim: int = CHANCE_DIM,
    seed: int = 0,
) -> dict[str, tuple[float, float, int]]:
    """``{metric: (mean, half-width, draws)}`` in percent: ``metrics`` (those the
    evaluation computes; others are left out) scored on ``draws`` draws of random
    embeddings (``numpy.random.default_rng(seed)``), the half-width that of the 95%
    prediction interval of one draw (NaN for one draw)."""
    known = [m for m in metrics if _computable(m)]
    if not known or draws < 1:
        return {}
    rng = np.random.default_rng(seed)
    values: dict[str, list[float]] = {m: [] for m in known}
    for draw in range(draws):
        query = rng.standard_normal((len(labels.query), dim)).astype(np.float32)
        gallery = (
            None
            if labels.gallery is None
            else rng.standard_normal((len(labels.gallery), dim)).astype(np.float32)
        )
        scores = evaluate_embeddings(
            query, labels.query, gallery, labels.gallery, metrics=known, kmeans_seed=draw
        )
        for m in known:
            values[m].append(100.0 * float(scores[m]))
    return {m: (float(np.mean(v)), _prediction_half_width(v), len(v)) for m, v in values.items()}


def _computable(metric: str) -> bool:
    try:
        parse_metrics([metric])
    except HarnessError:
        return False
    return True


def _prediction_half_width(values: Sequence[float]) -> float:
    """Half-width of the two-sided 95% prediction interval of one more draw."""
    n = len(values)
    if n < 2:
        return math.nan
    quantile = stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)
    return float(quantile * np.std(values, ddof=1) * math.sqrt(1 + 1 / n))


def chance_frame(
    runs: pd.DataFrame,
    metrics: Sequence[str],
    per_query: Callable[[str], dict | None] | None,
    *,
    draws: int = CHANCE_DRAWS,
) -> pd.DataFrame:
    """``dataset, metric, mean, half_width, draws`` for each dataset of ``runs`` whose test
    labels some run's per-query results (``per_query(run_id)``) give; empty without
    ``per_query`` or draws."""
    rows: list[dict] = []
    if per_query is None or draws < 1 or runs.empty:
        return pd.DataFrame(rows, columns=["dataset", "metric", "mean", "half_width", "draws"])
    for dataset, group in runs.groupby("dataset", sort=False):
        labels = _first_labels(group["run_id"], per_query)
        if labels is None:
            continue
        for metric, (mean, half, n) in _cached_levels(labels, tuple(metrics), draws).items():
            rows.append(
                {"dataset": dataset, "metric": metric, "mean": mean, "half_width": half, "draws": n}
            )
    return pd.DataFrame(rows, columns=["dataset", "metric", "mean", "half_width", "draws"])


#: Chance levels computed in this process, by test set, metrics and draws: a tuned grid
#: writes each report in two formats, and an SOP-sized set (60,502 queries, 11,316
#: classes) takes 11 s a draw on 2 cores.
_LEVELS: dict[tuple, dict[str, tuple[float, float, int]]] = {}


def _cached_levels(
    labels: SplitLabels, metrics: tuple[str, ...], draws: int
) -> dict[str, tuple[float, float, int]]:
    digest = hashlib.sha256(np.ascontiguousarray(labels.query).tobytes())
    if labels.gallery is not None:
        digest.update(b"|" + np.ascontiguousarray(labels.gallery).tobytes())
    key = (digest.hexdigest(), metrics, draws)
    if key not in _LEVELS:
        _LEVELS[key] = chance_levels(labels, metrics, draws=draws)
    return _LEVELS[key]


def _first_labels(run_ids, per_query) -> SplitLabels | None:
    for run_id in run_ids:
        arrays = per_query(run_id)
        if arrays is not None and "label" in arrays:
            labels = split_labels(arrays)
            if labels is not None:
                return labels
    return None


def chance_cells(cells: pd.DataFrame, chance: pd.DataFrame) -> pd.DataFrame:
    """``cells`` (``CELL_COLUMNS``) with a chance row in every block, for each (dataset,
    metric) column the block has and the chance frame gives: ``n`` counts the draws."""
    if chance.empty or cells.empty:
        return cells
    levels = chance.set_index(["dataset", "metric"])
    rows = []
    for (backbone, loss, dataset, metric), _ in cells.groupby(
        ["backbone", "loss", "dataset", "metric"], sort=False
    ):
        if (dataset, metric) not in levels.index:
            continue
        level = levels.loc[(dataset, metric)]
        rows.append(
            {
                "backbone": backbone,
                "loss": loss,
                "method": CHANCE,
                "setting": "",
                "dataset": dataset,
                "metric": metric,
                "mean": level["mean"],
                "half_width": level["half_width"],
                "std": math.nan,
                "n": int(level["draws"]),
                "flagged": False,
                "code_flagged": False,
                "reproduced": False,
                "published": math.nan,
            }
        )
    if not rows:
        return cells
    return pd.concat([cells, pd.DataFrame(rows, columns=CELL_COLUMNS)], ignore_index=True)
