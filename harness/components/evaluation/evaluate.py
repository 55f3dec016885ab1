"""Scoring embeddings: :func:`evaluate_embeddings`, the one entry point of every metric
(the names and their definitions are in :mod:`harness.components.evaluation`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from harness.base.errors import HarnessError
from harness.components.evaluation.clustering import clustering_metrics, kmeans_assignments
from harness.components.evaluation.knn import first_relevant_rank, iter_knn
from harness.components.evaluation.metric_names import MetricRequest, parse_metrics
from harness.components.evaluation.metrics import RetrievalScores, relevant_counts
from harness.components.evaluation.reranking import (
    PairScorer,
    Reranker,
    exhaustive_knn,
    rerank_top_k,
)

__all__ = ["evaluate_embeddings", "Scores", "l2_normalize", "evaluation_code_digest"]


class Scores(dict):
    """Metric name -> value (a plain dict to every caller), with ``per_query``: the
    per-query arrays of the retrieval metrics when they were asked for, else None."""

    per_query: dict[str, np.ndarray] | None = None


def evaluation_code_digest() -> str:
    """sha256 (16 hex) of what decides an evaluation's numbers: the sources of
    ``harness/components/evaluation/*.py`` and the versions of the libraries they call (faiss,
    scikit-learn, numpy). Runs record it as the ``evaluation_code`` tag; tables flag rows
    whose runs differ in it."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for package in ("faiss-cpu", "faiss-gpu", "faiss", "scikit-learn", "numpy"):
        try:
            digest.update(f"{package}=={metadata.version(package)}\0".encode())
        except metadata.PackageNotFoundError:
            continue
    return digest.hexdigest()[:16]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (N x D float32, a new array); all-zero rows stay zero."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, np.finfo(np.float32).tiny)


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
    query, gallery, q_codes, g_codes = _prepared(
        query, query_labels, gallery, gallery_labels, normalize=normalize
    )
    search = _Search(reranker, rerank_k, pair_scorer, pair_chunks, chunk_size, use_gpu)
    out = _retrieval_result(query, q_codes, gallery, g_codes, request, search, per_query)
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


def _prepared(
    query, query_labels, gallery, gallery_labels, *, normalize: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """The embeddings checked and (with ``normalize``) L2-normalised, float32 and
    contiguous, and the labels as dense codes shared by query and gallery."""
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
    return query, gallery, q_codes, g_codes


@dataclass(frozen=True)
class _Search:
    """How the retrieval lists are made: the cosine's kNN (faiss, ``chunk_size`` queries
    at a time, on a GPU with ``use_gpu``), its top ``rerank_k`` re-scored by ``reranker``,
    or every pair scored by ``pair_scorer`` in ``pair_chunks``."""

    reranker: Reranker | None
    rerank_k: int
    pair_scorer: PairScorer | None
    pair_chunks: tuple[int, int]
    chunk_size: int
    use_gpu: bool


def _retrieval_result(
    query: np.ndarray,
    q_codes: np.ndarray,
    gallery: np.ndarray | None,
    g_codes: np.ndarray | None,
    request: MetricRequest,
    search: _Search,
    per_query: bool,
) -> Scores:
    """The retrieval metrics the request asks for (with their per-query values when
    ``per_query``), or without any only the counts of scored and lone queries."""
    out = Scores()
    if not request.retrieval:
        r = relevant_counts(
            q_codes, q_codes if g_codes is None else g_codes, same_source=gallery is None
        )
        out.update(num_queries=int((r > 0).sum()), num_lone_queries=int((r == 0).sum()))
        return out
    if search.pair_scorer is not None:
        scores = _retrieval_exhaustive(
            len(query),
            q_codes,
            None if gallery is None else len(gallery),
            g_codes,
            request,
            search.pair_scorer,
            search.pair_chunks,
        )
    else:
        scores = _retrieval(
            query,
            q_codes,
            gallery,
            g_codes,
            request,
            reranker=search.reranker,
            rerank_k=search.rerank_k,
            chunk_size=search.chunk_size,
            use_gpu=search.use_gpu,
        )
    out.update(scores.result())
    if per_query:
        out.per_query = scores.per_query()
        if g_codes is not None:  # the gallery's classes: a chance level needs the whole test set
            out.per_query["gallery_label"] = g_codes.astype(np.int64)
    return out
