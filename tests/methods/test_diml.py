"""DIML: the paper's equations on tiny inputs (the solver itself:
tests/components/test_transport.py), the re-ranking against per-pair loops and the
evaluation, the training mode's loss by hand, and the explanation of a pair (CPU, no
backbone)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners

from harness.base.errors import HarnessError
from harness.components.evaluation import evaluate_embeddings, rerank_top_k
from harness.components.losses import MetricLoss
from harness.engine.run.embedding import make_reranker
from harness.methods import METHODS, HeadOutput, PaperInfo, TrainingBatch, create_method
from harness.methods.diml import (
    PAPER,
    DIMLHead,
    PrecomputedDistance,
    cross_correlation_marginals,
    explain_pair,
    pair_figure,
    structural_distance,
    structural_similarity,
    transport_plans,
)
from harness.reports.explanations import draw_figure

C = 48
EMB = 16


def make(**options) -> DIMLHead:
    torch.manual_seed(0)
    return create_method("diml", channels={"s32": C}, embedding_size=EMB, **options).eval()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def clustered_maps(num, *, classes=6, size=5, seed=0, dtype=torch.float32):
    """Non-negative maps with a class-specific object bump on noise (so that grids differ)."""
    g = gen(seed)
    codes = torch.relu(torch.randn(classes, C, generator=g, dtype=dtype))
    labels = torch.arange(num) % classes
    ys, xs = torch.meshgrid(
        torch.arange(size, dtype=dtype), torch.arange(size, dtype=dtype), indexing="ij"
    )
    centres = torch.rand(num, 2, generator=g, dtype=dtype) * (size - 1)
    bumps = torch.exp(-((ys - centres[:, :1, None]) ** 2 + (xs - centres[:, 1:, None]) ** 2) / 2)
    maps = torch.relu(
        0.7 * torch.randn(num, C, size, size, generator=g, dtype=dtype)
        + 2 * bumps[:, None] * codes[labels][:, :, None, None]
    )
    return maps, labels


# ------------------------------------------------------------- the paper's equations


def test_local_grid_is_roi_align_of_the_projected_map():
    head = make(grid=4)
    maps, _ = clustered_maps(3, size=7)
    with torch.no_grad():
        out = head([maps])
        g7 = make(grid=7)
        g7.load_state_dict(head.state_dict())
        out7 = g7([maps])
        out1 = make(grid=1)
        out1.load_state_dict(head.state_dict())
        o1 = out1([maps])
    assert out.local.shape == (3, 16, EMB)
    torch.testing.assert_close(out.local.norm(dim=-1), torch.ones(3, 16))
    # The embedding is exactly the plain head's.
    plain = create_method("plain", channels={"s32": C}, embedding_size=EMB)
    plain.load_state_dict(head.state_dict())
    torch.testing.assert_close(out.embedding, plain([maps]).embedding)
    # G = 7 on a 7 x 7 map: the Linear at every location; G = 1: the embedding itself.
    per_location = F.normalize(head.project(maps.flatten(2).transpose(1, 2)), dim=-1)
    torch.testing.assert_close(out7.local, per_location, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o1.local[:, 0], o1.embedding, rtol=1e-5, atol=1e-6)


def test_cross_correlation_marginals_eqs_8_9():
    g = gen(10)
    x = F.normalize(torch.randn(5, 16, 8, generator=g), dim=-1)
    y = F.normalize(torch.randn(5, 16, 8, generator=g), dim=-1)
    xg = F.normalize(torch.randn(5, 8, generator=g), dim=-1)
    yg = F.normalize(torch.randn(5, 8, generator=g), dim=-1)
    mu, nu = cross_correlation_marginals(x, y, xg, yg)
    alpha = torch.einsum("pid,pd->pi", x, yg)  # x's cells against y's global feature (Eq. 8)
    expected = (alpha.clamp_min(0) + 1e-5) / (alpha.clamp_min(0) + 1e-5).sum(-1, keepdim=True)
    torch.testing.assert_close(mu, expected)
    torch.testing.assert_close(mu.sum(-1), torch.ones(5))
    torch.testing.assert_close(nu.sum(-1), torch.ones(5))
    assert (mu > 0).all()
    # All correlations negative: uniform instead of the code's 0 / 0.
    mu_neg, _ = cross_correlation_marginals(x, y, xg, -F.normalize(x.sum(1), dim=-1))
    assert torch.isfinite(mu_neg).all()


def test_structural_similarity_and_distance_eqs_5_6():
    g = gen(11)
    x = F.normalize(torch.randn(2, 4, 6, generator=g, dtype=torch.float64), dim=-1)
    y = F.normalize(torch.randn(2, 4, 6, generator=g, dtype=torch.float64), dim=-1)
    plan, s, mu, nu = transport_plans(
        x, y, marginals="uniform", eps=0.05, tol=1e-12, max_iter=10_000
    )
    manual_sim = sum(plan[0, i, j] * (x[0, i] @ y[0, j]) for i in range(4) for j in range(4))
    manual_dist = sum(
        plan[0, i, j] * (x[0, i] - y[0, j]).norm() for i in range(4) for j in range(4)
    )
    assert float(structural_similarity(plan, s)[0]) == pytest.approx(float(manual_sim), abs=1e-12)
    assert float(structural_distance(plan, s)[0]) == pytest.approx(float(manual_dist), abs=1e-9)
    torch.testing.assert_close(mu, torch.full((2, 4), 0.25, dtype=torch.float64))


def test_identical_grids_in_a_different_order_match_perfectly():
    """Structural matching is invariant to where the parts are: a permuted copy of a grid
    (orthogonal cells, uniform marginals, small eps) has structural similarity ~1 even
    though the cell-by-cell cosine is 0."""
    x = torch.eye(4, dtype=torch.float64)[None]
    y = x[:, [2, 0, 3, 1]]
    plan, s, _, _ = transport_plans(x, y, marginals="uniform", eps=0.01, tol=1e-12, max_iter=10_000)
    assert float(structural_similarity(plan, s)[0]) == pytest.approx(1.0, abs=1e-12)
    assert float(torch.diagonal(s[0]).mean()) == 0.0


# ----------------------------------------------------------------------- re-ranking


def embedded(head, num=40, seed=0, dtype=torch.float32):
    maps, labels = clustered_maps(num, seed=seed, dtype=dtype)
    if dtype == torch.float64:
        head = head.double()
    with torch.no_grad():
        out = head([maps])
    return out, labels


def loop_reference(head, query, candidates):
    """Per-pair loop over (query, candidate): Eq. 4 with Eqs. 8-9, Eq. 5, plus the cosine."""
    nq, k = candidates["embedding"].shape[:2]
    out = torch.empty(nq, k, dtype=torch.float64)
    for q in range(nq):
        for j in range(k):
            x, y = query["local"][q][None], candidates["local"][q, j][None]
            xg, yg = query["embedding"][q][None], candidates["embedding"][q, j][None]
            plan, s, _, _ = transport_plans(
                x,
                y,
                xg,
                yg,
                marginals=head.marginals,
                eps=head.eps,
                max_iter=head.max_iter,
                tol=head.tol,
            )
            out[q, j] = structural_similarity(plan, s)[0] + (
                xg[0] @ yg[0] if head.add_global else 0
            )
    return out


@pytest.mark.parametrize("marginals", ["cross_correlation", "uniform"])
def test_batched_rerank_equals_a_per_pair_loop(marginals):
    head = make(marginals=marginals, tol=1e-11, max_iter=5000, sinkhorn_stop="converged")
    out, _ = embedded(head, dtype=torch.float64)
    g = gen(12)
    qi = torch.arange(7)
    ci = torch.randint(0, 40, (7, 9), generator=g)
    query = {"embedding": out.embedding[qi], "local": out.local[qi]}
    cands = {"embedding": out.embedding[ci], "local": out.local[ci]}
    batched = head.rerank_similarity(query, cands)
    assert batched.shape == (7, 9) and batched.dtype == torch.float64
    torch.testing.assert_close(batched, loop_reference(head, query, cands), rtol=0, atol=1e-9)
    fields = {"embedding": out.embedding, "local": out.local}
    by_ids = head.rerank_by_ids(fields, fields, qi.numpy(), ci.numpy())
    torch.testing.assert_close(by_ids, batched, rtol=0, atol=1e-12)
    reranker = make_reranker(head, fields)
    np.testing.assert_allclose(
        reranker(qi.numpy(), ci.numpy()), batched.float().numpy(), rtol=1e-6, atol=1e-6
    )


def test_float32_rerank_in_small_chunks_matches_float64():
    head = make(tol=1e-7, max_iter=1000)
    out, _ = embedded(head)
    qi = torch.arange(12)
    ci = torch.randint(0, 40, (12, 30), generator=gen(13))
    query = {"embedding": out.embedding[qi], "local": out.local[qi]}
    cands = {"embedding": out.embedding[ci], "local": out.local[ci]}
    small = head.rerank_similarity(query, cands, window=64)  # many admissions and retirements
    ref = head.rerank_similarity(
        {k: v.double() for k, v in query.items()}, {k: v.double() for k, v in cands.items()}
    )
    assert small.dtype == torch.float32
    torch.testing.assert_close(small.double(), ref, rtol=0, atol=1e-5)


def test_grid_1_keeps_the_cosine_order():
    """With G = 1 the grid is the embedding itself (ROI Align over the whole map is GAP,
    and the Linear commutes with it), both marginals are [1], so the structural similarity
    equals the cosine and the score is 2 x cosine: re-ranking cannot change the order.
    The same data re-ranked at G = 4 does change it, so the check has teeth."""
    head1 = make(grid=1)
    out, _ = embedded(head1, num=60, dtype=torch.float64)
    torch.testing.assert_close(out.local[:, 0], out.embedding, rtol=0, atol=1e-12)
    fields = {"embedding": out.embedding, "local": out.local}
    emb = out.embedding.numpy()
    sims = emb @ emb.T
    np.fill_diagonal(sims, -np.inf)
    idx = np.argsort(-sims, axis=1, kind="stable")[:, :30]
    scores = make_reranker(head1, fields)(np.arange(60), idx)
    np.testing.assert_allclose(scores, 2 * np.take_along_axis(sims, idx, 1), rtol=0, atol=1e-6)
    reranked = rerank_top_k(idx, np.arange(60), make_reranker(head1, fields), 30)
    np.testing.assert_array_equal(reranked, idx)

    head4 = make(grid=4).double()
    head4.load_state_dict(head1.state_dict())
    out4, _ = embedded(head4, num=60, dtype=torch.float64)
    torch.testing.assert_close(out4.embedding, out.embedding)
    fields4 = {"embedding": out4.embedding, "local": out4.local}
    assert (rerank_top_k(idx, np.arange(60), make_reranker(head4, fields4), 30) != idx).any()


def test_k_zero_gives_exactly_the_baseline_metrics():
    head = make()
    out, labels = embedded(head, num=60)
    fields = {"embedding": out.embedding, "local": out.local}
    calls = []
    reranker = make_reranker(head, fields)

    def spy(q, c):
        calls.append(c.shape)
        return reranker(q, c)

    emb = out.embedding.numpy()
    base = evaluate_embeddings(
        emb,
        labels.numpy(),
        metrics=["precision_at_1", "r_precision", "mean_average_precision_at_r", "recall_at_k"],
    )
    zero = evaluate_embeddings(
        emb,
        labels.numpy(),
        metrics=["precision_at_1", "r_precision", "mean_average_precision_at_r", "recall_at_k"],
        reranker=spy,
        rerank_k=0,
    )
    assert zero == base and not calls
    reranked = evaluate_embeddings(
        emb,
        labels.numpy(),
        metrics=["precision_at_1", "r_precision", "mean_average_precision_at_r", "recall_at_k"],
        reranker=spy,
        rerank_k=20,
    )
    assert calls and reranked != base


def test_reranking_never_promotes_an_item_from_beyond_the_top_k():
    head = make()
    out, _ = embedded(head, num=50)
    emb = out.embedding.numpy()
    sims = emb @ emb.T
    np.fill_diagonal(sims, -np.inf)
    idx = np.argsort(-sims, axis=1, kind="stable")[:, :30]
    k = 10
    reranked = rerank_top_k(
        idx, np.arange(50), make_reranker(head, {"embedding": out.embedding, "local": out.local}), k
    )
    for row, new in zip(idx, reranked, strict=True):
        assert set(new[:k]) == set(row[:k])
        np.testing.assert_array_equal(new[k:], row[k:])
    assert (reranked[:, :k] != idx[:, :k]).any()


def test_structural_only_variant_and_empty_input():
    head = create_method("diml_ss", channels={"s32": C}, embedding_size=EMB).eval()
    out, _ = embedded(head)
    query = {"embedding": out.embedding[:3], "local": out.local[:3]}
    cands = {
        "embedding": out.embedding[3:9].view(3, 2, EMB),
        "local": out.local[3:9].view(3, 2, 16, EMB),
    }
    full = make(marginals="uniform")
    full.load_state_dict(head.state_dict())
    cos = torch.einsum("qd,qkd->qk", query["embedding"], cands["embedding"])
    torch.testing.assert_close(
        full.rerank_similarity(query, cands) - head.rerank_similarity(query, cands), cos
    )
    empty = head.rerank_similarity(
        query, {"embedding": cands["embedding"][:, :0], "local": cands["local"][:, :0]}
    )
    assert empty.shape == (3, 0)


# ----------------------------------------------------------------- training (App. A.3)


def hand_batch():
    """Four images, two classes; grids of one cell (G = 1: the plan is [1] whatever the
    marginals), deliberately different from the embeddings."""
    emb = F.normalize(
        torch.tensor([[1.0, 0.2, 0.0], [0.8, 0.5, 0.1], [0.1, 1.0, 0.3], [0.0, 0.7, 0.9]]), dim=-1
    )
    loc = F.normalize(
        torch.tensor([[0.9, 0.0, 0.4], [0.2, 0.9, 0.1], [0.5, 0.5, 0.5], [0.0, 0.2, 1.0]]), dim=-1
    )
    return HeadOutput(embedding=emb, local=loc[:, None]), torch.tensor([0, 0, 1, 1])


def batch(labels, loss, miner=None) -> TrainingBatch:
    """What the trainer hands ``loss_terms``: the labels and the run's loss with its miner."""
    return TrainingBatch(labels, MetricLoss(loss, miner))


