"""Paper-style comparison tables from the tracking store alone (no retraining).

``python -m harness table --experiment NAME [--published CSV --table 3]`` reads the
FINISHED runs of one or more MLflow experiments, groups them into rows (backbone, loss,
method and its setting) and dataset columns, and prints for each ``test/<metric>`` metric the
mean over seeds in percent, the half-width of its 95% Student t-interval and the number
of seeds, a paired comparison with the block's baseline row, and the published number
with the difference beside it.

Four steps, each a plain function so that each is easy to test:

1. :func:`load_runs` (tracking store -> one row per run, the newest per seed and setting),
2. :func:`summarize` (runs -> one row per cell, refusing blocks that mix protocol
   fingerprints) and :func:`attach_published`,
3. :func:`paired_tests` (each method row against the baseline row of its block: paired
   t-test over seeds, and a paired bootstrap over queries where runs stored per-query
   results; :mod:`harness.reports.stats`),
4. :func:`render_latex` / :func:`render_markdown` (cells + tests -> string; pure).

Layout (A-grouping Table 3): rows are blocks of backbone + loss, one row per method
(and setting) inside a block; columns are dataset x metric. What a row compares:

* Runs of one method that differ in method options, in being tuned (tagged by
  ``harness tune``) or in starting from another run's weights (``--init-from`` while
  training) are separate rows, labelled by what differs; never merged, never one
  superseding the other.
* Bold: the best mean of its block and column when its interval lies above every other
  row's; when intervals overlap the best, every row whose interval overlaps it is
  marked tied instead. Marks and the selection of the numbers are explained in
  footnotes.
* Rows whose runs were computed by different evaluation code (the ``evaluation_code``
  tag: sources of ``harness/evaluation`` and the versions of faiss, scikit-learn,
  numpy), or that lack that tag, are flagged.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.base.errors import HarnessError
from harness.base.metric_keys import split_key
from harness.config.deviations import TAG_PREFIX, from_tag, grouped_notes
from harness.reports.stats import (
    paired_bootstrap,
    paired_t_test,
    pool_query_differences,
    t_interval,
)

__all__ = ["load_runs", "summarize", "paired_tests", "load_published",
           "parse_published_row", "attach_published", "render_latex", "render_markdown", "write_atomic",
           "build_table", "compose_table", "Table", "block_label", "row_label", "ordered_tests", "missing_results", "has_per_query_values", "artifact_per_query", "method_labels", "recorded_options", "DEFAULT_METRICS",
           "CELL_COLUMNS", "TEST_COLUMNS", "SIGNIFICANCE"]

#: Metrics of A-grouping's Tables 3 and 4 (Roth's class-wise mAP is ``map_at_c``), then MAP@R
#: (Musgrave et al. 2020, Sec. 3.2: R-precision averaged over the first R ranks).
DEFAULT_METRICS = ("recall_at_1", "recall_at_2", "nmi", "f1", "map_at_c", "mean_average_precision_at_r")
#: What a published value is matched on.
KEYS = ["backbone", "loss", "method", "dataset"]
#: A table row inside a block: the method and its setting (options / tuned / init).
ROW = ["backbone", "loss", "method", "setting"]
BLOCK = ["backbone", "loss", "dataset"]
#: Columns of the long "cell" frame the renderers take.
CELL_COLUMNS = ["backbone", "loss", "method", "setting", "dataset", "metric", "mean", "half_width", "std", "n",
                "flagged", "code_flagged", "published"]
#: Columns of :func:`paired_tests`.
TEST_COLUMNS = ["backbone", "loss", "method", "setting", "dataset", "metric", "baseline", "pairs", "difference",
                "low", "high", "p_t", "boot_difference", "boot_low", "boot_high", "p_boot", "boot_queries", "boot_pooling",
                "boot_missing"]
#: Level below which a paired test marks a cell.
SIGNIFICANCE = 0.05

METRIC_LABELS = {"recall_at_1": "R@1", "recall_at_2": "R@2", "recall_at_4": "R@4",
                 "recall_at_8": "R@8", "recall_at_10": "R@10", "recall_at_100": "R@100",
                 "recall_at_16": "R@16", "recall_at_32": "R@32", "recall_at_1000": "R@1000",
                 "nmi": "NMI", "f1": "F1", "map_at_c": "mAP@C", "precision_at_1": "P@1",
                 "r_precision": "RP", "mean_average_precision_at_r": "MAP@R",
                 # DIML's released evaluation counts the query in R (harness.components.evaluation.metrics)
                 "r_precision_query_in_r": "RP (query in R)",
                 "mean_average_precision_at_r_query_in_r": "MAP@R (query in R)"}
DATASET_LABELS = {"cub200": "CUB-200-2011", "cars196": "Cars196", "sop": "SOP", "inshop": "In-Shop",
                  "synthetic": "synthetic", "fashion-mnist": "Fashion-MNIST"}
BACKBONE_LABELS = {"googlenet": "GoogLeNet", "resnet50": "ResNet-50", "resnet18": "ResNet-18",
                   "efficientnet_lite0": "EfficientNet-Lite0"}
LOSS_LABELS = {"contrastive": "Contrastive", "triplet": "Triplet", "binomial_deviance": "Binomial deviance",
               "margin": "Margin", "multi_similarity": "Multi-similarity", "proxy_nca": "ProxyNCA",
               "proxy_anchor": "ProxyAnchor", "arcface": "ArcFace", "normalized_softmax": "Normalized softmax",
               # DIML Table 1's other rows (Roth et al. 2020's loss names)
               "triplet_random": "Triplet (random)", "triplet_semihard": "Triplet (semihard)",
               "triplet_softhard": "Triplet (softhard)", "triplet_distance": "Triplet (distance)",
               "angular": "Angular", "npair": "N-pair", "generalized_lifted": "Generalized lifted",
               "quadruplet": "Quadruplet", "snr": "SNR", "histogram": "Histogram"}
def _label(table: dict[str, str], name: str) -> str:
    return table.get(name, name)


def method_labels(methods: Iterable[str], recorded: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """Each method's row label, as its plugin declares it (:meth:`methods.MethodEntry.display_name`)
    from the options its runs recorded (``recorded``: ``{method: {option: value}}``, the
    rest at their defaults); a name the registry does not know (a published row of
    another paper) is its own label."""
    from methods import METHODS

    recorded = recorded or {}
    return {m: METHODS.get(m).display_name(recorded.get(m)) if m in METHODS else m for m in methods}


def recorded_options(runs: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """``{method: options}`` for each method whose runs all recorded the same method options
    (``params.method.<option>``, in the ``options`` column); a method whose runs differ is
    left out (its rows are labelled by registry name and setting)."""
    out = {}
    if "options" not in runs:
        return out
    for method, group in runs.groupby("method", sort=False):
        distinct = set(group["options"].fillna("{}"))
        if len(distinct) == 1:
            out[method] = json.loads(distinct.pop() or "{}")
    return out


def _method_order(baseline: str) -> list[str]:
    """Row order inside a block: the baseline row, then the methods in the order their
    plugins register them (each plugin registers its own baselines before its method)."""
    from methods import METHODS

    return list(dict.fromkeys([baseline, *METHODS.registered()]))


# ------------------------------------------------------------------------ loading


def load_runs(experiments: Sequence[str]) -> pd.DataFrame:
    """One row per FINISHED run of ``experiments``: keys, setting, fingerprint, flags and test metrics.

    Columns: ``run_id, experiment, backbone, loss, method, setting, dataset, seed,
    fingerprint, deviations, test_set_selection, method_revision, selection,
    validation_classes, selection_metric, evaluation_code, options, tuned, init_from`` and one column per
    ``test_<metric>`` (fractions, from the runs' ``test/*`` metrics). ``setting`` labels what tells apart runs of one method
    (see :func:`label_settings`).
    """
    from harness.store.queries import finished_runs_frame

    frame, ids = finished_runs_frame(experiments)
    columns = ["run_id", "experiment", "backbone", "loss", "method", "setting", "dataset", "seed", "fingerprint",
               "deviations", "test_set_selection", "method_revision", "selection", "validation_classes",
               "selection_metric", "evaluation_code", "options", "tuned", "init_from"]
    if frame.empty:
        return pd.DataFrame(columns=columns)

    def col(name: str, default: str = "") -> pd.Series:
        return frame[name].fillna(default) if name in frame else pd.Series(default, index=frame.index)

    option_columns = sorted(c for c in frame.columns if c.startswith("params.method."))
    options = [json.dumps({c.removeprefix("params.method."): row[c] for c in option_columns
                           if isinstance(row[c], str)}, sort_keys=True)
               for _, row in frame[option_columns].iterrows()] if option_columns else ["{}"] * len(frame)
    deviation_columns = sorted(c for c in frame.columns if c.startswith("tags." + TAG_PREFIX))
    paper_deviations = [{c.removeprefix("tags." + TAG_PREFIX): row[c] for c in deviation_columns if isinstance(row[c], str)}
                        for _, row in frame[deviation_columns].iterrows()] if deviation_columns else [{}] * len(frame)
    training_init = (col("tags.init_from", "none") != "none") & (col("tags.evaluate_only", "False") != "True")
    runs = pd.DataFrame({
        "run_id": frame["run_id"],
        "experiment": frame["experiment_id"].map(ids),
        "backbone": col("params.protocol.backbone.name"),
        "loss": col("tags.loss"),
        "method": col("tags.method"),
        "setting": "",
        "dataset": col("tags.dataset"),
        "seed": col("tags.seed"),
        "fingerprint": col("tags.fingerprint"),
        "deviations": col("tags.deviations", "none"),
        "test_set_selection": col("tags.test_set_selection", "False") == "True",
        "method_revision": pd.to_numeric(col("tags.method_revision", "1"), errors="coerce").fillna(1).astype(int),
        "selection": col("tags.selection", "validation"),
        "validation_classes": col("params.protocol.splits.validation_classes"),
        "selection_metric": col("params.protocol.selection.metric"),
        "evaluation_code": col("tags.evaluation_code"),
        "options": options,
        "tuned": col("tags.tune_role") != "",
        "init_from": training_init,
        "paper_deviations": paper_deviations,
    })
    for name in frame.columns:  # the runs' test/* metrics as test_<metric> columns
        parts = split_key(name.removeprefix("metrics.")) if name.startswith("metrics.") else None
        if parts is not None and parts[0] == "test":
            runs[f"test_{parts[1]}"] = frame[name]
    runs = label_settings(runs)
    return _newest_per_seed(runs, frame["start_time"])


def label_settings(runs: pd.DataFrame) -> pd.DataFrame:
    """Fill ``setting``: for each method, the options whose values differ between its runs
    (``"entries=16"``), ``tuned`` for runs tagged by ``harness tune`` and ``init-from`` for
    runs that trained from another run's weights; empty when all runs of the method agree.
    Distinct option sets always get distinct labels, so they are separate rows."""
    runs = runs.copy()
    for column, default in (("options", "{}"), ("tuned", False), ("init_from", False)):
        if column not in runs:
            runs[column] = default
    runs["setting"] = ""
    for _method, group in runs.groupby("method", sort=False):
        parsed = {i: json.loads(o or "{}") for i, o in group["options"].items()}
        keys = sorted({k for opts in parsed.values() for k in opts})
        varying = [k for k in keys if len({opts.get(k, "–") for opts in parsed.values()}) > 1]
        for i in group.index:
            parts = [f"{k}={parsed[i].get(k, '–')}" for k in varying]
            parts += ["tuned"] if runs.at[i, "tuned"] else []
            parts += ["init-from"] if runs.at[i, "init_from"] else []
            runs.at[i, "setting"] = ", ".join(parts)
    return runs


def _newest_per_seed(runs: pd.DataFrame, start_time: pd.Series) -> pd.DataFrame:
    """One run per (method, setting, protocol, seed): runs of an older method revision and
    older runs of the same seed are superseded, so that ``n`` counts seeds of the current
    code and the spread is over seeds, not over repeats of one. Runs of another setting
    (options, tuned, init) are never superseded: they are another row."""
    cell = [*ROW, "dataset", "fingerprint"]
    current = runs[runs["method_revision"] == runs.groupby(cell)["method_revision"].transform("max")]
    order = start_time.loc[current.index].sort_values(kind="stable").index
    newest = current.loc[order].drop_duplicates([*cell, "seed"], keep="last")
    if len(newest) < len(runs):
        print(f"tables: {len(runs) - len(newest)} run(s) superseded by a newer run or method revision "
              f"of the same method, setting, protocol and seed", file=sys.stderr)
    return newest.sort_index().reset_index(drop=True)


def _check_fingerprints(runs: pd.DataFrame) -> None:
    for (backbone, loss, dataset), block in runs.groupby(BLOCK, sort=False):
        prints = sorted(set(block["fingerprint"]))
        if len(prints) > 1:
            a, b = prints[0], prints[1]
            na, nb = (int((block["fingerprint"] == p).sum()) for p in (a, b))
            raise HarnessError(
                f"refusing to compare runs of different protocols in block {backbone} + {loss} on "
                f"{dataset}: protocol fingerprints {a} ({na} runs) and {b} ({nb} runs); method options set "
                f"in a protocol or by --set change it too; table one protocol at a time (one experiment, "
                f"or delete the odd runs from it)")


def _code_flags(runs: pd.DataFrame) -> dict[tuple, bool]:
    """Per block: True when its runs were scored by different evaluation code (the
    ``evaluation_code`` tag differs) or some lack the tag."""
    codes = runs["evaluation_code"] if "evaluation_code" in runs else pd.Series("", index=runs.index)
    return {key: bool(len(set(codes[block.index])) > 1 or (codes[block.index] == "").any())
            for key, block in runs.groupby(BLOCK, sort=False)}


def summarize(runs: pd.DataFrame, metrics: Sequence[str] = DEFAULT_METRICS) -> pd.DataFrame:
    """Runs -> cells (``CELL_COLUMNS`` without ``published``): over seeds, in percent, the
    mean, the half-width of the 95% Student t-interval, the sample std and the number of
    runs; ``flagged`` when any run of the cell has deviations or test-set selection,
    ``code_flagged`` when the runs of its block differ in evaluation code or lack the tag.
    Raises if a block mixes protocol fingerprints."""
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
        for metric in metrics:
            column = f"test_{metric}"
            values = (cell[column].dropna() * 100.0) if column in cell else pd.Series(dtype=float)
            if values.empty:
                continue
            mean, half, n = t_interval(values)
            rows.append({**dict(zip([*ROW, "dataset"], key, strict=True)), "metric": metric,
                         "mean": mean, "half_width": half,
                         "std": float(values.std(ddof=1)) if len(values) > 1 else math.nan,
                         "n": n, "flagged": flagged, "code_flagged": code_flags[block]})
    return pd.DataFrame(rows, columns=CELL_COLUMNS[:-1])


# ------------------------------------------------------------------ paired tests


#: ``run_id -> per-query arrays`` (or None when the run stored none).
PerQueryLoader = Callable[[str], "dict[str, np.ndarray] | None"]


def artifact_per_query(run_id: str) -> dict[str, np.ndarray] | None:
    """The run's ``evaluation/per_query_test.npz`` artifact, or None when it has none."""
    from harness.components.evaluation import PER_QUERY_ARTIFACT, load_per_query
    from harness.store.queries import read_artifact

    return read_artifact(run_id, PER_QUERY_ARTIFACT, load_per_query)


def paired_tests(runs: pd.DataFrame, metrics: Sequence[str], *, baseline: str = "plain",
                 per_query: PerQueryLoader | None = None, resamples: int = 10_000) -> pd.DataFrame:
    """Each row of a block against the block's ``baseline`` row (same backbone, loss,
    dataset; the baseline method's row without a setting, else its only row), per metric
    (``TEST_COLUMNS``, differences in percent points):

    * ``difference``, ``p_t``: paired t-test over the seeds both rows have (pairs = seeds);
      ``low``, ``high``: the 95% Student t-interval of the mean paired difference (NaN
      for one pair);
    * ``boot_*``: paired bootstrap over queries from the runs' per-query results, when
      ``per_query`` gives them for every paired run and the metric has per-query values
      (retrieval metrics; not NMI / F1): per seed, method minus baseline per query (both
      runs must have scored the same queries), averaged over seeds when every seed scored
      the same queries, else pooled (:func:`harness.reports.stats.pool_query_differences`);
      ``resamples`` resamples, seed 0;
    * ``boot_missing``: the runs (ids, space-separated) whose per-query results ``per_query``
      did not give, for a metric that has per-query values: that bootstrap is owed, not
      computed (the table marks the cell and :func:`compose_table` reports the runs).
    """
    from harness.components.evaluation import per_query_values

    if runs.empty or baseline not in set(runs["method"]):
        return pd.DataFrame(columns=TEST_COLUMNS)
    runs = runs.copy()
    if "setting" not in runs:
        runs["setting"] = ""
    cache: dict[str, dict | None] = {}

    def arrays(run_id: str):
        if run_id not in cache:
            cache[run_id] = per_query(run_id) if per_query is not None else None
        return cache[run_id]

    out = []
    for (backbone, loss, dataset), block in runs.groupby(BLOCK, sort=False):
        base_rows = block[block["method"] == baseline]
        settings = list(dict.fromkeys(base_rows["setting"]))
        if not settings:
            continue
        base_setting = "" if "" in settings else settings[0] if len(settings) == 1 else None
        if base_setting is None:
            continue  # several labelled baseline rows and none unlabelled: no single reference
        base = base_rows[base_rows["setting"] == base_setting].set_index("seed")
        for (method, setting), row in block.groupby(["method", "setting"], sort=False):
            if method == baseline and setting == base_setting:
                continue
            row = row.set_index("seed")
            seeds = [s for s in row.index if s in base.index]
            for metric in metrics:
                column = f"test_{metric}"
                if column not in row or column not in base:
                    continue
                both = [s for s in seeds if not (math.isnan(row.at[s, column]) or math.isnan(base.at[s, column]))]
                if not both:
                    continue
                diff, p_t = paired_t_test(row.loc[both, column] * 100, base.loc[both, column] * 100)
                _, half, _ = t_interval((row.loc[both, column] - base.loc[both, column]) * 100)
                record = {"backbone": backbone, "loss": loss, "method": method, "setting": setting,
                          "dataset": dataset, "metric": metric, "baseline": baseline, "pairs": len(both),
                          "difference": diff, "low": diff - half, "high": diff + half, "p_t": p_t, "boot_difference": math.nan, "boot_low": math.nan,
                          "boot_high": math.nan, "p_boot": math.nan, "boot_queries": 0, "boot_pooling": "",
                          "boot_missing": ""}
                if per_query is not None:
                    record.update(_bootstrap(row, base, both, metric, arrays, per_query_values, resamples))
                out.append(record)
    return pd.DataFrame(out, columns=TEST_COLUMNS)


def has_per_query_values(metric: str) -> bool:
    """Whether stored per-query results give ``metric`` query by query
    (:func:`harness.components.evaluation.per_query_values`): P@1, Recall@K and the
    scores kept per query; not the clustering metrics."""
    from harness.components.evaluation import PER_QUERY_SCORES

    recall_k = metric.startswith("recall_at_") and metric.removeprefix("recall_at_").isdigit()
    return metric == "precision_at_1" or recall_k or metric in PER_QUERY_SCORES


def _bootstrap(row: pd.DataFrame, base: pd.DataFrame, seeds: list, metric: str, arrays, values_of,
               resamples: int) -> dict:
    """The ``boot_*`` fields of one comparison: {} when the stored arrays cannot give the
    metric or disagree on the queries; ``boot_missing`` when a run's per-query results are
    missing."""
    pairs, missing = [], []
    for seed in seeds:
        ours, theirs = arrays(row.at[seed, "run_id"]), arrays(base.at[seed, "run_id"])
        missing += [rid for rid, got in ((row.at[seed, "run_id"], ours), (base.at[seed, "run_id"], theirs))
                    if got is None]
        if ours is None or theirs is None:
            continue
        a, b = values_of(ours, metric), values_of(theirs, metric)
        labels = ours["label"][ours["num_relevant"] > 0]
        if a is None or b is None or a.shape != b.shape or not np.array_equal(
                labels, theirs["label"][theirs["num_relevant"] > 0]):
            return {}
        pairs.append((a * 100, b * 100, labels))
    if missing:
        return {"boot_missing": " ".join(dict.fromkeys(missing))} if has_per_query_values(metric) else {}
    differences, pooling = pool_query_differences(pairs)
    result = paired_bootstrap(differences, resamples=resamples)
    return {"boot_difference": result.mean, "boot_low": result.low, "boot_high": result.high,
            "p_boot": result.p, "boot_queries": result.queries, "boot_pooling": pooling}


def parse_published_row(spec: str) -> tuple[str, str]:
    """``"diablo@entries=16"`` -> ``("diablo", "entries=16")``; no ``@``: the empty setting."""
    method, _, setting = spec.partition("@")
    if not method:
        raise HarnessError(f"published row '{spec}' must look like method@setting (setting may be empty)")
    return method, setting


def _select_published_rows(frame: pd.DataFrame, rows: dict[str, Sequence[str]], path: Path) -> pd.DataFrame:
    """Each reproduced method's published rows, renamed to it: ``rows`` maps a reproduced
    method to ``"method@setting"`` specs matched against the CSV's ``method`` and
    ``setting`` columns (a CSV without ``setting`` has the empty one). Rows no spec names
    are dropped; a spec that matches nothing is an error (a typo would drop a column)."""
    setting = frame["setting"].astype(str) if "setting" in frame else pd.Series("", index=frame.index)
    picked = []
    for reproduced, specs in rows.items():
        for spec in specs:
            method, wanted = parse_published_row(spec)
            match = frame[(frame["method"] == method) & (setting == wanted)]
            if match.empty:
                known = sorted({f"{m}@{s}" for m, s in zip(frame["method"], setting, strict=True)})
                raise HarnessError(f"{path} has no row '{spec}' (for {reproduced}) in the chosen tables; "
                                   f"rows there: {', '.join(known)}")
            picked.append(match.assign(method=reproduced))
    return pd.concat(picked, ignore_index=True) if picked else frame.iloc[0:0]


def published_dir() -> Path:
    """The transcribed published numbers: ``results/published/`` of the source checkout
    (the source of truth), else the copy a wheel installs as package data
    (``harness/_published``, mapped in pyproject.toml)."""
    package = Path(__file__).resolve().parents[1]  # harness/
    checkout = package.parent / "results" / "published"
    return checkout if checkout.is_dir() else package / "_published"


def locate_published(path: Path | str) -> Path:
    """``path`` as given when it exists; else a relative ``results/published/<name>.csv``
    (what grids name) or a bare ``<name>.csv`` / ``<name>`` from :func:`published_dir`, so
    tables work from any working directory and from an installed package."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    parts = path.parts
    if parts[:2] == ("results", "published") or len(parts) == 1:
        shipped = published_dir() / Path(parts[-1]).with_suffix(".csv").name
        if shipped.is_file():
            return shipped
    return path


#: Flags a published row's ``notes`` may start with (``flag: why``). ``column_mislabelled``:
#: the printed column's heading names another metric than its values are (kept in the CSV
#: as printed, never compared). ``ksweep``: computed by a path of the authors' code that
#: differs from the method's definition (compared, and the table's footnote says so).
EXCLUDED_FLAGS = ("column_mislabelled",)
FOOTNOTED_FLAGS = ("ksweep",)


def _note_flag(note: str) -> str:
    head = note.split(":", 1)[0].strip()
    return head if head in (*EXCLUDED_FLAGS, *FOOTNOTED_FLAGS) else ""


def _drop_excluded(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Rows flagged ``column_mislabelled`` out, with one line on stderr naming them; the
    descriptions stay in ``frame.attrs["excluded"]`` for the table's footnote."""
    notes = frame["notes"] if "notes" in frame.columns else pd.Series("", index=frame.index)
    flags = notes.map(_note_flag)
    excluded = frame[flags.isin(EXCLUDED_FLAGS)]
    kept = frame[~flags.isin(EXCLUDED_FLAGS)].copy()
    kept["note"] = [n if _note_flag(n) else "" for n in notes[kept.index]]
    described = sorted({f"{r['method']} {r['dataset']} {r['metric']} (table {r['table']}): {r['notes']}"
                        for _, r in excluded.iterrows()})
    if described:
        print(f"tables: {len(excluded)} published value(s) of {Path(path).name} not compared: "
              + "; ".join(described), file=sys.stderr)
    kept.attrs["excluded"] = described
    return kept


def load_published(path: Path, tables: Iterable[str] | None = None,
                   rows: dict[str, Sequence[str]] | None = None) -> pd.DataFrame:
    """The transcribed CSV (``table,backbone,loss,method,dataset,metric,value``), filtered.

    ``rows`` (a grid's ``[published] rows``): ``{reproduced method: ["method@setting"]}``,
    the published rows beside each reproduced method, told apart by the CSV's ``setting``
    column (e.g. DIABLO's N = 8 and N = 16 rows of one loss); without it every row keeps
    its own method and the ``setting`` column is not read.

    A row whose ``notes`` start with ``column_mislabelled:`` is left out (one line on
    stderr; ``attrs["excluded"]``); the ``note`` column keeps the other flagged notes
    (``ksweep: ...``) for the table's footnotes."""
    path = locate_published(path)
    if not Path(path).is_file():
        raise HarnessError(f"published table file not found: {path}")
    frame = pd.read_csv(path, dtype={"table": str}, keep_default_na=False)
    missing = {"table", *KEYS, "metric", "value"} - set(frame.columns)
    if missing:
        raise HarnessError(f"{path} lacks the columns {', '.join(sorted(missing))}")
    if tables:
        wanted = [str(t) for t in tables]
        unknown = sorted(set(wanted) - set(frame["table"]))
        if unknown:
            raise HarnessError(f"{path} has no table {', '.join(unknown)}; tables there: "
                               f"{', '.join(sorted(set(frame['table'])))}")
        frame = frame[frame["table"].isin(wanted)]
    if rows:
        frame = _select_published_rows(frame, rows, path)
    frame = _drop_excluded(frame, path)
    twice = frame[frame.duplicated([*KEYS, "metric"], keep=False)]
    if not twice.empty:
        first = twice.iloc[0]
        others = [c for c in frame.columns if c not in (*KEYS, "metric", "value", "note")]
        raise HarnessError(
            f"{path} holds several values for one cell, e.g. {first['method']} + {first['loss']} on "
            f"{first['dataset']}, {first['metric']} ({len(twice)} rows in tables "
            f"{', '.join(sorted(set(twice['table'])))} differ only in {', '.join(others)}); "
            f"choose one table with --table, or name the rows beside each method with --published-row "
            f"(a grid's [published] rows)")
    out = frame[[*KEYS, "metric", "value", "note"]].astype({"value": float}).reset_index(drop=True)
    out.attrs["excluded"] = frame.attrs.get("excluded", [])
    return out


def attach_published(cells: pd.DataFrame, published: pd.DataFrame | None) -> pd.DataFrame:
    """Outer-join reproduced cells with published values (column ``published``), so a
    published row without runs still appears (reproduced mean NaN). A published value
    sits beside every setting of its method."""
    if published is None or published.empty:
        out = cells.copy()
        out["published"] = math.nan
        return out[CELL_COLUMNS]
    pub = published.rename(columns={"value": "published"})
    if cells.empty:
        out = pub.assign(setting="", mean=math.nan, half_width=math.nan, std=math.nan, n=0, flagged=False,
                         code_flagged=False)
    else:
        out = pub.merge(cells, on=[*KEYS, "metric"], how="outer")
    out["setting"] = out["setting"].fillna("")
    out["n"] = out["n"].fillna(0).astype(int)
    for flag in ("flagged", "code_flagged"):
        out[flag] = out[flag].astype("boolean").fillna(False).astype(bool)
    return out[CELL_COLUMNS].reset_index(drop=True)


# ---------------------------------------------------------------------- rendering


def _order(values: Iterable, known: Sequence = ()) -> list:
    """Distinct values: those in ``known`` first in its order, then the rest as they appear."""
    seen = list(dict.fromkeys(v for v in values if isinstance(v, str | tuple)))
    rank = {v: i for i, v in enumerate(known)}
    return sorted(seen, key=lambda v: (rank.get(v, len(rank)), seen.index(v)))


def _layout(cells: pd.DataFrame, metrics: Sequence[str] | None, baseline: str):
    """Row blocks, rows (method, setting) and (dataset, metric) columns: the known labels'
    order, then first appearance (methods: :func:`_method_order`)."""
    if cells.empty:
        raise HarnessError("nothing to tabulate: no finished runs and no published values")
    backbones, losses = _order(cells["backbone"], list(BACKBONE_LABELS)), _order(cells["loss"], list(LOSS_LABELS))
    blocks = _order(zip(cells["backbone"], cells["loss"], strict=True),
                    [(b, lo) for b in backbones for lo in losses])
    methods = _order(cells["method"], _method_order(baseline))
    rows = sorted(dict.fromkeys(zip(cells["method"], cells["setting"], strict=True)),
                  key=lambda r: (methods.index(r[0]), r[1] != "", r[1]))
    datasets = _order(cells["dataset"], list(DATASET_LABELS))
    present = _order(cells["metric"])
    metric_order = [m for m in (metrics or present) if m in present]
    columns = [(d, m) for d in datasets for m in metric_order
               if ((cells["dataset"] == d) & (cells["metric"] == m)).any()]
    return blocks, rows, datasets, columns


def _cell_key(row) -> tuple:
    return (row["backbone"], row["loss"], row["method"], row["setting"], row["dataset"], row["metric"])


def _best(cells: pd.DataFrame) -> tuple[set[tuple], set[tuple]]:
    """``(bold, tied)`` cell keys per block and column. Only rows with an interval (n >= 2)
    compete, and only when at least two do. The best mean is bold when its interval lies
    above every other row's (lower end above their upper ends); otherwise it and every row
    whose interval reaches its interval are tied."""
    bold, tied = set(), set()
    have = cells.dropna(subset=["mean", "half_width"])
    for _, group in have.groupby([*BLOCK, "metric"], sort=False):
        if len(group) < 2:
            continue
        top = group.loc[group["mean"].idxmax()]
        reach = group[(group.index != top.name)
                      & (group["mean"] + group["half_width"] >= top["mean"] - top["half_width"])]
        if reach.empty:
            bold.add(_cell_key(top))
        else:
            tied.update(_cell_key(r) for _, r in pd.concat([top.to_frame().T, reach]).iterrows())
    return bold, tied


def _fmt(value: float) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


MARKS = {  # (markdown, LaTeX)
    "flagged": ("†", "$^\\dagger$"), "code": ("§", "$^\\S$"), "tied": ("≈", "$^{\\approx}$"),
    "t_up": ("↑", "$^{\\uparrow}$"), "t_down": ("↓", "$^{\\downarrow}$"),
    "boot_up": ("⇑", "$^{\\Uparrow}$"), "boot_down": ("⇓", "$^{\\Downarrow}$"),
    "incomplete": ("‡", "$^{\\ddagger}$"),
}


def _mark(name: str, latex: bool) -> str:
    return MARKS[name][int(latex)]


def _test_marks(test: pd.Series | None, latex: bool) -> str:
    if test is None:
        return ""
    marks = ""
    if not math.isnan(test["p_t"]) and test["p_t"] < SIGNIFICANCE:
        marks += _mark("t_up" if test["difference"] > 0 else "t_down", latex)
    if not math.isnan(test["p_boot"]) and test["p_boot"] < SIGNIFICANCE:
        marks += _mark("boot_up" if test["boot_difference"] > 0 else "boot_down", latex)
    if test.get("boot_missing", ""):
        marks += _mark("incomplete", latex)
    return marks


def _cell_text(row: pd.Series | None, bold: bool, *, latex: bool, tied: bool = False,
               test: pd.Series | None = None) -> str:
    """``mean ± half-width`` (bold when best beyond the intervals), its marks (tie, paired
    tests, deviations, evaluation code), ``n``, then ``/ published (difference)``."""
    dash = "--" if latex else "–"
    if row is None:
        return dash
    mean, half, pub = row["mean"], row["half_width"], row["published"]
    if math.isnan(mean):
        ours = dash
    else:
        ours = _fmt(mean)
        if bold:
            ours = f"\\textbf{{{ours}}}" if latex else f"**{ours}**"
        if not math.isnan(half):
            ours += f"$\\pm${half:.2f}" if latex else f" ± {half:.2f}"
        ours += _mark("tied", latex) if tied else ""
        ours += _test_marks(test, latex)
        ours += _mark("flagged", latex) if bool(row["flagged"]) else ""
        ours += _mark("code", latex) if bool(row["code_flagged"]) else ""
        ours += f"$_{{n={row['n']}}}$" if latex else f" (n={row['n']})"
    if math.isnan(pub):
        return ours
    diff = "" if math.isnan(mean) else f" ({round(mean, 2) - pub:+.2f})"
    return f"{ours} / {pub:.2f}{diff}"


def _footnotes(cells: pd.DataFrame, deviations: Sequence[str], latex: bool, tests: pd.DataFrame | None,
               notes: Sequence[str], labels: Mapping[str, str]) -> list[str]:
    pm, pct, lt = ("$\\pm$", "\\%", "$<$") if latex else ("±", "%", "<")
    formula = ("$t_{0.975,\\,n-1}\\,s/\\sqrt{n}$, $s$ the sample standard deviation" if latex
               else "t(0.975, n-1) s / sqrt(n), s the sample std")
    ttest = "ttest\\_rel" if latex else "ttest_rel"
    published = ""
    if cells["published"].notna().any():
        published = ("; a row \\emph{published} beneath a method: the paper's value, reproduced minus published in "
                     "parentheses" if latex else " / published value (reproduced minus published)")
    seeds = "$n$: the number of seeds (its column)" if latex else "n: the number of seeds"
    few = "$n < 2$" if latex else "n < 2"
    significant = f"$p < {SIGNIFICANCE}$" if latex else f"p < {SIGNIFICANCE}"
    out = [f"Cells: mean over seeds {pm} half-width of the 95{pct} Student t-interval over seeds "
           f"({formula}), in percent; {seeds}{published}. "
           f"Bold: the best mean of its block and column when its interval lies above every other row's; "
           f"{_mark('tied', latex)}: tied for best (the intervals overlap the best one's). Cells with {few} "
           f"have no interval and are neither."]
    if tests is not None and not tests.empty:
        baseline = labels[tests["baseline"].iloc[0]]
        boot = tests[tests["boot_queries"] > 0]
        text = (f"{_mark('t_up', latex)}/{_mark('t_down', latex)}: above/below the block's baseline row "
                f"({baseline}) in a paired t-test over seeds (same seed: same split and initialisation; "
                f"scipy.stats.{ttest}, two-sided), {significant}.")
        if not boot.empty:
            pooling = ", ".join(sorted(set(boot["boot_pooling"])))
            text += (f" {_mark('boot_up', latex)}/{_mark('boot_down', latex)}: the same in a paired bootstrap "
                     f"over test queries (per-query differences {pooling}; 10,000 resamples, seed 0, "
                     f"percentile interval), {significant}.")
        out.append(text + " Differences and p-values: the table of paired tests.")
        if "boot_missing" in tests and (tests["boot_missing"] != "").any():
            runs = len({r for ids in tests["boot_missing"] for r in ids.split()})
            out.append(f"{_mark('incomplete', latex)}: paired bootstrap over test queries not computed: the "
                       f"per-query results of {runs} run(s) are missing (harness table names each run and "
                       f"what is missing on stderr).")
    out += [_latex_escape(n) if latex else n for n in notes]
    if cells["flagged"].any():
        what = "; ".join(deviations) if deviations else "see the runs' deviations tags"
        what = _latex_escape(what) if latex else what
        out.append(f"{_mark('flagged', latex)} runs with protocol deviations or test-set model selection ({what}).")
    return out


def _rows(cells: pd.DataFrame, metrics: Sequence[str] | None, tests: pd.DataFrame | None, baseline: str):
    blocks, rows, datasets, columns = _layout(cells, metrics, baseline)
    bold, tied = _best(cells)
    index = {_cell_key(r._asdict()): r for r in cells.itertuples(index=False)}
    test_index = {} if tests is None else {_cell_key(t._asdict()): t for t in tests.itertuples(index=False)}
    body = []
    for backbone, loss in blocks:
        in_block = cells[(cells["backbone"] == backbone) & (cells["loss"] == loss)]
        present = set(zip(in_block["method"], in_block["setting"], strict=True))
        block_rows = []
        for method, setting in [r for r in rows if r in present]:
            row = []
            for dataset, metric in columns:
                key = (backbone, loss, method, setting, dataset, metric)
                rec, test = index.get(key), test_index.get(key)
                row.append(dict(row=None if rec is None else pd.Series(rec._asdict()), bold=key in bold,
                                tied=key in tied, test=None if test is None else pd.Series(test._asdict())))
            block_rows.append(((method, setting), row))
        body.append(((backbone, loss), block_rows))
    return body, datasets, columns


def block_label(backbone: str, loss: str) -> str:
    """A block's heading: ``ResNet-50 + Margin``."""
    return f"{_label(BACKBONE_LABELS, backbone)} + {_label(LOSS_LABELS, loss)}"


def row_label(method: str, setting: str, labels: Mapping[str, str]) -> str:
    """The paper's label for a method's row (``labels``, :func:`method_labels`); the method's
    registered name and what tells the row apart when it has a setting (a paper label may
    name an option, "N = 8")."""
    return f"{method} [{setting}]" if setting else labels[method]


_LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                   "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                   "<": r"\textless{}", ">": r"\textgreater{}", "§": r"\S{}",
                   # characters the notes may hold that pdflatex has no glyph for by default
                   "–": "--", "—": "---", "×": r"$\times$", "≤": r"$\le$", "≥": r"$\ge$", "±": r"$\pm$",
                   "→": r"$\to$", "≈": r"$\approx$", "Δ": r"$\Delta$", "λ": r"$\lambda$", "·": r"$\cdot$",
                   "†": r"$^\dagger$", "‡": r"$^\ddagger$", "’": "'", "“": "``", "”": "''"}


