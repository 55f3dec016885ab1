"""The evaluation suite against independent oracles.

* pytorch-metric-learning's ``AccuracyCalculator`` for Precision@1, R-Precision,
  MAP@R (and NMI/AMI on the same clustering);
* brute-force reimplementations (full similarity matrix, Python loops) for
  Recall@K, Roth's mAP@C and the pair-counting F1.

Ties. With exact ties the order among tied items is implementation-defined, so
two kinds of data are used:

* continuous random data whose only exact ties are *harmless*: duplicates
  within a class. Every query sees the copies at equal similarity, but they
  share a label, so their order cannot change any metric; a query with a copy
  of itself must lose itself (removed by index), not the copy. PML runs its
  own faiss kNN here. (Duplicates across classes are not harmless: every
  other query would see two tied items of different classes.)
* "dyadic" data: unit vectors whose coordinates are 0 or +-1/2, so every inner
  product is an exact multiple of 1/4 whatever the summation order, with many
  exact ties across classes. Our kNN orders ties by index (lower first); the
  oracle kNN handed to PML sorts the exact float64 similarity matrix by
  (-similarity, index) and removes the query by index. Agreement therefore
  checks the tie rule, the self-removal and the metric definitions at once;
  a column-0 self-removal is shown to disagree on the same data.

The search itself (chunking, re-ranking, faiss and torch) is ``test_evaluation_search.py``'s;
the ``evaluate`` command ``test_evaluation_cli.py``'s.
"""

from __future__ import annotations

from itertools import combinations

import faiss
import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import FaissKMeans, FaissKNN

from harness.components.evaluation import (
    evaluate_embeddings,
    kmeans_assignments,
    knn,
    l2_normalize,
    pair_counting_f1,
)
from tests.evaluation_data import (
    PML_METRICS,
    continuous_data,
    dyadic_data,
    wide_data,
)


def index_order_knn(query, k, reference, ref_includes_query=False):
    """PML knn_func: exact float64 similarities, ties by lower index, self removed by index."""
    sims = query.double() @ reference.double().T
    order = np.lexsort(
        (np.broadcast_to(np.arange(sims.shape[1]), sims.shape), -sims.numpy()), axis=1
    )
    order = torch.from_numpy(order)
    if ref_includes_query:
        keep = order != torch.arange(len(query))[:, None]
        order = order[keep].view(len(query), -1)
    order = order[:, :k]
    return torch.gather(sims, 1, order).float(), order


def pml(
    query,
    labels,
    reference=None,
    reference_labels=None,
    *,
    knn_func=None,
    include=PML_METRICS,
    kmeans_func=None,
):
    calc = AccuracyCalculator(
        include=include,
        k="max_bin_count",
        device=torch.device("cpu"),
        knn_func=knn_func or FaissKNN(index_init_fn=faiss.IndexFlatIP),
        kmeans_func=kmeans_func,
    )
    return calc.get_accuracy(query, labels, reference, reference_labels, ref_includes_query=False)


def assert_agree(ours, theirs, names=PML_METRICS):
    for name in names:
        assert ours[name] == pytest.approx(theirs[name], abs=1e-6), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_pml_on_continuous_data_same_source(seed):
    x, y = continuous_data(seed)
    ours = evaluate_embeddings(x, y, metrics=PML_METRICS)
    assert_agree(ours, pml(l2_normalize(x), y))
    lone = int((np.bincount(y)[y] == 1).sum())
    assert lone >= 3 and ours["num_lone_queries"] == lone and ours["num_queries"] == len(y) - lone


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_pml_on_continuous_data_query_gallery(seed):
    x, y = continuous_data(seed)
    q, g = np.arange(len(y)) % 3 == 0, np.arange(len(y)) % 3 != 0
    ours = evaluate_embeddings(x[q], y[q], x[g], y[g], metrics=PML_METRICS)
    assert_agree(ours, pml(l2_normalize(x[q]), y[q], l2_normalize(x[g]), y[g]))
    assert ours["num_lone_queries"] == int((~np.isin(y[q], y[g])).sum())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_pml_with_exact_ties_broken_by_index(seed):
    x, y = dyadic_data(seed)
    ours = evaluate_embeddings(x, y, metrics=PML_METRICS)
    theirs = pml(x, y, knn_func=index_order_knn)
    assert_agree(ours, theirs)
    # The data is tie-sensitive: removing column 0 instead of the query itself disagrees.
    assert _column0_precision_at_1(x, y) != pytest.approx(theirs["precision_at_1"], abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_pml_with_exact_ties_query_gallery(seed):
    x, y = dyadic_data(seed)
    q = np.random.default_rng(seed).random(len(y)) < 0.4
    ours = evaluate_embeddings(x[q], y[q], x[~q], y[~q], metrics=PML_METRICS)
    assert ours["num_lone_queries"] > 0
    assert_agree(ours, pml(x[q], y[q], x[~q], y[~q], knn_func=index_order_knn))


def _column0_precision_at_1(x, y):
    """Precision@1 of the wrong self-removal (drop column 0 of a (-sim, index) ranking)."""
    sims = x.astype(np.float64) @ x.T.astype(np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(len(y)), sims.shape), -sims), axis=1)
    counts = np.bincount(y)[y]
    not_lone = counts > 1
    return float((y[order[:, 1]] == y)[not_lone].mean())