def test_margin_loss_on_the_mean_of_global_and_structural_distances_by_hand():
    """Eqs. 15-16: D = (d_struct + d_global) / 2, Euclidean; PML's margin loss reduction
    (sum over all triplets / number of non-zero terms)."""
    out, labels = hand_batch()
    head = make(grid=1, train_structural=True)
    loss = pml_losses.MarginLoss(margin=0.2, beta=1.0, triplets_per_anchor="all")
    got = head.loss_terms(out, batch(labels, loss))["metric"]
    e, z = out.embedding, out.local[:, 0]
    dist = lambda a, b: float((e[a] - e[b]).norm() + (z[a] - z[b]).norm()) / 2  # noqa: E731
    terms, nonzero = 0.0, 0
    for a in range(4):
        for p in range(4):
            for n in range(4):
                if a != p and labels[a] == labels[p] and labels[a] != labels[n]:
                    pos = max(0.0, dist(a, p) - 1.0 + 0.2)
                    neg = max(0.0, 1.0 - dist(a, n) + 0.2)
                    terms += pos + neg
                    nonzero += (pos > 0) + (neg > 0)
    assert float(got) == pytest.approx(terms / nonzero, rel=1e-5)


def test_multi_similarity_loss_on_the_mean_of_global_and_structural_similarities_by_hand():
    """Eqs. 18-19: s = (s_global + s_struct) / 2 inside the MS loss (Wang et al. 2019)."""
    out, labels = hand_batch()
    head = make(grid=1, train_structural=True)
    alpha, beta, base = 2.0, 50.0, 0.5
    loss = pml_losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=base)
    got = head.loss_terms(out, batch(labels, loss))["metric"]
    e, z = out.embedding, out.local[:, 0]
    sim = lambda a, b: float(e[a] @ e[b] + z[a] @ z[b]) / 2  # noqa: E731
    total = 0.0
    for a in range(4):
        pos = [sim(a, p) for p in range(4) if p != a and labels[p] == labels[a]]
        neg = [sim(a, n) for n in range(4) if labels[n] != labels[a]]
        total += math.log(1 + sum(math.exp(-alpha * (s - base)) for s in pos)) / alpha
        total += math.log(1 + sum(math.exp(beta * (s - base)) for s in neg)) / beta
    assert float(got) == pytest.approx(total / 4, rel=1e-5)