def _latex_escape(text: str) -> str:
    """Plain text to LaTeX: every special character escaped, ``->`` as an arrow."""
    return r"$\to$".join("".join(_LATEX_SPECIALS.get(ch, ch) for ch in part) for part in text.split("->"))


def _p(value: float) -> str:
    return "–" if math.isnan(value) else ("<0.001" if value < 0.001 else f"{value:.3f}")


def _interval(mean: float, low: float, high: float, *, latex: bool) -> str:
    """``+1.25 [-0.50, +3.00]``; the mean alone when there is no interval."""
    if math.isnan(low) or math.isnan(high):
        return _signed(mean, latex)
    return f"{_signed(mean, latex)} [{_signed(low, latex)}, {_signed(high, latex)}]"


def _p_latex(value: float) -> str:
    return "--" if math.isnan(value) else _p(value).replace("<", "$<$")


def _test_rows(tests: pd.DataFrame, labels: Mapping[str, str]) -> list[list[str]]:
    """Plain-text rows of the paired-tests table."""
    rows = []
    for t in tests.itertuples(index=False):
        boot = ("–" if t.boot_queries == 0 else
                f"{t.boot_difference:+.2f} [{t.boot_low:+.2f}, {t.boot_high:+.2f}] (Q={t.boot_queries})")
        rows.append([f"{_label(BACKBONE_LABELS, t.backbone)} + {_label(LOSS_LABELS, t.loss)}",
                     _label(DATASET_LABELS, t.dataset), _label(METRIC_LABELS, t.metric),
                     f"{row_label(t.method, t.setting, labels)} vs {labels[t.baseline]}", str(t.pairs),
                     _interval(t.difference, t.low, t.high, latex=False), _p(t.p_t), boot, _p(t.p_boot)])
    return rows


