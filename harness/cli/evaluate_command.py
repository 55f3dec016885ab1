"""``python -m harness evaluate``: score saved embeddings with the project's evaluation suite.

Same code path and metric names as ``run`` (:func:`harness.components.evaluation.evaluate_embeddings`).
Every input problem is one :class:`~harness.base.errors.HarnessError` line (the CLI
prints ``error: ...`` and exits 2), raised before any work starts; the
``--json`` file is written atomically, only once the metrics exist.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from harness.base.errors import HarnessError
from harness.base.written import write_output_json
from harness.cli.outputs import output_file
from harness.components.evaluation import (
    DEFAULT_METRICS,
    evaluate_embeddings,
    gpu_available,
    parse_metrics,
)

__all__ = ["cmd_evaluate", "load_embeddings", "load_labels"]


# ------------------------------------------------------------------------- inputs


def _load_npy(path: Path, flag: str) -> np.ndarray:
    if path.suffix.lower() != ".npy":
        raise HarnessError(
            f"{flag} {path}: expected a .npy file (numpy.save), got '{path.suffix or 'no suffix'}'"
        )
    if not path.exists():
        raise HarnessError(f"{flag} {path}: no such file")
    if not path.is_file():
        raise HarnessError(f"{flag} {path}: not a file")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HarnessError(f"{flag} {path}: not a readable .npy array ({reason})") from None


def load_embeddings(path: Path, flag: str) -> np.ndarray:
    """N x D float32 embeddings from ``path``: numeric, 2-D, non-empty, finite, no all-zero row."""
    x = _load_npy(path, flag)
    if x.dtype.kind not in "fiu":
        raise HarnessError(f"{flag} {path}: expected numbers, got dtype {x.dtype}")
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise HarnessError(f"{flag} {path}: expected a non-empty N x D array, got shape {x.shape}")
    x = x.astype(np.float32, copy=False)
    finite = np.isfinite(x).all(1)
    if not finite.all():
        raise HarnessError(
            f"{flag} {path}: row {int(np.argmin(finite))} contains NaN or infinite values "
            f"({int((~finite).sum())} rows in all)"
        )
    zero = ~x.any(1)
    if zero.any():
        raise HarnessError(
            f"{flag} {path}: row {int(np.argmax(zero))} is all zeros and cannot be L2-normalised"
        )
    return x


def load_labels(path: Path, flag: str, num_rows: int, embeddings_flag: str) -> np.ndarray:
    """(N,) labels from ``path``: integers, strings, or integral floats; one per embedding row."""
    y = _load_npy(path, flag)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise HarnessError(f"{flag} {path}: expected a 1-D array of labels, got shape {y.shape}")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or not (y == np.round(y)).all():
            raise HarnessError(f"{flag} {path}: float labels must be whole numbers (no NaN)")
        y = y.astype(np.int64)
    elif y.dtype.kind not in "iubUS":
        raise HarnessError(f"{flag} {path}: expected integer or string labels, got dtype {y.dtype}")
    if len(y) != num_rows:
        raise HarnessError(
            f"{flag} {path} has {len(y)} labels but {embeddings_flag} has {num_rows} rows"
        )
    return y


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", ",").split(",") if x.strip()]
    except ValueError:
        raise HarnessError(
            f"{flag} expects comma-separated integers like 1,2,4,8; got '{text}'"
        ) from None
    if not values or min(values) < 1:
        raise HarnessError(f"{flag} expects positive integers like 1,2,4,8; got '{text}'")
    return values


# ------------------------------------------------------------------------- output


def _check_some_query_has_a_positive(
    query_labels: np.ndarray, gallery_labels: np.ndarray | None
) -> None:
    """Refuse labels under which no query has a positive: every metric would be undefined,
    and printing zeros would read as a model that retrieves nothing."""
    if gallery_labels is None:
        _, counts = np.unique(query_labels, return_counts=True)
        if not (counts > 1).any():
            raise HarnessError(
                f"--labels: all {len(query_labels)} labels are distinct, so no query has another "
                f"image of its class and every metric is undefined; a class needs 2 or more images"
            )
    elif not np.isin(query_labels, gallery_labels).any():
        raise HarnessError(
            f"--query-labels: none of the {len(query_labels)} queries has a class in --labels, so "
            f"no query has a positive in the gallery and every metric is undefined"
        )


def _jsonable(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value


def _use_gpu(device: str) -> bool:

    if device == "cuda" and not gpu_available():
        raise HarnessError(
            "--device cuda: this faiss build has no GPU support or sees no CUDA device"
        )
    return device == "cuda" or (device == "auto" and gpu_available())


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Validate every input, evaluate, print a table, write ``--json``; 0 on success."""

    if (args.query_embeddings is None) != (args.query_labels is None):
        raise HarnessError("give both --query-embeddings and --query-labels, or neither")
    recall_k = _int_list(args.recall_k, "--recall-k")
    chosen = ",".join(DEFAULT_METRICS) if args.metrics is None else args.metrics
    metrics = [m for m in chosen.replace(" ", ",").split(",") if m.strip()]
    if not metrics:
        raise HarnessError("--metrics is empty")
    parse_metrics(metrics, recall_k)
    args.json = output_file(args.json, "--json", args=args)
    use_gpu = _use_gpu(args.device)

    query, query_labels, gallery, gallery_labels = _load_inputs(args)
    _check_some_query_has_a_positive(query_labels, gallery_labels)

    result = evaluate_embeddings(
        query,
        query_labels,
        gallery,
        gallery_labels,
        recall_k=recall_k,
        metrics=metrics,
        chunk_size=args.chunk_size,
        use_gpu=use_gpu,
        kmeans_seed=args.seed,
    )
    print(_format(result, len(query), None if gallery is None else len(gallery)))
    if args.json:
        write_output_json(args.json, _record(args, result, recall_k, same=gallery is None))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _load_inputs(
    args: argparse.Namespace,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(query, query labels, gallery, gallery labels): with no ``--query-embeddings`` every
    embedding is a query against the others (gallery None)."""
    embeddings = load_embeddings(args.embeddings, "--embeddings")
    labels = load_labels(args.labels, "--labels", len(embeddings), "--embeddings")
    if args.query_embeddings is None:
        return embeddings, labels, None, None
    query = load_embeddings(args.query_embeddings, "--query-embeddings")
    query_labels = load_labels(
        args.query_labels, "--query-labels", len(query), "--query-embeddings"
    )
    if query.shape[1] != embeddings.shape[1]:
        raise HarnessError(
            f"--query-embeddings has {query.shape[1]} dimensions but --embeddings has "
            f"{embeddings.shape[1]}"
        )
    return query, query_labels, embeddings, labels


def _record(
    args: argparse.Namespace, result: dict[str, float], recall_k: list[int], *, same: bool
) -> dict:
    """What ``--json`` holds: the inputs, the settings, the counts and the metrics."""
    return {
        "mode": "self" if same else "query-gallery",
        "embeddings": str(args.embeddings),
        "labels": str(args.labels),
        "query_embeddings": None if args.query_embeddings is None else str(args.query_embeddings),
        "query_labels": None if args.query_labels is None else str(args.query_labels),
        "normalized": True,
        "recall_k": recall_k,
        "kmeans_seed": args.seed,
        "num_queries": result["num_queries"],
        "num_lone_queries": result["num_lone_queries"],
        "metrics": {k: _jsonable(v) for k, v in result.items() if not k.startswith("num_")},
    }


def _format(result: dict[str, float], num_query: int, num_gallery: int | None) -> str:
    where = "against themselves" if num_gallery is None else f"against a gallery of {num_gallery}"
    lines = [
        f"{num_query} queries searched {where}: {result['num_queries']} scored, "
        f"{result['num_lone_queries']} lone (no other member of their class) excluded"
    ]
    width = max((len(k) for k in result), default=0)
    lines += [f"  {k:<{width}}  {v:.4f}" for k, v in result.items() if not k.startswith("num_")]
    return "\n".join(lines)
