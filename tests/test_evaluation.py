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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import FaissKMeans, FaissKNN

from harness.base.errors import HarnessError
from harness.cli.evaluate import add_evaluate_parser
from harness.components.evaluation import (
    chunk_bounds,
    evaluate_embeddings,
    gpu_available,
    kmeans_assignments,
    knn,
    l2_normalize,
    pair_counting_f1,
    parse_metrics,
)

PML_METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- data


def class_sizes_with_lone(rng, num_classes: int, high: int) -> np.ndarray:
    """Unequal class sizes 1..high, at least three singleton (lone) classes."""
    sizes = rng.integers(1, high + 1, num_classes)
    sizes[:3] = 1
    return sizes


def continuous_data(seed: int = 0, dim: int = 16):
    """Clustered random vectors, unequal classes, lone classes, exact duplicates within classes."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(40), class_sizes_with_lone(rng, 40, 14))
    centres = rng.standard_normal((40, dim))
    x = centres[labels] + 1.3 * rng.standard_normal((len(labels), dim))
    n = len(labels)
    for i in rng.choice(n, 12, replace=False):  # duplicates within the class
        same = np.flatnonzero(labels == labels[i])
        x[same[0]] = x[i]
    order = rng.permutation(n)
    return x[order].astype(np.float32), labels[order]


def dyadic_data(seed: int = 0, n: int = 260, dim: int = 8):
    """Unit vectors with coordinates in {0, +-1/2}: exact inner products, many exact ties."""
    rng = np.random.default_rng(seed)
    pool = np.zeros((24, dim), np.float32)
    for row in pool:
        row[rng.choice(dim, 4, replace=False)] = rng.choice([-0.5, 0.5], 4)
    sizes = class_sizes_with_lone(rng, 30, 16)
    labels = np.repeat(np.arange(len(sizes)), sizes)[:n]
    home = rng.integers(0, len(pool), (len(sizes), 2))
    choice = home[labels, rng.integers(0, 2, len(labels))]
    stray = rng.random(len(labels)) < 0.3
    choice[stray] = rng.integers(0, len(pool), stray.sum())
    order = rng.permutation(len(labels))
    return pool[choice][order], labels[order]


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


# ------------------------------------------------------- PML AccuracyCalculator


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


# ------------------------------------------------------------ brute-force oracles


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


# --------------------------------------------------------------- chunking, re-rank


def test_chunk_bounds_cover_everything_and_keep_faiss_on_one_path():
    assert chunk_bounds(0, 5, 8) == []
    for n, size, dim in [
        (1100, 1, 512),
        (1100, 300, 512),
        (7, 2, 8),
        (10_000, 4096, 64),
        (10_000, 10, 64),
    ]:
        bounds = chunk_bounds(n, size, dim)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert [s for s, _ in bounds[1:]] == [e for _, e in bounds[:-1]]
        minimum = -(-faiss.cvar.distance_compute_blas_threshold // dim)
        assert len(bounds) == 1 or all(e - s >= max(size, minimum) for s, e in bounds)


def wide_data(seed: int = 0):
    """1,100 x 512: large enough for several chunks on faiss's BLAS path; a few duplicates."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 120, 1100)
    x = (rng.standard_normal((120, 512))[y] + 2.0 * rng.standard_normal((1100, 512))).astype(
        np.float32
    )
    x[5] = x[6]
    x[7] = x[6]
    x[900] = x[901]
    return x, y


#: How far two BLAS blockings of the same float32 product may round apart (unit vectors,
#: D = 512): observed up to 1.3e-7 on another x86 BLAS and 9e-8 on CUDA; 1e-6 leaves margin.
SIMILARITY_TOLERANCE = 1e-6


def assert_same_ranking_up_to_rounding(idx, sims, idx_ref, sims_ref, tol=SIMILARITY_TOLERANCE):
    """Similarities equal within ``tol``; neighbour lists equal except where two entries'
    similarities are within ``tol`` of each other (a near tie that rounding may order
    either way), in which case the swapped entries must hold the same similarity."""
    np.testing.assert_allclose(sims, sims_ref, rtol=0, atol=tol)
    rows, cols = np.nonzero(idx != idx_ref)
    for r, c in zip(rows, cols, strict=True):
        j = np.flatnonzero(idx_ref[r] == idx[r, c])  # where the reference put this item
        near = abs(sims_ref[r, c] - sims_ref[r, j[0]]) <= 2 * tol if j.size else False
        assert near, f"row {r}, rank {c}: item {idx[r, c]} vs {idx_ref[r, c]} is not a near tie"