TEST_HEADER = ["Block", "Dataset", "Metric", "Comparison", "Seeds", "Δ (seeds) [95% CI]", "p (paired t)",
               "Δ over queries [95% CI]", "p (bootstrap)"]


#: What a LaTeX table needs in the preamble (written in its comment header).
LATEX_PACKAGES = ("booktabs",)
#: ``\textwidth`` of a standard one-column ``article`` (10pt, letter or A4 paper): the
#: narrowest text block a table must fit; a two-column article's (``table*``) is 469pt.
TEXT_WIDTH_PT = 345.0
#: Widths at ``\footnotesize`` (cmr8, in pt) of what cells print, for :func:`_text_pt`;
#: a mark is a superscript symbol; ``\tabcolsep`` is 6pt on each side of a column.
_GLYPH_PT = {**dict.fromkeys("0123456789", 4.25), ".": 2.4, " ": 2.8, "(": 3.3, ")": 3.3, "±": 6.6, "+": 6.6,
             "-": 6.6}
_LETTER_PT, _MARK_PT, _COLSEP_PT = 4.6, 4.5, 12.0


def _text_pt(text: str) -> float:
    return sum(_GLYPH_PT.get(ch, _LETTER_PT) for ch in text)


def _signed(value: float, latex: bool) -> str:
    """``+1.25`` / ``-1.25``, with LaTeX's plus and minus signs (not a hyphen) in LaTeX."""
    text = f"{value:+.2f}"
    return f"${text[0]}${text[1:]}" if latex else text


