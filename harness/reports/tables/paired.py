"""Paired tests of each row against its block's baseline row: a paired t-test over seeds,
and a paired bootstrap over the test set's classes where the runs stored per-query results
(:mod:`harness.reports.stats`); the runs whose per-query results a bootstrap needed and
did not get."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from harness.components.evaluation import (
    PER_QUERY_ARTIFACT,
    PER_QUERY_SCORES,
    load_per_query,
    per_query_values,
)
from harness.reports.stats import (
    paired_bootstrap,
    paired_t_test,
    pool_query_differences,
    t_interval,
)
from harness.reports.tables.columns import BLOCK, TEST_COLUMNS
from harness.reports.tables.labels import METRIC_LABELS, label
from harness.store.queries import missing_artifact, read_artifact

__all__ = [
    "PerQueryLoader",
    "artifact_per_query",
    "artifact_problem",
    "paired_tests",
    "has_per_query_values",
    "missing_results",
]

#: ``run_id -> per-query arrays`` (or None when the run stored none).
PerQueryLoader = Callable[[str], "dict[str, np.ndarray] | None"]
#: The mark of a cell whose bootstrap is owed, as the Markdown table prints it.
INCOMPLETE_MARK = "‡"


def artifact_per_query(run_id: str) -> dict[str, np.ndarray] | None:
    """The run's ``evaluation/per_query_test.npz`` artifact, or None when it has none."""
    # Imported when called: the store pulls in MLflow, evaluation faiss and scikit-learn.

    return read_artifact(run_id, PER_QUERY_ARTIFACT, load_per_query)


def artifact_problem(run_id: str) -> str:
    """What is missing of run ``run_id``'s per-query artifact, and where it was looked for."""
    # Imported when called, as in artifact_per_query.

    return missing_artifact(run_id, PER_QUERY_ARTIFACT)


def paired_tests(
    runs: pd.DataFrame,
    metrics: Sequence[str],
    *,
    baseline: str = "plain",
    per_query: PerQueryLoader | None = None,
    resamples: int = 10_000,
) -> pd.DataFrame:
    """Each row of a block against the block's ``baseline`` row (same backbone, loss,
    dataset; the baseline method's row without a setting, else its only row, else its row
    of the same setting: a tuned grid's fold i against the baseline's fold i), per metric
    (``TEST_COLUMNS``, differences in percent points):

    * ``row_mean``, ``baseline_mean``: both rows' means over the paired seeds (percent);
    * ``difference``, ``p_t``: paired t-test over the seeds both rows have (pairs = seeds);
      ``low``, ``high``: the 95% Student t-interval of the mean paired difference (NaN
      for one pair);
    * ``boot_*``: paired bootstrap over the test set's classes (all queries of a drawn
      class together) from the runs' per-query results, when
      ``per_query`` gives them for every paired run and the metric has per-query values
      (retrieval metrics; not NMI / F1): per seed, method minus baseline per query (both
      runs must have scored the same queries), averaged over seeds when every seed scored
      the same queries, else pooled (:func:`harness.reports.stats.pool_query_differences`);
      classes resampled with all their queries (``boot_classes`` of them), ``resamples``
      resamples, seed 0;
    * ``boot_missing``: the runs (ids, space-separated) whose per-query results ``per_query``
      did not give, for a metric that has per-query values: that bootstrap is owed, not
      computed (the table marks the cell and :func:`~harness.reports.tables.compose.make_table`
      reports the runs).
    """
    if runs.empty or baseline not in set(runs["method"]):
        return pd.DataFrame(columns=TEST_COLUMNS)
    runs = runs.copy()
    if "setting" not in runs:
        runs["setting"] = ""
    bootstrap = _Bootstrap(per_query, resamples) if per_query is not None else None
    out = []
    for (backbone, loss, dataset), block in runs.groupby(BLOCK, sort=False):
        base_rows = block[block["method"] == baseline]
        for (method, setting), row in block.groupby(["method", "setting"], sort=False):
            base_setting = _baseline_setting(base_rows, setting)
            if base_setting is None or (method == baseline and setting == base_setting):
                continue
            base = base_rows[base_rows["setting"] == base_setting].set_index("seed")
            key = {
                "backbone": backbone,
                "loss": loss,
                "method": method,
                "setting": setting,
                "dataset": dataset,
                "baseline": baseline,
            }
            row = row.set_index("seed")
            for metric in metrics:
                record = _compare(row, base, metric, bootstrap)
                if record is not None:
                    out.append({**key, "metric": metric, **record})
    return pd.DataFrame(out, columns=TEST_COLUMNS)


def _baseline_setting(base_rows: pd.DataFrame, setting: str) -> str | None:
    """The setting of the baseline row a row of ``setting`` is compared with: the empty
    one, else the only one, else the row's own (the fold models of a tuned grid, ``tuned,
    fold i``: fold i against the baseline's fold i); None when the block has no baseline
    row, or several labelled ones and none unlabelled nor of ``setting`` (no single
    reference)."""
    settings = list(dict.fromkeys(base_rows["setting"]))
    if "" in settings:
        return ""
    if len(settings) == 1:
        return settings[0]
    return setting if setting in settings else None


