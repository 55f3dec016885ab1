"""``python -m harness tune --method M --dataset D --trials N``: the arguments, the best
trial and the reproduction's mean over seeds; the study is :mod:`harness.engine.tuning.tune`'s."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from harness.cli.fetch_command import check_dataset
from harness.cli.run_command import check_checkpoint_root
from harness.cli.store import check_study_storage, open_store
from harness.components.data.own import dataset_name
from harness.engine.run.run_config import RunSettings, logs_model
from harness.engine.run.runtime import resolve_device
from harness.engine.tuning.tune import (
    failed_trials,
    reproduce,
    search,
    tune_setup,
    where_failures_are,
)
from harness.reports.results import format_results

__all__ = ["cmd_tune", "failures_status"]


def cmd_tune(args: argparse.Namespace, *, train: Any = None) -> int:
    """The study's trials, its best trial, and the best setting reproduced over the seeds
    (``train``: what trains one run, default :func:`~harness.engine.run.training.run_training`)."""
    # torch and the data loaders: imported when a command needs them

    resolve_device(args.device)
    setup = tune_setup(
        args.method,
        dataset_name(args.dataset, name=args.dataset_name),
        protocol=args.protocol,
        loss=args.loss,
        overrides=list(args.set or []),
        space=args.space,
        seed=args.seed,
        experiment=args.experiment,
        settings=RunSettings(
            data_root=args.data_root, device=args.device, workers=args.loader_workers
        ),
        folds=args.folds,
        train=train,
    )
    seeds = args.seeds
    check_checkpoint_root(None)  # checked before the search starts, not after it
    check_study_storage(args.storage)
    check_dataset(setup.dataset, args.data_root)
    open_store()

    logs_model()  # a bad $DML_HARNESS_LOG_MODEL is refused before any training
    study = search(setup, trials=args.trials, storage=args.storage, sampler_seed=args.sampler_seed)
    best = study.best_trial
    print(
        f"best trial {best.number}: validation {setup.metric} {best.value:.4f}; params {best.params}"
    )
    if not args.no_reproduce:
        _report_reproduction(setup, best, seeds)
    return failures_status(setup, study)


def failures_status(setup, study) -> int:
    """The exit status of a finished search ``study`` of ``setup``
    (:func:`harness.engine.tuning.tune.tune_setup`): 0, or 1 with one line on stderr counting the
    failed trials (not the interrupted ones, which run again) and saying where their errors
    are. The best setting stands among the trials that ran, but a search that lost trials
    is not the search that was asked for. (When every trial fails,
    :func:`harness.engine.tuning.tune.search` raises: exit 2, nothing to report.)"""
    failed = failed_trials(study)
    if not failed:
        return 0
    print(
        f"{len(failed)} of {len(study.trials)} trial(s) failed (numbers "
        f"{', '.join(str(t.number) for t in failed[:10])}{', ...' if len(failed) > 10 else ''}); "
        f"{where_failures_are(setup)}",
        file=sys.stderr,
    )
    return 1


def _report_reproduction(setup, best, seeds: list[int] | None) -> None:
    """Train the best setting with each seed and print the test results and their mean."""
    records = reproduce(setup, best, seeds)
    print(format_results(records))
    values = [
        r["metrics"].get(setup.metric)
        for r in records
        if r["metrics"].get(setup.metric) is not None
    ]
    if values:
        mean = sum(values) / len(values)
        std = (
            math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            if len(values) > 1
            else 0.0
        )
        used = seeds if seeds is not None else list(setup.protocol.seeds)
        print(
            f"test {setup.metric} of the best setting over seeds {used}: {100 * mean:.2f} +- {100 * std:.2f}"
        )