def _latex_header(caption: str) -> list[str]:
    return [f"% {caption}" if caption else "% Table from the harness's tracking store",
            "% Needs in the preamble: " + " ".join(f"\\usepackage{{{p}}}" for p in LATEX_PACKAGES),
            f"% Each tabular fits \\textwidth of a one-column article ({TEXT_WIDTH_PT:.0f}pt) and spans both "
            f"columns of a two-column one (table*); text at \\footnotesize."]


def _latex_reproduced(c: dict) -> str:
    """A reproduced cell: mean (bold when best beyond the intervals) +- half-width and its marks."""
    row = c["row"]
    if row is None or math.isnan(row["mean"]):
        return "--"
    text = _fmt(row["mean"])
    text = f"\\textbf{{{text}}}" if c["bold"] else text
    if not math.isnan(row["half_width"]):
        text += f"$\\pm${row['half_width']:.2f}"
    marks = (_mark("tied", True) if c["tied"] else "") + _test_marks(c["test"], True)
    marks += (_mark("flagged", True) if bool(row["flagged"]) else "") + (_mark("code", True) if bool(row["code_flagged"]) else "")
    return text + marks


def _latex_published(c: dict) -> str:
    """A published cell: the value, and reproduced minus published in parentheses."""
    row = c["row"]
    if row is None or math.isnan(row["published"]):
        return "--"
    if math.isnan(row["mean"]):
        return f"{row['published']:.2f}"
    return f"{row['published']:.2f} ({_signed(round(row['mean'], 2) - row['published'], True)})"


