"""DIML: the Sinkhorn solver against POT, the paper's equations on tiny inputs, the
re-ranking against per-pair loops and the evaluation, the training mode's loss by hand,
and the explanation of a pair (CPU, no backbone)."""

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
from harness.components.transport import SinkhornStream, sinkhorn
from harness.engine.embedding import make_reranker
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


def pot():
    """POT (a test dependency, ``pip install -e '.[test]'``) is the reference Sinkhorn; the
    GPU machine's wheelhouse leaves it out, so only the tests that compare with it skip there."""
    return pytest.importorskip("ot", reason="POT (the reference Sinkhorn) is not installed")


def make(**options) -> DIMLHead:
    torch.manual_seed(0)
    return create_method("diml", channels={"s32": C}, embedding_size=EMB, **options).eval()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def problems(batch, n, m, *, seed=0, dtype=torch.float64, scale=1.0):
    g = gen(seed)
    cost = torch.rand(batch, n, m, generator=g, dtype=dtype) * scale
    mu = torch.rand(batch, n, generator=g, dtype=dtype) + 0.05
    nu = torch.rand(batch, m, generator=g, dtype=dtype) + 0.05
    return cost, mu / mu.sum(-1, keepdim=True), nu / nu.sum(-1, keepdim=True)


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


# ------------------------------------------------------------------------ Sinkhorn


@pytest.mark.parametrize("eps", [0.05, 0.1, 0.5])
def test_plans_meet_both_marginals(eps):
    cost, mu, nu = problems(32, 9, 16, seed=1, dtype=torch.float32)
    plan = sinkhorn(cost, mu, nu, eps=eps, max_iter=1000, tol=1e-6)
    assert plan.shape == (32, 9, 16) and (plan >= 0).all()
    torch.testing.assert_close(plan.sum(-1), mu, rtol=0, atol=1e-4)
    torch.testing.assert_close(plan.sum(-2), nu, rtol=0, atol=1e-4)


@pytest.mark.parametrize("eps", [0.05, 0.1, 1.0])
def test_plans_agree_with_pot(eps):
    """Same convention as ``ot.sinkhorn(a, b, M, reg)``: reg multiplies the entropy term,
    plan = diag(u) exp(-M / reg) diag(v)."""
    cost, mu, nu = problems(6, 5, 7, seed=2)
    plan = sinkhorn(cost, mu, nu, eps=eps, max_iter=100_000, tol=1e-13).numpy()
    for i in range(len(cost)):
        ref = pot().sinkhorn(
            mu[i].numpy(), nu[i].numpy(), cost[i].numpy(), eps, numItermax=100_000, stopThr=1e-14
        )
        np.testing.assert_allclose(plan[i], ref, rtol=0, atol=1e-5)


def test_entropic_objective_is_pots():
    """The plan minimises <T, M> + reg * sum T (log T - 1) over the transport polytope:
    POT's own entropic loss gives the same value."""
    cost, mu, nu = problems(1, 4, 6, seed=3)
    eps = 0.2
    plan = sinkhorn(cost, mu, nu, eps=eps, max_iter=100_000, tol=1e-13)[0]
    value = float((plan * cost[0]).sum() + eps * (plan * (plan.log() - 1)).sum())
    ref_plan = torch.as_tensor(
        pot().sinkhorn(
            mu[0].numpy(), nu[0].numpy(), cost[0].numpy(), eps, stopThr=1e-14, numItermax=100_000
        )
    )
    ref = float((ref_plan * cost[0]).sum() + eps * (ref_plan * (ref_plan.log() - 1)).sum())
    assert value == pytest.approx(ref, abs=1e-9)


def test_stable_for_small_eps_and_large_costs():
    cost, mu, nu = problems(64, 16, 16, seed=4, dtype=torch.float32, scale=90.0)
    cost = cost + 10.0
    # The scaling-domain kernel is all zeros here: plain Sinkhorn would divide 0 by 0.
    assert (torch.exp(-cost / 0.01) == 0).all()
    plan = sinkhorn(cost, mu, nu, eps=0.01, max_iter=300)
    assert torch.isfinite(plan).all() and (plan >= 0).all()
    torch.testing.assert_close(plan.sum(-2), nu, rtol=0, atol=1e-4)  # the last half-step is exact