def test_multi_similarity_mines_on_the_combined_similarity_by_hand():
    """Eqs. 18-19: s* (the epsilon pair selection of Eq. 18) is taken on the combined
    similarity (s_global + s_struct) / 2, as the released ``multisimilarity_diml``
    criterion does; mining on the global cosine gives another value on this batch."""
    g = gen(1)
    emb = F.normalize(torch.randn(8, 3, generator=g), dim=-1)
    loc = F.normalize(torch.randn(8, 3, generator=g), dim=-1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    out = HeadOutput(embedding=emb, local=loc[:, None])
    head = make(grid=1, train_structural=True)
    alpha, beta, base, eps = 2.0, 50.0, 0.5, 0.1
    loss = pml_losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=base)
    got = head.loss_terms(out, batch(labels, loss, pml_miners.MultiSimilarityMiner(eps)))["metric"]
    combined = lambda a, b: float(emb[a] @ emb[b] + loc[a] @ loc[b]) / 2  # noqa: E731
    cosine = lambda a, b: float(emb[a] @ emb[b])  # noqa: E731

    def by_hand(mine_on):
        total = 0.0
        for a in range(8):
            pos = [p for p in range(8) if p != a and labels[p] == labels[a]]
            neg = [n for n in range(8) if labels[n] != labels[a]]
            hardest_neg, hardest_pos = (
                max(mine_on(a, n) for n in neg),
                min(mine_on(a, p) for p in pos),
            )
            kept_pos = [combined(a, p) for p in pos if mine_on(a, p) - eps < hardest_neg]
            kept_neg = [combined(a, n) for n in neg if mine_on(a, n) + eps > hardest_pos]
            total += math.log(1 + sum(math.exp(-alpha * (s - base)) for s in kept_pos)) / alpha
            total += math.log(1 + sum(math.exp(beta * (s - base)) for s in kept_neg)) / beta
        return total / 8

    assert float(got) == pytest.approx(by_hand(combined), rel=1e-5)
    assert by_hand(cosine) == pytest.approx(0.7298, abs=1e-3)  # the old behaviour, far from it
    assert abs(by_hand(cosine) - float(got)) > 0.1