def _estimated_width(cell: dict) -> float:
    """The printed width of a cell's widest line (pt), from its characters' widths."""
    row = cell["row"]
    if row is None:
        return _text_pt("--")
    marks = _latex_reproduced(cell).count("$^")
    ours = _text_pt(f"{row['mean']:.2f}±{row['half_width']:.2f}") + marks * _MARK_PT if not math.isnan(row["mean"]) else 0
    theirs = _text_pt(f"{row['published']:.2f} (+{abs(row['mean'] - row['published']):.2f})") \
        if not math.isnan(row["published"]) and not math.isnan(row["mean"]) else _text_pt(f"{row['published']:.2f}")
    return max(ours, theirs)


def _latex_chunks(body, columns, labels: Mapping[str, str]) -> list[list[int]]:
    """Column indices of each tabular: one dataset per tabular, its metrics split so that
    every tabular fits :data:`TEXT_WIDTH_PT` (by :func:`_estimated_width`)."""
    label = max([_text_pt(row_label(m, s, labels)) for _, rows in body for (m, s), _ in rows]
                + [_text_pt("published") + 10.0])  # the published rows' label is indented by \quad
    fixed = label + _text_pt("2--3") + 2 * _COLSEP_PT  # the label and n columns
    widths = [max([_estimated_width(row[i]) for _, rows in body for _, row in rows] + [_text_pt("MAP@R")]) + _COLSEP_PT
              for i in range(len(columns))]
    def fits(part: list[int]) -> bool:
        return fixed + sum(widths[j] for j in part) <= TEXT_WIDTH_PT

    chunks: list[list[int]] = []
    for dataset in dict.fromkeys(d for d, _ in columns):
        indices = [i for i, (d, _) in enumerate(columns) if d == dataset]
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