def test_chunking_gives_the_same_ranking_and_metrics():
    """Chunk size changes nothing but the BLAS blocking of the product. Its float32
    rounding depends on the BLAS and CPU (or GPU), so similarities are compared to
    :data:`SIMILARITY_TOLERANCE` and metrics to the share one near-tie swap could move."""
    x, y = wide_data()
    metrics = [
        "precision_at_1",
        "recall_at_k",
        "r_precision",
        "mean_average_precision_at_r",
        "map_at_c",
    ]
    full = evaluate_embeddings(x, y, metrics=metrics, chunk_size=10**6)
    idx_full, sims_full = knn(l2_normalize(x), None, 40, chunk_size=10**6)
    assert len(chunk_bounds(1100, 1, 512)) > 2
    for size in (1, 299, 1000):
        chunked = evaluate_embeddings(x, y, metrics=metrics, chunk_size=size)
        assert chunked.keys() == full.keys()
        for name, value in full.items():
            assert chunked[name] == pytest.approx(
                value, abs=1e-9 if name.startswith("num_") else 1 / len(y)
            ), name
        idx, sims = knn(l2_normalize(x), None, 40, chunk_size=size)
        assert_same_ranking_up_to_rounding(idx, sims, idx_full, sims_full)


def test_ranking_comparison_rejects_a_real_difference():
    """The tolerance helper above is not vacuous: a swap of two distinct scores fails it."""
    x, y = wide_data()
    idx, sims = knn(l2_normalize(x), None, 40, chunk_size=10**6)
    assert_same_ranking_up_to_rounding(idx, sims, idx, sims)
    swapped = idx.copy()
    swapped[0, [0, 5]] = swapped[0, [5, 0]]
    with pytest.raises(AssertionError):
        assert_same_ranking_up_to_rounding(swapped, sims, idx, sims)
    with pytest.raises(AssertionError):
        assert_same_ranking_up_to_rounding(idx, sims + 1e-5, idx, sims)


def test_self_is_removed_by_index_and_ties_ordered_by_index():
    x = np.array([[1, 0], [1, 0], [1, 0], [0, 1]], np.float32)
    idx, sims = knn(x, None, 3)
    np.testing.assert_array_equal(idx, [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])


def test_metrics_on_a_reranked_order():
    """An oracle re-ranker (score = same class) makes every metric perfect within its window."""
    x, y = wide_data(1)
    plain = evaluate_embeddings(x, y, metrics=PML_METRICS, chunk_size=1)
    seen = []

    def oracle(query_ids, candidates):
        seen.append(query_ids.copy())
        return (y[candidates] == y[query_ids, None]).astype(np.float32)

    reranked = evaluate_embeddings(
        x, y, metrics=PML_METRICS, reranker=oracle, rerank_k=len(y) - 1, chunk_size=1
    )
    assert plain["mean_average_precision_at_r"] < 0.99
    assert (
        reranked["precision_at_1"]
        == reranked["r_precision"]
        == reranked["mean_average_precision_at_r"]
        == 1.0
    )
    np.testing.assert_array_equal(np.concatenate(seen), np.arange(len(y)))


def test_training_call_signature_and_names():
    x, y = continuous_data(0)
    out = evaluate_embeddings(
        x,
        y,
        None,
        None,
        recall_k=(1, 2, 4, 8),
        use_gpu=False,
        metrics=("precision_at_1", "recall_at_k", "r_precision", "mean_average_precision_at_r"),
    )
    assert set(out) == {
        "num_queries",
        "num_lone_queries",
        "precision_at_1",
        "recall_at_1",
        "recall_at_2",
        "recall_at_4",
        "recall_at_8",
        "r_precision",
        "mean_average_precision_at_r",
    }
    full = evaluate_embeddings(x, y)
    assert {"map_at_c", "nmi", "f1"} <= set(full) and "ami" not in full
    assert evaluate_embeddings(x, y, use_gpu=True) == full  # falls back to the CPU without a GPU


