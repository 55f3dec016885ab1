"""``python -m harness tune --method M --dataset D --trials N``: the arguments, the best
trial and the reproduction's mean over seeds; the study is :mod:`harness.engine.tune`'s."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from harness.cli.arguments import (
    DATASET_HELP,
    SEED_LIMIT,
    at_least,
    dataset_label,
    experiment_name,
    int_list,
)
from harness.cli.fetch import check_dataset
from harness.cli.outputs import add_output_argument, check_study_storage
from harness.cli.run import check_checkpoint_root
from harness.cli.store import open_store
from harness.components.data.own import dataset_name
from harness.engine.run_config import logs_model
from harness.engine.training import RunSettings, resolve_device
from harness.engine.tune import (
    DEFAULT_SPACE,
    failed_trials,
    reproduce,
    search,
    tune_setup,
    where_failures_are,
)
from harness.reports.results import format_results

__all__ = ["add_tune_parser", "cmd_tune", "failures_status"]


def cmd_tune(args: argparse.Namespace, *, train: Any = None) -> int:
    """The study's trials, its best trial, and the best setting reproduced over the seeds
    (``train``: what trains one run, default :func:`~harness.engine.training.run_training`)."""
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
    (:func:`harness.engine.tune.tune_setup`): 0, or 1 with one line on stderr counting the
    failed trials (not the interrupted ones, which run again) and saying where their errors
    are. The best setting stands among the trials that ran, but a search that lost trials
    is not the search that was asked for. (When every trial fails,
    :func:`harness.engine.tune.search` raises: exit 2, nothing to report.)"""
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


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune",
        help="Optuna TPE over a method's search space (validation), "
        "then the best setting over the protocol's seeds (test)",
    )
    p.add_argument("--method", required=True)
    p.add_argument("--dataset", default="synthetic", help=DATASET_HELP)
    p.add_argument(
        "--dataset-name",
        type=dataset_label,
        metavar="NAME",
        help="the short name of a --dataset PATH (default: the folder's or the .csv file's name)",
    )
    p.add_argument(
        "--trials", type=at_least(1), required=True, help="total trials of the study (resumable)"
    )
    p.add_argument(
        "--folds",
        type=at_least(1),
        default=1,
        help="class-disjoint folds of the training classes a trial trains on, scored by their "
        "mean (default 1: the protocol's validation split; MLRC: 4)",
    )
    add_output_argument(
        p, "--storage", form="storage", help="Optuna RDB URL (default sqlite:///results/optuna.db)"
    )
    p.add_argument("--protocol", help="protocol name or .toml path (default as for run)")
    p.add_argument("--loss", help="metric loss (default: the protocol's)")
    p.add_argument(
        "--space",
        help="comma-separated protocol fields to tune as deviations "
        f"(default {','.join(DEFAULT_SPACE)}; '' for none)",
    )
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="fixed protocol override (a deviation)"
    )
    _add_seed_arguments(p)
    p.add_argument("--no-reproduce", action="store_true", help="stop after the search")
    p.add_argument(
        "--experiment",
        type=experiment_name,
        help="MLflow experiment (default tune-<method>-<dataset>-<protocol>)",
    )
    p.add_argument("--data-root", type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--loader-workers", type=at_least(0), help="data-loading processes per run")
    p.set_defaults(func=cmd_tune)
    return p


def _add_seed_arguments(p: argparse.ArgumentParser) -> None:
    """The seeds of the trials, of the reproduction and of the sampler."""
    p.add_argument(
        "--seed",
        type=at_least(0, SEED_LIMIT - 1),
        help="training seed of the trials (default: the protocol's first)",
    )
    p.add_argument(
        "--seeds", type=int_list, help="seeds of the reproduction (default: the protocol's)"
    )
    p.add_argument(
        "--sampler-seed",
        type=at_least(0, SEED_LIMIT - 1),
        default=0,
        help="seed of the TPE sampler",
    )