def test_nmi_and_ami_match_pml_on_the_same_clustering():
    x, y = continuous_data(4)
    xn = l2_normalize(x)
    clusters = kmeans_assignments(xn, len(np.unique(y)), seed=5)
    ours = evaluate_embeddings(x, y, metrics=["nmi", "ami"], kmeans_seed=5)
    given = pml(
        xn, y, include=("NMI", "AMI"), kmeans_func=lambda emb, k: torch.from_numpy(clusters)
    )
    assert ours["nmi"] == pytest.approx(given["NMI"], abs=1e-6)
    assert ours["ami"] == pytest.approx(given["AMI"], abs=1e-6)
    # PML's own FaissKMeans with the same seed runs the same clustering procedure.
    own = pml(xn, y, include=("NMI",), kmeans_func=FaissKMeans(niter=20, seed=5))
    assert ours["nmi"] == pytest.approx(own["NMI"], abs=1e-6)


def brute_force_rankings(x, y, xg=None, yg=None):
    """Full (-sim, index) rankings with the query removed by index; exact for dyadic data."""
    same = xg is None
    xg, yg = (x, y) if same else (xg, yg)
    sims = x.astype(np.float64) @ xg.T.astype(np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(len(yg)), sims.shape), -sims), axis=1)
    rankings = [row[row != i] if same else row for i, row in enumerate(order)]
    return [yg[r] == y[i] for i, r in enumerate(rankings)], yg


def test_recall_at_k_is_the_hit_rate():
    x, y = dyadic_data(7)
    ks = (1, 2, 4, 8, 16, 1000)
    ours = evaluate_embeddings(x, y, metrics=["recall_at_k"], recall_k=ks)
    hits, _ = brute_force_rankings(x, y)
    scored = [h for h in hits if h.any()]
    assert ours["num_queries"] == len(scored)
    for k in ks:
        assert ours[f"recall_at_{k}"] == pytest.approx(
            np.mean([h[:k].any() for h in scored]), abs=1e-12
        )


def test_recall_beyond_the_lists_matches_a_full_search():
    """Recall@K for K beyond the other metrics' lists comes from exact first-hit counting; it must
    equal the hit rate read off complete rankings, same-source and query/gallery, any chunking."""
    x, y = wide_data(2)
    ks = (1, 3, 10, 100, 1000)
    for q, g in [(slice(None), None), (slice(0, 400), slice(400, None))]:
        xg, yg = (None, None) if g is None else (x[g], y[g])
        idx, _ = knn(l2_normalize(x[q]), None if g is None else l2_normalize(xg), 10**6)
        hits = (y if g is None else yg)[idx] == y[q][:, None]
        scored = hits.any(1)
        for size in (1, 10**6):
            out = evaluate_embeddings(
                x[q],
                y[q],
                xg,
                yg,
                metrics=["recall_at_k", "r_precision"],
                recall_k=ks,
                chunk_size=size,
            )
            for k in ks:
                assert out[f"recall_at_{k}"] == np.mean(hits[scored, :k].any(1)), (k, size)


@pytest.mark.parametrize("seed", [0, 3])
def test_map_at_c_matches_a_per_query_reimplementation(seed):
    """Roth et al. 2020 mAP_c: c = class size incl. the query; top-c non-self neighbours; divide by c."""
    x, y = dyadic_data(seed)
    ours = evaluate_embeddings(x, y, metrics=["map_at_c"])
    hits, _ = brute_force_rankings(x, y)
    per_query = []
    for i, h in enumerate(hits):
        c = int((y == y[i]).sum())
        if c < 2:
            continue  # lone query: excluded
        found, total = 0, 0.0
        for rank in range(c):
            if h[rank]:
                found += 1
                total += found / (rank + 1)
        per_query.append(total / c)
    assert ours["map_at_c"] == pytest.approx(np.mean(per_query), abs=1e-12)


def test_map_at_c_by_hand():
    """Two perfectly separated classes of two: MAP@R = 1 but mAP@C = 1/2 (top-2 = [same, other])."""
    x = np.array([[1, 0], [1, 0.01], [0, 1], [0.01, 1]], np.float32)
    y = np.array([0, 0, 1, 1])
    out = evaluate_embeddings(x, y, metrics=["map_at_c", "mean_average_precision_at_r"])
    assert out["mean_average_precision_at_r"] == 1.0 and out["map_at_c"] == 0.5
    gallery = evaluate_embeddings(
        x[[0, 2]],
        y[[0, 2]],
        x[[1, 3]],
        y[[1, 3]],
        metrics=["map_at_c", "mean_average_precision_at_r"],
    )
    assert gallery["map_at_c"] == gallery["mean_average_precision_at_r"] == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_pair_counting_f1_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    labels, clusters = rng.integers(0, 6, 70), rng.integers(0, 8, 70)
    clusters[:20] = labels[:20]  # partly agreeing
    tp = pred = actual = 0
    for i, j in combinations(range(70), 2):
        same_class, same_cluster = labels[i] == labels[j], clusters[i] == clusters[j]
        tp += same_class and same_cluster
        pred += same_cluster
        actual += same_class
    p, r = tp / pred, tp / actual
    assert pair_counting_f1(labels, clusters) == pytest.approx(2 * p * r / (p + r), abs=1e-12)


def test_f1_edge_cases():
    assert pair_counting_f1(np.array([0, 0, 1, 1]), np.array([5, 5, 7, 7])) == 1.0
    assert pair_counting_f1(np.array([0, 1, 2]), np.array([0, 0, 0])) == 0.0


def test_f1_and_nmi_share_one_kmeans_run():
    x, y = continuous_data(5)
    out = evaluate_embeddings(x, y, metrics=["nmi", "f1"], kmeans_seed=2)
    clusters = kmeans_assignments(l2_normalize(x), len(np.unique(y)), seed=2)
    assert out["f1"] == pytest.approx(pair_counting_f1(y, clusters), abs=1e-12)
