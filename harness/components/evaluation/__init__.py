"""Evaluation suite: chunked exact kNN (faiss) + retrieval and clustering metrics.

One implementation of each metric for the whole project: ``run`` (via
``harness.engine.training``), ``python -m harness evaluate`` and the benchmarks all go
through :func:`evaluate_embeddings`.

Metric names (the keys of the result and of the run's JSON):

==================================  =================================================
``precision_at_1``                  PML ``AccuracyCalculator`` definition
``recall_at_K``                     hit rate in the top K, one key per K
                                    (request all of ``recall_k`` with ``recall_at_k``)
``r_precision``                     PML, R = class size - 1 (same-source)
``mean_average_precision_at_r``     PML MAP@R (Musgrave et al. 2020)
``map_at_c``                        Roth et al. 2020 mAP@C (see :mod:`.metrics`)
``nmi``, ``ami``                    sklearn scores of one faiss k-means clustering
``f1``                              pair-counting F1 of the same clustering
``r_precision_query_in_r``,         DIML's released evaluation: the query counted in R
``mean_average_precision_at_r_query_in_r``   (a perfect ranking scores (n-1)/n)
==================================  =================================================

``evaluate_embeddings(..., per_query=True)`` also returns the per-query values behind
the retrieval means (:attr:`Scores.per_query`, see
:meth:`.metrics.RetrievalScores.per_query`), which a run stores as its
``evaluation/per_query_test.npz`` artifact (:func:`save_per_query`, :func:`load_per_query`)
so that intervals and paired tests over queries can be computed after the fact.

Plus ``num_queries`` (queries scored) and ``num_lone_queries`` (queries with no
other member of their class in the searched set, excluded from the retrieval
metrics). Cost: one kNN search with k = the largest neighbour count any metric
needs except a large Recall@K (in practice max R + 1), shared by all retrieval
metrics and streamed chunk by chunk (never Q x N, never even the full Q x k
lists); an exact count of the first relevant item's rank for the few queries
that a larger Recall@K needs beyond those lists; one k-means run shared by the
clustering metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from harness.base.errors import HarnessError, unknown_name
from harness.components.evaluation.clustering import (
    CLUSTERING_METRICS,
    clustering_metrics,
    kmeans_assignments,
    pair_counting_f1,
)
from harness.components.evaluation.knn import (
    break_ties_by_index,
    chunk_bounds,
    drop_self,
    first_relevant_rank,
    gpu_available,
    iter_knn,
    knn,
)
from harness.components.evaluation.metrics import (
    PAPER_VARIANTS,
    PER_QUERY_SCORES,
    RETRIEVAL_METRICS,
    RetrievalScores,
    relevant_counts,
    retrieval_metrics,
    with_paper_variants,
)

__all__ = [
    "evaluate_embeddings",
    "Scores",
    "save_per_query",
    "load_per_query",
    "per_query_values",
    "evaluation_code_digest",
    "PER_QUERY_ARTIFACT",
    "PAPER_VARIANTS",
    "PER_QUERY_SCORES",
    "with_paper_variants",
    "rerank_top_k",
    "exhaustive_knn",
    "Reranker",
    "PairScorer",
    "MetricRequest",
    "parse_metrics",
    "l2_normalize",
    "METRICS",
    "DEFAULT_METRICS",
    "RETRIEVAL_METRICS",
    "CLUSTERING_METRICS",
    "knn",
    "iter_knn",
    "drop_self",
    "break_ties_by_index",
    "chunk_bounds",
    "gpu_available",
    "first_relevant_rank",
    "retrieval_metrics",
    "relevant_counts",
    "kmeans_assignments",
    "pair_counting_f1",
    "clustering_metrics",
]

#: (query ids (Q,), candidate ids (Q x K)) -> new similarities (Q x K), higher is closer.
Reranker = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: (query ids (Q,), gallery ids (G,)) -> similarities of every pair (Q x G, a numpy array or a
#: torch tensor on any device), higher is closer.
PairScorer = Callable[[np.ndarray, np.ndarray], "np.ndarray | object"]

METRICS = RETRIEVAL_METRICS + CLUSTERING_METRICS
#: Everything except ``ami`` (sklearn's expected mutual information is slow with many classes)
#: and the papers' variants (asked for by name, or added by :func:`with_paper_variants`).
DEFAULT_METRICS = tuple(m for m in METRICS if m != "ami" and m not in PAPER_VARIANTS.values())
#: Where a run's per-query test results are logged (MLflow artifact path).
PER_QUERY_ARTIFACT = "evaluation/per_query_test.npz"


class Scores(dict):
    """Metric name -> value (a plain dict to every caller), with ``per_query``: the
    per-query arrays of the retrieval metrics when they were asked for, else None."""

    per_query: dict[str, np.ndarray] | None = None


def save_per_query(path, per_query: dict[str, np.ndarray]) -> None:
    """Write per-query arrays as one compressed ``.npz``, atomically (never half-written)."""
    import io

    from harness.base.atomic import atomic_write_bytes

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
    ``precision_at_1`` and ``recall_at_K`` come from the first relevant item's rank."""
    scored = per_query["num_relevant"] > 0
    rank = per_query["first_hit_rank"][scored]
    if metric == "precision_at_1":
        return (rank == 0).astype(np.float64)
    if metric.startswith("recall_at_") and metric.removeprefix("recall_at_").isdigit():
        return (rank < int(metric.removeprefix("recall_at_"))).astype(np.float64)
    if metric in per_query and metric in PER_QUERY_SCORES:
        return per_query[metric][scored].astype(np.float64)
    return None