def test_small_eps_agrees_with_pots_log_domain_solver():
    cost, mu, nu = problems(3, 6, 5, seed=5, scale=2.0)
    plan = sinkhorn(cost, mu, nu, eps=0.01, max_iter=100_000, tol=1e-11).numpy()
    for i in range(3):
        ref = pot().sinkhorn(
            mu[i].numpy(),
            nu[i].numpy(),
            cost[i].numpy(),
            0.01,
            method="sinkhorn_log",
            numItermax=100_000,
            stopThr=1e-13,
        )
        np.testing.assert_allclose(plan[i], ref, rtol=0, atol=1e-5)


def test_each_pair_stops_on_its_own_convergence_test():
    cost, mu, nu = problems(40, 8, 8, seed=6, dtype=torch.float32)
    cost[:20] *= 0.01  # nearly constant costs: converge at once
    _, its = sinkhorn(cost, mu, nu, eps=0.05, max_iter=500, tol=1e-5, return_iterations=True)
    assert its[:20].max() < its[20:].min()
    _, capped = sinkhorn(cost, mu, nu, eps=0.05, max_iter=3, tol=0.0, return_iterations=True)
    assert (capped == 3).all()


def test_zero_marginals_give_empty_rows_not_nan():
    cost, mu, nu = problems(8, 6, 6, seed=7)
    mu[:, :2] = 0
    mu = mu / mu.sum(-1, keepdim=True)
    plan = sinkhorn(cost, mu, nu, eps=0.05, max_iter=5000, tol=1e-10)
    assert torch.isfinite(plan).all() and (plan[:, :2] == 0).all()
    torch.testing.assert_close(plan.sum(-1), mu, rtol=0, atol=1e-8)


def test_gradients_flow_through_the_iterations():
    cost, mu, nu = problems(4, 5, 6, seed=8)
    cost.requires_grad_(True)
    mu.requires_grad_(True)
    plan = sinkhorn(cost, mu, nu, eps=0.1, max_iter=200, tol=1e-9)
    (plan * torch.linspace(0, 1, 30, dtype=cost.dtype).view(5, 6)).sum().backward()
    assert torch.isfinite(cost.grad).all() and cost.grad.abs().sum() > 0
    assert torch.isfinite(mu.grad).all() and mu.grad.abs().sum() > 0
    # Exact derivative of the unrolled iterations (a fixed count: tol = 0).
    c, a, b = problems(2, 3, 4, seed=9)
    c.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, a, b, eps=0.3, max_iter=6, tol=0.0), (c,))


class Blocks:
    """A source of problems for the streaming solver: the next ``count`` pairs, in order."""

    def __init__(self, log_kernel, mu, nu):
        self.problems, self.pos = (log_kernel, mu, nu), 0

    def __call__(self, count):
        total = len(self.problems[0])
        if self.pos >= total:
            return None
        rows = slice(self.pos, min(total, self.pos + count))
        self.pos = rows.stop
        return tuple(t[rows] for t in self.problems)


def streamed(cost, mu, nu, *, eps, max_iter, tol, window):
    """Plans and iteration counts of the streaming solver (the re-ranking's), ``window``
    pairs at a time: ``window=1`` solves each pair alone, stopped at its own convergence."""
    plans = torch.empty_like(cost)
    iterations = torch.empty(len(cost), dtype=torch.long)
    stream = SinkhornStream(max_iter=max_iter, tol=tol, window=window)
    for solved in stream.solve(Blocks(cost / -eps, mu, nu)):
        plans[solved.ids] = solved.plans()
        iterations[solved.ids] = solved.iterations
    return plans, iterations


