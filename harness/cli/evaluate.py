"""``python -m harness evaluate``: score saved embeddings with the evaluation suite.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.evaluate_command`, imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.arguments import (
    at_least,
)
from harness.cli.outputs import add_force_argument, add_output_argument

__all__ = ["add_evaluate_parser", "cmd_evaluate"]


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Score the saved embeddings of ``args``
    (:func:`harness.cli.evaluate_command.cmd_evaluate`)."""
    # deferred: torch, numpy and faiss load only when the command runs
    from harness.cli import evaluate_command

    return evaluate_command.cmd_evaluate(args)


_DESCRIPTION = """\
Score embeddings saved as .npy files. Embeddings are L2-normalised by this
command before any metric (cosine similarity, exact kNN with faiss in chunks).
With only --embeddings/--labels the set is searched against itself (each
query without itself; queries alone in their class are excluded and counted).
With --query-embeddings/--query-labels the query set is searched against the
--embeddings/--labels gallery (In-Shop style). Metrics: precision_at_1,
recall_at_k (one recall_at_K per --recall-k value, or name recall_at_5 etc.),
r_precision, mean_average_precision_at_r, map_at_c (Roth et al. 2020 mAP@C),
nmi, ami, f1 (clustering metrics of one faiss k-means run on the query set)."""


def add_evaluate_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``evaluate`` sub-command to an ``argparse`` sub-parser collection."""

    p = subparsers.add_parser(
        "evaluate",
        help="score saved embeddings (.npy) with the evaluation suite",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--embeddings",
        type=Path,
        required=True,
        help="N x D .npy (float); the searched set, or the gallery with --query-*; "
        "L2-normalised by the command",
    )
    p.add_argument(
        "--labels", type=Path, required=True, help="(N,) .npy of class labels for --embeddings"
    )
    p.add_argument(
        "--query-embeddings",
        type=Path,
        help="Q x D .npy of queries searched against --embeddings (L2-normalised by the command)",
    )
    p.add_argument(
        "--query-labels", type=Path, help="(Q,) .npy of class labels for --query-embeddings"
    )
    p.add_argument(
        "--metrics",
        help="comma-separated metric names (default: every metric above but ami, which is "
        "slow with thousands of classes)",
    )
    p.add_argument(
        "--recall-k", default="1,2,4,8", help="comma-separated K for recall_at_K (default 1,2,4,8)"
    )
    add_output_argument(p, "--json", help="also write the result to this JSON file (atomically)")
    add_force_argument(p)
    p.add_argument(
        "--chunk-size",
        type=at_least(1),
        default=4096,
        help="queries per faiss search (bounds memory)",
    )
    p.add_argument(
        "--seed", type=at_least(0), default=0, help="k-means seed for nmi/ami/f1 (default 0)"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="faiss on a GPU (cuda), the CPU, or a GPU when available (auto)",
    )
    p.set_defaults(func=cmd_evaluate)
    return p
