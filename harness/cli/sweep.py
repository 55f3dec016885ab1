"""``python -m harness sweep``: every cell of a grid once, restartable, by any number of workers.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.sweep_command`, imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.cli.arguments import (
    at_least,
)
from harness.cli.outputs import add_output_argument
from harness.config.catalog import MAX_CELLS
from harness.config.executor import check_mem, check_time
from harness.store.location import DEFAULT_STORAGE

__all__ = ["add_sweep_parser", "add_cluster_arguments", "cmd_sweep"]


def cmd_sweep(args: argparse.Namespace, *, train: Any = None, submitter: Any = None) -> int:
    """Sweep, show or cancel the grid of ``args``
    (:func:`harness.cli.sweep_command.cmd_sweep`); ``train`` and ``submitter`` stand in
    for the engine's training and the cluster's job submission."""
    # deferred: torch, the engine, Optuna and MLflow load only when the command runs
    from harness.cli import sweep_command

    return sweep_command.cmd_sweep(args, train=train, submitter=submitter)


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sweep", help="run every cell of a grid once (restartable, multi-worker)"
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--grid", help="grid name (protocols/grids/<name>.toml) or a .toml path")
    which.add_argument(
        "--status",
        metavar="GRID",
        help="show each cell of a submitted grid: finished, running (with its job), queued, failed",
    )
    which.add_argument(
        "--cancel",
        metavar="GRID",
        help="cancel a grid's submitted tasks (finished cells stay; running ones are queued again)",
    )
    p.add_argument(
        "--workers",
        type=at_least(1),
        help="local worker processes (default 1: in this process); with --executor, the "
        "tasks of the array (default: one per cell to run)",
    )
    add_output_argument(
        p,
        "--storage",
        form="storage",
        help=f"Optuna RDB URL shared by the workers (default {DEFAULT_STORAGE}; "
        "postgresql://user@host/db across machines)",
    )
    p.add_argument("--smoke", action="store_true", help="the grid's tiny [smoke] version")
    p.add_argument("--data-root", type=Path)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--loader-workers", type=at_least(0), help="data-loading processes per run")
    add_output_argument(
        p,
        "--checkpoint-root",
        form="folder",
        type=Path,
        help="checkpoints and selected weights (default "
        "$DML_HARNESS_CHECKPOINTS, else results/checkpoints)",
    )
    p.add_argument(
        "--heartbeat", type=at_least(1), default=30, help="seconds between worker heartbeats"
    )
    p.add_argument(
        "--grace",
        type=at_least(1),
        default=90,
        help="seconds without a heartbeat after which a running cell is retried",
    )
    p.add_argument(
        "--yes",
        action="store_true",
        help=f"sweep a grid of more than {MAX_CELLS:,} cells, or on a CPU one the estimate "
        "printed before the first cell puts over an hour (refused without it)",
    )
    add_cluster_arguments(p)
    p.add_argument("--worker-only", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_sweep)
    return p


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The executor, its resources, and the hidden options of a multi-process cell."""
    p.add_argument(
        "--executor",
        choices=("slurm", "local"),
        help="submit the cells as one job array: to Slurm, or as local processes (submitit)",
    )
    p.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    p.add_argument(
        "--gpus-per-task",
        type=at_least(0),
        help="GPUs of each task; above 1 each cell trains on that many processes (DDP)",
    )
    p.add_argument("--cpus-per-task", type=at_least(1), help="CPUs of each task")
    p.add_argument("--mem", type=_typed(check_mem), help="memory of each task: 16G, 64000M")
    p.add_argument(
        "--time",
        type=_typed(check_time),
        help="time limit of each task: 90 (minutes), 4:00:00, 2-00:00:00 "
        "(default: the partition's; a task out of time is requeued)",
    )
    p.add_argument(
        "--array-parallelism", type=at_least(1), help="tasks of the array that run at once"
    )
    p.add_argument("--account", help="Slurm account to charge")
    p.add_argument("--qos", help="Slurm quality of service")
    p.add_argument(
        "--wait", action="store_true", help="with --executor: wait for the tasks, then report"
    )
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--cell-record", type=Path, help=argparse.SUPPRESS)


def _typed(check):
    """An argparse type from a ``check_*(text, where)`` of :mod:`harness.config.executor`."""

    def parse(text: str) -> str:
        try:
            return check(text, text)
        except HarnessError as err:
            raise argparse.ArgumentTypeError(str(err).split(": ", 1)[1]) from None

    return parse