def evaluation_code_digest() -> str:
    """sha256 (16 hex) of what decides an evaluation's numbers: the sources of
    ``harness/components/evaluation/*.py`` and the versions of the libraries they call (faiss,
    scikit-learn, numpy). Runs record it as the ``evaluation_code`` tag; tables flag rows
    whose runs differ in it."""
    import hashlib
    from importlib import metadata
    from pathlib import Path

    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for package in ("faiss-cpu", "faiss-gpu", "faiss", "scikit-learn", "numpy"):
        try:
            digest.update(f"{package}=={metadata.version(package)}\0".encode())
        except metadata.PackageNotFoundError:
            continue
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class MetricRequest:
    """Validated metric names: ``names`` among :data:`METRICS` and the Recall@K values."""

    names: frozenset[str]
    recall_k: tuple[int, ...]

    @property
    def retrieval(self) -> frozenset[str]:
        return self.names & set(RETRIEVAL_METRICS)

    @property
    def clustering(self) -> frozenset[str]:
        return self.names & set(CLUSTERING_METRICS)


def parse_metrics(
    metrics: Iterable[str] | None, recall_k: Iterable[int] = (1, 2, 4, 8)
) -> MetricRequest:
    """Names -> :class:`MetricRequest`; ``recall_at_k`` asks for every K in ``recall_k``, ``recall_at_5``
    for K = 5 alone. Unknown names and K < 1 raise :class:`HarnessError`."""
    names: set[str] = set()
    ks: set[int] = set()
    for raw in DEFAULT_METRICS if metrics is None else list(metrics):
        name = raw.strip().lower()
        suffix = name[len("recall_at_") :]
        if name == "recall_at_k":
            ks.update(int(k) for k in recall_k)
        elif name.startswith("recall_at_") and suffix.isdigit():
            ks.add(int(suffix))
        elif name not in METRICS:
            raise unknown_name("metric", raw, [*METRICS, "recall_at_<K>"])
        names.add("recall_at_k" if name.startswith("recall_at_") else name)
    if any(k < 1 for k in ks):
        raise HarnessError(f"Recall@K needs K >= 1, got {sorted(ks)}")
    return MetricRequest(frozenset(names), tuple(sorted(ks)))


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (N x D float32, a new array); all-zero rows stay zero."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, np.finfo(np.float32).tiny)


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
    import torch

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


