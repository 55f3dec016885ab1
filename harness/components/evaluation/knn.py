"""Exact nearest neighbours by inner product with faiss, in chunks of queries.

On L2-normalised embeddings the inner product is the cosine similarity, so the
ranking is the one pytorch-metric-learning's ``AccuracyCalculator`` gets from
``FaissKNN(index_init_fn=faiss.IndexFlatIP)``.

Guarantees
----------
* Memory is bounded by ``chunk x k`` results plus the index, and by
  :data:`RANK_BLOCK` similarities in :func:`first_relevant_rank`: no N x N matrix.
* Same-source search (``reference=None``) removes each query from its own list
  *by index*, never by dropping column 0: with duplicates and ties another item
  can come first. When the query is not among its ``k + 1`` results (more than
  ``k`` items tie with it) the last result is dropped instead, as PML does.
* The lists are the exact top k of one total order: decreasing similarity,
  ties broken by reference index (lower first). faiss orders equal scores
  arbitrarily and, when a group of equal scores straddles the k-th position,
  keeps an arbitrary part of it; so each search asks for one extra neighbour,
  sorts ties by index, and re-searches with a growing k only the rows whose
  k-th and (k+1)-th scores are equal (rare outside duplicated embeddings).
* Recall@K for a K far beyond the other metrics' needs (SOP's Recall@1000)
  does not need a k = K search, only the rank of the first relevant item:
  :func:`first_relevant_rank` counts it exactly, for the few queries whose
  first relevant item is not in their list (selecting 1,000 neighbours costs
  faiss about twice the matrix product itself).
* Results do not depend on ``chunk_size`` beyond float32 rounding: faiss
  computes inner products with a sequential SIMD kernel for small batches and
  with BLAS for large ones, and the two round differently, so every chunk is
  made large enough to take the BLAS path as one big chunk would (see
  :func:`chunk_bounds`). How a BLAS blocks the product still depends on its
  shape, and that depends on the library and CPU (and on CUDA): similarities
  may differ by a few ulp between chunk sizes (observed up to 1.3e-7), which
  can only reorder near ties. On this project's CI machine they are
  bit-identical; the tests compare them to a stated tolerance (1e-6).

Where the search runs: with ``use_gpu``, faiss's GPU index when this faiss build
has one (``faiss-gpu``), else torch on the CUDA device (the reference uploaded
once, one ``chunk x N`` similarity block and ``topk`` per chunk: the same exact
top k, ties then ordered by index as above), else faiss on the CPU. ``device``
forces the torch search on a named device (the tests run it on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import faiss
import numpy as np
import torch

if TYPE_CHECKING:  # torch is imported only for a torch search (the CPU suite stays without it)
    import torch

__all__ = [
    "knn",
    "iter_knn",
    "drop_self",
    "break_ties_by_index",
    "chunk_bounds",
    "make_index",
    "first_relevant_rank",
    "gpu_available",
    "search_device",
    "GPU_MAX_K",
]

#: Largest k faiss's GPU flat index accepts; larger searches fall back to the CPU.
GPU_MAX_K = 2048
#: Similarities held at once by :func:`first_relevant_rank` (64 MiB of float32).
RANK_BLOCK = 1 << 24
_GPU_RESOURCES: list = []


def gpu_available() -> bool:
    """True when this faiss build has GPU support and sees a CUDA device."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def make_index(reference: np.ndarray, *, use_gpu: bool = False) -> faiss.Index:
    """An exact inner-product index over ``reference`` (N x D float32), on a GPU when asked and present."""
    index: faiss.Index = faiss.IndexFlatIP(reference.shape[1])
    if use_gpu and gpu_available():
        if not _GPU_RESOURCES:
            _GPU_RESOURCES.append(faiss.StandardGpuResources())
        index = faiss.index_cpu_to_gpu(_GPU_RESOURCES[0], 0, index)
    index.add(reference)
    return index


