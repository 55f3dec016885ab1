"""``python -m harness explain``: a finished run's similarities explained and the explanations scored.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.explain_command`, imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.arguments import (
    at_least,
)
from harness.cli.outputs import add_force_argument, add_output_argument
from harness.components.explanation.curve_settings import CANVASES, CURVE_PAIRS

__all__ = ["add_explain_parser", "cmd_explain"]


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain the run of ``args`` and score its maps
    (:func:`harness.cli.explain_command.cmd_explain`)."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import explain_command

    return explain_command.cmd_explain(args)


def add_explain_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "explain",
        help="explain a finished run's similarities and score the explanations "
        "(ground-truth parts on synthetic; deletion / insertion everywhere)",
    )
    p.add_argument(
        "--run", required=True, metavar="RUN_ID", help="a FINISHED run in the tracking store"
    )
    p.add_argument(
        "--pairs", type=at_least(1), default=200, help="pairs to explain and score (default 200)"
    )
    p.add_argument(
        "--curve-pairs",
        type=at_least(1),
        default=CURVE_PAIRS,
        help=f"of those, how many get deletion / insertion curves (default {CURVE_PAIRS}; "
        "114 forward passes each)",
    )
    p.add_argument(
        "--insertion-canvas",
        choices=CANVASES,
        default="blur",
        help="what the insertion curve reveals pixels on: the query blurred (default; RISE's "
        "substrate) or the protocol's mean colour (what deletion leaves)",
    )
    add_output_argument(
        p, "--out", form="folder", help="folder for the figures (default results/explain/<run id>)"
    )
    add_output_argument(p, "--json", help="write the scores to this file")
    add_force_argument(p)
    p.add_argument(
        "--seed",
        type=at_least(0),
        default=0,
        help="seed of the pair sampling and the random orders",
    )
    _add_location_arguments(p)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--sanity",
        action="store_true",
        help="also score the ceiling (the differing part's mask), the chance (a map uniform "
        "on the object), the floors (a uniform and a random map) and each source's maps "
        "under cascading randomisation of the weights (Adebayo et al. 2018), with three "
        "verdicts per source: beats chance, changes under randomisation, uses training",
    )
    p.set_defaults(func=cmd_explain)
    return p


def _add_location_arguments(p: argparse.ArgumentParser) -> None:
    """Where the run's data and weights are now."""
    p.add_argument("--data-root", type=Path)
    p.add_argument(
        "--dataset",
        type=Path,
        metavar="PATH",
        help="where the files of a run on your own dataset are now (default: where the run "
        "read them; the run's fingerprint must match)",
    )
    p.add_argument(
        "--checkpoint-root",
        type=Path,
        help="where the run's weights are (default "
        "$DML_HARNESS_CHECKPOINTS, else results/checkpoints)",
    )
