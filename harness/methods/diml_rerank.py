"""DIML's re-ranking (Sec. 3.3, App. A.2): each query's top K candidates scored by the
structural similarity (Eq. 5), with the cosine added for the multi-scale matching ("MM").

All the Q x K (query, candidate) pairs are solved as one stream, not query by query (the
released code's loop): a few queries' similarity matrices and marginals are built
whenever the solver has room (:class:`_QueryBlocks`), and a pair's score is taken as soon
as its plan is final. Two stopping rules (``SINKHORN_STOPS``): each pair at its own
convergence (:class:`~harness.components.transport.SinkhornStream`), or the released
code's rule for a query's group of K candidates (:func:`sinkhorn_diml_code`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.components.transport import (
    SINKHORN_WINDOW,
    SINKHORN_WINDOW_CUDA,
    SinkhornStream,
    SolvedPairs,
)
from harness.methods.diml_matching import normalized_weights

__all__ = [
    "SINKHORN_STOPS",
    "DIML_CODE_THRESHOLD",
    "StructuralReranking",
    "sinkhorn_diml_code",
]

#: Sinkhorn's stopping rules in the re-ranking: each pair to its own L1 marginal tolerance,
#: or the released code's rule for a query's group of candidates (:func:`sinkhorn_diml_code`).
SINKHORN_STOPS = ("converged", "diml_code")
#: The released code's threshold on the mean change of the row scalings (utilities/diml.py line 7).
DIML_CODE_THRESHOLD = 0.1

#: The candidates' embeddings (q x K x D) and grids (q x K x N x D) of the queries ``rows``.
Candidates = Callable[[slice], tuple[torch.Tensor, torch.Tensor]]


def sinkhorn_diml_code(
    log_kernel: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    *,
    max_iter: int = 100,
    threshold: float = DIML_CODE_THRESHOLD,
) -> torch.Tensor:
    """Sinkhorn with the released code's stopping rule (wl-zhao/DIML utilities/diml.py,
    ``Sinkhorn``, lines 4-16), for Q groups of K problems solved together.

    ``log_kernel``: Q x K x n x m (= -C / eps), ``mu``: Q x K x n, ``nu``: Q x K x m; a
    group is one query's K candidates, the batch the code's evaluation hands ``Sinkhorn``
    (evaluation/eval_diml.py line 78). From r = c = 1, each iteration sets r = mu / (K c),
    then c = nu / (K^T r); a group stops after the first iteration whose mean |r - r_prev|
    over its K x n row scalings is below ``threshold`` (0.1), or after ``max_iter``. The
    plans are diag(r) K diag(c) (Q x K x n x m): columns exact, rows as the rule left them.
    Computed in the log domain (log r, log c), so a kernel entry or a sum that underflows
    in the code's float32 stays finite here; the rule compares the scalings themselves."""
    f = torch.zeros_like(mu)
    g = torch.zeros_like(nu)
    running = torch.ones(mu.shape[0], dtype=torch.bool, device=mu.device)
    log_mu, log_nu = mu.log(), nu.log()
    for _ in range(max_iter):
        f_new = log_mu - torch.logsumexp(log_kernel + g[..., None, :], dim=-1)
        g_new = log_nu - torch.logsumexp(log_kernel + f_new[..., :, None], dim=-2)
        change = (f_new.exp() - f.exp()).abs().flatten(1).mean(1)
        keep = running[:, None, None]
        f, g = torch.where(keep, f_new, f), torch.where(keep, g_new, g)
        running = running & ~(change < threshold)
        if not bool(running.any()):
            break
    return torch.exp(log_kernel + f[..., :, None] + g[..., None, :])