@pytest.mark.parametrize("name", ["margin", "multi_similarity"])
def test_structural_training_loss_reduces_to_the_plain_loss_when_grids_are_the_embedding(name):
    """G = 1 from real maps: the grid is the embedding, so the DIML matrix equals the global
    one and the training-mode loss equals the plain PML loss (with a miner as well)."""
    head = make(grid=1, train_structural=True)
    maps, labels = clustered_maps(12, classes=4, seed=3)
    out = head([maps])
    loss = (
        pml_losses.MarginLoss(margin=0.2, beta=1.2, num_classes=4, learn_beta=True)
        if name == "margin"
        else pml_losses.MultiSimilarityLoss()
    )
    miner = pml_miners.MultiSimilarityMiner(0.1) if name == "multi_similarity" else None
    got = head.loss_terms(out, batch(labels, loss, miner))["metric"]
    plain = loss(out.embedding, labels, miner(out.embedding, labels) if miner else None)
    assert float(got.detach()) == pytest.approx(float(plain.detach()), rel=1e-4, abs=1e-6)


def test_precomputed_distance_reproduces_pml_on_the_global_matrix():
    g = gen(14)
    emb = F.normalize(torch.randn(16, 8, generator=g), dim=-1)
    labels = torch.arange(16) % 4
    for loss, matrix, inverted in (
        (pml_losses.MarginLoss(), torch.cdist(emb, emb), False),
        (pml_losses.MultiSimilarityLoss(), emb @ emb.t(), True),
        (pml_losses.ContrastiveLoss(), torch.cdist(emb, emb), False),
    ):
        expected = loss(emb, labels)
        old = loss.distance
        loss.distance = PrecomputedDistance(matrix, is_inverted=inverted)
        assert float(loss(emb, labels)) == pytest.approx(float(expected), rel=1e-5)
        loss.distance = old