def test_bad_inputs_raise_one_line_errors():
    x, y = continuous_data(0)
    bad = x.copy()
    bad[3, 0] = np.nan
    with pytest.raises(HarnessError, match="NaN"):
        evaluate_embeddings(bad, y)
    with pytest.raises(HarnessError, match="labels"):
        evaluate_embeddings(x, y[:-1])
    with pytest.raises(HarnessError, match="did you mean 'map_at_c'"):
        evaluate_embeddings(x, y, metrics=["map_at_k"])
    with pytest.raises(HarnessError):
        parse_metrics(["recall_at_0"])
    assert parse_metrics(["recall_at_5"], (1, 2)).recall_k == (5,)


def test_all_lone_gives_nan_not_a_crash():
    out = evaluate_embeddings(np.eye(3, dtype=np.float32), np.arange(3), metrics=PML_METRICS)
    assert (
        out["num_queries"] == 0 and out["num_lone_queries"] == 3 and np.isnan(out["precision_at_1"])
    )


# ------------------------------------------------------------------------- CLI


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """The evaluate command under a parser like harness.cli.main's (HarnessError -> 'error: ...', exit 2)."""
    parser = argparse.ArgumentParser(prog="python -m harness")
    add_evaluate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def saved(tmp_path):
    x, y = continuous_data(1)
    np.save(tmp_path / "emb.npy", x)
    np.save(tmp_path / "lab.npy", y)
    return tmp_path, x, y


def test_cli_self_and_query_gallery(saved, capsys):
    tmp, x, y = saved
    out_json = tmp / "out" / "m.json"
    code, out, _ = run_cli(
        [
            "evaluate",
            "--embeddings",
            str(tmp / "emb.npy"),
            "--labels",
            str(tmp / "lab.npy"),
            "--recall-k",
            "1,10",
            "--json",
            str(out_json),
        ],
        capsys,
    )
    assert code == 0 and "precision_at_1" in out
    record = json.loads(out_json.read_text())
    expected = evaluate_embeddings(x, y, recall_k=(1, 10))
    assert record["mode"] == "self" and record["num_lone_queries"] == expected["num_lone_queries"]
    assert record["metrics"] == pytest.approx(
        {k: v for k, v in expected.items() if not k.startswith("num_")}
    )
    assert not list(out_json.parent.glob(".*tmp"))

    np.save(tmp / "q.npy", x[:50])
    np.save(tmp / "ql.npy", y[:50])
    code, _, _ = run_cli(
        [
            "evaluate",
            "--embeddings",
            str(tmp / "emb.npy"),
            "--labels",
            str(tmp / "lab.npy"),
            "--query-embeddings",
            str(tmp / "q.npy"),
            "--query-labels",
            str(tmp / "ql.npy"),
            "--metrics",
            "precision_at_1,recall_at_5",
            "--json",
            str(out_json),
        ],
        capsys,
    )
    record = json.loads(out_json.read_text())
    assert code == 0 and record["mode"] == "query-gallery"
    assert set(record["metrics"]) == {"precision_at_1", "recall_at_5"}
    assert record["metrics"]["precision_at_1"] == pytest.approx(
        evaluate_embeddings(x[:50], y[:50], x, y, metrics=["precision_at_1"])["precision_at_1"]
    )