@dataclass(frozen=True)
class StructuralReranking:
    """The head's re-ranking settings: ``marginals`` (Eqs. 7-9), Sinkhorn's ``eps``,
    ``max_iter`` and ``tol``, the stopping rule ``stop`` (:data:`SINKHORN_STOPS`),
    ``add_global`` (cosine + structural similarity, or the structural similarity alone)
    and ``marginal_norm`` (:data:`~harness.methods.diml_matching.MARGINAL_NORMS`)."""

    marginals: str
    eps: float
    max_iter: int
    tol: float
    stop: str
    add_global: bool
    marginal_norm: str = "balanced"

    def scores(
        self,
        q_emb: torch.Tensor,
        q_loc: torch.Tensor,
        candidates: Candidates,
        nq: int,
        k: int,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """Scores (Q x K) of every query (``q_emb`` Q x D, ``q_loc`` Q x N x D) against its K
        candidates, solved as one stream: a few queries' pairs are built whenever the
        solver's working set has room (``window`` pairs, by default about
        ``SINKHORN_WINDOW``, ``SINKHORN_WINDOW_CUDA`` on a GPU), and a pair's score is taken
        as soon as it has converged. Float32 (float64 stays float64)."""
        dtype = torch.float64 if q_loc.dtype == torch.float64 else torch.float32
        structural = torch.zeros(nq * k, dtype=dtype, device=q_loc.device)
        blocks = _QueryBlocks(self, q_emb, q_loc, candidates, nq, k, dtype)
        if window is None:
            window = SINKHORN_WINDOW_CUDA if q_loc.device.type == "cuda" else SINKHORN_WINDOW
        if nq and k and self.stop == "diml_code":
            self._solve_by_code_rule(blocks, structural, window)
        elif nq and k:
            stream = SinkhornStream(max_iter=self.max_iter, tol=self.tol, window=window)
            for solved in stream.solve(blocks):
                structural[solved.ids] = self._structural(solved)
        score = structural.view(nq, k)
        return score + blocks.cosine if self.add_global else score

    def _structural(self, solved: SolvedPairs) -> torch.Tensor:
        """Eq. 5, sum_ij T_ij S_ij with T = diag(u) kernel diag(v) and S = 1 + eps * lk:
        sum_i u_i (kernel v)_i + eps * sum_i u_i ((kernel * lk) v)_i."""
        weighted = torch.bmm(solved.kernel * solved.log_kernel, solved.v[:, :, None]).squeeze(-1)
        return (solved.u * (solved.rows + self.eps * weighted)).sum(-1)

    def _solve_by_code_rule(
        self, blocks: _QueryBlocks, structural: torch.Tensor, window: int
    ) -> None:
        """:func:`sinkhorn_diml_code` on a few queries' groups at a time, into ``structural``."""
        k = blocks.k
        while (got := blocks(window)) is not None:
            lk, mu, nu = got
            ids = torch.arange(blocks.start * k - len(lk), blocks.start * k, device=lk.device)
            shape = (-1, k) + lk.shape[1:]
            plan = sinkhorn_diml_code(
                lk.view(shape),
                mu.view(-1, k, mu.shape[-1]),
                nu.view(-1, k, nu.shape[-1]),
                max_iter=self.max_iter,
            ).flatten(0, 1)
            structural[ids] = (plan * (1 + self.eps * lk)).sum((-2, -1))  # Eq. 5, S = 1 + eps lk

    def pair_terms(
        self, q_emb, q_loc, c_emb, c_loc
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Similarities and marginals of the pairs of a few queries, as transposed problems
        (rows: the candidate's cells, columns: the query's, as in the code; the plan of the
        transposed problem is the transposed plan): S^T (q*K x n x m), the candidate's
        marginal (q*K x n) and the query's (q*K x m)."""
        nq, k, n, d = c_loc.shape
        m = q_loc.shape[1]
        uniform = self.marginals == "uniform"
        # One bmm per query for all its pairs: (q, K*n, D) @ (q, D, m [+1]). The extra
        # column (the query's embedding) gives relu(<candidate cell, query global>), Eq. 8.
        cols = q_loc if uniform else torch.cat([q_loc, q_emb[:, None]], 1)
        prod = torch.bmm(c_loc.reshape(nq, k * n, d), cols.transpose(1, 2)).view(nq * k, n, -1)
        s = prod[..., :m]
        if uniform:
            return s, s.new_full((nq * k, n), 1.0 / n), s.new_full((nq * k, m), 1.0 / m)
        gamma_c = F.relu(prod[..., m])
        gamma_q = F.relu(torch.bmm(c_emb, q_loc.transpose(1, 2))).reshape(nq * k, m)
        norm = self.marginal_norm
        return s, normalized_weights(gamma_c, norm), normalized_weights(gamma_q, norm)


class _QueryBlocks:
    """The re-ranking's source of pairs (a :data:`~harness.components.transport.PairSource`):
    asked for about ``count`` pairs, the K candidate pairs of the next ``count // K``
    queries (at least one) as ``((S - 1) / eps, candidate marginal, query marginal)``, or
    None after the last query. ``start`` is the first query not yet given; ``cosine``
    (Q x K) gets each given query's cosines with its candidates."""

    def __init__(
        self,
        reranking: StructuralReranking,
        q_emb: torch.Tensor,
        q_loc: torch.Tensor,
        candidates: Candidates,
        nq: int,
        k: int,
        dtype: torch.dtype,
    ):
        self.reranking, self.candidates = reranking, candidates
        self.q_emb, self.q_loc, self.nq, self.k, self.dtype = q_emb, q_loc, nq, k, dtype
        self.start = 0
        self.cosine = torch.zeros(nq, k, dtype=dtype, device=q_loc.device)

    def __call__(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.start >= self.nq:
            return None
        rows = slice(self.start, min(self.nq, self.start + max(1, count // self.k)))
        self.start = rows.stop
        c_emb, c_loc = (t.to(self.dtype) for t in self.candidates(rows))
        q_e, q_l = self.q_emb[rows].to(self.dtype), self.q_loc[rows].to(self.dtype)
        self.cosine[rows] = torch.bmm(c_emb, q_e[:, :, None]).squeeze(-1)
        s, mu, nu = self.reranking.pair_terms(q_e, q_l, c_emb, c_loc)
        return (s - 1) / self.reranking.eps, mu, nu
