"""``export``'s arguments: the run, the folder, and where the run's checkpoints are here."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.export import cmd_export

__all__ = ["add_export_parser", "DESCRIPTION"]

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
