"""The runs of a tuned grid (:mod:`harness.engine.tuning.sweep`): a search trial's fold
runs (the test split sealed) and its record in the study; a final cell's fold runs with
the best setting, and MLRC's two reports of k fold models ("separated", "concatenated")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import torch
from optuna.trial import TrialState, create_trial

from harness.base.errors import HarnessError, NonFiniteLoss
from harness.base.metric_keys import group_metrics, metric_key
from harness.components.data import fold_splits, seal_test
from harness.components.data.transforms import build_transform
from harness.components.evaluation import (
    PER_QUERY_ARTIFACT,
    PER_QUERY_SCORES,
    evaluate_embeddings,
    l2_normalize,
    load_per_query,
    save_per_query,
)
from harness.config.deviations import deviation_tags
from harness.config.grids import Cell, Grid
from harness.config.protocol import apply_overrides
from harness.config.tuning import TuneSpec, suggest_setting
from harness.engine.grid.queue import pop_lock
from harness.engine.run import training
from harness.engine.run.data import check_training_split, prepare_splits
from harness.engine.run.embedding import embed_images
from harness.engine.run.model import build_model
from harness.engine.run.run_config import RunConfig, RunSettings
from harness.engine.run.runtime import resolve_device
from harness.engine.tuning.studies import (
    Study,
    best_trial,
    fold_plan,
    folds_experiment,
    log,
    record_study,
    round_start,
    search_cell,
    search_experiment,
    search_seed,
    search_summary,
    settled,
    trial_setting,
    tuned_studies,
)
from harness.store.queries import (
    find_run,
    metric_history,
    read_artifact,
    record_derived_run,
    search_runs,
    set_run_tags,
)
from harness.store.tracking import filter_value as q
from harness.store.weights import load_finished_weights

__all__ = ["run_trial", "run_final_cell", "separated_per_query"]


_PRUNE_AFTER = 3  # settled trials at a fold before the pruner compares with them


def _splits(
    cell: Cell, protocol, folds: int, fold: int | None, settings: dict, cache: dict, sealed: bool
):
    """The splits of ``fold`` of ``folds`` (None: the protocol's carve), the test split
    sealed while searching; the dataset is loaded once per protocol split in ``cache``."""

    by_seed = cell.seed if protocol.splits.validation_by_run_seed else None  # its own carve
    key = (
        cell.dataset,
        repr(protocol.splits),
        fold is None,
        str(settings.get("data_root")),
        by_seed,
    )
    if key not in cache:
        base = protocol
        if fold is not None:  # the whole training split: the folds replace the protocol's carve
            base, _ = apply_overrides(protocol, {"selection.mode": "last"})
        cache[key] = prepare_splits(base, cell.dataset, settings.get("data_root"), seed=cell.seed)
    splits = cache[key]
    if fold is not None:
        splits = fold_splits(splits, folds, fold, protocol.splits.seed)
    return seal_test(splits, "the hyperparameter search") if sealed else splits


def _fold_record(spec: TuneSpec, splits, fold: int | None, protocol) -> dict[str, str]:
    """What a fold run records of its fold: the rule that drew it (k folds of the training
    classes from the protocol's split seed) and a digest of its held-out classes."""
    if fold is None:
        return {"tune_folds": "the protocol's validation split"}
    held_out = ",".join(str(c) for c in sorted(set(splits.val.labels.tolist())))
    return {
        "tune_folds": f"{spec.folds} class-disjoint folds of the training classes, seed "
        f"{protocol.splits.seed}",
        "tune_fold_classes": hashlib.sha256(held_out.encode()).hexdigest()[:16],
    }


def _tuned_protocol(cell: Cell, overrides: dict[str, Any]):
    """The cell's protocol with a setting's protocol overrides (learning rates, loss
    arguments) applied: the tuned setting, recorded as ``tune_params``, not as deviations
    (the grid asks for them to be searched)."""

    protocol, _ = apply_overrides(cell.protocol, overrides)
    return protocol


def _fold_config(cell: Cell, protocol, options: dict, settings: dict, **run: Any):
    """A fold run of ``cell`` under a tuned ``protocol`` with the method ``options``,
    resumable; ``run``: the rest of :meth:`RunConfig.build`'s fields."""

    return RunConfig.build(
        protocol,
        method=cell.method,
        dataset=cell.dataset,
        loss=cell.loss,
        seed=cell.seed,
        deviations=cell.deviations,
        settings=RunSettings.of_worker(settings),
        method_options=options,
        protocol_path=cell.protocol_path,
        resume=True,
        **run,
    )


def _finished_run(experiment: str, tags: dict[str, Any]):
    """The FINISHED run of ``experiment`` with every tag of ``tags``, or None."""

    where = " and ".join(f"tags.{k} = {q(v)}" for k, v in tags.items())
    runs = search_runs(experiment, f"attributes.status = 'FINISHED' and {where}")
    return runs[0] if runs else None


def _best_validation(run_id: str, metric: str) -> float:

    history = metric_history(run_id, metric_key("val", metric))
    if not history:
        raise HarnessError(f"run {run_id} logged no {metric_key('val', metric)}")
    return max(v for _, v in history)


def _should_prune(spec: TuneSpec, fold: int, mean: float, history: dict[int, Any]) -> bool:
    """MLRC stops nothing early; the harness's median rule between folds: stop after fold
    ``fold`` when the running mean is below the median of the settled trials' running
    means at that fold (of earlier rounds only, so the decision is the same on every
    worker), once at least three of them reached it."""
    if spec.pruner == "none":
        return False
    values = [
        t.intermediate_values[fold] for t in history.values() if fold in t.intermediate_values
    ]
    return len(values) >= _PRUNE_AFTER and mean < statistics.median(values)


def run_trial(
    study: Study, number: int, storage, settings: dict, cache: dict, train: Any = None
) -> float:
    """Trial ``number`` of ``study``: its k fold runs (a finished one is read, not run
    again), the mean of their best validation values, recorded in the study (once);
    ``train`` trains a run (default :func:`~harness.engine.run.training.train_run`)."""

    spec = study.spec
    record = record_study(study, storage)
    done = settled(record)
    if number in done:  # settled by a worker that died before telling the queue
        return float(done[number].value or 0.0)
    params, distributions, options, overrides = trial_setting(study, number, done)
    history = {n: done[n] for n in range(round_start(spec, number))}
    setting = (params, options, _tuned_protocol(study.first, overrides))
    log(f"{study.label} trial {number}: {params}")
    values: list[float] = []
    intermediate: dict[int, float] = {}
    runs: list[str] = []
    state = TrialState.COMPLETE
    for fold in fold_plan(study.grid):
        try:
            run_id = _trial_fold_run(study, number, fold, setting, (settings, cache, train))
        except NonFiniteLoss as err:  # a diverging setting: the trial ends, the study goes on
            log(f"{study.label} trial {number} fold {fold}: {err}; recorded as pruned")
            state = TrialState.PRUNED
            break
        runs.append(run_id)
        values.append(_best_validation(run_id, spec.metric))
        step = 0 if fold is None else fold
        intermediate[step] = float(np.mean(values))
        last = fold is None or fold == spec.folds - 1
        if not last and _should_prune(spec, step, intermediate[step], history):
            log(f"{study.label} trial {number}: pruned after fold {fold}")
            state = TrialState.PRUNED
            break
    value = float(np.mean(values)) if state == TrialState.COMPLETE else None
    attrs = {"number": number, "runs": runs, "fold_values": values}
    with pop_lock(settings.get("storage")):
        if number not in settled(record):
            _add_trial(record, params, distributions, value, intermediate, state, attrs)
    return value if value is not None else float("nan")


def _add_trial(record, params, distributions, value, intermediate, state, attrs) -> None:

    record.add_trial(
        create_trial(
            params=params,
            distributions=distributions,
            value=value,
            intermediate_values=intermediate,
            state=state,
            user_attrs=attrs,
        )
    )


def _trial_fold_run(study: Study, number: int, fold: int | None, setting: tuple, how: tuple) -> str:
    """The run of one fold of a trial (its finished run if there is one): trained on the
    fold's training classes with the test split sealed, selected on the fold; ``how``:
    the worker's settings, its splits cache and what trains a run."""

    params, options, protocol = setting
    settings, cache, train = how
    cell = search_cell(study)
    tags = {
        "tune_study": study.name,
        "tune_trial": number,
        "tune_fold": "validation" if fold is None else fold,
        "tune_role": "trial",
    }
    run = _finished_run(search_experiment(study.grid), tags)
    if run is not None:
        return run.info.run_id
    splits = _splits(cell, protocol, study.spec.folds, fold, settings, cache, sealed=True)
    tags = {**tags, **_fold_record(study.spec, splits, fold, protocol)}
    cfg = _fold_config(
        cell,
        protocol,
        {**cell.method_options, **options},
        settings,
        search_only=True,
        experiment=search_experiment(study.grid),
        tags={**{k: str(v) for k, v in tags.items()}, "tune_params": json.dumps(params)},
    )
    check_training_split(cfg.protocol, cfg.dataset, splits)
    run_id = (train or training.train_run)(cfg, splits)["mlflow_run_id"]
    set_run_tags(run_id, tags)
    return run_id


def _final_tags(study: Study, record, best, cell: Cell) -> dict[str, str]:

    history = settled(record)
    values = [
        None if history[n].value is None else round(float(history[n].value), 6)
        for n in sorted(history)
    ]
    return {
        "tune_study": study.name,
        "tune_trial": str(best.user_attrs["number"]),
        "tune_role": "final",
        "tune_budget": study.spec.budget,
        "tune_trials": str(len(history)),
        "tune_params": json.dumps(best.params, sort_keys=True),
        "tune_history": json.dumps(values),
        "tune_search": json.dumps(
            {**search_summary(study.spec, record, best), "search_seed": search_seed(study.grid)}
        ),
        # The protocol the study searched under: the tables compare tuned rows by it.
        "tune_protocol": hashlib.sha256(cell.protocol.canonical_json().encode()).hexdigest()[:16],
        "grid": study.grid.name,
        "grid_cell": cell.label,
        **deviation_tags(
            _fold_selection(cell.paper_deviations, study.spec.folds), cell.method, cell.dataset
        ),
    }


#: The protocols' deviation that states how the harness selects models (each names the
#: protocol's validation carve, which k-fold runs replace).
SELECTION_DEVIATION = "validation_selection"


def _fold_selection(deviations: dict, folds: int) -> dict:
    """The cell's paper deviations, the selection one saying what k fold runs do instead
    of the protocol's carve."""
    if folds < 2 or SELECTION_DEVIATION not in deviations:
        return deviations
    said = deviations[SELECTION_DEVIATION]
    harness = (
        f"each of {folds} fold models trained on {folds - 1}/{folds} of the training classes "
        f"(class-disjoint folds), its epoch chosen by the validation score on the held-out fold"
    )
    return {**deviations, SELECTION_DEVIATION: dataclasses.replace(said, harness=harness)}


def run_final_cell(
    grid: Grid, cell: Cell, storage, settings: dict, cache: dict, train: Any = None
) -> None:
    """A final cell: the best setting of its study trained with the cell's seed on each
    fold (a test-time cell: its base cell's fold runs evaluated), then its results in the
    grid's experiment (``train``: what trains a run, as for :func:`run_trial`)."""
    spec = grid.tune
    assert spec is not None
    base_cell = cell
    if cell.base_key:
        base_cell = next(c for c in grid.cells if c.key == cell.base_key)
    study = next(s for s in tuned_studies(grid) if base_cell in s.cells)
    record = record_study(study, storage)
    best = best_trial(record)
    # The recorded parameters themselves (not a new suggestion) make the final setting.
    options, overrides = suggest_setting(
        optuna.trial.FixedTrial(best.params),
        study.spec,
        base_cell.method,
        base_cell.loss,
        base_cell.protocol,
    )
    protocol = _tuned_protocol(cell, overrides)
    options = {**cell.method_options, **({} if cell.base_key else options)}
    tags = _final_tags(study, record, best, cell)
    run_ids = [
        _final_fold_run(grid, cell, fold, (protocol, options, tags), (settings, cache, train))
        for fold in fold_plan(grid)
    ]
    if spec.folds > 1:
        _record_fold_reports(grid, cell, protocol, options, run_ids, tags, settings, cache)
    log(f"final {cell.label}: done ({len(run_ids)} run(s))")


def _final_fold_run(grid: Grid, cell: Cell, fold: int | None, setting: tuple, how: tuple) -> str:
    """The final run of one fold of a cell (its finished run if there is one): with
    ``folds = 1`` the cell's run in the grid's experiment, else a fold model in
    ``<experiment>-folds``; a test-time cell evaluates its base cell's run of that fold
    (``how``: as for a trial's fold run)."""

    protocol, options, tags = setting
    settings, cache, train = how
    spec = grid.tune
    assert spec is not None
    experiment = grid.experiment if spec.folds == 1 else folds_experiment(grid)
    fold_name = "validation" if fold is None else str(fold)
    fold_tags = {**tags, "tune_cell": cell.key, "tune_fold": fold_name}
    if spec.folds == 1:
        fold_tags["cell_key"] = cell.key
    run = _finished_run(experiment, {"tune_cell": cell.key, "tune_fold": fold_name})
    if run is not None:
        return run.info.run_id
    init_from = ""
    if cell.base_key:
        base_run = _finished_run(experiment, {"tune_cell": cell.base_key, "tune_fold": fold_name})
        if base_run is None:
            raise HarnessError(
                f"{cell.label}: its base cell has no finished run of fold {fold_name}"
            )
        init_from = base_run.info.run_id
    splits = _splits(cell, protocol, spec.folds, fold, settings, cache, sealed=False)
    fold_tags = {**fold_tags, **_fold_record(spec, splits, fold, protocol)}
    cfg = _fold_config(
        cell,
        protocol,
        options,
        settings,
        init_from=init_from,
        evaluate_only=bool(cell.base_key),
        experiment=experiment,
        tags=fold_tags,
    )
    check_training_split(cfg.protocol, cfg.dataset, splits)
    run_id = (train or training.train_run)(cfg, splits)["mlflow_run_id"]
    set_run_tags(run_id, fold_tags)
    return run_id


def _record_fold_reports(
    grid: Grid,
    cell: Cell,
    protocol,
    options: dict,
    run_ids: list[str],
    tags: dict[str, str],
    settings,
    cache,
) -> None:
    """MLRC's two reports of k fold models in the grid's experiment: ``separated`` (the
    mean of the models' test metrics and per-query values) and ``concatenated`` (the
    models' L2-normalised test embeddings joined, then evaluated; a re-ranking head's
    global embeddings, as its re-ranking does not concatenate)."""
    have = {run.data.tags.get("tune_report") for run in _cell_reports(grid, cell)}
    common = {
        **tags,
        "cell_key": cell.key,
        "tune_cell": cell.key,
        "tune_fold": "all",
        "tune_fold_runs": " ".join(run_ids),
    }
    if "concatenated" not in have:
        scores = _concatenated_scores(cell, protocol, options, run_ids, settings, cache)
        metrics = {metric_key("test", k): v for k, v in scores.items()}
        _record_report(grid, cell, run_ids, "concatenated", common, metrics, scores.per_query)
    if "separated" not in have:
        metrics, per_query = _separated(run_ids)
        _record_report(grid, cell, run_ids, "separated", common, metrics, per_query)


def _separated(run_ids: list[str]) -> tuple[dict[str, float], dict | None]:
    """The mean of the fold runs' test metrics and (when every run has them) per-query values."""

    tests = [group_metrics(find_run(r).data.metrics, "test") for r in run_ids]
    shared = sorted(set.intersection(*(set(t) for t in tests)))
    metrics = {metric_key("test", k): float(np.mean([t[k] for t in tests])) for k in shared}
    arrays = [read_artifact(r, PER_QUERY_ARTIFACT, load_per_query) for r in run_ids]
    if any(a is None for a in arrays):
        return metrics, None
    return metrics, separated_per_query([a for a in arrays if a is not None])


def separated_per_query(arrays: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The per-query arrays of the separated report from the fold models' own: each score
    averaged over the models (a mean over models of a mean over queries is the mean over
    queries of the per-query means), each model's first-hit ranks kept, one row per model
    (a rank is not averaged: P@1 and Recall@K are then the share of models that hit,
    :func:`harness.components.evaluation.per_query_values`), the queries' labels and
    relevant counts as the models share them."""
    keys = set.intersection(*(set(a) for a in arrays))
    out = {k: np.mean([a[k] for a in arrays], axis=0) for k in keys if k in PER_QUERY_SCORES}
    out.update({k: arrays[0][k] for k in keys if k not in out})
    out["first_hit_rank"] = np.stack([a["first_hit_rank"] for a in arrays])
    return out


def _record_report(
    grid: Grid,
    cell: Cell,
    run_ids: list[str],
    report: str,
    tags: dict[str, str],
    metrics: dict[str, float],
    per_query: dict | None,
) -> None:
    """One report of a cell's fold models as a run of the grid's experiment, with its
    per-query values (for the tables' paired bootstrap) when there are any."""

    folder, name = PER_QUERY_ARTIFACT.rsplit("/", 1)
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = []
        if per_query is not None:
            save_per_query(Path(tmp) / name, per_query)
            artifacts.append((Path(tmp) / name, folder))
        record_derived_run(
            grid.experiment,
            run_ids[0],
            run_name=f"{cell.label} {report}",
            drop=_FOLD_RUN_TAGS,
            tags={**tags, "tune_report": report},
            metrics=metrics,
            artifacts=artifacts,
        )


#: Tags of a fold run that do not describe a result derived from all folds.
_FOLD_RUN_TAGS = (
    "tune_fold_classes",
    "selected_epoch",
    "harness_worker",
    "checkpoint_dir",
    "run_key",
)


def _cell_reports(grid: Grid, cell: Cell) -> list:

    return search_runs(
        grid.experiment,
        f"attributes.status = 'FINISHED' and tags.cell_key = {q(cell.key)} and tags.tune_role = 'final'",
    )


def _concatenated_scores(
    cell: Cell, protocol, options: dict, run_ids: list[str], settings: dict, cache: dict
):
    """The test metrics of the fold models' L2-normalised embeddings, concatenated."""

    device = resolve_device(settings.get("device", "auto"))
    splits = _splits(cell, protocol, 2, None, settings, cache, sealed=False)
    transform = build_transform(protocol.image, train=False)
    parts: dict[str, list[np.ndarray]] = {"test": [], "gallery": []}
    for run_id in run_ids:
        model = build_model(protocol, cell.method, options)
        load_finished_weights(
            model, run_id, flag="a fold model", checkpoint_root=settings.get("checkpoint_root")
        )
        model = model.to(device).eval()
        for split in ("test", "gallery"):
            images = getattr(splits, split)
            if images is None:
                continue
            with torch.no_grad():
                embedded, _ = embed_images(
                    model,
                    images,
                    transform,
                    protocol.image,
                    batch_size=protocol.evaluation.batch_size,
                    device=device,
                    workers=0,
                    keep=(),
                    precision=protocol.numerics.precision,
                )
            parts[split].append(l2_normalize(np.asarray(embedded, dtype=np.float32)))
    query = np.concatenate(parts["test"], axis=1)
    gallery = np.concatenate(parts["gallery"], axis=1) if parts["gallery"] else None
    return evaluate_embeddings(
        query,
        splits.test.labels,
        gallery,
        None if splits.gallery is None else splits.gallery.labels,
        recall_k=protocol.evaluation.recall_k_for(cell.dataset),
        metrics=protocol.evaluation.metrics,
        use_gpu=device.type == "cuda",
        per_query=True,
    )
