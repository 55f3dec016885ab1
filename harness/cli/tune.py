"""``python -m harness tune``: Optuna's search over a method's space, then the best setting over the seeds.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.tune_command`, imported when it runs."""

from __future__ import annotations

import argparse
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
from harness.cli.outputs import add_output_argument
from harness.config.catalog import DEFAULT_PROTOCOL_SPACE

__all__ = ["add_tune_parser", "cmd_tune"]


def cmd_tune(args: argparse.Namespace, *, train: Any = None) -> int:
    """Tune the method of ``args`` and reproduce its best trial
    (:func:`harness.cli.tune_command.cmd_tune`); ``train`` stands in for the engine's
    training of one run."""
    # deferred: torch, the engine, Optuna and MLflow load only when the command runs
    from harness.cli import tune_command

    return tune_command.cmd_tune(args, train=train)


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune",
        help="one method tuned as a tuned grid of one study: Optuna TPE on validation, "
        "then the best setting over the seeds on test, and the grid's tables",
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
        "--trials", type=at_least(1), required=True, help="the study's budget of trials (resumable)"
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
        help="comma-separated protocol fields searched a decade either side of their value, "
        "besides the loss's and the method's spaces "
        f"(default {','.join(DEFAULT_PROTOCOL_SPACE)}; '' for none)",
    )
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="fixed protocol override (a deviation)"
    )
    _add_seed_arguments(p)
    p.add_argument(
        "--no-reproduce",
        action="store_true",
        help="stop after the search: no final runs, no tables",
    )
    p.add_argument(
        "--experiment",
        type=experiment_name,
        help="MLflow experiment of the final runs, <experiment>-search of the trials; it "
        "names the grid and its tables (default tune-<method>-<dataset>-<protocol>)",
    )
    p.add_argument("--data-root", type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--loader-workers", type=at_least(0), help="data-loading processes per run")
    p.set_defaults(func=cmd_tune)
    return p


def _add_seed_arguments(p: argparse.ArgumentParser) -> None:
    """The seeds of the trials (refused: the grid's rule), of the final runs and of the sampler."""
    p.add_argument(
        "--seed",
        type=at_least(0, SEED_LIMIT - 1),
        help="refused: the trials train with one seed above the highest of --seeds",
    )
    p.add_argument(
        "--seeds", type=int_list, help="seeds of the final runs (default: the protocol's)"
    )
    p.add_argument(
        "--sampler-seed",
        type=at_least(0, SEED_LIMIT - 1),
        default=0,
        help="seed of the TPE sampler",
    )