def mixed_problems(dtype):
    """Pairs that stop at many different iterations: constant costs (after the first), near
    constant ones, random ones and ones that hit the cap; with a zero-mass row and column
    in two of them."""
    cost, mu, nu = problems(48, 8, 8, seed=20, dtype=dtype)
    cost[:4] = 0.5
    cost[4:12] *= 0.01
    cost[12:24] *= 3.0
    mu[40, 0] = 0
    nu[41, 3] = 0
    return cost, mu / mu.sum(-1, keepdim=True), nu / nu.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_sync_free_solver_gives_each_pair_its_own_stopped_plan(dtype):
    """sinkhorn() iterates every pair a fixed number of times and freezes a pair once it
    has converged: the plan and the count are those the streaming solver gives the pair
    alone (stopped at its own test), at every count, with zero marginals as well: the
    same operations on each pair, so the same bits."""
    cost, mu, nu = mixed_problems(dtype)
    plan, its = sinkhorn(cost, mu, nu, eps=0.05, max_iter=60, tol=1e-5, return_iterations=True)
    ref, ref_its = streamed(cost, mu, nu, eps=0.05, max_iter=60, tol=1e-5, window=1)
    assert len(set(its.tolist())) >= 6 and (its == 60).any() and (its == 1).any()
    assert torch.equal(its, ref_its)
    assert torch.equal(plan, ref)


def test_the_sync_free_solver_absorbs_large_scalings_per_pair():
    """Small eps and large costs: the first step underflows and scalings leave the safe
    range, so the exact (logsumexp) iterations run, for the affected pairs only."""
    cost, mu, nu = problems(24, 16, 16, seed=21, dtype=torch.float32, scale=90.0)
    cost[:8] = cost[:8] + 10.0  # every kernel entry underflows: the first step is redone exactly
    cost[16:] *= 0.001
    plan, its = sinkhorn(cost, mu, nu, eps=0.01, max_iter=200, tol=1e-4, return_iterations=True)
    ref, ref_its = streamed(cost, mu, nu, eps=0.01, max_iter=200, tol=1e-4, window=1)
    assert (its[:16] == 200).all() and (its[16:] < 20).all()
    assert torch.equal(its, ref_its) and torch.isfinite(plan).all()
    assert torch.equal(plan, ref)


def test_the_sync_free_solver_differs_from_a_shared_working_set_only_below_tol():
    """The streaming solver with a working set keeps iterating a converged pair until a
    quarter of the set has converged; its plans meet the marginals at least as well, so
    the two differ by about the tolerance (L1 per pair)."""
    cost, mu, nu = mixed_problems(torch.float64)
    plan = sinkhorn(cost, mu, nu, eps=0.05, max_iter=500, tol=1e-6)
    ref, _ = streamed(cost, mu, nu, eps=0.05, max_iter=500, tol=1e-6, window=2048)
    difference = (plan - ref).abs().sum((-2, -1))
    assert 0 < difference.max() < 2e-6


def test_training_step_sinkhorn_never_reads_the_device():
    from harness.base.syncs import SyncCounter

    cost, mu, nu = mixed_problems(torch.float32)
    with SyncCounter() as counter:
        sinkhorn(cost, mu, nu, eps=0.05, max_iter=100, tol=1e-4)
    assert (counter.scalar_reads, counter.device_to_host, counter.shape_dependent) == (0, 0, 0)


def test_bad_shapes_raise():
    cost, mu, nu = problems(2, 3, 4)
    with pytest.raises(ValueError, match="marginals"):
        sinkhorn(cost, nu, mu)
    with pytest.raises(ValueError, match="eps"):
        sinkhorn(cost, mu, nu, eps=0)


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


def test_float32_rerank_in_small_chunks_matches_float64(monkeypatch):
    import harness.methods.diml_rerank as diml_rerank

    head = make(tol=1e-7, max_iter=1000)
    out, _ = embedded(head)
    qi = torch.arange(12)
    ci = torch.randint(0, 40, (12, 30), generator=gen(13))
    query = {"embedding": out.embedding[qi], "local": out.local[qi]}
    cands = {"embedding": out.embedding[ci], "local": out.local[ci]}
    monkeypatch.setattr(diml_rerank, "SINKHORN_WINDOW", 64)  # many admissions and retirements
    small = head.rerank_similarity(query, cands)
    monkeypatch.undo()
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
