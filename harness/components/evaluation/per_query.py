"""The per-query values behind the retrieval means, stored with a run
(:data:`PER_QUERY_ARTIFACT`) so that intervals and paired tests over queries can be
computed after the fact."""

from __future__ import annotations

import io

import numpy as np

from harness.base.atomic import atomic_write_bytes
from harness.components.evaluation.metrics import PER_QUERY_SCORES

__all__ = ["PER_QUERY_ARTIFACT", "save_per_query", "load_per_query", "per_query_values"]

#: Where a run's per-query test results are logged (MLflow artifact path).
PER_QUERY_ARTIFACT = "evaluation/per_query_test.npz"


def save_per_query(path, per_query: dict[str, np.ndarray]) -> None:
    """Write per-query arrays as one compressed ``.npz``, atomically (never half-written)."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **per_query)  # type: ignore[arg-type]  # numpy's stub matches **kwds to allow_pickle: bool
    atomic_write_bytes(path, buffer.getvalue())


def load_per_query(path) -> dict[str, np.ndarray]:
    """Arrays written by :func:`save_per_query` (no pickled objects are loaded)."""
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def per_query_values(per_query: dict[str, np.ndarray], metric: str) -> np.ndarray | None:
    """One metric's per-query values (Q',) over the scored queries (R > 0), in query order;
    None when the stored arrays cannot give it (clustering metrics, a score not kept).
    ``precision_at_1`` and ``recall_at_K`` come from the first relevant item's rank; where
    the ranks are several models' (one row per model: a tuned grid's separated report),
    a query's value is the share of the models that hit, as the report's metric is the
    mean over the models."""
    scored = per_query["num_relevant"] > 0
    rank = np.atleast_2d(per_query["first_hit_rank"])[:, scored]
    if metric == "precision_at_1":
        return (rank == 0).mean(axis=0, dtype=np.float64)
    if metric.startswith("recall_at_") and metric.removeprefix("recall_at_").isdigit():
        return (rank < int(metric.removeprefix("recall_at_"))).mean(axis=0, dtype=np.float64)
    if metric in per_query and metric in PER_QUERY_SCORES:
        return per_query[metric][scored].astype(np.float64)
    return None