def _bad_files(tmp: Path, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[list[str], str]]:
    """name -> (extra argv replacing the good files, expected words in the message)."""
    nan = x.copy()
    nan[2, 1] = np.nan
    cases = {
        "missing.npy": None,
        "flat.npy": x[:, 0],
        "nan.npy": nan,
        "short_labels.npy": y[:-2],
        "labels_2d.npy": np.stack([y, y], 1),
        "zero_dim.npy": np.zeros((len(y), 0), np.float32),
        "objects.npy": None,
        "narrow.npy": x[:10, :5],
        "float_labels.npy": y + 0.5,
    }
    for name, array in cases.items():
        if array is not None:
            np.save(tmp / name, array)
    (tmp / "text.txt").write_text("1 2 3\n")
    (tmp / "garbage.npy").write_bytes(b"definitely not numpy")
    np.save(tmp / "objects.npy", np.array([{"a": 1}] * len(y), dtype=object), allow_pickle=True)
    emb, lab = str(tmp / "emb.npy"), str(tmp / "lab.npy")
    return {
        "missing": (["--embeddings", str(tmp / "missing.npy"), "--labels", lab], "no such file"),
        "not npy suffix": (["--embeddings", str(tmp / "text.txt"), "--labels", lab], ".npy"),
        "not npy content": (
            ["--embeddings", str(tmp / "garbage.npy"), "--labels", lab],
            "not a readable",
        ),
        "pickled objects": (
            ["--embeddings", emb, "--labels", str(tmp / "objects.npy")],
            "objects.npy",
        ),
        "1-D embeddings": (["--embeddings", str(tmp / "flat.npy"), "--labels", lab], "shape"),
        "no columns": (["--embeddings", str(tmp / "zero_dim.npy"), "--labels", lab], "shape"),
        "NaN": (["--embeddings", str(tmp / "nan.npy"), "--labels", lab], "NaN"),
        "label count": (
            ["--embeddings", emb, "--labels", str(tmp / "short_labels.npy")],
            "labels but",
        ),
        "2-D labels": (["--embeddings", emb, "--labels", str(tmp / "labels_2d.npy")], "1-D"),
        "fractional labels": (
            ["--embeddings", emb, "--labels", str(tmp / "float_labels.npy")],
            "whole",
        ),
        "query dims": (
            [
                "--embeddings",
                emb,
                "--labels",
                lab,
                "--query-embeddings",
                str(tmp / "narrow.npy"),
                "--query-labels",
                str(tmp / "short_labels.npy"),
            ],
            "labels but",
        ),
        "query without labels": (
            ["--embeddings", emb, "--labels", lab, "--query-embeddings", emb],
            "both",
        ),
        "metric name": (
            ["--embeddings", emb, "--labels", lab, "--metrics", "nmi,recal_at_k"],
            "unknown metric",
        ),
        "recall k": (["--embeddings", emb, "--labels", lab, "--recall-k", "1,x"], "--recall-k"),
        **(
            {}
            if gpu_available()
            else {"no GPU": (["--embeddings", emb, "--labels", lab, "--device", "cuda"], "GPU")}
        ),
    }


def test_cli_rejects_each_bad_file_with_one_line(saved, capsys):
    tmp, x, y = saved
    out_json = tmp / "never.json"
    for case, (argv, words) in _bad_files(tmp, x, y).items():
        code, out, err = run_cli(["evaluate", *argv, "--json", str(out_json)], capsys)
        assert code == 2, case
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (case, err)
        assert not out_json.exists(), case
        assert not list(tmp.glob(".never.json*")), case


def _evaluate_is_wired() -> bool:
    from harness.cli.main import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return any("evaluate" in a.choices for a in actions)


