"""Tracking store -> one row per run: the newest FINISHED run per seed and setting, with
its keys, the setting that tells it apart from the method's other runs, its flags and its
``test/*`` metrics."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import pandas as pd

from harness.base.metric_keys import split_key
from harness.components.data.base import GIVEN_VALIDATION, VALIDATION_SPLIT_TAG
from harness.config.deviations import TAG_PREFIX
from harness.reports.tables.columns import ROW
from harness.reports.tuning import budget_keys, studied_method
from harness.store.queries import finished_runs_frame

__all__ = ["RUN_COLUMNS", "TUNE_TAGS", "load_runs", "label_settings", "select_report"]

#: A tuned grid's tags on its final results (:mod:`harness.reports.tuning`).
TUNE_TAGS = (
    "tune_budget",
    "tune_trials",
    "tune_params",
    "tune_history",
    "tune_report",
    "tune_protocol",
    "tune_study",
    "tune_search",
    "tune_folds",
    "tune_fold",
)

#: Columns of :func:`load_runs` before the ``paper_deviations`` and ``test_<metric>`` ones.
RUN_COLUMNS = [
    "run_id",
    "experiment",
    "backbone",
    "loss",
    "method",
    "setting",
    "dataset",
    "seed",
    "fingerprint",
    "deviations",
    "test_set_selection",
    "method_revision",
    "selection",
    "validation_classes",
    "selection_metric",
    "evaluation_code",
    "options",
    "tuned",
    "init_from",
    "rerun_last",
]


def load_runs(experiments: Sequence[str]) -> pd.DataFrame:
    """One row per FINISHED run of ``experiments``: keys, setting, fingerprint, flags and test metrics.

    Columns: ``run_id, experiment, backbone, loss, method, setting, dataset, seed,
    fingerprint, deviations, test_set_selection, method_revision, selection,
    validation_classes, selection_metric, evaluation_code, options, tuned, init_from`` and one
    column per ``test_<metric>`` (fractions, from the runs' ``test/*`` metrics). ``setting``
    labels what tells apart runs of one method (see :func:`label_settings`).
    """
    # Imported when called: the store pulls in MLflow, which the table's other steps never need.

    frame, ids = finished_runs_frame(experiments)
    if frame.empty:
        return pd.DataFrame(columns=RUN_COLUMNS)
    runs = _with_test_metrics(_runs_frame(frame, ids), frame)
    return _newest_per_seed(label_settings(runs), frame["start_time"])


def _column(frame: pd.DataFrame, name: str, default: str = "") -> pd.Series:
    """A column of the store's runs frame with ``default`` where it is missing or empty."""
    return frame[name].fillna(default) if name in frame else pd.Series(default, index=frame.index)


def _runs_frame(frame: pd.DataFrame, ids: dict) -> pd.DataFrame:
    """The store's runs frame (``params.*``, ``tags.*`` columns) -> :data:`RUN_COLUMNS` and
    ``paper_deviations``, one row per run, ``setting`` still empty."""
    training_init = (_column(frame, "tags.init_from", "none") != "none") & (
        _column(frame, "tags.evaluate_only", "False") != "True"
    )
    return pd.DataFrame(
        {
            "run_id": frame["run_id"],
            "experiment": frame["experiment_id"].map(ids),
            "backbone": _column(frame, "params.protocol.backbone.name"),
            "loss": _column(frame, "tags.loss"),
            "method": _column(frame, "tags.method"),
            "setting": "",
            "dataset": _column(frame, "tags.dataset"),
            "seed": _column(frame, "tags.seed"),
            "fingerprint": _column(frame, "tags.fingerprint"),
            "deviations": _column(frame, "tags.deviations", "none"),
            "test_set_selection": _column(frame, "tags.test_set_selection", "False") == "True",
            "method_revision": pd.to_numeric(
                _column(frame, "tags.method_revision", "1"), errors="coerce"
            )
            .fillna(1)
            .astype(int),
            "selection": _column(frame, "tags.selection", "validation"),
            "validation_classes": _column(frame, "params.protocol.splits.validation_classes").where(
                _column(frame, f"tags.{VALIDATION_SPLIT_TAG}") != GIVEN_VALIDATION,
                GIVEN_VALIDATION,
            ),
            "selection_metric": _column(frame, "params.protocol.selection.metric"),
            "evaluation_code": _column(frame, "tags.evaluation_code"),
            "options": _method_options(frame),
            "tuned": _column(frame, "tags.tune_role") != "",
            "init_from": training_init,
            # The verdict of the run's latest rerun (``harness rerun``), "" when never re-run.
            "rerun_last": _column(frame, "tags.rerun.last"),
            # A tuned grid's final result: its budget, choice and search (reports/tuning.py).
            **{name: _column(frame, f"tags.{name}") for name in TUNE_TAGS},
            "paper_deviations": _paper_deviations(frame),
        }
    )


def _method_options(frame: pd.DataFrame) -> list[str]:
    """Each run's method options (``params.method.<option>``) as sorted JSON."""
    option_columns = sorted(c for c in frame.columns if c.startswith("params.method."))
    if not option_columns:
        return ["{}"] * len(frame)
    return [
        json.dumps(
            {
                c.removeprefix("params.method."): row[c]
                for c in option_columns
                if isinstance(row[c], str)
            },
            sort_keys=True,
        )
        for _, row in frame[option_columns].iterrows()
    ]


def _paper_deviations(frame: pd.DataFrame) -> list[dict[str, str]]:
    """Each run's ``deviation.<name>`` tags as ``{name: tag value}``."""
    deviation_columns = sorted(c for c in frame.columns if c.startswith("tags." + TAG_PREFIX))
    if not deviation_columns:
        return [{}] * len(frame)
    return [
        {
            c.removeprefix("tags." + TAG_PREFIX): row[c]
            for c in deviation_columns
            if isinstance(row[c], str)
        }
        for _, row in frame[deviation_columns].iterrows()
    ]


def _with_test_metrics(runs: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with the store's ``test/*`` metrics as ``test_<metric>`` columns."""
    for name in frame.columns:
        parts = split_key(name.removeprefix("metrics.")) if name.startswith("metrics.") else None
        if parts is not None and parts[0] == "test":
            runs[f"test_{parts[1]}"] = frame[name]
    return runs


def label_settings(runs: pd.DataFrame) -> pd.DataFrame:
    """Fill ``setting``: for each method, the options whose values differ between its runs
    (``"entries=16"``), ``tuned`` for runs tagged by ``harness tune`` and ``init-from`` for
    runs that trained from another run's weights; empty when all runs of the method agree.
    Distinct option sets always get distinct labels, so they are separate rows. The
    options a tuned grid's search chose are not part of the label (each block may choose
    others; the appendix table lists them): its rows are ``tuned``, and ``other budget``
    where their study's budget differs from most rows' (not tuned alike). A tuned grid's
    fold model (``tune_fold`` i, one of k models of its seed) is ``tuned, fold i``: a row
    of one model per seed, as every row is."""
    runs = runs.copy()
    for column, default in (("options", "{}"), ("tuned", False), ("init_from", False)):
        if column not in runs:
            runs[column] = default
    runs["setting"] = ""
    searched = (
        runs["tune_budget"].fillna("") != "" if "tune_budget" in runs else runs["tuned"] & False
    )
    budgets = budget_keys(runs)
    usual = budgets[searched].value_counts().index[0] if searched.any() else ""
    test_time = _test_time(runs)
    # A fold model of a tuned grid (``tune_fold`` = i): one of k models of its seed, a row of
    # its own (the separated and concatenated results of all k are tagged "all").
    folds = (
        runs["tune_fold"].fillna("").astype(str)
        if "tune_fold" in runs
        else pd.Series("", index=runs.index)
    )
    for _method, group in runs.groupby("method", sort=False):
        parsed = {
            i: {} if searched[i] else json.loads(o or "{}") for i, o in group["options"].items()
        }
        keys = sorted({k for opts in parsed.values() for k in opts})
        varying = [k for k in keys if len({opts.get(k, "–") for opts in parsed.values()}) > 1]
        for i in group.index:
            parts = [f"{k}={parsed[i].get(k, '–')}" for k in varying]
            if test_time[i]:  # evaluated on its base method's tuned models, its own options fixed
                parts += [
                    f"own options untuned, on tuned {studied_method(runs.at[i, 'tune_study'])}"
                ]
            else:
                parts += ["tuned"] if runs.at[i, "tuned"] else []
            parts += [f"fold {folds[i]}"] if folds[i].isdigit() else []
            # A tuned grid's row whose study had another budget than most rows'.
            parts += ["other budget"] if usual and searched[i] and budgets[i] != usual else []
            parts += ["init-from"] if runs.at[i, "init_from"] else []
            runs.at[i, "setting"] = ", ".join(parts)
    return runs


def select_report(runs: pd.DataFrame, report: str) -> pd.DataFrame:
    """A tuned grid with k > 1 folds records two results per seed (``separated``,
    ``concatenated``): keep ``report``'s, and every run that is not such a result."""
    if "tune_report" not in runs:
        return runs
    kind = runs["tune_report"].fillna("")
    keep = (kind == "") | (kind == "single") | (kind == report)
    if report == "concatenated":  # a test-time method's concatenated result is its base's
        keep &= ~_test_time(runs)
    return runs[keep].reset_index(drop=True)


def _test_time(runs: pd.DataFrame) -> pd.Series:
    """The tuned grid's rows of a test-time method: their study is their base method's."""
    if "tune_study" not in runs:
        return pd.Series(False, index=runs.index)
    base = runs["tune_study"].fillna("").map(studied_method)
    return (base != "") & (base != runs["method"])


def _newest_per_seed(runs: pd.DataFrame, start_time: pd.Series) -> pd.DataFrame:
    """One run per (method, setting, protocol, seed): runs of an older method revision and
    older runs of the same seed are superseded, so that ``n`` counts seeds of the current
    code and the spread is over seeds, not over repeats of one. Runs of another setting
    (options, tuned, init) are never superseded: they are another row."""
    cell = [*ROW, "dataset", "fingerprint", *(["tune_report"] if "tune_report" in runs else [])]
    current = runs[
        runs["method_revision"] == runs.groupby(cell)["method_revision"].transform("max")
    ]
    order = start_time.loc[current.index].sort_values(kind="stable").index
    newest = current.loc[order].drop_duplicates([*cell, "seed"], keep="last")
    if len(newest) < len(runs):
        print(
            f"tables: {len(runs) - len(newest)} run(s) superseded by a newer run or method revision "
            f"of the same method, setting, protocol and seed",
            file=sys.stderr,
        )
    return newest.sort_index().reset_index(drop=True)
