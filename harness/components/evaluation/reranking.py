"""Ranking by a method's own scores instead of the cosine: re-scoring each query's top
candidates (:func:`rerank_top_k`) and ranking every (query, reference) pair in chunks
(:func:`exhaustive_knn`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from harness.base.errors import HarnessError

__all__ = ["Reranker", "PairScorer", "rerank_top_k", "exhaustive_knn"]

#: (query ids (Q,), candidate ids (Q x K)) -> new similarities (Q x K), higher is closer.
Reranker = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: (query ids (Q,), gallery ids (G,)) -> similarities of every pair (Q x G, a numpy array or a
#: torch tensor on any device), higher is closer.
PairScorer = Callable[[np.ndarray, np.ndarray], "np.ndarray | object"]


def rerank_top_k(
    indices: np.ndarray, query_ids: np.ndarray, reranker: Reranker, top_k: int
) -> np.ndarray:
    """Re-order the first ``top_k`` columns of ``indices`` (Q x k) by the reranker's scores.

    The rest stay in place; equal scores keep their original (cosine) order.
    """
    if top_k <= 0 or indices.shape[1] == 0:
        return indices
    head = indices[:, :top_k]
    scores = reranker(query_ids, head)
    if hasattr(scores, "detach"):  # a torch tensor, possibly on a GPU
        scores = scores.detach().float().cpu().numpy()
    order = np.argsort(-np.asarray(scores), axis=1, kind="stable")
    out = indices.copy()
    out[:, :top_k] = np.take_along_axis(head, order, 1)
    return out


def exhaustive_knn(
    num_queries: int,
    num_reference: int | None,
    scorer: PairScorer,
    k: int,
    *,
    query_chunk: int = 64,
    reference_chunk: int = 1024,
):
    """Yield ``(start, stop, indices)`` per chunk of queries: each query's top-``k`` reference
    items over *every* (query, reference) pair scored by ``scorer``.

    ``num_reference=None``: same-source retrieval (the queries against themselves, each
    query removed from its own list by index). The order is the one :func:`iter_knn` gives
    the cosine: decreasing score, ties by reference index (lower first). Reference chunks
    of ``reference_chunk`` items are scored for ``query_chunk`` queries at a time and merged
    into a running top-k, so memory is ``query_chunk x (reference_chunk + k)`` scores plus
    what the scorer needs for ``query_chunk x reference_chunk`` pairs; never Q x N. Merging
    runs on the scorer's device (a stable sort of [running top-k, new chunk]: both are in
    the total order already, and every running id is below the new chunk's).
    """

    same = num_reference is None
    n_ref = num_queries if num_reference is None else int(num_reference)
    k = max(0, min(int(k), n_ref - int(same)))
    for start in range(0, num_queries, max(1, query_chunk)):
        stop = min(num_queries, start + max(1, query_chunk))
        q_ids = np.arange(start, stop)
        if k == 0:
            yield start, stop, np.empty((stop - start, 0), np.int64)
            continue
        best_s = best_i = None
        for g0 in range(0, n_ref, max(1, reference_chunk)):
            g1 = min(n_ref, g0 + max(1, reference_chunk))
            s = torch.as_tensor(scorer(q_ids, np.arange(g0, g1))).float()
            if s.shape != (stop - start, g1 - g0):
                raise HarnessError(
                    f"pair scorer returned {tuple(s.shape)}, expected {(stop - start, g1 - g0)}"
                )
            ids = torch.arange(g0, g1, device=s.device).expand(stop - start, -1)
            s = torch.nan_to_num(s, nan=-torch.inf)
            if same:  # the query itself never enters: k <= N - 1 finite scores outrank it
                s = s.masked_fill(
                    ids == torch.as_tensor(q_ids, device=s.device)[:, None], -torch.inf
                )
            if best_s is not None and best_i is not None:
                s, ids = torch.cat([best_s, s], 1), torch.cat([best_i, ids], 1)
            order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
            best_s, best_i = s.gather(1, order), ids.gather(1, order)
        assert best_i is not None  # k > 0: at least one reference chunk
        yield start, stop, best_i.cpu().numpy().astype(np.int64)