def _seed_counts(row: list[dict], chunk: list[int]) -> str:
    counts = sorted({int(row[i]["row"]["n"]) for i in chunk if row[i]["row"] is not None and row[i]["row"]["n"]})
    return "--" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}--{counts[-1]}"


def _latex_tabular(body, columns, chunk: list[int], labels: Mapping[str, str]) -> list[str]:
    """One dataset's tabular: a row per method (mean +- half-width and marks, n) and, where
    published values exist, a row of them with the difference beneath it."""
    dataset = _latex_escape(_label(DATASET_LABELS, columns[chunk[0]][0]))
    width = 2 + len(chunk)
    lines = [f"\\begin{{tabular}}{{@{{}}lc{'c' * len(chunk)}@{{}}}}", "\\toprule",
             f" & & \\multicolumn{{{len(chunk)}}}{{c}}{{{dataset}}} \\\\",
             f"\\cmidrule(l){{3-{width}}}",
             " & ".join(["Method", "$n$", *(_latex_escape(_label(METRIC_LABELS, columns[i][1])) for i in chunk)]) + " \\\\"]
    for (backbone, loss), rows in body:
        shown = [(key, row) for key, row in rows if any(row[i]["row"] is not None for i in chunk)]
        if not shown:
            continue
        lines.append("\\midrule")
        title = f"{_label(BACKBONE_LABELS, backbone)} + {_label(LOSS_LABELS, loss)}"
        lines.append(f"\\multicolumn{{{width}}}{{@{{}}l}}{{\\emph{{{_latex_escape(title)}}}}} \\\\")
        for (method, setting), row in shown:
            label = _latex_escape(row_label(method, setting, labels))
            lines.append(" & ".join([label, _seed_counts(row, chunk), *(_latex_reproduced(row[i]) for i in chunk)])
                         + " \\\\")
            if any(row[i]["row"] is not None and not math.isnan(row[i]["row"]["published"]) for i in chunk):
                lines.append(" & ".join(["\\quad published", "", *(_latex_published(row[i]) for i in chunk)])
                             + " \\\\")
    return [*lines, "\\bottomrule", "\\end{tabular}"]


def render_latex(cells: pd.DataFrame, *, metrics: Sequence[str] | None = None, caption: str = "",
                 deviations: Sequence[str] = (), tests: pd.DataFrame | None = None,
                 notes: Sequence[str] = (), labels: Mapping[str, str] | None = None,
                 baseline: str = "plain") -> str:
    """Cells (``CELL_COLUMNS``) and paired tests (``TEST_COLUMNS``) -> booktabs LaTeX that
    drops into a paper: a comment header naming the packages it needs
    (:data:`LATEX_PACKAGES`), then one ``table*`` per dataset (its metrics split further
    when they would not fit :data:`TEXT_WIDTH_PT`) with the footnotes under the last, then
    the paired tests (:func:`render_latex_tests`), rows in the same order. ``labels``: row
    labels by method (:func:`method_labels`; the plugins' defaults where missing);
    ``baseline``: the method whose row leads each block (the paired tests' baseline)."""
    labels = _all_labels(cells, tests, labels)
    base = _baseline(tests, baseline)
    body, _, columns = _rows(cells, metrics, tests, base)
    chunks = _latex_chunks(body, columns, labels)
    lines = _latex_header(caption)
    for k, chunk in enumerate(chunks):
        dataset = columns[chunk[0]][0]
        same = [c for c in chunks if columns[c[0]][0] == dataset]  # a dataset split into parts
        part = f" ({_label(DATASET_LABELS, dataset)}{'' if len(same) == 1 else f', part {same.index(chunk) + 1} of {len(same)}'})"
        lines += ["", "\\begin{table*}[tp]", "\\centering", "\\footnotesize",
                  f"\\caption{{{_latex_escape((caption or 'Reproduced results') + part)}}}",
                  *_latex_tabular(body, columns, chunk, labels)]
        if k == len(chunks) - 1:
            lines += [f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\footnotesize {note}}}"
                      for note in _footnotes(cells, deviations, True, tests, notes, labels)]
        lines.append("\\end{table*}")
    if tests is not None and not tests.empty:
        lines += render_latex_tests(ordered_tests(tests, cells, metrics, base), labels, caption)
    return "\n".join(lines) + "\n"