def test_training_mode_trains_with_the_runs_loss():
    head = make(train_structural=True)
    head.train()
    maps, labels = clustered_maps(8, classes=4, seed=5)
    out = head([maps])
    terms = head.loss_terms(out, batch(labels, pml_losses.MultiSimilarityLoss()))
    assert set(terms) == {"metric"} and torch.isfinite(terms["metric"])
    terms["metric"].backward()
    assert head.project.weight.grad.abs().sum() > 0
    assert not list(head.state_dict().keys() - {"project.weight", "project.bias"})
    # Plan gradients on request (the paper's differentiable iterations).
    head2 = make(train_structural=True, plan_grad=True)
    out2 = head2([maps])
    head2.loss_terms(out2, batch(labels, pml_losses.MarginLoss()))["metric"].backward()
    assert torch.isfinite(head2.project.weight.grad).all()
    with pytest.raises(HarnessError, match="pair- or triplet-based"):
        head.loss_terms(
            out, batch(labels, pml_losses.ProxyAnchorLoss(num_classes=4, embedding_size=EMB))
        )


# ---------------------------------------------------------------- explanation, meta


def test_part_wise_contributions_sum_to_the_structural_similarity(tmp_path):
    head = make(tol=1e-9, max_iter=2000, sinkhorn_stop="converged")
    out, _ = embedded(head, num=4)
    exp = head.explain_pair(
        HeadOutput(embedding=out.embedding[:1], local=out.local[:1]),
        {"embedding": out.embedding[1], "local": out.local[1]},
    )
    assert exp.query_marginal.shape == (4, 4) and exp.gallery_marginal.shape == (4, 4)
    assert exp.plan.shape == (16, 16) and exp.contributions.shape == (16, 16)
    assert float(exp.contributions.sum()) == pytest.approx(exp.structural_similarity, abs=1e-6)
    torch.testing.assert_close(exp.contributions, exp.plan * exp.similarity)
    torch.testing.assert_close(exp.plan.sum(1), exp.query_marginal.flatten(), rtol=0, atol=1e-6)
    torch.testing.assert_close(exp.plan.sum(0), exp.gallery_marginal.flatten(), rtol=0, atol=1e-6)
    score = head.rerank_similarity(
        {"embedding": out.embedding[:1], "local": out.local[:1]},
        {"embedding": out.embedding[1:2, None], "local": out.local[1:2, None]},
    )
    assert float(score) == pytest.approx(exp.score, abs=1e-5)
    ((i, j, t_hat, s_ij, c_ij),) = exp.top_pairs(1)
    assert c_ij == pytest.approx(float(exp.contributions.max())) and t_hat == pytest.approx(
        256 * float(exp.plan[i, j])
    )
    figure = pair_figure(torch.rand(3, 40, 32), torch.rand(3, 36, 36), exp)
    assert [p.heat for p in figure.panels[0]] == [
        exp.query_marginal,
        exp.gallery_marginal,
    ] and figure.grid == 4
    # the top two flows in red, the smallest in blue, each from its query cell to its gallery cell
    assert [link.colour for link in figure.links] == ["red", "red", "blue"]
    assert figure.links[0].start == (0, 0, (i % 4 + 0.5) / 4, (i // 4 + 0.5) / 4)
    assert figure.links[0].end == (0, 1, (j % 4 + 0.5) / 4, (j // 4 + 0.5) / 4)
    assert figure.links[0].label == f"{t_hat:.2f} x {s_ij:.2f}"
    path = draw_figure(figure, tmp_path / "fig" / "pair.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    uniform = explain_pair(
        HeadOutput(embedding=out.embedding[2:3], local=out.local[2:3]),
        HeadOutput(embedding=out.embedding[3:4], local=out.local[3:4]),
        marginals="uniform",
    )
    torch.testing.assert_close(uniform.query_marginal, torch.full((4, 4), 1 / 16))
    assert float(uniform.contributions.sum()) == pytest.approx(
        uniform.structural_similarity, abs=1e-6
    )
    with pytest.raises(ValueError, match="one"):
        explain_pair(out, out)


def test_explain_maps_are_in_unit_range():
    head = make()
    out, _ = embedded(head, num=3)
    maps = head.explain(torch.rand(3, 3, 50, 40), out)
    assert maps.shape == (3, 1, 50, 40) and maps.min() >= 0 and maps.max() <= 1


def test_registry_metadata_and_options():
    assert {"diml", "diml_ss", "diml_ss_mm", "diml_train"} <= set(METHODS.list("diml*"))
    assert isinstance(DIMLHead.paper, PaperInfo) and DIMLHead.paper is PAPER
    assert PAPER.code_url == "https://github.com/wl-zhao/DIML" and PAPER.tables == (
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
    )
    assert PAPER.arxiv == "2108.05889" and PAPER.year == 2021
    assert DIMLHead.rerank_fields == ("embedding", "local")
    options = METHODS.get("diml").options()
    assert options["grid"] == 4 and options["rerank_k"] == 100 and options["eps"] == 0.05
    assert options["marginals"] == "cross_correlation" and options["train_structural"] is False
    with pytest.raises(HarnessError, match="grid"):
        make(grid=3)
    with pytest.raises(HarnessError, match="marginals"):
        make(marginals="cosine")
    with pytest.raises(HarnessError, match="unknown option 'gird'"):
        create_method("diml", channels={"s32": C}, embedding_size=EMB, gird=4)