@pytest.mark.skipif(
    not _evaluate_is_wired(), reason="harness.cli.main does not wire `evaluate` yet"
)
def test_python_m_harness_evaluate(saved):
    tmp, x, y = saved
    base = [sys.executable, "-m", "harness", "evaluate", "--labels", str(tmp / "lab.npy")]
    ok = subprocess.run(
        [
            *base,
            "--embeddings",
            str(tmp / "emb.npy"),
            "--metrics",
            "precision_at_1",
            "--json",
            str(tmp / "m.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    expected = evaluate_embeddings(x, y, metrics=["precision_at_1"])["precision_at_1"]
    assert json.loads((tmp / "m.json").read_text())["metrics"]["precision_at_1"] == pytest.approx(
        expected
    )
    bad = subprocess.run(
        [*base, "--embeddings", str(tmp / "missing.npy")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.strip().count("\n") == 0
        and bad.stderr.startswith("error: ")
    )


@pytest.mark.parametrize(
    "dim_copies, n, k", [(1, 260, 30), (1, 260, 150), (64, 1100, 40), (64, 1100, 300)]
)
def test_knn_is_the_exact_top_k_by_similarity_then_index(dim_copies, n, k):
    """Heavily tied data, faiss's sequential (d=8) and BLAS (d=512) kernels, heap (k < 100) and
    reservoir (k >= 100) selection, several chunkings: always the exact (-similarity, index) top k."""
    x, _ = dyadic_data(3, n=n)
    x = np.tile(x, dim_copies) / np.sqrt(dim_copies).astype(
        np.float32
    )  # still exact dyadic products
    sims = x.astype(np.float64) @ x.T.astype(np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(len(x)), sims.shape), -sims), axis=1)
    expected = np.stack([row[row != i][:k] for i, row in enumerate(order)])
    for size in (1, 97, 10**6):
        idx, _ = knn(x, None, k, chunk_size=size)
        np.testing.assert_array_equal(idx, expected)
    q = np.arange(len(x)) % 4 == 0
    expected_qg = np.flatnonzero(~q)[
        np.lexsort(
            (np.broadcast_to(np.arange((~q).sum()), (q.sum(), (~q).sum())), -sims[q][:, ~q]), axis=1
        )[:, :k]
    ]
    idx, _ = knn(x[q], x[~q], k)
    np.testing.assert_array_equal(np.flatnonzero(~q)[idx], expected_qg)


@pytest.mark.parametrize("dim_copies, n, k", [(1, 260, 30), (64, 1100, 300)])
def test_torch_search_is_the_same_exact_top_k(dim_copies, n, k):
    """The torch top-k search (CUDA when faiss has no GPU; run here on the CPU) gives the
    same (-similarity, index) top k on heavily tied data, at every chunking, and the same
    ranking as faiss on continuous data."""
    x, _ = dyadic_data(3, n=n)
    x = np.tile(x, dim_copies) / np.sqrt(dim_copies).astype(np.float32)
    for size in (1, 97, 10**6):
        np.testing.assert_array_equal(
            knn(x, None, k, chunk_size=size, device="cpu")[0], knn(x, None, k, chunk_size=size)[0]
        )
    q = np.arange(len(x)) % 4 == 0
    np.testing.assert_array_equal(knn(x[q], x[~q], k, device="cpu")[0], knn(x[q], x[~q], k)[0])
    w, _ = wide_data()
    idx, sims = knn(l2_normalize(w), None, 40, device="cpu")
    idx_faiss, sims_faiss = knn(l2_normalize(w), None, 40)
    assert_same_ranking_up_to_rounding(idx, sims, idx_faiss, sims_faiss)


def test_search_device_prefers_faiss_gpu_then_torch_cuda():
    from harness.components.evaluation.knn import gpu_available, search_device

    assert search_device(False) is None
    assert search_device(False, "cpu") == torch.device("cpu")
    expected = torch.device("cuda") if torch.cuda.is_available() and not gpu_available() else None
    assert search_device(True) == expected


class _BatchRecorder(torch.nn.Module):
    """A tiny embedding model that records the size of every batch it is given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 8)
        self.sizes: list[int] = []
        self.head = argparse.Namespace(embedding_size=8)

    def forward(self, x):
        from harness.methods import HeadOutput

        self.sizes.append(len(x))
        return HeadOutput(
            embedding=torch.nn.functional.normalize(self.linear(x.mean(dim=(2, 3))), dim=-1)
        )


def test_cpu_evaluation_forwards_small_batches_with_the_same_embeddings():
    """On CPU the protocol's evaluation batch (128) is forwarded in chunks of at most
    CPU_FORWARD_BATCH images: faster there, and the embeddings are the same."""
    from harness.components.data.base import ArrayImageSet
    from harness.components.data.transforms import build_transform
    from harness.config.protocol_files import load_protocol
    from harness.engine.embedding import CPU_FORWARD_BATCH, embed_images

    image = load_protocol("smoke").image
    pixels = np.random.default_rng(0).integers(0, 256, (70, 40, 40, 3), dtype=np.uint8)
    images = ArrayImageSet(pixels, labels=[0] * 70)
    cpu, embeddings = torch.device("cpu"), {}
    for batch in (128, 7):
        model = _BatchRecorder()
        embeddings[batch], _ = embed_images(
            model, images, build_transform(image, train=False), image, batch_size=batch, device=cpu
        )
        assert sum(model.sizes) == 70
        assert max(model.sizes) == min(batch, CPU_FORWARD_BATCH)
    np.testing.assert_allclose(embeddings[128], embeddings[7], rtol=0, atol=1e-6)