def render_latex_tests(tests: pd.DataFrame, labels: Mapping[str, str], caption: str = "") -> list[str]:
    """The paired tests as one ``table*`` per dataset: per block and comparison, for each
    metric the seeds, the mean paired difference (percent points) with its 95% t-interval
    and the t-test's p, and the bootstrap difference over queries with its 95% interval and p."""
    lines = []
    head = ["Metric", "$n$", "$\\Delta$ [95\\% CI]", "$p$", "$\\Delta_q$ [95\\% CI]", "$p_q$"]
    for dataset, part in tests.groupby("dataset", sort=False):
        name = _latex_escape(_label(DATASET_LABELS, dataset))
        title = "Paired tests against the baseline row" + (f" ({caption})" if caption else "")
        queries = sorted(set(part.loc[part["boot_queries"] > 0, "boot_queries"]))
        lines += ["", "\\begin{table*}[tp]", "\\centering", "\\footnotesize", "\\setlength{\\tabcolsep}{4pt}",
                  f"\\caption{{{_latex_escape(title)}: {name}}}",
                  f"\\begin{{tabular}}{{@{{}}l{'c' * (len(head) - 1)}@{{}}}}", "\\toprule", " & ".join(head) + " \\\\"]
        for (backbone, loss, method, setting), rows in part.groupby(["backbone", "loss", "method", "setting"],
                                                                    sort=False):
            block = f"{_label(BACKBONE_LABELS, backbone)} + {_label(LOSS_LABELS, loss)}"
            versus = f"{row_label(method, setting, labels)} vs {labels[rows['baseline'].iloc[0]]}"
            lines += ["\\midrule", f"\\multicolumn{{{len(head)}}}{{@{{}}l}}{{\\emph{{{_latex_escape(block)}}}: "
                                   f"{_latex_escape(versus)}}} \\\\"]
            for t in rows.itertuples(index=False):
                boot = "--" if t.boot_queries == 0 else _interval(t.boot_difference, t.boot_low, t.boot_high, latex=True)
                if t.boot_queries and len(queries) > 1:
                    boot += f" ($Q$={t.boot_queries})"
                lines.append(" & ".join([_latex_escape(_label(METRIC_LABELS, t.metric)), str(t.pairs),
                                         _interval(t.difference, t.low, t.high, latex=True), _p_latex(t.p_t), boot,
                                         _p_latex(t.p_boot)]) + " \\\\")
        over = f"$Q$ = {queries[0]} test queries" if len(queries) == 1 else "$Q$ test queries"
        lines += ["\\bottomrule", "\\end{tabular}",
                  "\\par\\smallskip\\parbox{\\linewidth}{\\footnotesize $n$: seeds both rows have; $\\Delta$, $p$: "
                  "mean paired difference over seeds (percent points), its 95\\% Student t-interval and the paired "
                  f"t-test; $\\Delta_q$, $p_q$: the paired bootstrap over {over} (10,000 resamples, percentile "
                  "interval); --: not computed (a clustering metric, or per-query results missing).}", "\\end{table*}"]
    return lines


def ordered_tests(tests: pd.DataFrame, cells: pd.DataFrame, metrics: Sequence[str] | None,
                  baseline: str) -> pd.DataFrame:
    """The paired tests in the main table's order: dataset, block, row, metric."""
    if tests is None or tests.empty:
        return tests
    blocks, rows, datasets, columns = _layout(cells, metrics, baseline)
    metric_order = list(dict.fromkeys(m for _, m in columns))

    def rank(values: Sequence, value) -> int:
        return values.index(value) if value in values else len(values)

    keys = [(rank(datasets, t.dataset), rank(blocks, (t.backbone, t.loss)), rank(rows, (t.method, t.setting)),
             rank(metric_order, t.metric)) for t in tests.itertuples(index=False)]
    order = sorted(range(len(tests)), key=lambda i: keys[i])
    return tests.iloc[order].reset_index(drop=True)


def render_markdown(cells: pd.DataFrame, *, metrics: Sequence[str] | None = None, caption: str = "",
                    deviations: Sequence[str] = (), tests: pd.DataFrame | None = None,
                    notes: Sequence[str] = (), labels: Mapping[str, str] | None = None,
                    baseline: str = "plain") -> str:
    """Cells (``CELL_COLUMNS``) and paired tests (``TEST_COLUMNS``) -> GitHub Markdown:
    the comparison with footnotes, then the paired tests (``labels``, ``baseline``: as
    :func:`render_latex`)."""
    labels = _all_labels(cells, tests, labels)
    body, _, columns = _rows(cells, metrics, tests, _baseline(tests, baseline))
    header = ["Method", *(f"{_label(DATASET_LABELS, d)} {_label(METRIC_LABELS, m)}" for d, m in columns)]
    lines = [f"**{caption}**", ""] if caption else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join([":---", *[":---:"] * len(columns)]) + "|"]
    for (backbone, loss), rows in body:
        title = f"{_label(BACKBONE_LABELS, backbone)} + {_label(LOSS_LABELS, loss)}"
        lines.append("| " + " | ".join([f"*{title}*", *[""] * len(columns)]) + " |")
        for (method, setting), row in rows:
            lines.append("| " + " | ".join([row_label(method, setting, labels),
                                            *(_cell_text(c["row"], c["bold"], latex=False, tied=c["tied"],
                                                         test=c["test"]) for c in row)]) + " |")
    for note in _footnotes(cells, deviations, False, tests, notes, labels):  # one paragraph each
        lines += ["", note]
    if tests is not None and not tests.empty:
        lines += ["", "**Paired tests against the baseline row**", "",
                  "| " + " | ".join(TEST_HEADER) + " |", "|" + "|".join([":---"] * 4 + [":---:"] * 5) + "|"]
        ordered = ordered_tests(tests, cells, metrics, _baseline(tests, baseline))
        lines += ["| " + " | ".join(r) + " |" for r in _test_rows(ordered, labels)]
    return "\n".join(lines) + "\n"


def _all_labels(cells: pd.DataFrame, tests: pd.DataFrame | None, given: Mapping[str, str] | None) -> dict[str, str]:
    """``given`` labels, completed with the plugins' default ones for every other method
    the cells and tests name."""
    named = set(cells["method"].dropna()) | (set() if tests is None else set(tests["baseline"]))
    return {**method_labels(sorted(named - set(given or {}))), **(given or {})}


def _baseline(tests: pd.DataFrame | None, default: str) -> str:
    return str(tests["baseline"].iloc[0]) if tests is not None and not tests.empty else default


def write_atomic(path: Path, text: str) -> None:
    """Write a table atomically (see :mod:`harness.base.atomic`)."""
    from harness.base.atomic import atomic_write_text

    atomic_write_text(path, text)


# ---------------------------------------------------------------------------- CLI


SELECTION_TEXT = {"validation": "the epoch with the best validation {metric}, on a class-disjoint validation "
                                "split of {fraction} of the training classes (trained on the rest)",
                  "test-paper": "the epoch with the best TEST-set score (the papers' released code; "
                                "optimistic)",
                  "last": "the last epoch"}


def selection_notes(runs: pd.DataFrame, published: Path | None) -> list[str]:
    """How the reproduced numbers were selected (from the runs' ``selection`` tags) against
    how the published ones were: the ``published_selection`` of the paper whose plugin is
    registered under the published CSV's name (:class:`methods.PaperInfo`)."""
    notes = []
    if not runs.empty:
        parts = []
        for mode in _order(runs["selection"]):
            these = runs[runs["selection"] == mode]
            fractions = sorted({f for f in these.get("validation_classes", []) if f})
            fraction = f"{float(fractions[0]):.0%}" if len(fractions) == 1 else "a fraction"
            chosen = sorted({m for m in these.get("selection_metric", []) if m})
            metric = _label(METRIC_LABELS, chosen[0]) if len(chosen) == 1 else "score"
            parts.append(SELECTION_TEXT.get(mode, mode).format(metric=metric, fraction=fraction))
        notes.append("Model selection of the reproduced numbers: " + "; ".join(parts) + ".")
    if published is not None:
        from methods import METHODS

        stem = Path(published).stem
        paper = METHODS.get(stem).cls.paper if stem in METHODS else None
        if paper is not None and paper.published_selection:
            notes.append(f"Published numbers: {paper.published_selection}.")
    return notes


