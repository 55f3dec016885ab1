"""The nearest-neighbour search under the metrics: chunks that change nothing but the
BLAS blocking, the query removed by index and ties ordered by index, faiss's and torch's
search as the exact top k by (-similarity, index), a re-ranked order, the call training
makes, bad inputs, and the CPU's small forward batches."""

from __future__ import annotations

import argparse

import faiss
import numpy as np
import pytest
import torch

from harness.base.errors import HarnessError
from harness.components.evaluation import (
    chunk_bounds,
    evaluate_embeddings,
    knn,
    l2_normalize,
    parse_metrics,
)
from tests.evaluation_data import (
    PML_METRICS,
    assert_same_ranking_up_to_rounding,
    continuous_data,
    dyadic_data,
    wide_data,
)


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
    from harness.engine.run.embedding import CPU_FORWARD_BATCH, embed_images

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
