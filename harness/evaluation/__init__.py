"""Evaluation: chunked exact kNN (faiss) + retrieval metrics, optionally on a re-ranked order."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .knn import drop_self, knn
from .metrics import relevant_counts, retrieval_metrics

__all__ = ["evaluate_embeddings", "knn", "drop_self", "retrieval_metrics", "relevant_counts",
           "rerank_top_k"]

#: (query ids Q, candidate ids Q x K) -> new similarity Q x K.
Reranker = Callable[[np.ndarray, np.ndarray], np.ndarray]


def rerank_top_k(indices: np.ndarray, query_ids: np.ndarray, reranker: Reranker, top_k: int) -> np.ndarray:
    """Re-order the first ``top_k`` columns by the reranker's scores; the rest stay in place."""
    if top_k <= 0:
        return indices
    head = indices[:, :top_k]
    scores = np.asarray(reranker(query_ids, head))
    order = np.argsort(-scores, axis=1, kind="stable")
    out = indices.copy()
    out[:, :top_k] = np.take_along_axis(head, order, 1)
    return out


def evaluate_embeddings(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray | None = None,
                        gallery_labels: np.ndarray | None = None, *, recall_k: Sequence[int] = (1, 2, 4, 8),
                        metrics: Sequence[str] | None = None, reranker: Reranker | None = None,
                        rerank_k: int = 0, chunk_size: int = 4096, use_gpu: bool = False) -> dict[str, float]:
    """Score L2-normalised embeddings; ``gallery=None`` searches the queries against themselves."""
    same = gallery is None
    ref_labels = query_labels if same else gallery_labels
    r = relevant_counts(query_labels, ref_labels, same_source=same)
    k = int(max(max(recall_k), r.max(initial=1), rerank_k))
    idx, _ = knn(query, gallery, k, chunk_size=chunk_size, use_gpu=use_gpu)
    if reranker is not None and rerank_k > 0:
        idx = rerank_top_k(idx, np.arange(len(query)), reranker, rerank_k)
    return retrieval_metrics(ref_labels[idx], query_labels, r, recall_k=recall_k, metrics=metrics)
