"""AVSL (Zhang et al. 2022): golden values for Eqs. 1-11 on small tensors, the edge buffers'
momentum rule, and the engine's exhaustive pair ranking against a brute-force loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.components.evaluation import evaluate_embeddings, exhaustive_knn
from harness.components.evaluation.metrics import relevant_counts, retrieval_metrics
from harness.components.losses import MetricLoss, create_loss
from harness.engine.run.embedding import make_pair_scorer, make_reranker
from harness.methods import TrainingBatch
from harness.methods.avsl import (
    attribution,
    cam_certainty,
    class_activation_maps,
    edge_estimate,
    normalized_edges,
    rectified_distance,
    reliability,
    similarity_nodes,
)
from harness.reports.explanations import write_tuple_figures
from tests.methods.test_conformance import BATCH, EMB, build, images


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ Eqs. 1-9, by hand


def test_similarity_nodes_are_eq_1_and_sum_to_the_squared_distance():
    x = F.normalize(torch.randn(3, 5, generator=gen(0)), dim=-1)
    y = F.normalize(torch.randn(3, 5, generator=gen(1)), dim=-1)
    delta = similarity_nodes(x, y)
    for b in range(3):
        for i in range(5):
            assert float(delta[b, i]) == pytest.approx(
                (float(x[b, i]) - float(y[b, i])) ** 2, rel=1e-6
            )
    torch.testing.assert_close(delta.sum(-1), 2 - 2 * (x * y).sum(-1))


def test_cams_are_eq_2_and_decompose_the_embedding():
    fmap = torch.randn(2, 3, 4, 5, generator=gen(2))
    weight, bias = torch.randn(6, 3, generator=gen(3)), torch.randn(6, generator=gen(4))
    linear = class_activation_maps(fmap, weight, bias, mode="linear")
    for i in range(6):  # Eq. 2: u_i = sum_j a_ij z_j
        expect = sum(weight[i, j] * fmap[:, j] for j in range(3))
        torch.testing.assert_close(linear[:, i], expect)
    # The code's form: the CAM's spatial mean is the embedding of GAP + GMP pooling.
    cams = class_activation_maps(fmap, weight, bias, mode="decomposed")
    emb = (fmap.mean((2, 3)) + fmap.amax((2, 3))) @ weight.t() + bias
    torch.testing.assert_close(cams.mean((2, 3)), emb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift", ["map", "width_min"])
def test_cam_certainty_is_the_std_of_the_normalised_map(shift):
    cams = torch.randn(2, 3, 4, 5, generator=gen(5))
    got = cam_certainty(cams, shift=shift)
    for b in range(2):
        for i in range(3):
            m = cams[b, i]
            m = m - (m.min() if shift == "map" else m.min(-1, keepdim=True).values)
            v = (m / m.abs().sum()).flatten().tolist()
            mean = sum(v) / len(v)
            std = math.sqrt(sum((t - mean) ** 2 for t in v) / (len(v) - 1))
            assert float(got[b, i]) == pytest.approx(std, rel=1e-5)


def test_edge_estimate_is_eq_3_by_hand():
    upper = torch.randn(2, 3, 2, 2, generator=gen(6))
    lower = torch.randn(2, 4, 4, 4, generator=gen(7))
    got = edge_estimate(upper, lower)
    assert got.shape == (3, 4)
    pooled = lower.view(2, 4, 2, 2, 2, 2).mean((3, 5))  # 4x4 -> 2x2 average pooling
    for i in range(3):
        for j in range(4):
            vals = []
            for b in range(2):
                u, v = upper[b, i].flatten(), pooled[b, j].flatten()
                vals.append(float(u @ v / (u.norm() * v.norm())))
            assert float(got[i, j]) == pytest.approx(sum(vals) / 2, rel=1e-5, abs=1e-6)


def test_normalized_edges_are_eqs_7_8_by_hand():
    edges = torch.tensor([[0.5, 0.1, 0.3, -0.2], [-0.1, -0.3, 0.2, 0.6], [0.1, 0.1, 0.1, 0.0]])
    got = normalized_edges(edges, 2)
    expect = torch.tensor(
        [[0.5 / 0.8, 0, 0.3 / 0.8, 0], [0, 0, 0.2 / 0.8, 0.6 / 0.8], [0.5, 0.5, 0, 0]]
    )
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)
    # k is clipped to the number of nodes; rows sum to 1 where any edge is positive.
    torch.testing.assert_close(
        normalized_edges(edges, 99).sum(1), torch.ones(3), rtol=1e-6, atol=1e-6
    )


def test_reliability_is_eqs_5_6_by_hand():
    cx, cy = torch.tensor([0.2, 0.5]), torch.tensor([0.3, 0.1])
    alpha, beta = torch.tensor([2.0, -1.0]), torch.tensor([0.1, 0.4])
    for gain in (1.0, 10.0):
        got = reliability(cx, cy, alpha, beta, gain=gain)
        for i in range(2):
            z = gain * (float(alpha[i]) * float(cx[i]) * float(cy[i]) + float(beta[i]))
            assert float(got[i]) == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-6)


def _graph(levels=3, r=4, seed=10):
    g = gen(seed)
    x = F.normalize(torch.randn(levels, r, generator=g), dim=-1)
    y = F.normalize(torch.randn(levels, r, generator=g), dim=-1)
    cx, cy = torch.rand(levels, r, generator=g), torch.rand(levels, r, generator=g)
    edges = [normalized_edges(torch.randn(r, r, generator=g), 2) for _ in range(levels - 1)]
    alphas = [torch.randn(r, generator=g) for _ in range(levels - 1)]
    betas = [torch.randn(r, generator=g) for _ in range(levels - 1)]
    return x, y, cx, cy, edges, alphas, betas


def test_rectified_distance_is_eqs_8_9_by_hand():
    x, y, cx, cy, edges, alphas, betas = _graph()
    gain = 10.0
    got = float(rectified_distance(x, y, cx, cy, edges, alphas, betas, gain=gain))
    r = x.shape[1]
    hat = [(float(x[0, i]) - float(y[0, i])) ** 2 for i in range(r)]  # level 1: delta^ = delta
    for level in (1, 2):
        new = []
        for i in range(r):
            p = 1 / (
                1
                + math.exp(
                    -gain
                    * (
                        float(alphas[level - 1][i]) * float(cx[level, i]) * float(cy[level, i])
                        + float(betas[level - 1][i])
                    )
                )
            )
            delta = (float(x[level, i]) - float(y[level, i])) ** 2
            new.append(
                p * delta + (1 - p) * sum(float(edges[level - 1][i, j]) * hat[j] for j in range(r))
            )
        hat = new
    assert got == pytest.approx(sum(hat), rel=1e-5)
    # Without rectification the distance is the top level's squared distance.
    plain = rectified_distance(x, y, cx, cy, edges, alphas, betas, rectify=False)
    assert float(plain) == pytest.approx(float((x[2] - y[2]).square().sum()), rel=1e-6)


def test_attribution_is_eq_11_and_sums_to_the_distance():
    x, y, cx, cy, edges, alphas, betas = _graph(seed=11)
    lam, contrib = attribution(x, y, cx, cy, edges, alphas, betas, gain=3.0)
    d = rectified_distance(x, y, cx, cy, edges, alphas, betas, gain=3.0)
    torch.testing.assert_close(contrib.sum(), d, rtol=1e-5, atol=1e-6)
    # lambda^3 = p^3, lambda^2 = (1 - p^3)^T W~^3 diag(p^2), lambda^1 = ((1 - p^3)^T W~^3 diag(1 - p^2)) W~^2.
    p = [reliability(cx[lv], cy[lv], alphas[lv - 1], betas[lv - 1], gain=3.0) for lv in (1, 2)]
    torch.testing.assert_close(lam[2], p[1])
    torch.testing.assert_close(lam[1], ((1 - p[1]) @ edges[1]) * p[0])
    torch.testing.assert_close(lam[0], (((1 - p[1]) @ edges[1]) * (1 - p[0])) @ edges[0])
    # The distance is linear in the nodes with these weights: d = sum lambda * delta.
    torch.testing.assert_close((lam * (x - y).square()).sum(), d, rtol=1e-5, atol=1e-6)


def test_distance_broadcasts_over_pairs():
    g = gen(12)
    xs = F.normalize(torch.randn(3, 2, 4, generator=g), dim=-1)
    ys = F.normalize(torch.randn(5, 2, 4, generator=g), dim=-1)
    cx, cy = torch.rand(3, 2, 4, generator=g), torch.rand(5, 2, 4, generator=g)
    edges, alphas, betas = (
        [normalized_edges(torch.randn(4, 4, generator=g), 3)],
        [torch.ones(4)],
        [torch.zeros(4)],
    )
    mat = rectified_distance(xs[:, None], ys[None], cx[:, None], cy[None], edges, alphas, betas)
    for a in range(3):
        for b in range(5):
            one = rectified_distance(xs[a], ys[b], cx[a], cy[b], edges, alphas, betas)
            torch.testing.assert_close(mat[a, b], one)


# ------------------------------------------------------------------ the head


def test_edges_are_buffers_updated_by_the_momentum_rule_in_train_mode_only():
    model = build("avsl")
    head = model.head
    keys = set(head.state_dict())
    assert {"edges_1", "edges_2", "edge_updates"} <= keys
    assert head.edges_1.shape == (EMB, EMB)
    with torch.no_grad():
        model.eval()
        model(images(0))
        assert int(head.edge_updates) == 0 and head.edges_1.abs().sum() == 0
        model.train()
        out1 = model(images(0))
        first = edge_estimate(out1.cams[1], out1.cams[0])
        torch.testing.assert_close(head.edges_1, first)  # the first batch overwrites (the code)
        out2 = model(images(1))
        second = edge_estimate(out2.cams[2], out2.cams[1])
        expect = 0.5 * edge_estimate(out1.cams[2], out1.cams[1]) + 0.5 * second
        torch.testing.assert_close(head.edges_2, expect)
        assert int(head.edge_updates) == 2
        before = head.edges_2.clone()
        model.eval()
        model(images(2))
        torch.testing.assert_close(head.edges_2, before)
    other = build("avsl", seed=1)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.head.edges_2, head.edges_2)
    assert int(other.head.edge_updates) == 2


def test_head_outputs_and_options():
    model = build("avsl").eval()
    head = model.head
    assert head.stages == ("s8", "s16", "s32") and head.metric_loss_copies == 3
    assert head.topk == EMB  # 128 clipped to the embedding size
    assert head.exhaustive_pairs and head.rerank_k == 0
    with torch.no_grad():
        out = model(images())
    assert len(out.levels) == 3 and all(e.shape == (BATCH, EMB) for e in out.levels)
    torch.testing.assert_close(out.embedding, out.levels[-1])
    assert out.field("levels").shape == (BATCH, 3, EMB) and out.field("certainty").shape == (
        BATCH,
        3,
        EMB,
    )
    rr = build("avsl", rank="rerank", rerank_k=5).head
    assert not rr.exhaustive_pairs and rr.rerank_k == 5
    one = build("avsl", levels=1).head
    assert one.stages == ("s32",) and not one.rectify and one.metric_loss_copies == 1


def test_pair_scores_agree_between_hooks():
    model = build("avsl").train()
    with torch.no_grad():
        model(images(3))  # non-zero edges
        model.eval()
        out = model(images(1))
    head = model.head
    fields = {f: out.field(f) for f in head.rerank_fields}
    full = make_pair_scorer(head, fields)(np.arange(BATCH), np.arange(BATCH))
    cands = np.stack([np.roll(np.arange(BATCH), -s)[:3] for s in range(BATCH)])
    some = make_reranker(head, fields, queries_per_call=3)(np.arange(BATCH), cands)
    np.testing.assert_allclose(
        some, np.take_along_axis(full.numpy(), cands, 1), rtol=1e-5, atol=1e-6
    )
    assert (full.diagonal().abs() < 1e-6).all()  # d^(x, x) = 0
    # Eq. 11 for one pair sums to the pair's distance.
    q = type(out)(
        embedding=out.embedding[:1],
        levels=[e[:1] for e in out.levels],
        extras={"certainty": out.extras["certainty"][:1]},
    )
    g = type(out)(
        embedding=out.embedding[2:3],
        levels=[e[2:3] for e in out.levels],
        extras={"certainty": out.extras["certainty"][2:3]},
    )
    _, contrib = head.attribute_pair(q, g)
    assert float(contrib.sum()) == pytest.approx(-float(full[0, 2]), rel=1e-5)


@pytest.mark.parametrize("loss", ["margin", "proxy_anchor"])
def test_final_loss_trains_only_the_inference_parameters(loss):
    model = build("avsl").train()
    head = model.head
    losses = [create_loss(loss, num_classes=4, embedding_size=EMB) for _ in range(3)]
    metric = MetricLoss(nn.ModuleList(losses))
    labels = torch.arange(BATCH) // 2
    x = images()
    terms = head.loss_terms(model(x), TrainingBatch(labels, metric, x, model))
    assert set(terms) == {"metric_level1", "metric_level2", "metric_level3", "final"}
    terms["final"].backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in head.project.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in head.alphas.parameters())


def test_final_loss_sees_the_cosine_when_nothing_is_rectified():
    """With alpha = beta = 0 and a huge gain p = 1/2; with rectification off d^ = d^L and the
    converted matrix 1 - d^/2 is exactly the cosine the loss would compute itself."""
    model = build("avsl", levels=2).train()
    head = model.head
    head.rectify = False
    loss = create_loss("multi_similarity", num_classes=4, embedding_size=EMB)
    metric = MetricLoss(nn.ModuleList([loss, loss]))
    labels = torch.arange(BATCH) // 2
    out = model(images())
    got = head._final_loss(out, TrainingBatch(labels, metric))
    torch.testing.assert_close(got, loss(out.embedding, labels), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ exhaustive ranking


def _brute_lists(scores: np.ndarray, same: bool) -> np.ndarray:
    """Every query's whole ranking by a Python sort: decreasing score, ties by index."""
    rows = []
    for q in range(scores.shape[0]):
        items = [(-scores[q, j], j) for j in range(scores.shape[1]) if not (same and j == q)]
        rows.append([j for _, j in sorted(items)])
    return np.array(rows)


