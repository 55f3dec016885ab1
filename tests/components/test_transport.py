"""The Sinkhorn solvers of harness.components.transport, as DIML uses them (Sec. 3.2,
App. A.2): the plans against POT, each pair's own convergence, stability at small eps,
gradients, and the streamed, sync-free solver."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.components.transport import SinkhornStream, sinkhorn


def pot():
    """POT (a test dependency, ``pip install -e '.[test]'``) is the reference Sinkhorn; the
    GPU machine's wheelhouse leaves it out, so only the tests that compare with it skip there."""
    return pytest.importorskip("ot", reason="POT (the reference Sinkhorn) is not installed")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def problems(batch, n, m, *, seed=0, dtype=torch.float64, scale=1.0):
    g = gen(seed)
    cost = torch.rand(batch, n, m, generator=g, dtype=dtype) * scale
    mu = torch.rand(batch, n, generator=g, dtype=dtype) + 0.05
    nu = torch.rand(batch, m, generator=g, dtype=dtype) + 0.05
    return cost, mu / mu.sum(-1, keepdim=True), nu / nu.sum(-1, keepdim=True)


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
