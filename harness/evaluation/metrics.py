"""Retrieval metrics from ranked neighbour lists: one implementation for the whole project.

Names follow pytorch-metric-learning's ``AccuracyCalculator`` where it has the
metric (``precision_at_1``, ``r_precision``, ``mean_average_precision_at_r``);
Recall@K is the field's hit rate (any of the top K shares the query's class),
reported as ``recall_at_K``.

Inputs are the labels of each query's ranked neighbours (Q x k), so the same
code scores a plain cosine ranking and a re-ranked one (DIML, AVSL).
Queries with no relevant item in the reference (R = 0) are excluded from every
metric and counted in ``num_lone_queries``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["retrieval_metrics", "relevant_counts"]


def relevant_counts(query_labels: np.ndarray, reference_labels: np.ndarray, *, same_source: bool) -> np.ndarray:
    """R per query: reference items of the query's class (minus the query itself)."""
    classes, counts = np.unique(reference_labels, return_counts=True)
    pos = np.searchsorted(classes, query_labels)
    pos = np.clip(pos, 0, len(classes) - 1)
    found = classes[pos] == query_labels
    r = np.where(found, counts[pos], 0)
    return r - 1 if same_source else r


def retrieval_metrics(neighbor_labels: np.ndarray, query_labels: np.ndarray, num_relevant: np.ndarray,
                      *, recall_k=(1,), metrics=None) -> dict[str, float]:
    """Precision@1, Recall@K, R-Precision and MAP@R (R = ``num_relevant`` per query)."""
    valid = num_relevant > 0
    hits = neighbor_labels[valid] == query_labels[valid, None]
    r = num_relevant[valid]
    k = hits.shape[1]
    wanted = set(metrics or ("precision_at_1", "recall_at_k", "r_precision", "mean_average_precision_at_r"))
    out: dict[str, float] = {"num_queries": int(valid.sum()), "num_lone_queries": int((~valid).sum())}
    if not valid.any():
        return out
    if "precision_at_1" in wanted:
        out["precision_at_1"] = float(hits[:, 0].mean())
    if "recall_at_k" in wanted:
        first_hit = np.where(hits.any(1), hits.argmax(1), k)
        for kk in recall_k:
            out[f"recall_at_{kk}"] = float((first_hit < kk).mean())
    if wanted & {"r_precision", "mean_average_precision_at_r"}:
        if r.max() > k:
            raise ValueError(f"need at least max R = {r.max()} neighbours, got {k}")
        within_r = np.arange(k)[None, :] < r[:, None]
        hits_r = hits & within_r
        if "r_precision" in wanted:
            out["r_precision"] = float((hits_r.sum(1) / r).mean())
        if "mean_average_precision_at_r" in wanted:
            precision_at_i = np.cumsum(hits_r, axis=1) / np.arange(1, k + 1)[None, :]
            out["mean_average_precision_at_r"] = float(((precision_at_i * hits_r).sum(1) / r).mean())
    return out
