"""``python -m harness tune --method M --dataset D --trials N``: one method tuned as a
tuned grid of one cell per reported seed (:func:`tune_grid`), swept here by the tuned
grid's engine (:mod:`harness.engine.tuning.sweep`): the same study, trials, folds, final
runs and tables as ``sweep --grid`` gives the grid file that holds the same table."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from harness.base.errors import HarnessError
from harness.base.metric_keys import group_metrics
from harness.cli.fetch_command import check_dataset
from harness.cli.run_command import check_checkpoint_root
from harness.cli.store import check_study_storage, open_store
from harness.cli.sweep_tuned import check_tuned_tables, queue_tuned_grid, tuned_final_report
from harness.components.data.own import dataset_name
from harness.config.catalog import DEFAULT_PROTOCOL_SPACE
from harness.config.grids import GRID_NAME_MAX, Grid, grid_from_table
from harness.config.overrides import parse_overrides
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import default_protocol, load_protocol
from harness.config.tuning import decade_space
from harness.engine.grid.sweep import open_study, storage_url
from harness.engine.run.runtime import resolve_device
from harness.engine.tuning.studies import (
    Study,
    best_trial,
    record_storage,
    record_study,
    search_experiment,
    settled,
    tuned_studies,
)
from harness.engine.tuning.sweep import check_tuned_folds, check_tuned_grid, tuned_worker_loop
from harness.methods import METHODS
from harness.reports.results import format_results
from harness.store.environment import logs_model
from harness.store.queries import search_runs
from harness.store.tracking import filter_value as q

__all__ = ["cmd_tune", "tune_grid", "TUNE_ROUND"]

#: Trials suggested together by ``tune``: one, each fitted on every trial before it (the
#: command runs one worker).
TUNE_ROUND = 1


def tune_grid(args: argparse.Namespace) -> Grid:
    """The tuned grid ``tune``'s arguments stand for: the method, the loss and the dataset
    under the protocol (``--set``: its deviations), one cell per reported seed (``--seeds``,
    default the protocol's), ``[tune]`` of ``--trials``, ``--folds`` and ``--sampler-seed``
    over MLRC's space, the method's own ``search_space`` and the ``--space`` fields (a
    decade either side of the protocol's value); its experiment ``--experiment`` (default
    ``tune-<method>-<dataset>-<protocol>``) names it too."""
    METHODS.get(args.method)
    dataset = dataset_name(args.dataset, name=args.dataset_name)
    protocol = args.protocol or default_protocol(dataset)
    if protocol.endswith(".toml"):
        protocol = str(Path(protocol).resolve())
    overrides = parse_overrides(list(args.set or []))
    base, _ = apply_overrides(load_protocol(protocol).for_dataset(dataset), overrides)
    fields = DEFAULT_PROTOCOL_SPACE if args.space is None else args.space.split(",")
    space = decade_space(base, tuple(f.strip() for f in fields if f.strip()))
    experiment = args.experiment or f"tune-{args.method}-{dataset}-{base.name}"
    name = _grid_name(experiment)
    table: dict[str, Any] = {
        "name": name,
        "description": f"tune: {args.method} ({args.loss or base.loss.name} loss, {dataset})",
        "protocol": protocol,
        "experiment": experiment,
        "methods": [args.method],
        "losses": [args.loss or base.loss.name],
        "backbones": [base.backbone.name],
        "datasets": [dataset],
        "seeds": list(args.seeds or base.seeds),
        "set": overrides,
        "baseline": args.method,
        "tune": {
            "trials": args.trials,
            "folds": args.folds,
            "sampler_seed": args.sampler_seed,
            "round": TUNE_ROUND,
            "method_spaces": True,
            "space": space,
        },
    }
    return grid_from_table(table, Path.cwd() / f"{name}.toml", max_cells=None)


def _grid_name(experiment: str) -> str:
    """The grid's name, from its experiment's: a plain file name (it names the tables)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", experiment).lstrip("._-")[:GRID_NAME_MAX]
    return name or "tune"


def cmd_tune(args: argparse.Namespace, *, train: Any = None) -> int:
    """The study's trials, its best trial and (unless ``--no-reproduce``) its final runs
    and tables (``train``: what trains one run, default
    :func:`~harness.engine.run.training.train_run`)."""
    resolve_device(args.device)
    if args.seed is not None:
        raise HarnessError(
            "--seed: the trials train with one seed above the highest reported seed, so that "
            "no reported run repeats a trial; choose the reported seeds with --seeds"
        )
    grid = tune_grid(args)
    check_tuned_folds(grid, args.data_root, flag="--")
    if not args.no_reproduce:
        check_tuned_tables(grid)
    check_checkpoint_root(None)  # checked before the search starts, not after it
    check_study_storage(args.storage)
    for dataset in grid.axes["datasets"]:
        check_dataset(dataset, args.data_root)
    open_store()
    logs_model()  # a bad $DML_HARNESS_LOG_MODEL is refused before any training
    # the batch and the folds on the loaded splits, before the storage's folder is made
    check_tuned_grid(grid, {"data_root": args.data_root}, flag="--")
    settings = {
        "data_root": args.data_root,
        "device": args.device,
        "loader_workers": args.loader_workers,
        "storage": storage_url(args.storage),
        "checkpoint_root": None,
    }
    queue = open_study(grid, settings["storage"])
    queue_tuned_grid(grid, queue, settings["storage"], finals=not args.no_reproduce)
    records = record_storage(settings["storage"])
    report = tuned_worker_loop(
        grid, queue, records, settings=settings, train=train, finals=not args.no_reproduce
    )
    return _report(grid, settings["storage"], report, reproduce=not args.no_reproduce)


def _report(grid: Grid, storage: str, report: dict[str, list], *, reproduce: bool) -> int:
    """Each study's best trial; with a failed task, one line on stderr and exit status 1
    (the next start retries it); else the final cells' tables and test results."""
    records = record_storage(storage)
    for study in tuned_studies(grid):
        best = _best(study, records, report)
        print(
            f"best trial {best.user_attrs['number']}: validation {study.spec.metric} "
            f"{best.value:.4f}; params {best.params}"
        )
    if report["failed"]:
        names = "; ".join(name for name, _ in report["failed"][:10])
        print(
            f"{len(report['failed'])} task(s) failed ({names}); each reason is on a [tune] "
            f"line above; the next start runs them again",
            file=sys.stderr,
        )
        return 1
    if not reproduce:
        return 0
    status = tuned_final_report(grid, storage)
    _print_final_results(grid)
    return status


def _best(study: Study, records, report: dict[str, list]):
    """The study's best finished trial; a study without one is an error saying where the
    reasons are."""
    record = record_study(study, records)
    done = settled(record)
    if any(t.state == TrialState.COMPLETE for t in done.values()):
        return best_trial(record)
    lost = len(done) + sum(1 for name, _ in report["failed"] if name.startswith(study.name))
    raise HarnessError(
        f"all {lost} trial(s) of study '{study.name}' failed or were pruned; each run's "
        f"reason is its MLflow run's 'failure' tag in experiment "
        f"'{search_experiment(study.grid)}' (tag tune_study = {study.name}), a pruned "
        f"trial's on its [tune] line"
    )


def _print_final_results(grid: Grid) -> None:
    """The final results (one per seed; k folds: the separated report) and the mean over
    seeds of the selection metric on the test split."""
    assert grid.tune is not None
    report = " and tags.tune_report = 'separated'" if grid.tune.folds > 1 else ""
    for study in tuned_studies(grid):
        rows = []
        for cell in study.cells:
            runs = search_runs(
                grid.experiment,
                f"attributes.status = 'FINISHED' and tags.tune_role = 'final' and "
                f"tags.cell_key = {q(cell.key)}{report}",
            )
            rows += [_record(run, cell) for run in runs[:1]]
        print(format_results(rows))
        metric = study.spec.metric
        values = [r["metrics"][metric] for r in rows if metric in r["metrics"]]
        if values:
            mean = sum(values) / len(values)
            spread = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
            seeds = [cell.seed for cell in study.cells]
            print(
                f"test {metric} of the best setting over seeds {seeds}: "
                f"{100 * mean:.2f} +- {100 * math.sqrt(spread):.2f}"
            )


def _record(run, cell) -> dict[str, Any]:
    """The ``run --json`` record of a final result, read back from its run."""
    tags = run.data.tags
    return {
        "method": cell.method,
        "dataset": cell.dataset,
        "loss": cell.loss,
        "seed": cell.seed,
        "protocol": tags.get("protocol", cell.protocol.name),
        "fingerprint": tags.get("fingerprint", ""),
        "deviations": [d for d in tags.get("deviations", "none").split("; ") if d != "none"],
        "selection": tags.get("selection", cell.protocol.selection.mode),
        "mlflow_run_id": run.info.run_id,
        "metrics": {
            k: v
            for k, v in group_metrics(run.data.metrics, "test").items()
            if not k.startswith("num_")
        },
    }
