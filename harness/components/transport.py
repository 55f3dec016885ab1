"""Entropic optimal transport: Sinkhorn's iterations on batches of small problems.

DIML's structural matching (:mod:`harness.methods.diml`; Zhao et al., ICCV 2021) solves
one transport problem per pair of images (App. A.1, Eqs. 12-14): its training solves a
batch's pairs together, its re-ranking a stream of Q x K (query, candidate) pairs. Two
solvers, the same iterates:

* :func:`sinkhorn`: a batch of problems iterated together on their device, each pair
  frozen once it has converged, with no value read back to the host (a training step
  never waits for it); differentiable.
* :class:`SinkhornStream`: pairs taken from a source as the working set has room and
  handed back (:class:`SolvedPairs`) as soon as they converge; the working set's
  bookkeeping is read on the host (evaluation).

Both keep the potentials in the log domain and scale a kernel of entries at most 1
between exact (``logsumexp``) iterations, the log-stabilised Sinkhorn of Schmitzer
(2019), so they are finite for any eps > 0 and any cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

__all__ = [
    "SINKHORN_WINDOW",
    "SINKHORN_WINDOW_CUDA",
    "SINKHORN_BLOCK",
    "PairSource",
    "SinkhornStream",
    "SolvedPairs",
    "sinkhorn",
]

#: Pairs iterated together by the Sinkhorn solvers (a cache-sized working set).
SINKHORN_WINDOW = 2048
#: The same on a GPU: enough pairs per kernel launch to fill the device (each pair's
#: state is a few G^2 x G^2 matrices: 65,536 pairs at G = 4 hold ~70 MB per matrix).
SINKHORN_WINDOW_CUDA = 1 << 16
#: Iterations of :func:`sinkhorn` between its reads of "does any pair still run?": the
#: training's cap (``max_iter`` = 100) is below it, so a training step never reads; a solve
#: to a tight tolerance with a large cap stops at most this many iterations after its last
#: pair converged.
SINKHORN_BLOCK = 128

#: A stream of problems: called with about how many pairs the working set can take, it
#: returns the next ones as ``(log_kernel P x n x m = -C / eps, mu P x n, nu P x m)``, or
#: None when there are no more.
PairSource = Callable[[int], "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]


# ------------------------------------------------------------------ a batch, on the device


def sinkhorn(
    cost: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    *,
    eps: float = 0.05,
    max_iter: int = 100,
    tol: float = 1e-6,
    return_iterations: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Entropic optimal transport plans of a batch of problems (DIML App. A.1, Eqs. 12-14).

    ``cost``: B x n x m, ``mu``: B x n, ``nu``: B x m (non-negative, each summing to 1).
    Returns the plans T (B x n x m) minimising ``<T, C> + eps * sum T (log T - 1)`` with
    ``T 1 = mu`` and ``T^T 1 = nu``, i.e. ``T = diag(u) K diag(v)`` with ``K = exp(-C / eps)``.
    ``eps`` is exactly POT's ``reg`` in ``ot.sinkhorn(a, b, M, reg)``, DIML's lambda
    (Eq. 12) and its released code's 0.05 in ``exp(-dis / 0.05)``.

    Every pair is iterated until its row marginal's L1 error ``sum_i |T 1 - mu|_i`` is at
    most ``tol`` (the column marginal is exact after each iteration) or ``max_iter``
    iterations were made; a converged pair is frozen (its plan is the one it had when it
    stopped), so each plan depends on its own problem only. With ``return_iterations`` also
    returns each pair's count (B,). The loop runs on the device without reading it back
    (:func:`_sinkhorn_frozen`).

    Numerics: the potentials f = log u, g = log v are kept in the log domain. An exact
    log-domain iteration (``logsumexp``) starts the solve and re-derives the kernel of the
    current plan, ``exp(-C/eps + f_i + g_j)``, whose entries are at most 1; the following
    iterations scale that kernel (two batched mat-vecs each) and a scaling that would
    leave a safe range is absorbed into f, g by another exact iteration. This is the
    log-stabilised Sinkhorn of Schmitzer (2019) and POT's ``sinkhorn_stabilized``: the
    same iterates as plain Sinkhorn, finite for any eps > 0 and any cost, and several
    times faster than a ``logsumexp`` every iteration. Differentiable: autograd unrolls the
    iterations (all of them, a frozen pair's too: the loop's length does not depend on the
    data).
    """
    _check_problems(cost, mu, nu, eps=eps, max_iter=max_iter)
    mu, nu = mu.to(cost.dtype), nu.to(cost.dtype)
    plan, its = _solve_in_windows(cost / -eps, mu, nu, max_iter=max_iter, tol=tol)
    return (plan, its) if return_iterations else plan