def _compare(
    row: pd.DataFrame, base: pd.DataFrame, metric: str, bootstrap: _Bootstrap | None
) -> dict | None:
    """One row against the baseline row on ``metric`` (both indexed by seed): the paired
    t-test over the seeds where both have it, and the bootstrap when asked for; None when
    no seed pairs."""
    column = f"test_{metric}"
    if column not in row or column not in base:
        return None
    seeds = [s for s in row.index if s in base.index]
    both = [
        s for s in seeds if not (math.isnan(row.at[s, column]) or math.isnan(base.at[s, column]))
    ]
    if not both:
        return None
    diff, p_t = paired_t_test(row.loc[both, column] * 100, base.loc[both, column] * 100)
    _, half, _ = t_interval((row.loc[both, column] - base.loc[both, column]) * 100)
    record = {
        "pairs": len(both),
        "row_mean": float(row.loc[both, column].mean() * 100),
        "baseline_mean": float(base.loc[both, column].mean() * 100),
        "difference": diff,
        "low": diff - half,
        "high": diff + half,
        "p_t": p_t,
        "boot_difference": math.nan,
        "boot_low": math.nan,
        "boot_high": math.nan,
        "p_boot": math.nan,
        "boot_queries": 0,
        "boot_classes": 0,
        "boot_pooling": "",
        "boot_missing": "",
    }
    if bootstrap is not None:
        record.update(bootstrap(row, base, both, metric))
    return record


def has_per_query_values(metric: str) -> bool:
    """Whether stored per-query results give ``metric`` query by query
    (:func:`harness.components.evaluation.per_query_values`): P@1, Recall@K and the
    scores kept per query; not the clustering metrics."""
    # Imported when called: evaluation pulls in faiss and scikit-learn.

    recall_k = metric.startswith("recall_at_") and metric.removeprefix("recall_at_").isdigit()
    return metric == "precision_at_1" or recall_k or metric in PER_QUERY_SCORES


class _Bootstrap:
    """The paired class bootstrap of one table: reads each run's per-query results
    once (``per_query``) and computes the ``boot_*`` fields of a comparison."""

    def __init__(self, per_query: PerQueryLoader, resamples: int):
        # Imported when called: evaluation pulls in faiss and scikit-learn.

        self.per_query, self.resamples, self.values_of = per_query, resamples, per_query_values
        self.cache: dict[str, dict | None] = {}

    def arrays(self, run_id: str) -> dict | None:
        if run_id not in self.cache:
            self.cache[run_id] = self.per_query(run_id)
        return self.cache[run_id]

    def __call__(self, row: pd.DataFrame, base: pd.DataFrame, seeds: list, metric: str) -> dict:
        """The ``boot_*`` fields of one comparison: {} when the stored arrays cannot give the
        metric or disagree on the queries; ``boot_missing`` when a run's per-query results
        are missing."""
        pairs, missing = [], []
        for seed in seeds:
            ours, theirs = self.arrays(row.at[seed, "run_id"]), self.arrays(base.at[seed, "run_id"])
            missing += [
                rid
                for rid, got in ((row.at[seed, "run_id"], ours), (base.at[seed, "run_id"], theirs))
                if got is None
            ]
            if ours is None or theirs is None:
                continue
            pair = self._query_pair(ours, theirs, metric)
            if pair is None:
                return {}
            pairs.append(pair)
        if missing:
            return (
                {"boot_missing": " ".join(dict.fromkeys(missing))}
                if has_per_query_values(metric)
                else {}
            )
        differences, classes, pooling = pool_query_differences(pairs)
        result = paired_bootstrap(differences, classes=classes, resamples=self.resamples)
        return {
            "boot_difference": result.mean,
            "boot_low": result.low,
            "boot_high": result.high,
            "p_boot": result.p,
            "boot_queries": result.queries,
            "boot_classes": result.classes,
            "boot_pooling": pooling,
        }

    def _query_pair(self, ours: dict, theirs: dict, metric: str) -> tuple | None:
        """Both runs' per-query values in percent and the queries' labels; None when the
        arrays cannot give the metric or the runs scored different queries."""
        a, b = self.values_of(ours, metric), self.values_of(theirs, metric)
        labels = ours["label"][ours["num_relevant"] > 0]
        if (
            a is None
            or b is None
            or a.shape != b.shape
            or not np.array_equal(labels, theirs["label"][theirs["num_relevant"] > 0])
        ):
            return None
        return a * 100, b * 100, labels


def missing_results(
    runs: pd.DataFrame, tests: pd.DataFrame, *, explain: Callable[[str], str] | None = None
) -> list[str]:
    """One line per run whose per-query results a paired bootstrap needed (``boot_missing``):
    the run id, its method, dataset and seed, what is missing (``explain(run_id)``) and the
    cells left without the bootstrap."""
    if tests.empty or "boot_missing" not in tests:
        return []
    owed: dict[str, list[str]] = {}
    for t in tests.itertuples(index=False):
        for run_id in t.boot_missing.split():
            owed.setdefault(run_id, []).append(
                f"{t.method}{f' [{t.setting}]' if t.setting else ''} "
                f"{t.dataset} {label(METRIC_LABELS, t.metric)}"
            )
    about = runs.set_index("run_id") if "run_id" in runs else pd.DataFrame()
    lines = []
    for run_id, cells in owed.items():
        who = (
            f" ({about.at[run_id, 'method']}, {about.at[run_id, 'dataset']}, seed {about.at[run_id, 'seed']})"
            if run_id in about.index
            else ""
        )
        why = (explain(run_id) if explain else "") or "no per-query results"
        lines.append(
            f"run {run_id}{who}: {why}; no paired bootstrap for "
            f"{'; '.join(dict.fromkeys(cells))} (marked {INCOMPLETE_MARK})"
        )
    return lines