@pytest.mark.parametrize("same", [True, False])
def test_chunked_exhaustive_ranking_equals_a_brute_force_loop(same):
    rng = np.random.default_rng(0)
    nq, ng = 23, 23 if same else 31
    scores = rng.integers(0, 6, size=(nq, ng)).astype(np.float32)  # many ties
    scorer = lambda qi, gi: scores[np.ix_(qi, gi)]  # noqa: E731
    brute = _brute_lists(scores, same)
    for qc, gc in ((1, 1), (4, 7), (64, 1024)):
        for k in (1, 5, brute.shape[1]):
            got = np.concatenate(
                [
                    idx
                    for _, _, idx in exhaustive_knn(
                        nq, None if same else ng, scorer, k, query_chunk=qc, reference_chunk=gc
                    )
                ]
            )
            np.testing.assert_array_equal(got, brute[:, :k])
    # The metrics of evaluate_embeddings equal those of the brute-force lists.
    q_labels = rng.integers(0, 4, nq)
    g_labels = q_labels if same else rng.integers(0, 4, ng)
    dummy_q = rng.normal(size=(nq, 3)).astype(np.float32)
    dummy_g = None if same else rng.normal(size=(ng, 3)).astype(np.float32)
    names = [
        "precision_at_1",
        "recall_at_k",
        "r_precision",
        "mean_average_precision_at_r",
        "map_at_c",
    ]
    got = evaluate_embeddings(
        dummy_q,
        q_labels,
        dummy_g,
        None if same else g_labels,
        pair_scorer=scorer,
        pair_chunks=(4, 7),
        metrics=names,
    )
    r = relevant_counts(q_labels, g_labels, same_source=same)
    expect = retrieval_metrics(
        g_labels[brute], q_labels, r, recall_k=(1, 2, 4, 8), same_source=same, metrics=names
    )
    assert got == pytest.approx(expect, nan_ok=True)