def chunk_bounds(num_queries: int, chunk_size: int, dim: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(num_queries)`` in order.

    Each chunk has at least ``max(chunk_size, m)`` rows, where ``m`` is the
    smallest batch faiss searches with BLAS (``distance_compute_blas_threshold``
    counts ``rows x dim``); a short tail is merged into the chunk before it. So
    either every chunk takes faiss's BLAS path or there is a single chunk, and
    each query's similarities equal an unchunked search's up to the BLAS's
    blocking-dependent rounding (a few ulp; see the module docstring).
    """
    minimum = _min_rows(dim)
    size = max(int(chunk_size), minimum)
    starts = list(range(0, num_queries, size))
    if len(starts) > 1 and num_queries - starts[-1] < minimum:
        starts.pop()
    return [
        (s, starts[i + 1] if i + 1 < len(starts) else num_queries) for i, s in enumerate(starts)
    ]


def drop_self(
    indices: np.ndarray, sims: np.ndarray, query_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Remove ``query_ids[i]`` from row ``i`` (Q x (k+1) -> Q x k), or its last entry where absent."""
    remove = indices == query_ids[:, None]
    remove[~remove.any(1), -1] = True
    keep = ~remove
    shape = (indices.shape[0], indices.shape[1] - 1)
    return indices[keep].reshape(shape), sims[keep].reshape(shape)


def break_ties_by_index(indices: np.ndarray, sims: np.ndarray) -> None:
    """Order equal similarities by index, in place (rows already sorted by decreasing similarity)."""
    if sims.shape[1] < 2:
        return
    rows = np.flatnonzero((sims[:, 1:] == sims[:, :-1]).any(1))
    if rows.size == 0:
        return
    sub_idx, sub_sims = indices[rows], sims[rows]
    order = np.lexsort((sub_idx, -sub_sims), axis=-1)
    indices[rows] = np.take_along_axis(sub_idx, order, 1)
    sims[rows] = np.take_along_axis(sub_sims, order, 1)


def _min_rows(dim: int) -> int:
    """Smallest batch that faiss searches with BLAS (``distance_compute_blas_threshold`` counts rows x dim)."""
    threshold = int(faiss.cvar.distance_compute_blas_threshold)
    return max(-(-threshold // max(dim, 1)), 32, faiss.omp_get_max_threads())


def search_device(use_gpu: bool, device: str | torch.device | None = None) -> torch.device | None:
    """The device of a torch search, or None for faiss: ``device`` when given, else CUDA when
    a GPU is asked for and faiss has none."""
    if device is None and not (use_gpu and not gpu_available()):
        return None

    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else None


class _Search:
    """``search(x, k) -> (sims, indices)``: faiss on a GPU when asked, present and k allows,
    torch on ``device`` (see :func:`search_device`), else faiss on the CPU."""

    cpu: faiss.Index | None

    def __init__(
        self, reference: np.ndarray, *, use_gpu: bool, device: str | torch.device | None = None
    ):
        self.reference, self.cpu = reference, None
        self.device = search_device(use_gpu, device)
        self.torch_reference = None
        if self.device is not None:
            self.torch_reference = torch.from_numpy(reference).to(self.device)
        self.gpu = (
            make_index(reference, use_gpu=True)
            if use_gpu and self.device is None and gpu_available()
            else None
        )

    def __call__(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.torch_reference is not None:
            with torch.inference_mode():
                sims = (
                    torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
                    @ self.torch_reference.T
                )
                values, indices = sims.topk(k, dim=1, largest=True, sorted=True)
            return values.cpu().numpy(), indices.cpu().numpy()
        if self.gpu is not None and k <= GPU_MAX_K:
            return self.gpu.search(x, k)
        if self.cpu is None:
            self.cpu = make_index(self.reference)
        return self.cpu.search(x, k)


def _ranked(
    search: _Search, x: np.ndarray, width: int, query_ids: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Search ``width`` neighbours (one more with a self to drop), self removed, ties ordered by index."""
    sims, idx = search(x, width + int(query_ids is not None))
    if query_ids is not None:
        idx, sims = drop_self(idx, sims, query_ids)
    break_ties_by_index(idx, sims)
    return idx, sims


def _widen(
    search: _Search,
    query: np.ndarray,
    rows: np.ndarray,
    k: int,
    *,
    same: bool,
    candidates: int,
    budget: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k (by similarity, then index) of the query ``rows`` whose k-th score ties with the next.

    Re-searches with a doubling width until the tied group at the k-th position
    is complete (the last score retrieved is lower) or everything is retrieved.
    Batches stay small enough for faiss's sequential kernel (and are padded to
    the thread count, below which faiss splits the database instead), so a
    row's result never depends on which rows are re-searched with it, hence
    not on the chunking. ``budget`` bounds rows x width per batch.
    """
    threshold = int(faiss.cvar.distance_compute_blas_threshold)
    seq_rows = max(1, -(-threshold // max(query.shape[1], 1)) - 1)
    pad_to = min(faiss.omp_get_max_threads(), seq_rows)
    out_idx, out_sims = np.empty((len(rows), k), np.int64), np.empty((len(rows), k), np.float32)
    todo, width = np.arange(len(rows)), min(2 * (k + 1), candidates)
    while todo.size:
        step = max(1, min(budget // (width + 1), seq_rows))
        still = []
        for b in range(0, len(todo), step):
            part = todo[b : b + step]
            x = query[rows[part]]
            if len(x) < pad_to:
                x = np.concatenate([x, np.repeat(x[:1], pad_to - len(x), 0)])
            sims, idx = search(x, width + int(same))
            idx, sims = idx[: len(part)], sims[: len(part)]
            if same:
                idx, sims = drop_self(idx, sims, rows[part])
            break_ties_by_index(idx, sims)
            done = (
                (sims[:, k - 1] > sims[:, -1]) if width < candidates else np.ones(len(part), bool)
            )
            out_idx[part[done]], out_sims[part[done]] = idx[done, :k], sims[done, :k]
            still.append(part[~done])
        todo, width = np.concatenate(still), min(2 * width, candidates)
    return out_idx, out_sims


def iter_knn(
    query: np.ndarray,
    reference: np.ndarray | None,
    k: int,
    *,
    chunk_size: int = 4096,
    use_gpu: bool = False,
    device: str | torch.device | None = None,
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """Yield ``(start, stop, indices, sims)`` per chunk of queries; arrays are (stop - start) x k'.

    ``query``: Q x D float32; ``reference``: N x D float32, or None to search
    the queries against themselves without each query itself. ``k'`` is ``k``
    capped at the number of candidates (N, or Q - 1 for same-source).
    """
    same = reference is None
    query = np.ascontiguousarray(query, dtype=np.float32)
    reference = query if same else np.ascontiguousarray(reference, dtype=np.float32)
    candidates = len(reference) - int(same)
    k = max(0, min(int(k), candidates))
    bounds = chunk_bounds(len(query), chunk_size, query.shape[1])
    if k == 0:
        for start, stop in bounds:
            yield (
                start,
                stop,
                np.empty((stop - start, 0), np.int64),
                np.empty((stop - start, 0), np.float32),
            )
        return
    width = min(
        k + 1, candidates
    )  # one extra neighbour shows whether a tie straddles the k-th position
    search = _Search(reference, use_gpu=use_gpu, device=device)
    budget = max(chunk_size, _min_rows(query.shape[1])) * (width + 1)
    for start, stop in bounds:
        ids = np.arange(start, stop)
        idx, sims = _ranked(search, query[start:stop], width, ids if same else None)
        if width > k:
            straddle = np.flatnonzero(sims[:, k - 1] == sims[:, k])
            if straddle.size:
                idx[straddle, :k], sims[straddle, :k] = _widen(
                    search, query, ids[straddle], k, same=same, candidates=candidates, budget=budget
                )
        yield start, stop, idx[:, :k], sims[:, :k]


def knn(
    query: np.ndarray,
    reference: np.ndarray | None,
    k: int,
    *,
    chunk_size: int = 4096,
    use_gpu: bool = False,
    device: str | torch.device | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` reference indices (Q x k int64) and similarities (Q x k float32) per query.

    ``reference=None`` searches the queries against themselves, each query
    removed from its own list by index. See :func:`iter_knn`.
    """
    parts = list(
        iter_knn(query, reference, k, chunk_size=chunk_size, use_gpu=use_gpu, device=device)
    )
    if not parts:
        return np.empty((0, 0), np.int64), np.empty((0, 0), np.float32)
    return np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts])


def first_relevant_rank(
    query: np.ndarray,
    reference: np.ndarray | None,
    query_labels: np.ndarray,
    reference_labels: np.ndarray,
    rows: np.ndarray,
    *,
    block: int = RANK_BLOCK,
) -> np.ndarray:
    """0-based rank (R,) int64 of the first relevant reference item of each query in ``rows``.

    The rank is the position in the same total order as :func:`iter_knn`
    (decreasing similarity, ties by index, the query itself left out when
    ``reference`` is None): the number of items before the best relevant one.
    Computed without sorting, by counting, over blocks of at most ``block``
    similarities (query rows x N), so memory stays bounded. Every row must have
    a relevant item. Similarities come from numpy's BLAS matrix product (rows
    padded to two so that it never switches to its vector kernel), which is
    independent of how rows are batched.
    """
    same = reference is None
    reference = query if reference is None else reference
    cols = np.arange(len(reference))
    step = max(1, block // max(len(reference), 1))
    out = np.empty(len(rows), np.int64)
    for b in range(0, len(rows), step):
        part = rows[b : b + step]
        x = query[part] if len(part) > 1 else query[np.r_[part, part]]
        sims = (x @ reference.T)[: len(part)]
        relevant = reference_labels[None, :] == query_labels[part, None]
        if same:
            here = np.arange(len(part))
            relevant[here, part] = False
            sims[here, part] = -np.inf
        best = np.where(relevant, sims, -np.inf).max(1, keepdims=True)
        first = np.argmax(relevant & (sims == best), axis=1)[:, None]
        out[b : b + len(part)] = ((sims > best) | ((sims == best) & (cols[None, :] < first))).sum(1)
    return out
