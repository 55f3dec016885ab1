"""``python -m harness rerun``: runs trained again from their records, every metric compared.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.rerun_command`, imported when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cli.arguments import at_least, experiment_name, positive_number
from harness.cli.outputs import add_output_argument

__all__ = ["add_rerun_parser", "DEFAULT_TOLERANCE", "DESCRIPTION", "cmd_rerun"]


def cmd_rerun(
    args: argparse.Namespace, *, train: Callable[..., dict[str, Any]] | None = None
) -> int:
    """Re-run the runs of ``args`` and compare their metrics
    (:func:`harness.cli.rerun_command.cmd_rerun`); ``train`` stands in for the engine's
    training of one run."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import rerun_command

    return rerun_command.cmd_rerun(args, train=train)


#: ``--tolerance``'s default: the noise interval of a test metric (a fraction) when the
#: run's cell has one seed.
DEFAULT_TOLERANCE = 0.01


DESCRIPTION = """\
Train runs again from their records alone and compare every metric: IDENTICAL (float
for float), WITHIN NOISE (within the seed spread of the run's cell) or DIFFERS. Every run
is checked before any trains; one summary line per run, then the table of verdicts. Exit
status 0 when no run DIFFERS, 1 when one does, 2 on bad input."""


def add_rerun_parser(subparsers) -> argparse.ArgumentParser:
    rerun_parser = subparsers.add_parser(
        "rerun",
        help="train runs again from their records and compare every metric",
        description=DESCRIPTION,
    )
    rerun_parser.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="runs to re-run")
    rerun_parser.add_argument(
        "--experiment", type=experiment_name, help="re-run the runs of this experiment"
    )
    rerun_parser.add_argument(
        "--filter",
        default="",
        help="with --experiment: MLflow's search syntax, e.g. \"params.method = 'agrouping'\"",
    )
    rerun_parser.add_argument(
        "--table",
        type=experiment_name,
        metavar="EXPERIMENT",
        help="re-run the runs behind the cells of this experiment's table and print it marked",
    )
    rerun_parser.add_argument("--data-root", type=Path, help="where the runs' dataset is here")
    rerun_parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    rerun_parser.add_argument("--workers", type=at_least(0), help="data-loading processes")
    add_output_argument(
        rerun_parser,
        "--checkpoint-root",
        form="folder",
        type=Path,
        help="the reruns' checkpoints go under <root>/reruns (default: as run)",
    )
    rerun_parser.add_argument(
        "--tolerance",
        type=positive_number,
        default=DEFAULT_TOLERANCE,
        help="the noise interval of a test metric (a fraction) for a cell of one seed "
        f"(default {DEFAULT_TOLERANCE})",
    )
    rerun_parser.add_argument(
        "--allow-data-change",
        action="store_true",
        help="re-run on data whose split digest differs from the record",
    )
    rerun_parser.add_argument(
        "--allow-code-change",
        action="store_true",
        help="re-run a run whose commit is not in this checkout's history",
    )
    rerun_parser.set_defaults(func=cmd_rerun)
    return rerun_parser