def _check_inputs(query, query_labels, gallery, gallery_labels) -> None:
    """One-line :class:`HarnessError` for shapes that cannot be evaluated."""
    if query.ndim != 2:
        raise HarnessError(f"query embeddings must be 2-D (N x D), got shape {query.shape}")
    if len(query_labels) != len(query):
        raise HarnessError(f"{len(query_labels)} query labels for {len(query)} query embeddings")
    if (gallery is None) != (gallery_labels is None):
        raise HarnessError("give both gallery embeddings and gallery labels, or neither")
    if gallery is not None:
        if gallery.ndim != 2 or gallery.shape[1] != query.shape[1]:
            raise HarnessError(
                f"gallery embeddings must be N x {query.shape[1]}, got shape {gallery.shape}"
            )
        if len(gallery_labels) != len(gallery):
            raise HarnessError(
                f"{len(gallery_labels)} gallery labels for {len(gallery)} gallery embeddings"
            )
    for name, x in (("query", query), ("gallery", gallery)):
        if x is not None and not np.isfinite(x).all():
            raise HarnessError(f"{name} embeddings contain NaN or infinite values")


def _encode(
    query_labels: np.ndarray, gallery_labels: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels of any dtype -> dense int64 codes shared by query and gallery."""
    q = np.asarray(query_labels).ravel()
    if gallery_labels is None:
        return np.unique(q, return_inverse=True)[1].ravel().astype(np.int64), None
    g = np.asarray(gallery_labels).ravel()
    codes = np.unique(np.concatenate([q, g]), return_inverse=True)[1].ravel().astype(np.int64)
    return codes[: len(q)], codes[len(q) :]


def _retrieval(
    query: np.ndarray,
    q_codes: np.ndarray,
    gallery: np.ndarray | None,
    g_codes: np.ndarray | None,
    request: MetricRequest,
    *,
    reranker: Reranker | None,
    rerank_k: int,
    chunk_size: int,
    use_gpu: bool,
) -> RetrievalScores:
    """Stream the kNN lists chunk by chunk into :class:`RetrievalScores`."""
    same = gallery is None
    ref_codes = q_codes if same else g_codes
    assert ref_codes is not None  # g_codes is set when a gallery is
    r = relevant_counts(q_codes, ref_codes, same_source=same)
    scores = RetrievalScores(
        q_codes, r, window_c=r + int(same), names=request.retrieval, recall_k=request.recall_k
    )
    k = max(scores.needed_k(recall=False), rerank_k if reranker is not None else 0)
    listed = 0
    for start, stop, idx, _ in iter_knn(query, gallery, k, chunk_size=chunk_size, use_gpu=use_gpu):
        if reranker is not None and rerank_k > 0:
            idx = rerank_top_k(idx, np.arange(start, stop), reranker, rerank_k)
        scores.add(start, stop, ref_codes[idx])
        listed = idx.shape[1]
    # Recall@K beyond the lists: rank the first relevant item exactly by counting. Re-ranking only
    # permuted the listed head, so for these queries (no hit in it) the rank is the cosine one.
    rows = scores.rows_without_hit(listed)
    if rows.size:
        ranks = first_relevant_rank(query, gallery, q_codes, ref_codes, rows)
        scores.set_first_hits(rows, np.maximum(ranks, listed))
    return scores


def _retrieval_exhaustive(
    num_queries: int,
    q_codes: np.ndarray,
    num_gallery: int | None,
    g_codes: np.ndarray | None,
    request: MetricRequest,
    scorer: PairScorer,
    chunks: tuple[int, int],
) -> RetrievalScores:
    """Every retrieval metric from exhaustive lists (:func:`exhaustive_knn`), k = what they read."""
    same = num_gallery is None
    ref_codes = q_codes if same else g_codes
    assert ref_codes is not None  # g_codes is set when a gallery is
    r = relevant_counts(q_codes, ref_codes, same_source=same)
    scores = RetrievalScores(
        q_codes, r, window_c=r + int(same), names=request.retrieval, recall_k=request.recall_k
    )
    k = scores.needed_k(recall=True)  # Recall@K included: the lists are exact, no cosine fallback
    for start, stop, idx in exhaustive_knn(
        num_queries, num_gallery, scorer, k, query_chunk=chunks[0], reference_chunk=chunks[1]
    ):
        scores.add(start, stop, ref_codes[idx])
    return scores


def evaluate_embeddings(
    query: np.ndarray,
    query_labels: np.ndarray,
    gallery: np.ndarray | None = None,
    gallery_labels: np.ndarray | None = None,
    *,
    recall_k: Sequence[int] = (1, 2, 4, 8),
    metrics: Sequence[str] | None = None,
    reranker: Reranker | None = None,
    rerank_k: int = 0,
    pair_scorer: PairScorer | None = None,
    pair_chunks: tuple[int, int] = (64, 1024),
    chunk_size: int = 4096,
    use_gpu: bool = False,
    normalize: bool = True,
    kmeans_seed: int = 0,
    kmeans_iterations: int = 20,
    per_query: bool = False,
) -> Scores:
    """Score embeddings; ``gallery=None`` searches the queries against themselves.

    ``query``: Q x D, ``query_labels``: (Q,); ``gallery``: N x D and
    ``gallery_labels``: (N,) for In-Shop-style query/gallery retrieval. Labels
    may be of any dtype. ``metrics``: names (see the module docstring; default
    :data:`DEFAULT_METRICS`). ``normalize``: L2-normalise the embeddings first
    (metrics are defined on normalised embeddings; pass False only for data
    that already is). ``reranker``/``rerank_k``: re-score each query's top
    ``rerank_k`` candidates (ids into the query set and into the gallery, or
    the query set when same-source) and compute every retrieval metric on the
    re-ranked order. ``pair_scorer``: rank every query against the whole searched
    set by the scorer's similarities instead of the cosine (:func:`exhaustive_knn`, in
    ``pair_chunks`` = (queries, gallery items) per call); the embeddings still serve the
    clustering metrics. ``chunk_size``: queries per faiss search (memory bound);
    ``use_gpu``: faiss on a GPU when this build has one (silently CPU
    otherwise). Clustering metrics cluster the query set (as PML does) with
    k = its number of classes, ``kmeans_iterations`` iterations and
    ``kmeans_seed``.

    Returns ``{"num_queries", "num_lone_queries", <metric>: value, ...}`` (a :class:`Scores`);
    metrics are NaN when no query has a relevant item. ``per_query``: keep the per-query
    values of the retrieval metrics in ``result.per_query``.
    """
    request = parse_metrics(metrics, recall_k)
    query, gallery = np.asarray(query), None if gallery is None else np.asarray(gallery)
    _check_inputs(
        query,
        np.asarray(query_labels),
        gallery,
        None if gallery_labels is None else np.asarray(gallery_labels),
    )
    prepare = l2_normalize if normalize else (lambda x: np.ascontiguousarray(x, dtype=np.float32))
    query = prepare(query)
    gallery = None if gallery is None else prepare(gallery)
    q_codes, g_codes = _encode(query_labels, gallery_labels)
    out = Scores()
    if request.retrieval:
        if pair_scorer is not None:
            scores = _retrieval_exhaustive(
                len(query),
                q_codes,
                None if gallery is None else len(gallery),
                g_codes,
                request,
                pair_scorer,
                pair_chunks,
            )
        else:
            scores = _retrieval(
                query,
                q_codes,
                gallery,
                g_codes,
                request,
                reranker=reranker,
                rerank_k=rerank_k,
                chunk_size=chunk_size,
                use_gpu=use_gpu,
            )
        out.update(scores.result())
        if per_query:
            out.per_query = scores.per_query()
    else:
        r = relevant_counts(
            q_codes, q_codes if g_codes is None else g_codes, same_source=gallery is None
        )
        out.update(num_queries=int((r > 0).sum()), num_lone_queries=int((r == 0).sum()))
    if request.clustering and len(query):
        clusters = kmeans_assignments(
            query,
            len(np.unique(q_codes)),
            iterations=kmeans_iterations,
            seed=kmeans_seed,
            use_gpu=use_gpu,
        )
        out.update(clustering_metrics(q_codes, clusters, names=request.clustering))
    return out
