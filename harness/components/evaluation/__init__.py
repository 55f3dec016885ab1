"""Evaluation suite: chunked exact kNN (faiss) + retrieval and clustering metrics.

One implementation of each metric for the whole project: ``run`` (via
``harness.engine.run.training``), ``python -m harness evaluate`` and the benchmarks all go
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

The modules: :mod:`~harness.components.evaluation.evaluate` (:func:`evaluate_embeddings`),
:mod:`~harness.components.evaluation.metric_names` (the names, validated),
:mod:`~harness.components.evaluation.knn` (the exact kNN search),
:mod:`~harness.components.evaluation.reranking` (ranking by a method's scores),
:mod:`~harness.components.evaluation.metrics` (the retrieval metrics),
:mod:`~harness.components.evaluation.clustering` (the clustering metrics) and
:mod:`~harness.components.evaluation.per_query` (the stored per-query values).
"""

from harness.components.evaluation.clustering import (
    CLUSTERING_METRICS,
    clustering_metrics,
    kmeans_assignments,
    pair_counting_f1,
)
from harness.components.evaluation.evaluate import (
    Scores,
    evaluate_embeddings,
    evaluation_code_digest,
    l2_normalize,
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
from harness.components.evaluation.metric_names import (
    DEFAULT_METRICS,
    METRICS,
    MetricRequest,
    parse_metrics,
)
from harness.components.evaluation.metrics import (
    PAPER_VARIANTS,
    PER_QUERY_SCORES,
    RETRIEVAL_METRICS,
    relevant_counts,
    retrieval_metrics,
    with_paper_variants,
)
from harness.components.evaluation.per_query import (
    PER_QUERY_ARTIFACT,
    load_per_query,
    per_query_values,
    save_per_query,
)
from harness.components.evaluation.reranking import (
    PairScorer,
    Reranker,
    exhaustive_knn,
    rerank_top_k,
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
