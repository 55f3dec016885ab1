"""DIML: deep interpretable metric learning by structural matching (Zhao, Rao, Wang, Lu,
Zhou; code: wl-zhao/DIML).

DIML compares two images by an optimal-transport matching of their G x G grids of local
embeddings instead of (or on top of) the cosine of their global embeddings. The pieces,
in the order of the paper's Sec. 3, and the one configurable head:

======================================  ===================================================
piece                                   paper
======================================  ===================================================
:func:`sinkhorn`                        Eq. 4 with the entropic regulariser of Eq. 12,
                                        solved by the Sinkhorn iterations of Eqs. 13-14
:func:`local_similarity`                S_ij = s(z_i, z_j), cost C = 1 - S (Eq. 3)
:func:`uniform_marginals`               Eq. 7
:func:`cross_correlation_marginals`     Eqs. 8-9 ("CC")
:func:`structural_similarity`           Eq. 5 ("SS"), sum_ij T_ij S_ij
:func:`structural_distance`             Eq. 6 with d = Euclidean distance (Eq. 16)
:class:`DIMLHead`                       the plain head (GAP + Linear) plus the local grid
                                        (Sec. 3.4, "Testing"); ``rerank_similarity`` is the
                                        multi-scale matching ("MM", Sec. 3.3, App. A.2):
                                        cosine + structural similarity of the top K;
                                        ``train_structural`` is App. A.3 (Eqs. 15-19)
:func:`explain_pair`, :func:`pair_figure`  Fig. 5: marginals as heat maps, the plan, and the
                                        part-wise contributions T_ij * S_ij
======================================  ===================================================

This file has the head, its variants and the paper's metadata, and exports every piece.
The solver is the harness's entropic optimal transport
(:mod:`harness.components.transport`); the matching of Eqs. 3-9 is
:mod:`harness.methods.diml_matching`, the streamed re-ranking
:mod:`harness.methods.diml_rerank`, and Fig. 5 :mod:`harness.methods.diml_figures`.

Registered: ``diml`` (the configurable head; paper defaults G = 4, K = 100, eps = 0.05,
cross-correlation marginals, training-free), and the Table 2 / Table 3 rows
``diml_ss`` (SS alone, uniform marginals, no cosine), ``diml_ss_mm`` (SS + MM, uniform
marginals) and ``diml_train`` (DIML also inside the training loss).

Where the paper and the released code (wl-zhao/DIML) differ or are silent:

* Sinkhorn's stopping rule in the re-ranking (``sinkhorn_stop``). The code stops a
  query's batch of 100 problems when the mean absolute change of the row scaling vector
  drops below 0.1 (utilities/diml.py lines 7-14), an absolute threshold on a quantity of
  size ~exp(1/eps); on near-parallel embeddings that is after two iterations, and the
  plans can miss the marginals by ~1e-3 in L1, or the rule runs to the 100-iteration cap.
  ``"diml_code"`` (the head's default, so the ``diml-table1`` grid reproduces the
  code's scores) is that rule (:func:`sinkhorn_diml_code`). ``"converged"``
  (a named choice) iterates every pair until its own L1
  marginal error is at most ``tol`` (head default 1e-4; :func:`sinkhorn` default 1e-6)
  or ``max_iter`` (the code's cap, 100): the paper's "iteratively projecting onto the
  marginal constraints until convergence" (App. A.1). Either way the pairs of several
  queries are solved together, not one query at a time. Training
  (``train_structural``) and the explanation figures always use ``"converged"``.
* Zero marginals (``marginal_norm``). Eq. 9 and the code divide relu(alpha) by its sum
  (the code adds 1e-5 to the denominator only, utilities/diml.py lines 32-36), so the two
  marginals sum to slightly different values below 1 and an image with no positively
  correlated location gives a NaN plan: ``marginal_norm="code"`` (the ``diml``
  protocol's value) does so in the re-ranking. The head's default ``"balanced"`` takes
  ``(relu(alpha) + delta) / sum(relu(alpha) + delta)`` with delta = 1e-5: both sum
  exactly to 1 (balanced transport), no location has zero mass, and an all-negative
  map falls back to uniform weights. Training and the figures use ``"balanced"``.
* The "global feature" of Eq. 8 is the method's L2-normalised embedding (GAP, then the
  embedding Linear), as in the code's evaluation and as the paper states ("both psi^k
  and z-bar^k represent the same embedding"), not the mean of the pooled G x G grid.
* Grid pooling (``grid_pool``). The paper says ROI Align (``"roi_align"``, the head's
  default: :func:`torchvision.ops.roi_align` over the whole map, aligned, adaptive
  sampling); the code average-pools the map to G x G where G divides it (its test is
  ``7 % G``), else upsamples it bilinearly (corners aligned) to 4G x 4G first
  (evaluation/eval_diml.py lines 14-20, 37-39): ``"code"``, the ``diml`` protocol's value.
  Both are averages of bilinear samples; their sample positions differ (on a 7 x 7 map
  the G = 4 cells' cosines between the two are 0.97-0.99). With G = 1 both are exactly
  GAP, with G equal to the map size the identity. The Linear is applied after pooling,
  which equals projecting every location first (the weights of each cell sum to one) at
  a third of the cost.
* Training (``train_structural=True``). The code's criteria match each image's
  cross-correlation marginal against the *other* image's locations (the row marginal
  is computed over the columns' grid); here Eqs. 8-9 are used as in the evaluation
  code. As in the code, the plan is a constant for the gradient by default
  (``plan_grad=False``; the paper calls the iterations differentiable, and
  ``plan_grad=True`` back-propagates through them at a memory cost of one plan per
  iteration). Multi-similarity's pair mining (Eq. 18's s*) runs on the combined
  similarity of Eq. 19, as the code's ``multisimilarity_diml`` criterion does; the
  margin loss's distance-weighted sampler runs on the global embeddings, as the code's
  ``margin_diml`` criterion does (:func:`harness.methods.diml_training.training_tuples`,
  with the rest of the training mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from harness.base.errors import HarnessError
from harness.components.losses import (
    PrecomputedDistance,
    apply_loss,
    distance_replaced,
)
from harness.components.transport import sinkhorn
from harness.methods.base import (
    FigureSet,
    HeadOutput,
    PaperInfo,
    TrainingBatch,
    register_method,
    register_variant,
)
from harness.methods.diml_figures import PairExplanation, explain_pair, pair_figure
from harness.methods.diml_matching import (
    MARGINAL_NORMS,
    MARGINALS,
    cross_correlation_marginals,
    local_similarity,
    pairwise_matching,
    structural_distance,
    structural_similarity,
    transport_plans,
    uniform_marginals,
)
from harness.methods.diml_rerank import SINKHORN_STOPS, StructuralReranking, sinkhorn_diml_code
from harness.methods.diml_training import (
    STRUCTURAL_LOSSES,
    combined_matrix,
    structural_loss,
    training_tuples,
)
from harness.methods.plain import PlainHead
from harness.methods.roles import (
    Explainer,
    FigureMaker,
    IdReranker,
    LossShaper,
    PairExplainer,
    ProcessBound,
    Reranker,
    TrainsAsAnother,
)

if TYPE_CHECKING:
    from optuna.trial import Trial

__all__ = [
    "DIMLHead",
    "PAPER",
    "MARGINALS",
    "MARGINAL_NORMS",
    "GRIDS",
    "GRID_POOLS",
    "code_grid_pool",
    "SINKHORN_STOPS",
    "sinkhorn",
    "sinkhorn_diml_code",
    "local_similarity",
    "uniform_marginals",
    "cross_correlation_marginals",
    "transport_plans",
    "structural_similarity",
    "structural_distance",
    "pairwise_matching",
    "PrecomputedDistance",
    "PairExplanation",
    "explain_pair",
    "pair_figure",
]

PAPER = PaperInfo(
    title="Towards Interpretable Deep Metric Learning with Structural Matching",
    authors="Wenliang Zhao, Yongming Rao, Ziyi Wang, Jiwen Lu, Jie Zhou",
    year=2021,
    # The authors' README cites ICCV 2021 and arXiv 2108.05889; our copy of the paper text
    # states neither.
    venue="ICCV 2021",
    arxiv="2108.05889",
    code_url="https://github.com/wl-zhao/DIML",
    tables=("1", "2", "3", "4", "5", "6"),
    published_selection=(
        "DIML: no validation split in the paper; the released code (wl-zhao/DIML) reports the best test-set "
        "epoch, and evaluates with the query counted in R for RP and MAP@R"
    ),
)

#: Grid sizes of the paper's Table 6 / Fig. 4.
GRIDS = (1, 2, 4, 7)
#: How the last map becomes the G x G grid: the paper's ROI Align or the code's pooling.
GRID_POOLS = ("roi_align", "code")


def code_grid_pool(fmap: torch.Tensor, grid: int) -> torch.Tensor:
    """B x C x H x W -> B x C x G x G as the released evaluation pools (wl-zhao/DIML@c15dbea
    evaluation/eval_diml.py lines 14-20): an adaptive average pool where G divides the map,
    else a bilinear upsampling (corners aligned) to 4G x 4G first."""
    if fmap.shape[-2] % grid == 0 and fmap.shape[-1] % grid == 0:
        return F.adaptive_avg_pool2d(fmap, grid)
    up = F.interpolate(fmap, size=(4 * grid, 4 * grid), mode="bilinear", align_corners=True)
    return F.adaptive_avg_pool2d(up, grid)


# ---------------------------------------------------------------------------- head


@register_method(
    "diml",
    description="DIML: optimal-transport matching of G x G local embeddings, "
    "cross-correlation marginals, top-K re-ranking",
)
class DIMLHead(
    PlainHead,
    LossShaper,
    Reranker,
    IdReranker,
    Explainer,
    PairExplainer,
    FigureMaker,
    ProcessBound,
    TrainsAsAnother,
):
    """The plain head (GAP + Linear, L2-normalised) plus DIML's grid of local embeddings.

    ``embed`` returns ``embedding`` (B x D, exactly :class:`~harness.methods.plain.PlainHead`'s)
    and ``local`` (B x G*G x D): the last feature map ROI-aligned to G x G over the whole
    map, projected by the same Linear at every cell and L2-normalised (Sec. 3.4).

    Options: ``grid`` G (1, 2, 4 or 7; paper default 4, Table 6), ``rerank_k`` K (Table 5;
    100), ``eps`` (Sinkhorn's entropic weight, App. A.2: 0.05), ``marginals``
    (``"cross_correlation"``, Eqs. 8-9, or ``"uniform"``, Eq. 7; Table 2),
    ``add_global`` (re-rank by cosine + structural similarity, the multi-scale matching
    "MM", or by the structural similarity alone, Table 2's "SS" row), ``max_iter`` /
    ``tol`` (Sinkhorn's cap and L1 marginal tolerance), ``train_structural`` (App. A.3,
    Table 3: the metric loss sees the average of the global and the structural
    similarity or distance; default False, the paper's training-free use) and
    ``plan_grad`` (back-propagate through the Sinkhorn iterations in that mode; False
    as in the code) and ``sinkhorn_stop`` (the re-ranking's stopping rule, ``"converged"``
    or the released code's ``"diml_code"``; see the module docstring), ``grid_pool``
    (``"roi_align"``, the paper's, or the code's ``"code"``) and ``marginal_norm``
    (``"balanced"`` or the code's ``"code"``).
    """

    label = "DIML"
    figure_tuples = ("pair",)
    paper = PAPER
    rerank_fields = ("embedding", "local")
    #: 2: ``train_structural`` mines multi-similarity pairs on the combined similarity
    #: (Eqs. 18-19) rather than on the global cosine. 3: the re-ranking's Sinkhorn stops by
    #: the released code's rule by default (``sinkhorn_stop``). 4: with ``train_structural``,
    #: each pair's Sinkhorn stops at its own convergence (plans within ``tol`` of 3's).
    revision = 4

    def __init__(
        self,
        *,
        channels,
        embedding_size,
        grid: int = 4,
        rerank_k: int = 100,
        eps: float = 0.05,
        marginals: str = "cross_correlation",
        add_global: bool = True,
        max_iter: int = 100,
        tol: float = 1e-4,
        train_structural: bool = False,
        plan_grad: bool = False,
        sinkhorn_stop: str = "diml_code",
        grid_pool: str = "roi_align",
        marginal_norm: str = "balanced",
    ):
        super().__init__(channels=channels, embedding_size=embedding_size, pool="avg")
        if grid not in GRIDS:
            raise HarnessError(f"DIML grid must be one of {GRIDS} (Table 6), got {grid}")
        if marginals not in MARGINALS:
            raise HarnessError(f"DIML marginals must be one of {MARGINALS}, got {marginals!r}")
        if rerank_k < 0:
            raise HarnessError(f"DIML rerank_k must be >= 0, got {rerank_k}")
        if not eps > 0 or max_iter < 1 or not tol >= 0:
            raise HarnessError(
                f"DIML needs eps > 0, max_iter >= 1 and tol >= 0 (got {eps}, {max_iter}, {tol})"
            )
        if sinkhorn_stop not in SINKHORN_STOPS:
            raise ValueError(
                f"sinkhorn_stop must be one of {', '.join(SINKHORN_STOPS)}; got {sinkhorn_stop!r}"
            )
        if grid_pool not in GRID_POOLS:
            raise ValueError(f"grid_pool must be one of {', '.join(GRID_POOLS)}; got {grid_pool!r}")
        if marginal_norm not in MARGINAL_NORMS:
            raise ValueError(
                f"marginal_norm must be one of {', '.join(MARGINAL_NORMS)}; got {marginal_norm!r}"
            )
        self.sinkhorn_stop = sinkhorn_stop
        self.grid_pool, self.marginal_norm = grid_pool, marginal_norm
        self.grid, self.rerank_k, self.eps, self.marginals = grid, rerank_k, eps, marginals
        self.add_global, self.max_iter, self.tol = add_global, max_iter, tol
        self.train_structural, self.plan_grad = train_structural, plan_grad
        if train_structural:  # the pair matrix replaces a pair- or triplet-based loss's distance
            self.supported_losses = STRUCTURAL_LOSSES

    # ------------------------------------------------------------------ embeddings

    def local_grid(self, fmap: torch.Tensor) -> torch.Tensor:
        """B x C x H x W -> B x G*G x D: the map pooled to G x G (``grid_pool``), the Linear
        per cell, L2-normalised."""
        if self.grid_pool == "code":
            pooled = code_grid_pool(fmap, self.grid)
            return F.normalize(self.project(pooled.flatten(2).transpose(1, 2)), dim=-1)
        bsz, _, h, w = fmap.shape
        boxes = fmap.new_tensor([0.0, 0.0, float(w), float(h)]).expand(bsz, 4)
        boxes = torch.cat(
            [torch.arange(bsz, device=fmap.device, dtype=fmap.dtype)[:, None], boxes], dim=1
        )
        pooled = roi_align(
            fmap, boxes, output_size=self.grid, spatial_scale=1.0, sampling_ratio=-1, aligned=True
        )
        return F.normalize(self.project(pooled.flatten(2).transpose(1, 2)), dim=-1)

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        fmap = maps[-1]
        embedding = F.normalize(self.project(fmap.mean(dim=(2, 3))), dim=-1)
        return HeadOutput(embedding=embedding, local=self.local_grid(fmap))

    # ---------------------------------------------------------------- re-ranking

    def _options(self) -> dict[str, Any]:
        return {
            "marginals": self.marginals,
            "eps": self.eps,
            "max_iter": self.max_iter,
            "tol": self.tol,
        }

    def _reranking(self) -> StructuralReranking:
        return StructuralReranking(
            marginals=self.marginals,
            eps=self.eps,
            max_iter=self.max_iter,
            tol=self.tol,
            stop=self.sinkhorn_stop,
            add_global=self.add_global,
            marginal_norm=self.marginal_norm,
        )

    @torch.no_grad()
    def rerank_similarity(
        self,
        query: dict[str, torch.Tensor],
        candidates: dict[str, torch.Tensor],
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """Multi-scale matching (Sec. 3.3, App. A.2): scores of Q x K (query, candidate)
        pairs, cosine + structural similarity (Eq. 5), or the structural similarity alone
        when ``add_global`` is False.

        ``query``: {"embedding": Q x D, "local": Q x N x D}; ``candidates``:
        {"embedding": Q x K x D, "local": Q x K x N x D}. All Q*K pairs are solved together
        as one stream (:meth:`.StructuralReranking.scores`), not query by query. Float32
        (float64 stays float64). From stored fields, :meth:`rerank_by_ids` avoids building the
        candidates. ``window``: the solver's working set in pairs (None: the device's
        default, :data:`~harness.components.transport.SINKHORN_WINDOW` or its CUDA size).
        """
        q_emb, q_loc = query["embedding"], query["local"]
        c_emb, c_loc = candidates["embedding"], candidates["local"]
        nq, k = c_emb.shape[:2]
        if (
            q_loc.dim() != 3
            or c_loc.dim() != 4
            or c_loc.shape[:2] != (nq, k)
            or q_emb.shape[0] != nq
            or q_loc.shape[0] != nq
        ):
            raise ValueError(
                f"rerank_similarity expects query local Q x N x D and candidate local Q x K x N x D; "
                f"got {tuple(q_loc.shape)} and {tuple(c_loc.shape)}"
            )
        return self._reranking().scores(
            q_emb, q_loc, lambda rows: (c_emb[rows], c_loc[rows]), nq, k, window=window
        )

    def figures(
        self, kind: str, images: list[torch.Tensor], outputs: list[HeadOutput]
    ) -> FigureSet | None:
        """Fig. 5 for a (query, nearest neighbour) pair: marginals, plan and the largest and
        smallest part-wise contributions (:func:`pair_figure`)."""
        query, gallery = outputs
        explanation = explain_pair(query, gallery, marginals=self.marginals, eps=self.eps)
        return FigureSet(figures=(pair_figure(images[0], images[1], explanation),))

    @torch.no_grad()
    def rerank_by_ids(
        self,
        query_fields: Mapping[str, torch.Tensor],
        gallery_fields: Mapping[str, torch.Tensor],
        query_ids,
        candidate_ids,
    ) -> torch.Tensor:
        """:meth:`rerank_similarity` from stored fields and ids (``query_ids`` (Q,),
        ``candidate_ids`` Q x K): the candidates of a few queries are gathered only when
        the solver takes them in, so the Q x K x N x D candidate grids are never built and
        each gathered block is used while it is still in cache."""
        g_emb, g_loc = gallery_fields["embedding"], gallery_fields["local"]
        # Ids go where the fields are (on a GPU run, the whole re-ranking stays on it).
        q_ids = torch.as_tensor(np.asarray(query_ids), dtype=torch.long).to(
            query_fields["local"].device
        )
        c_ids = torch.as_tensor(np.asarray(candidate_ids), dtype=torch.long).to(g_loc.device)
        nq, k = c_ids.shape
        flat = g_loc.reshape(len(g_loc), -1)

        def candidates(rows: slice):
            ids = c_ids[rows].reshape(-1)
            return (
                g_emb.index_select(0, ids).view(-1, k, g_emb.shape[-1]),
                flat.index_select(0, ids).view(-1, k, *g_loc.shape[1:]),
            )

        return self._reranking().scores(
            query_fields["embedding"].index_select(0, q_ids),
            query_fields["local"].index_select(0, q_ids),
            candidates,
            nq,
            k,
        )

    # ------------------------------------------------------------------- training

    @classmethod
    def cross_process_refusal(cls, options: dict[str, Any]) -> str:
        if options.get("train_structural"):
            return (
                "its training mode builds the structural pair matrix from the local batch, so the "
                "pairs between processes' shares would be missing; train it in one process"
            )
        return ""

    @classmethod
    def trains_as(cls, options: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """Without ``train_structural`` DIML is training-free (Sec. 3.4): the head is the
        plain average-pooling head, and its local embeddings reuse that head's Linear, so
        its training is ``plain``'s step for step."""
        return None if options.get("train_structural") else ("plain", {"pool": "avg"})

    def loss_terms(self, output: HeadOutput, batch: TrainingBatch) -> dict[str, torch.Tensor]:
        """The metric loss; with ``train_structural`` on DIML's pair matrix (App. A.3).

        Distance-based losses (margin, contrastive, triplet: Eqs. 15-16) see
        ``(d_global + d_struct) / 2`` with d the Euclidean distance of unit vectors;
        similarity-based ones (multi-similarity: Eqs. 18-19) see ``(s_global + s_struct) / 2``.
        The loss is the run's PML loss (``batch.metric_loss.module()``, with its learnable
        beta and hyperparameters) and its miner; which similarity the miner sees is
        :func:`~harness.methods.diml_training.training_tuples`'s.
        """
        labels = batch.labels
        if not self.train_structural:
            return {"metric": batch.metric_loss(output.embedding, labels)}
        loss = structural_loss(batch.metric_loss)
        assert output.local is not None  # embed always returns the grid
        emb = output.embedding.float()
        with torch.autocast(device_type=emb.device.type, enabled=False):  # matching in float32
            plan, s = pairwise_matching(
                output.local.float(),
                emb,
                marginals=self.marginals,
                eps=self.eps,
                max_iter=self.max_iter,
                tol=self.tol,
                plan_grad=self.plan_grad,
            )
            cos = emb @ emb.t()
        matrix = combined_matrix(loss.distance, cos, plan, s)
        indices = training_tuples(
            batch.metric_loss, emb, labels, matrix, inverted=loss.distance.is_inverted
        )
        with distance_replaced(
            loss, PrecomputedDistance(matrix, is_inverted=loss.distance.is_inverted)
        ):
            return {"metric": apply_loss(loss, emb, labels, indices)}

    # ---------------------------------------------------------------- explanation

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """Per image, where its grid agrees with its own embedding: relu(<z_i, psi>) on the
        G x G grid (Eq. 8 with the image as its own partner), at image size, in [0, 1]."""
        if output.local is None:
            return None
        weights = F.relu(torch.einsum("bnd,bd->bn", output.local.float(), output.embedding.float()))
        maps = weights.view(-1, 1, self.grid, self.grid)
        maps = F.interpolate(
            maps, size=tuple(images.shape[-2:]), mode="bilinear", align_corners=False
        )
        lo = maps.amin(dim=(-2, -1), keepdim=True)
        hi = maps.amax(dim=(-2, -1), keepdim=True)
        return ((maps - lo) / (hi - lo).clamp_min(1e-12)).clamp(0, 1)

    @torch.no_grad()
    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fig. 5 as data, for P pairs at once: each cell's part of the transport. With the
        plan T of Eq. 4 (cost 1 - S), a query cell i carries sum_j T_ij S_ij of the structural
        similarity (Eq. 5) and sum_j T_ij (1 - S_ij) of the transport cost; a same-class pair
        is explained by the first, a pair of two classes by the second (a gallery cell: the
        sums over i). Negative contributions (S < 0) are clipped to 0. Returns two P x G x G
        maps."""
        if query.local is None or gallery.local is None:
            return None
        plan, s, _, _ = transport_plans(
            query.local.float(),
            gallery.local.float(),
            query.embedding.float(),
            gallery.embedding.float(),
            plan_grad=False,
            **self._options(),
        )
        same = torch.as_tensor(same, device=s.device)[:, None, None]
        parts = (plan * torch.where(same, s, 1 - s)).clamp_min(0)
        g = self.grid
        return parts.sum(2).view(-1, g, g), parts.sum(1).view(-1, g, g)

    def explain_pair(self, query_out, gallery_out) -> PairExplanation:
        """:func:`explain_pair` with this head's marginals, eps and Sinkhorn settings."""
        return explain_pair(query_out, gallery_out, **self._options())

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        return {
            "grid": trial.suggest_categorical("grid", [2, 4, 7]),
            "eps": trial.suggest_float("eps", 0.02, 0.2, log=True),
            "marginals": trial.suggest_categorical("marginals", list(MARGINALS)),
        }


register_variant(
    "diml_ss",
    DIMLHead,
    ablation=True,
    marginals="uniform",
    add_global=False,
    label="DIML (SS)",
    description="DIML Table 2 row SS: structural similarity alone, uniform marginals",
)
register_variant(
    "diml_ss_mm",
    DIMLHead,
    ablation=True,
    marginals="uniform",
    label="DIML (SS+MM)",
    description="DIML Table 2 row SS+MM: cosine + structural similarity, uniform marginals",
)
register_variant(
    "diml_train",
    DIMLHead,
    train_structural=True,
    label="DIML (train)",
    description="DIML Table 3 (train): structural matching also inside the metric loss",
)
