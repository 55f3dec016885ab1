"""``python -m harness export RUN_ID DIR``: a run's trained embedder as an MLflow model
folder of its own, loaded with MLflow and torch alone.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.export_command`, imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_export_parser", "DESCRIPTION", "cmd_export"]


def cmd_export(args: argparse.Namespace) -> int:
    """Write the model folder of ``args.run_id`` (:func:`harness.cli.export_command.cmd_export`)."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import export_command

    return export_command.cmd_export(args)


DESCRIPTION = """\
Write a FINISHED run's selected weights, with the protocol's input normalisation, as an
MLflow model folder: mlflow.pyfunc.load_model(DIR) and mlflow.pytorch.load_model(DIR) load
it in a Python with MLflow and torch and nothing of the harness. uint8 images B x 3 x H x W
in (any batch; any height and width the backbone takes), L2-normalised embeddings out; the
run, its protocol fingerprint and its evaluation preprocessing are in the model's metadata.
DIR must be new, empty, or an earlier export left as it was; it appears whole or not at all."""


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    export = subparsers.add_parser(
        "export",
        help="write a run's embedder as an MLflow model folder that loads without the harness",
        description=DESCRIPTION,
    )
    export.add_argument("run_id", metavar="RUN_ID", help="a FINISHED run in the tracking store")
    export.add_argument("folder", metavar="DIR", type=Path, help="the model folder to write")
    export.add_argument(
        "--checkpoint-root",
        type=Path,
        help="where the run's checkpoints are here (default: $DML_HARNESS_CHECKPOINTS, "
        "else results/checkpoints)",
    )
    export.set_defaults(func=cmd_export)
    return export
