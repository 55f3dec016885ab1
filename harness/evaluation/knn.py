"""Exact nearest neighbours by inner product with faiss, in chunks of queries.

Memory is bounded by ``chunk_size x k`` results plus the index; no N x N matrix
is ever built. The query itself is removed from its own results by index (never
by dropping column 0: duplicates and ties put other items first).
"""

from __future__ import annotations

import faiss
import numpy as np

__all__ = ["knn", "drop_self"]


def _index(reference: np.ndarray, use_gpu: bool):
    index = faiss.IndexFlatIP(reference.shape[1])
    if use_gpu and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    index.add(reference)
    return index


def drop_self(indices: np.ndarray, sims: np.ndarray, query_ids: np.ndarray, k: int):
    """Remove ``query_ids[i]`` from row ``i`` (or the last column where it is absent)."""
    is_self = indices == query_ids[:, None]
    # A stable sort on the boolean mask moves the self entry to the end, keeping order.
    order = np.argsort(is_self, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(indices, order, 1), np.take_along_axis(sims, order, 1)


def knn(query: np.ndarray, reference: np.ndarray | None, k: int, *, chunk_size: int = 4096,
        use_gpu: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` reference indices and similarities per query (Q x k each).

    ``reference=None`` searches the queries against themselves, excluding each
    query from its own list.
    """
    same = reference is None
    query = np.ascontiguousarray(query, dtype=np.float32)
    reference = query if same else np.ascontiguousarray(reference, dtype=np.float32)
    k = min(k, len(reference) - (1 if same else 0))
    index = _index(reference, use_gpu)
    out_idx = np.empty((len(query), k), dtype=np.int64)
    out_sim = np.empty((len(query), k), dtype=np.float32)
    for start in range(0, len(query), chunk_size):
        stop = min(start + chunk_size, len(query))
        sims, idx = index.search(query[start:stop], k + (1 if same else 0))
        if same:
            idx, sims = drop_self(idx, sims, np.arange(start, stop), k)
        out_idx[start:stop], out_sim[start:stop] = idx, sims
    return out_idx, out_sim