def code_notes(runs: pd.DataFrame) -> list[str]:
    codes = runs["evaluation_code"] if "evaluation_code" in runs else pd.Series("", index=runs.index)
    distinct = sorted(set(codes) - {""})
    missing = int((codes == "").sum())
    if len(distinct) <= 1 and not missing:
        return []
    what = []
    if len(distinct) > 1:
        what.append(f"its runs were scored by different evaluation code ({', '.join(distinct)})")
    if missing:
        what.append(f"{missing} run(s) lack the evaluation_code tag (older harness)")
    return [f"§ block where {' and '.join(what)}: its rows may differ by more than the method."]


def variant_notes(metrics: Sequence[str], metric_map: dict[str, str]) -> list[str]:
    if not any(m.endswith("_query_in_r") for m in [*metrics, *metric_map.values()]):
        return []
    text = ("RP (query in R), MAP@R (query in R): DIML's released evaluation (wl-zhao/DIML evaluation/metrics.py), "
            "R = the class size with the query itself counted, from the same ranking as RP and MAP@R "
            "(a perfect ranking scores (n-1)/n).")
    if metric_map:
        text += " The published " + ", ".join(f"{_label(METRIC_LABELS, p)}" for p in metric_map) + \
                " sit beside these variants, as the paper measured them."
    return [text]


@dataclass(frozen=True)
class Table:
    """A rendered table and what it was computed from: ``text`` (LaTeX or Markdown),
    ``tests`` (:func:`paired_tests`, the rows of the paired-tests table), ``labels`` (row
    labels by method) and ``problems`` (one line per run whose results a cell needed
    and did not get: run id and what is missing)."""

    text: str
    tests: pd.DataFrame
    labels: dict[str, str]
    metrics: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


def build_table(experiments: Sequence[str], **options) -> str:
    """Tracking store -> table text (:func:`compose_table`'s, same options)."""
    return compose_table(experiments, **options).text


def compose_table(experiments: Sequence[str], *, fmt: str = "latex", published: Path | None = None,
                  tables: Sequence[str] = (), metrics: Sequence[str] | None = None,
                  caption: str = "", published_rows: dict[str, Sequence[str]] | None = None,
                  baseline: str = "plain", published_metrics: dict[str, str] | None = None,
                  per_query: PerQueryLoader | None = artifact_per_query, resamples: int = 10_000) -> Table:
    """Tracking store -> :class:`Table` (what ``cmd_table`` writes). ``published_metrics``:
    ``{published metric: reproduced metric}`` where a paper defines a metric differently
    (DIML: ``r_precision`` -> ``r_precision_query_in_r``). Each run whose per-query results
    a paired bootstrap needed and did not get is one line on stderr (and in ``problems``)."""
    metric_map = dict(published_metrics or {})
    runs = load_runs(experiments)
    pub = load_published(published, tables, published_rows) if published else None
    excluded = pub.attrs.get("excluded", []) if pub is not None else []
    flagged = [] if pub is None else sorted(set(pub["note"]) - {""})
    if pub is not None and metric_map:
        pub = pub.assign(metric=pub["metric"].map(lambda m: metric_map.get(m, m)))
    wanted = list(metrics) if metrics else (_order(pub["metric"]) if pub is not None else list(DEFAULT_METRICS))
    if pub is not None:
        pub = pub[pub["metric"].isin(wanted)]
    cells = attach_published(summarize(runs, wanted), pub)
    tests = paired_tests(runs, wanted, baseline=baseline, per_query=per_query, resamples=resamples)
    problems = missing_results(runs, tests, explain=artifact_problem if per_query is artifact_per_query else None)
    for line in problems:
        print(f"tables: {line}", file=sys.stderr)
    deviations = sorted({d for d, s in zip(runs["deviations"], runs["test_set_selection"], strict=True)
                         if d != "none"} | ({"test-set model selection"} if runs["test_set_selection"].any() else set()))
    notes = [*selection_notes(runs, published), *variant_notes(wanted, metric_map), *code_notes(runs)]
    if (cells["setting"] != "").any():
        notes.append("[...]: runs of one method that differ in method options, were tuned (harness tune) or "
                     "trained from another run's weights (--init-from) are separate rows, labelled by what differs.")
    render = render_latex if fmt == "latex" else render_markdown
    caption = caption or (f"Reproduced (experiment {', '.join(experiments)})"
                          + (f" vs published (table {', '.join(tables)})" if tables else ""))
    notes += published_notes(excluded, flagged)
    labels = method_labels(sorted(set(cells["method"].dropna()) | {baseline}), recorded_options(runs))
    tests = ordered_tests(tests, cells, wanted, _baseline(tests, baseline))
    text = render(cells, metrics=wanted, caption=caption, deviations=deviations, tests=tests, notes=notes,
                  labels=labels, baseline=baseline)
    text += deviations_block(paper_deviation_notes(runs), latex=fmt == "latex")
    return Table(text=text, tests=tests, labels=_all_labels(cells, tests, labels), metrics=tuple(wanted),
                 problems=tuple(problems))


def artifact_problem(run_id: str) -> str:
    """What is missing of run ``run_id``'s per-query artifact, and where it was looked for."""
    from harness.components.evaluation import PER_QUERY_ARTIFACT
    from harness.store.queries import missing_artifact

    return missing_artifact(run_id, PER_QUERY_ARTIFACT)


def missing_results(runs: pd.DataFrame, tests: pd.DataFrame, *, explain: Callable[[str], str] | None = None) -> list[str]:
    """One line per run whose per-query results a paired bootstrap needed (``boot_missing``):
    the run id, its method, dataset and seed, what is missing (``explain(run_id)``) and the
    cells left without the bootstrap."""
    if tests.empty or "boot_missing" not in tests:
        return []
    owed: dict[str, list[str]] = {}
    for t in tests.itertuples(index=False):
        for run_id in t.boot_missing.split():
            owed.setdefault(run_id, []).append(f"{t.method}{f' [{t.setting}]' if t.setting else ''} "
                                               f"{t.dataset} {_label(METRIC_LABELS, t.metric)}")
    about = runs.set_index("run_id") if "run_id" in runs else pd.DataFrame()
    lines = []
    for run_id, cells in owed.items():
        who = (f" ({about.at[run_id, 'method']}, {about.at[run_id, 'dataset']}, seed {about.at[run_id, 'seed']})"
               if run_id in about.index else "")
        why = (explain(run_id) if explain else "") or "no per-query results"
        lines.append(f"run {run_id}{who}: {why}; no paired bootstrap for "
                     f"{'; '.join(dict.fromkeys(cells))} (marked {_mark('incomplete', False)})")
    return lines


def published_notes(excluded: Sequence[str], flagged: Sequence[str]) -> list[str]:
    """Footnotes for the published values: those left out of the comparison
    (``column_mislabelled``) and each note a published row is flagged with."""
    lines = [f"Published values not compared: {'; '.join(excluded)}."] if excluded else []
    return lines + [f"Published values marked {note}" for note in flagged]


def paper_deviation_notes(runs: pd.DataFrame) -> list[str]:
    """The deviations from a paper or its code that any run of the table records
    (``deviation.<name>`` tags: the protocols' ``[deviations]`` tables, a smoke version's
    settings), one note per reason."""
    found = {name: from_tag(text) for tags in runs.get("paper_deviations", []) for name, text in tags.items()}
    return grouped_notes(found)


def deviations_block(notes: Sequence[str], *, latex: bool) -> str:
    """The last block of every table's text: where its runs depart from the paper or the
    authors' code, one item per reason (empty when none does)."""
    if not notes:
        return ""
    title = "Deviations from the paper or the authors' code"
    if latex:
        # Long option names (smoke_methods_agrouping_...) may break after an underscore.
        items = "\n".join(f"  \\item {_latex_escape(n)}".replace("\\_", "\\_\\allowbreak{}") for n in notes)
        return (f"\n% {title} (python -m harness deviations)\n{{\\footnotesize\\sloppy\n\\paragraph{{{title}.}}\n"
                f"\\begin{{itemize}}\n{items}\n\\end{{itemize}}\n}}\n")
    return f"\n**{title}**\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