def test_one_level_without_rectification_ranks_like_the_cosine():
    model = build("avsl", levels=1).eval()
    with torch.no_grad():
        out = model(torch.randn(24, 3, 96, 80, generator=gen(4)))
    head = model.head
    fields = {f: out.field(f) for f in head.rerank_fields}
    labels = np.arange(24) % 5
    emb = out.embedding.numpy()
    cosine = evaluate_embeddings(
        emb, labels, metrics=["precision_at_1", "recall_at_k", "mean_average_precision_at_r"]
    )
    ranked = evaluate_embeddings(
        emb,
        labels,
        pair_scorer=make_pair_scorer(head, fields),
        pair_chunks=(5, 7),
        metrics=["precision_at_1", "recall_at_k", "mean_average_precision_at_r"],
    )
    assert ranked == pytest.approx(cosine)
    # -d^ = 2 cos - 2 exactly: the same order.
    d = make_pair_scorer(head, fields)(np.arange(24), np.arange(24)).numpy()
    np.testing.assert_allclose(d, 2 * emb @ emb.T - 2, atol=1e-5)


def test_pair_figures_6_and_7_and_the_attribution_as_data(tmp_path):
    """Figs. 6-7 are written for a pair, with Eq. 11's attribution as JSON that sums to d^."""
    import json

    model = build("avsl").train()
    with torch.no_grad():
        model(images(3))  # non-zero edges
        model.eval()
        out = model(images(1))
    pictures = torch.rand(BATCH, 3, 32, 32)
    written = write_tuple_figures(
        model.head, "pair", [pictures[0], pictures[2]], [out.select(0), out.select(2)], tmp_path
    )
    names = sorted(p.name for p in written)
    assert names == ["pair_avsl_attribution.json", "pair_fig6.png", "pair_fig7.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    record = json.loads((tmp_path / "pair_avsl_attribution.json").read_text())
    distance = -float(
        make_pair_scorer(model.head, {f: out.field(f) for f in model.head.rerank_fields})(
            np.array([0]), np.array([2])
        )[0, 0]
    )
    assert record["distance"] == pytest.approx(distance, rel=1e-5)
    assert sum(map(sum, record["contributions"])) == pytest.approx(distance, rel=1e-4)
    assert len(record["reliability"]) == 2 and len(record["lambdas"]) == 3
    assert (
        build("avsl", levels=1).head.figures(
            "pair", [pictures[0], pictures[2]], [out.select(0), out.select(2)]
        )
        is None
    )
