"""Clustering metrics: NMI, AMI and pair-counting F1 on one faiss k-means clustering.

The clustering is the one pytorch-metric-learning's ``AccuracyCalculator``
runs (``FaissKMeans``): faiss k-means with k = number of classes in the
evaluated set, 20 iterations, then every point assigned to its nearest final
centroid. Here it is seeded explicitly and run once for all three metrics.
"""

from __future__ import annotations

from collections.abc import Collection

import faiss
import numpy as np
from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

from harness.components.evaluation.knn import gpu_available

__all__ = ["CLUSTERING_METRICS", "kmeans_assignments", "pair_counting_f1", "clustering_metrics"]

CLUSTERING_METRICS = ("nmi", "ami", "f1")


def kmeans_assignments(
    x: np.ndarray, num_clusters: int, *, iterations: int = 20, seed: int = 0, use_gpu: bool = False
) -> np.ndarray:
    """Cluster ids (N,) int64 of faiss k-means on ``x`` (N x D float32).

    Exactly ``iterations`` Lloyd iterations (faiss has no convergence test, so
    no early stop), seeded; faiss's defaults otherwise (one run, subsampling only
    above 256 points per centroid). Points are then assigned to the nearest
    final centroid, as PML's ``FaissKMeans`` does.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    # min_points_per_centroid only silences faiss's "please provide more points" warning.
    kmeans = faiss.Kmeans(
        x.shape[1],
        int(num_clusters),
        niter=int(iterations),
        seed=int(seed),
        gpu=bool(use_gpu and gpu_available()),
        min_points_per_centroid=1,
        verbose=False,
    )
    kmeans.train(x)
    _, assignment = kmeans.index.search(x, 1)
    return assignment[:, 0].astype(np.int64)


def _pairs(counts: np.ndarray) -> int:
    """sum over entries of C(n, 2)."""
    counts = counts.astype(np.int64)
    return int((counts * (counts - 1) // 2).sum())


def pair_counting_f1(labels: np.ndarray, clusters: np.ndarray) -> float:
    """Pair-counting F-measure of a clustering (labels, clusters: (N,)).

    From the contingency table n_ij (class i, cluster j) with class sizes b_i
    and cluster sizes a_j: TP = sum_ij C(n_ij, 2), predicted-positive pairs =
    sum_j C(a_j, 2), actual-positive pairs = sum_i C(b_i, 2); precision =
    TP / predicted, recall = TP / actual, F1 = 2PR / (P + R) (0 when P + R = 0;
    P or R is 0 when its denominator is). Only the non-empty cells are counted,
    so memory is O(N), never classes x clusters.
    """
    _, y = np.unique(labels, return_inverse=True)
    _, c = np.unique(clusters, return_inverse=True)
    y, c = y.ravel().astype(np.int64), c.ravel().astype(np.int64)
    _, cells = np.unique(y * (int(c.max(initial=0)) + 1) + c, return_counts=True)
    tp, predicted, actual = _pairs(cells), _pairs(np.bincount(c)), _pairs(np.bincount(y))
    precision = tp / predicted if predicted else 0.0
    recall = tp / actual if actual else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def clustering_metrics(
    labels: np.ndarray, clusters: np.ndarray, *, names: Collection[str]
) -> dict[str, float]:
    """``nmi`` (sklearn ``normalized_mutual_info_score``, arithmetic mean, as PML), ``ami``
    (sklearn ``adjusted_mutual_info_score``; slow with thousands of classes) and ``f1``
    (:func:`pair_counting_f1`) of one clustering, for the requested ``names``."""
    out: dict[str, float] = {}
    if "nmi" in names:
        out["nmi"] = float(normalized_mutual_info_score(labels, clusters))
    if "ami" in names:
        out["ami"] = float(adjusted_mutual_info_score(labels, clusters))
    if "f1" in names:
        out["f1"] = float(pair_counting_f1(labels, clusters))
    return out