def _solve_in_windows(
    log_kernel: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor, *, max_iter: int, tol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sinkhorn_frozen` over windows of the B pairs: (plans B x n x m, iterations B)."""
    b, n, m = log_kernel.shape
    window = SINKHORN_WINDOW_CUDA if log_kernel.device.type == "cuda" else SINKHORN_WINDOW
    plans, iterations = [], []
    for start in range(0, b, window):  # each pair's plan is its own: the windows only bound memory
        rows = slice(start, start + window)
        u, kernel, v, its = _sinkhorn_frozen(
            log_kernel[rows], mu[rows], nu[rows], max_iter=max_iter, tol=tol
        )
        plans.append(u[:, :, None] * kernel * v[:, None, :])
        iterations.append(its)
    if b == 0:
        plans, iterations = (
            [log_kernel.new_empty(0, n, m)],
            [torch.empty(0, dtype=torch.long, device=log_kernel.device)],
        )
    return torch.cat(plans), torch.cat(iterations)


def _check_problems(
    cost: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor, *, eps: float, max_iter: int
) -> None:
    """Refuse what :func:`sinkhorn` cannot solve, naming the shape or value."""
    if cost.dim() != 3:
        raise ValueError(f"cost must be B x n x m, got shape {tuple(cost.shape)}")
    b, n, m = cost.shape
    if mu.shape != (b, n) or nu.shape != (b, m):
        raise ValueError(
            f"marginals must be {b} x {n} and {b} x {m}, got {tuple(mu.shape)} and {tuple(nu.shape)}"
        )
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be at least 1, got {max_iter}")
    if not cost.is_floating_point():
        raise ValueError("cost must be a floating-point tensor")


def _divide(marginal: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """``marginal / sums``, where rows or columns without mass (a zero marginal) keep zero
    mass instead of 0/0; the same values as the plain quotient where the marginal is positive."""
    return torch.where(marginal > 0, marginal / sums, torch.zeros_like(sums))


def _exact_step(
    lk: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Sinkhorn iteration in the log domain (Eqs. 13-14 with ``logsumexp``) from the
    column potential g: the new g and the kernel ``exp(lk + f_i + g_j)`` of its plan."""
    f = a.log() - torch.logsumexp(lk + g[:, None, :], dim=-1)
    g = b.log() - torch.logsumexp(lk + f[:, :, None], dim=-2)
    return g, torch.exp(lk + f[:, :, None] + g[:, None, :])


def _first_step(
    lk: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    tiny: float,
    divide: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _divide,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first iteration (from g = 0) with a single exp, shifted by each pair's largest
    log-kernel entry: (g, kernel, bad), ``bad`` marking the pairs with a row or column sum
    at most ``tiny`` (underflow), whose g and kernel :func:`_exact_step` must give instead.
    In place unless autograd records."""
    track = torch.is_grad_enabled() and (lk.requires_grad or a.requires_grad or b.requires_grad)
    shifted = lk - lk.flatten(1).amax(1)[:, None, None]
    kernel = shifted.exp() if track else shifted.exp_()
    r = kernel.sum(-1)
    row_scale = divide(a, r)  # exp(lk + f) = kernel * row_scale: its rows sum to a
    c = torch.bmm(row_scale[:, None, :], kernel).squeeze(1)
    g = b.log() - c.log()
    col_scale = divide(b, c)
    if track:
        kernel = kernel * row_scale[:, :, None] * col_scale[:, None, :]
    else:
        kernel.mul_(row_scale[:, :, None]).mul_(col_scale[:, None, :])
    bad = ((r <= tiny) & (a > 0)).any(-1) | ((c <= tiny) & (b > 0)).any(-1)
    return g, kernel, bad


def _safe_range(dtype: torch.dtype) -> tuple[float, float]:
    """(limit, tiny): scalings beyond [1 / limit, limit] are absorbed into the potentials,
    and a first-step sum at most ``tiny`` counts as underflowed."""
    return torch.finfo(dtype).max ** 0.25, torch.finfo(dtype).tiny * 2**10


def _sinkhorn_frozen(
    lk: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, max_iter: int, tol: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The solver behind :func:`sinkhorn`: P problems iterated together on their device,
    with no value read back to the host (a training step's Sinkhorn never waits for it).

    ``lk``: P x n x m (= -C / eps), ``a``: P x n, ``b``: P x m. Returns (u, kernel, v,
    iterations) with each plan ``u_i kernel_ij v_j``. The iterates are those of
    :class:`SinkhornStream`, one pair at a time: an exact first iteration, then kernel
    scalings, a scaling outside the safe range absorbed into the potentials by an exact
    iteration. The per-pair stopping rule (L1 row error at most ``tol``, or ``max_iter``
    iterations) is kept by a ``running`` mask: a pair that stops is frozen by
    ``torch.where`` (its u, v, kernel never change again: the values it stopped with), so
    the loop makes ``max_iter - 1`` iterations whatever the data, and the safe-range test
    and the underflow redo are per pair as well (both branches computed, one kept). Only
    with ``max_iter`` above :data:`SINKHORN_BLOCK` does it ask the device, once per block,
    whether any pair still runs, to stop early."""
    limit, tiny = _safe_range(lk.dtype)
    g, kernel, bad = _first_step(lk, a, b, tiny=tiny)
    g_exact, kernel_exact = _exact_step(lk, torch.zeros_like(g), a, b)
    g = torch.where(bad[:, None], g_exact, g)
    kernel = torch.where(bad[:, None, None], kernel_exact, kernel)
    u, v = torch.ones_like(a), torch.ones_like(b)
    iterations = torch.ones(len(lk), dtype=torch.long, device=lk.device)
    running = torch.ones(len(lk), dtype=torch.bool, device=lk.device)
    for step in range(1, max_iter):  # the first iteration was _first_step
        if step % SINKHORN_BLOCK == 0 and not bool(running.any()):
            break
        # Convergence test: row sums of the current plan (its columns are exact).
        rows = torch.bmm(kernel, v[:, :, None]).squeeze(-1)
        running = running & ~((u * rows - a).abs().sum(-1) <= tol)  # NaN error: runs to max_iter
        u_new = _divide(a, rows)
        v_new = _divide(b, (kernel * u_new[:, :, None]).sum(-2))
        safe = _within(torch.where(a > 0, u_new, 1.0), limit) & _within(
            torch.where(b > 0, v_new, 1.0), limit
        )
        g_abs, kernel_abs = _exact_step(
            lk, g + v.log(), a, b
        )  # absorb the scalings, iterate exactly
        scale, absorb = (running & safe)[:, None], (running & ~safe)[:, None]
        u = torch.where(scale, u_new, torch.where(absorb, 1.0, u))
        v = torch.where(scale, v_new, torch.where(absorb, 1.0, v))
        g = torch.where(absorb, g_abs, g)
        kernel = torch.where(absorb[:, :, None], kernel_abs, kernel)
        iterations = iterations + running.long()
    return u, kernel, v, iterations


def _within(scalings: torch.Tensor, limit: float) -> torch.Tensor:
    """Per pair: every scaling in (1 / limit, limit); False for NaN."""
    lo, hi = scalings.amin(-1), scalings.amax(-1)
    return (hi < limit) & (lo > 1 / limit)


# ------------------------------------------------------------------ a stream, host-driven


@dataclass(frozen=True)
class SolvedPairs:
    """Pairs that left a :class:`SinkhornStream`, one row each: ``ids`` (their numbers in
    the stream, 0, 1, ... in the order the source gave them), the plan
    ``u_i kernel_ij v_j`` as ``u`` (P x n), ``kernel`` (P x n x m) and ``v`` (P x m),
    ``rows = kernel @ v`` (P x n), the problems' ``log_kernel`` and each pair's
    ``iterations``."""

    ids: torch.Tensor
    u: torch.Tensor
    kernel: torch.Tensor
    v: torch.Tensor
    rows: torch.Tensor
    log_kernel: torch.Tensor
    iterations: torch.Tensor

    def plans(self) -> torch.Tensor:
        """The transport plans, P x n x m."""
        return self.u[:, :, None] * self.kernel * self.v[:, None, :]


@dataclass
class _WorkingSet:
    """The pairs a :class:`SinkhornStream` iterates, one row each: ``ids``, the problem
    (``log_kernel``, ``mu``, ``nu``), the log-domain column potential ``g`` and the kernel
    ``exp(log_kernel + f_i + g_j)`` of the plan of the last exact iteration (entries at
    most 1), the scalings ``u``, ``v`` of that kernel since then, and the ``iterations``
    made."""

    ids: torch.Tensor
    log_kernel: torch.Tensor
    mu: torch.Tensor
    nu: torch.Tensor
    g: torch.Tensor
    kernel: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor
    iterations: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def joined(self, other: _WorkingSet) -> _WorkingSet:
        return _WorkingSet(
            *(torch.cat([a, b]) for a, b in zip(self._tensors(), other._tensors(), strict=True))
        )

    def selected(self, index: torch.Tensor) -> _WorkingSet:
        return _WorkingSet(*(t.index_select(0, index) for t in self._tensors()))

    def solved(self, rows: torch.Tensor) -> SolvedPairs:
        return SolvedPairs(
            self.ids, self.u, self.kernel, self.v, rows, self.log_kernel, self.iterations
        )


class SinkhornStream:
    """Sinkhorn on a stream of pairs (DIML's re-ranking, App. A.2), the iterates of
    :func:`sinkhorn` with each pair stopped at its own convergence.

    :meth:`solve` takes pairs from a :data:`PairSource` through a working set of about
    ``window`` pairs (cache-sized): each enters with an exact first iteration, is iterated
    by kernel scalings and leaves when its L1 row error is at most ``tol`` or after
    ``max_iter`` iterations, yielded as :class:`SolvedPairs`. The working set's
    bookkeeping (who converged, whether a scaling left the safe range) is read on the
    host; with ``window=1`` each pair is solved alone.

    What the stream has seen so far is state of its own: ``admitted`` (pairs taken from
    the source), ``zero_mass`` (whether a marginal had a zero entry: the plain quotient is
    used until one has) and the safe range of the problems' dtype (``limit``, ``tiny``).
    """

    def __init__(self, *, max_iter: int, tol: float, window: int | None = None):
        self.max_iter, self.tol = max_iter, tol
        self.window = window or SINKHORN_WINDOW
        self.admitted = 0
        self.zero_mass = False
        self.limit = self.tiny = 0.0

    def solve(self, source: PairSource) -> Iterator[SolvedPairs]:
        """The pairs of ``source``, each yielded once, as they converge."""
        pairs: _WorkingSet | None = None
        exhausted = False
        while True:
            active = 0 if pairs is None else len(pairs)
            if not exhausted and 4 * active <= 3 * self.window:  # admit the next pairs
                fresh = self._admit(source(self.window - active))
                exhausted = fresh is None
                if fresh is not None:
                    pairs = fresh if pairs is None else pairs.joined(fresh)
            if pairs is None:
                if exhausted:
                    return
                continue
            retired, pairs = self._iterate(pairs)
            if retired is not None:
                yield retired

    def _divide(self, marginal: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        return _divide(marginal, sums) if self.zero_mass else marginal / sums

    def _admit(self, got) -> _WorkingSet | None:
        """The source's next pairs after their first iteration, or None when it has no more."""
        if got is None or len(got[0]) == 0:
            return None
        lk, a, b = got
        if not self.limit:
            self.limit, self.tiny = _safe_range(lk.dtype)
        self.zero_mass = self.zero_mass or bool((a == 0).any() or (b == 0).any())
        g, kernel, bad = _first_step(lk, a, b, tiny=self.tiny, divide=self._divide)
        if bool(bad.any()):
            g, kernel = g.clone(), kernel.clone()
            g[bad], kernel[bad] = _exact_step(lk[bad], torch.zeros_like(g[bad]), a[bad], b[bad])
        ids = torch.arange(self.admitted, self.admitted + len(lk), device=lk.device)
        self.admitted += len(lk)
        return _WorkingSet(
            ids=ids,
            log_kernel=lk,
            mu=a,
            nu=b,
            g=g,
            kernel=kernel,
            u=torch.ones_like(a),
            v=torch.ones_like(b),
            iterations=torch.ones_like(ids),
        )

    def _iterate(self, pairs: _WorkingSet) -> tuple[SolvedPairs | None, _WorkingSet | None]:
        """Retire the pairs that stop (all of them, or the converged ones once they are a
        quarter of the working set), then iterate the others once: (retired, the rest)."""
        # Convergence test: row sums of the current plan (its columns are exact).
        rows = torch.bmm(pairs.kernel, pairs.v[:, :, None]).squeeze(-1)
        error = (pairs.u * rows - pairs.mu).abs().sum(-1)
        done = (error <= self.tol) | (pairs.iterations >= self.max_iter)
        count = int(done.sum())
        if count == len(done):  # retire everything
            return pairs.solved(rows), None
        retired = None
        if 4 * count >= len(done):  # retire the converged pairs
            sel = done.nonzero().squeeze(1)
            retired = pairs.selected(sel).solved(rows.index_select(0, sel))
            keep = (~done).nonzero().squeeze(1)
            pairs = pairs.selected(keep)
            rows, done = rows.index_select(0, keep), done.index_select(0, keep)
        self._scale(pairs, rows)
        # Converged pairs waiting for retirement keep their count (their plan only improves).
        pairs.iterations = pairs.iterations + (~done).long()
        return retired, pairs

    def _scale(self, pairs: _WorkingSet, rows: torch.Tensor) -> None:
        """One iteration of every pair of the working set: kernel scalings u, v, or, when a
        scaling would leave the safe range, an exact iteration that absorbs them into the
        potentials."""
        zero_mass = self.zero_mass
        u_new = self._divide(pairs.mu, rows)
        v_new = self._divide(pairs.nu, (pairs.kernel * u_new[:, :, None]).sum(-2))
        u_lo, u_hi = torch.aminmax(torch.where(pairs.mu > 0, u_new, 1.0) if zero_mass else u_new)
        v_lo, v_hi = torch.aminmax(torch.where(pairs.nu > 0, v_new, 1.0) if zero_mass else v_new)
        hi_u, hi_v, lo_u, lo_v = torch.stack([u_hi, v_hi, u_lo, v_lo]).tolist()
        if max(hi_u, hi_v) < self.limit and min(lo_u, lo_v) > 1 / self.limit:  # False for NaN
            pairs.u, pairs.v = u_new, v_new
        else:
            pairs.g, pairs.kernel = _exact_step(
                pairs.log_kernel, pairs.g + pairs.v.log(), pairs.mu, pairs.nu
            )
            pairs.u, pairs.v = torch.ones_like(pairs.mu), torch.ones_like(pairs.nu)
