"""``python -m harness run``: train and evaluate methods under a fair protocol.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.run_command`, imported when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cli.arguments import (
    DATASET_HELP,
    EMBEDDED_DEFAULT,
    at_least,
    dataset_label,
    experiment_name,
    int_list,
    model_name,
    name_list,
)
from harness.cli.outputs import add_force_argument, add_output_argument
from harness.config.sections import MAX_STEPS

__all__ = ["add_run_parser", "cmd_run"]


def cmd_run(
    args: argparse.Namespace,
    *,
    train: Callable[..., dict[str, Any]] | None = None,
    estimate: Callable[..., Any] | None = None,
) -> int:
    """Train and test the methods of ``args``, seed by seed
    (:func:`harness.cli.run_command.cmd_run`); ``train`` stands in for the engine's
    training of one run, ``estimate`` for the estimate made before the first."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import run_command

    return run_command.cmd_run(args, train=train, estimate=estimate)


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    run = subparsers.add_parser("run", help="train and evaluate methods under a fair protocol")
    _add_what_arguments(run)
    _add_how_arguments(run)
    _add_weights_arguments(run)
    run.set_defaults(func=cmd_run)
    return run


def _add_what_arguments(run: argparse.ArgumentParser) -> None:
    """What runs: the methods, the dataset, the protocol and its overrides, the seeds."""
    run.add_argument(
        "--methods",
        default=["all"],
        type=name_list,
        help="'all' (every registered method but ablation variants) or a comma-separated list",
    )
    run.add_argument("--dataset", default=EMBEDDED_DEFAULT, help=DATASET_HELP)
    run.add_argument(
        "--dataset-name",
        type=dataset_label,
        metavar="NAME",
        help="the short name of a --dataset PATH in tables and MLflow (default: the folder's "
        "or the .csv file's name)",
    )
    run.add_argument(
        "--protocol",
        help="protocol name or .toml path (default: smoke on synthetic "
        "and fashion-mnist, roth2020 on the four benchmarks)",
    )
    run.add_argument("--loss", help="metric loss (default: the protocol's)")
    run.add_argument(
        "--seeds", type=int_list, help="comma-separated seeds (default: the protocol's)"
    )
    run.add_argument(
        "--epochs",
        type=at_least(0, MAX_STEPS),
        help="override schedule.epochs (recorded as a deviation); 0 evaluates the initial model",
    )
    run.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override any protocol field, e.g. optimizer.lr_head=1e-4 (a deviation)",
    )


def _add_how_arguments(run: argparse.ArgumentParser) -> None:
    """Where and how the runs execute, and where they record."""
    run.add_argument("--data-root", type=Path)
    run.add_argument(
        "--download",
        action="store_true",
        help="fetch a missing benchmark first (python -m harness datasets fetch NAME)",
    )
    run.add_argument("--device", default="auto", help="auto, cpu or cuda")
    run.add_argument(
        "--workers",
        type=at_least(0),
        help="data-loading processes (default 4 on CUDA; on CPU 1, or 0 with under 2 cores per process)",
    )
    run.add_argument(
        "--experiment",
        type=experiment_name,
        help="MLflow experiment (default: <dataset>-<protocol>)",
    )
    add_output_argument(run, "--json", help="write the result records to this file")
    add_force_argument(run)
    run.add_argument(
        "--resume", action="store_true", help="continue interrupted runs from their last checkpoint"
    )
    run.add_argument(
        "--yes",
        action="store_true",
        help="run on a CPU what the estimate printed before the first run puts over an hour "
        "(refused without it)",
    )
    run.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels on every device (an op without one is an error), cuDNN "
        "without autotuning, CUBLAS_WORKSPACE_CONFIG=:4096:8; recorded with each run",
    )
    run.add_argument(
        "--fast",
        action="store_true",
        help="cuDNN autotuning and non-deterministic kernels (faster on a GPU, not "
        "bit-repeatable); recorded with each run (tag fast)",
    )
    run.add_argument(
        "--compile",
        action="store_true",
        help="train through torch.compile: forward, loss and backward as one graph where the "
        "miner works in a fixed shape and the method on the device (else with graph breaks, "
        "said in one line), the optimizer step as a second; recorded with each run (tag compile)",
    )
    run.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="--compile, with the step's graph replayed as a CUDA graph (a GPU and a step that "
        "is one graph); recorded with each run (tag cuda_graphs)",
    )


def _add_weights_arguments(run: argparse.ArgumentParser) -> None:
    """The weights: where they are kept, the run they start from, what is evaluated, and
    the registered model."""
    add_output_argument(
        run,
        "--checkpoint-root",
        form="folder",
        type=Path,
        help="checkpoints and selected weights (default "
        "$DML_HARNESS_CHECKPOINTS, else results/checkpoints); --init-from finds a run's "
        "weights under it even after the folder moved",
    )
    run.add_argument(
        "--init-from",
        metavar="RUN_ID",
        help="start from the selected weights of a finished run (a deviation, unless "
        "--evaluate-only)",
    )
    run.add_argument(
        "--evaluate-only",
        action="store_true",
        help="train no epoch: evaluate the --init-from run's weights, trained under this "
        "same protocol (e.g. --methods diml: DIML at test time on a trained plain run)",
    )
    run.add_argument(
        "--seen-class-control",
        action="store_true",
        help="diagnostic: train on other images of the test classes, not on the training "
        "classes (a deviation; tells broken training from features that do not transfer)",
    )
    run.add_argument(
        "--shuffled-labels-control",
        action="store_true",
        help="diagnostic: train on the training images with their labels permuted (a "
        "deviation; the data randomisation test of explanation maps, Adebayo et al. 2018)",
    )
    run.add_argument(
        "--register",
        metavar="NAME",
        type=model_name,
        help="register each run's trained embedder in MLflow's model registry as a version of "
        "NAME (each run logs its embedder as an MLflow model unless $DML_HARNESS_LOG_MODEL is 0)",
    )
