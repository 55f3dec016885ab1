"""AVSL: attributable visual similarity learning (Zhang, Zheng, Zhou, Lu, CVPR 2022; code:
zbr17/AVSL).

AVSL compares two images by a graph of per-dimension "similarity nodes" over several
backbone levels: the nodes of a level are rectified by the most correlated nodes of the
level below, weighted by how reliable (how focused) their class activation maps are, and
the overall distance is the sum of the rectified top-level nodes. The pieces, in the order
of the paper's Sec. 3, and the one configurable head:

======================================  ===================================================
piece                                   paper
======================================  ===================================================
:meth:`AVSLHead.embed`                  nodes' embeddings e^l = h^l(g^l(z^l)) (Sec. 3.2)
:func:`similarity_nodes`                Eq. 1, delta_i = (e~_i - e~'_i)^2 on unit vectors
:func:`class_activation_maps`           Eq. 2, u_i = sum_j a_ij z_j
:func:`edge_estimate`                   Eq. 3, omega^_ij = <u^_i^l, u^_j^{l-1}> (batch mean)
:meth:`AVSLHead.update_edges`           Eq. 4, momentum update of the edge buffers
:func:`cam_certainty`                   std of a normalised CAM (one factor of Eq. 5)
:func:`reliability`                     Eqs. 5-6, p = sigma(alpha * eta + beta)
:func:`normalized_edges`                Eq. 7 (top-k per node) and the normalised
                                        omega~ of Eq. 8
:func:`rectified_distance`              Eqs. 8-9 and d^ = sum_i delta^_i^L
:func:`attribution`                     Eq. 11: lambda_i^l delta_i^l, summing to d^
:meth:`AVSLHead.loss_terms`             Eq. 10: a metric loss per level plus the final
                                        loss on d^
======================================  ===================================================

This file has the head and the paper's metadata, and exports every piece: the graph's
(Eqs. 1-9 and 11) are :mod:`harness.methods.avsl_graph`, the losses around the run's
metric loss (Eq. 10, with the code's settings) :mod:`harness.methods.avsl_losses`, and
the attribution's figures and maps (Figs. 6-7) :mod:`harness.methods.avsl_figures`.

Registered: ``avsl`` (paper defaults: levels s8/s16/s32, i.e. ResNet-50 layer2/3/4, top
k = 128 clipped to the embedding size, momentum 0.5, every query ranked against the whole
gallery by d^).

Evaluation. ``embed`` returns the unit top-level embedding (the cosine ranking, logged as
``global_*``), ``levels`` (unit embeddings per level) and ``extras["certainty"]`` (B x L x
r: the std of each node's normalised CAM, Eq. 5's per-image factor); ``rerank_fields``
are those two. With ``rank="exhaustive"`` (default, the paper's "Evaluation" in Sec. 3.4)
the head declares ``exhaustive_pairs`` and the engine scores every (query, gallery) pair
in chunks (:meth:`AVSLHead.score_pairs`); ``rank="rerank"`` re-scores only the top
``rerank_k`` cosine candidates. Scores are similarities: -d^.

Where the paper and the released code differ or are silent (each choice is an option):

* Pooling g^l: GAP + GMP, then a 1x1 conv (= Linear) with bias, as the code (the paper
  says "global pooling"); kaiming-normal (fan_out) weights, zero bias, as the code.
* CAMs (Eq. 2). ``cam="decomposed"`` (default, the code): the conv applied to
  ``z + H W max(z) 1[argmax z]`` per channel (bias included), so that the CAM's spatial mean *is* the
  embedding (GAP + GMP are linear in it); ``cam="linear"`` is Eq. 2 as printed,
  ``sum_j a_ij z_j`` without bias or max term. CAMs carry no gradient (the code's
  ``detach``; the paper trains nothing through them).
* Normalised CAM for Eq. 5: min-shifted, L1-normalised over the map, unbiased std (the
  code). The code subtracts the minimum over the *width only* (avsl_embedder.py line 127,
  ``min(dim=-1)`` before ``flatten(2)``): ``cam_shift="width_min"`` (the ``avsl``
  protocol's value); ``"map"`` (the head's default) subtracts the whole map's minimum,
  the shift that makes the normalised map a distribution over locations.
* Eq. 3: the lower level's CAM is average-pooled to the upper level's size (the paper's
  p = min h x min w), each map L2-normalised, the inner products averaged over the batch
  (the code). Eq. 4: the first update overwrites the buffer (the code; a zero buffer
  would halve the first estimate), later ones use gamma = ``momentum`` (0.5, paper and
  code). Edge buffers are updated in training mode only and travel in the state dict.
* Eq. 7-8: the code applies relu to the edges before the top-k (the paper's
  omega~ in [0, 1] needs non-negative edges) and adds 1e-8 to the denominator;
  followed. Ties at the k-th value: the code keeps every entry within 1e-8 of it
  (utils.py ``topk_mask`` lines 5-8), more than k where entries tie, e.g. relu's zeros
  when a node has fewer than k positive edges: ``link_ties="code"`` (the ``avsl``
  protocol's value); ``"index"`` (the head's default) keeps exactly k, lower index first.
* Eq. 6 reliability p = sigma(g (alpha eta + beta)), alpha = 1, beta = 0 at init (the
  code). The paper has g = 1 (default); the code multiplies by ``prob_gamma = 10``
  (``reliability_gain=10``).
* Eq. 10. The paper leaves L^m and L^f as "a loss"; here both are the run's metric loss.
  The per-level losses are copy l of the run's loss on level l's unit embedding. Their
  distance: the code hands every loss ``metric_mat`` = sum_i delta_i^l, the *squared*
  Euclidean distance (avsl_collector.py lines 227-234, index_p = 2), and the final loss
  d^ itself (line 259). ``distance="squared"`` (the ``avsl`` protocol's value) does so
  for Euclidean-distance losses (the margin loss: hinges on d^2 against beta, as
  GeDML's MarginLoss on the code's matrix); ``"euclidean"`` (the head's default) gives
  them the loss's own Euclidean distance and sqrt(d^) (equal to it when nothing is
  rectified). Similarity losses see 1 - d^/2 either way (an exact affine map of the
  code's squared distances, see below);
  the code adds per-level weights (CUB 0.5/1/0.5, Cars and SOP 1/4/4):
  ``level_weights`` (default all 1, the paper's plain sum). The final loss L^f sees d^
  converted to the loss's own distance: a cosine-like similarity 1 - d^/2 for
  similarity losses (ProxyAnchor on cosine with margin 0.1, alpha 32 equals the code's
  alpha 16, margins 1.8/2.2 on squared distance; the code's SOP script gives the level
  losses a negative margin 2.4, i.e. 0.2 here, the loss's ``neg_margin``, and the final
  loss 2.2, i.e. 0.1: ``final_neg_margin``, examples/samples_avsl.sh line 10), d^ or
  sqrt(d^) for Euclidean ones (``distance`` above). The nodes are detached in d^ there,
  so L^f trains alpha, beta only (theta_2 in Eq. 10; paper and code agree). Proxy losses:
  the proxies of each level's loss copy are the "images" compared with (the code) and
  their CAM std is the batch mean of the level's (the code). The top level's loss copy
  evaluates L^f by default (sharing, e.g., the margin loss's beta with level L);
  ``final_loss="separate"`` gives it a copy of its own, as the code.
* The code's training schedule (5-epoch frozen-trunk warm-up, per-part learning rates,
  StepLR) belongs to a protocol, not to the head. The head's collector rate (alpha, beta,
  and the proxies below) is ``collector_lr`` when set (the code's ``--lr_collector``:
  1.1e-4 on CUB, 0.09918 on Cars, 0.06 on SOP, examples/samples_avsl.sh lines 2, 6, 10;
  the ``avsl`` protocol sets these per dataset), else ``inference_lr_scale`` times the
  head's rate (the code's collector / embedder ratios are 0.2, 608.7 and 100).
  The head's defaults (1.0, ``distance="euclidean"``, ``link_ties="index"``,
  ``cam_shift="map"``) are the harness's reading of the paper; the ``avsl`` protocol
  selects the code's arithmetic.
* The code's optimisation around the losses (``examples/config/links/
  link_avsl_proxyanchor.yaml``, ``link_avsl_margin.yaml``), each an option whose head
  default is the harness's reading: the proxies of ProxyAnchor are collector parameters
  (avsl_collector.py lines 104-110) trained at ``--lr_collector`` with ``--wd`` 1e-4
  (``proxies_in_collector``; ``collector_lr`` the collector's absolute rate, CUB 1.1e-4,
  Cars 0.0992, SOP 0.06, examples/samples_avsl.sh lines 2, 6, 10; the default keeps them
  in the loss group at ``lr_loss`` without weight decay); above 1,000 classes only the
  batch's classes' proxies enter the losses (avsl_collector.py lines 153-163:
  ``batch_proxies``); Margin-AVSL mines with GeDML's HardSelector on each level's and on
  the final matrix (``level_miner="hard"``, :func:`hard_triplets`, cutoff 0.5) and has
  four margin losses, each with its beta (``final_loss="separate"``; the default
  ``"shared"`` evaluates L^f with the top level's copy); the code clips the collector and
  each loss as units (``clip_units="code"``, :data:`~harness.methods.avsl_losses.CLIP_UNITS`).
* The released tester builds the whole N x N distance with N x N x r intermediates per
  slice; here gallery chunks are scored with a running top-k (harness.components.evaluation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from harness.base.errors import HarnessError
from harness.components.losses import PrecomputedDistance, apply_loss, distance_replaced
from harness.methods.avsl_figures import (
    PairAttribution,
    level_maps,
    node_expansion_figure,
    node_weight_maps,
    pair_attribution,
    reliable_nodes_figure,
)
from harness.methods.avsl_graph import (
    Graph,
    attribution,
    cam_certainty,
    class_activation_maps,
    edge_estimate,
    normalized_edges,
    rectified_distance,
    reliability,
    similarity_nodes,
)
from harness.methods.avsl_losses import (
    SUPPORTED_LOSSES,
    collector_proxy_groups,
    final_loss_matrix,
    hard_level_tuples,
    inference_group,
    level_distance,
    loss_labels,
    mines_hard,
    neg_margin,
    param_group,
    proxy_references,
)
from harness.methods.avsl_options import check_choices, check_ranges, checked_level_weights
from harness.methods.base import (
    FigureSet,
    HeadOutput,
    Method,
    PaperInfo,
    TrainingBatch,
    register_method,
)
from harness.methods.roles import (
    Explainer,
    FigureMaker,
    HostReader,
    LossShaper,
    PairExplainer,
    PairScorer,
    ProcessBound,
    Reranker,
    Tunable,
)

if TYPE_CHECKING:
    from optuna.trial import Trial

__all__ = [
    "AVSLHead",
    "PAPER",
    "similarity_nodes",
    "class_activation_maps",
    "cam_certainty",
    "edge_estimate",
    "normalized_edges",
    "reliability",
    "rectified_distance",
    "attribution",
    "pair_distance_matrix",
    "PairAttribution",
    "reliable_nodes_figure",
    "node_expansion_figure",
]

PAPER = PaperInfo(
    title="Attributable Visual Similarity Learning",
    authors="Borui Zhang, Wenzhao Zheng, Jie Zhou, Jiwen Lu",
    year=2022,
    venue="CVPR 2022",
    code_url="https://github.com/zbr17/AVSL",
    tables=("1", "2", "3"),
    published_selection=(
        "AVSL: no validation split in the paper; the released code (zbr17/AVSL) stops early on the test set"
    ),
)


def pair_distance_matrix(
    head: AVSLHead, x_levels, x_cert, y_levels, y_cert, *, detach_nodes: bool = False
) -> torch.Tensor:
    """d^ of every (x, y) pair: (N x L x r, M x L x r) -> N x M, with the head's parameters."""
    return head.graph().distance(
        x_levels[:, None], y_levels[None], x_cert[:, None], y_cert[None], detach_nodes=detach_nodes
    )


def _stacked(field) -> torch.Tensor:
    return torch.stack(list(field), 1) if isinstance(field, (list, tuple)) else field


def _fields(fields: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``rerank_fields`` as (levels ... x L x r, certainty ... x L x r), float32."""
    return _stacked(fields["levels"]).float(), _stacked(fields["certainty"]).float()


def _output_fields(out: HeadOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """A head output's levels and CAM stds (B x L x r each), float32."""
    return _stacked(out.levels).float(), out.extras["certainty"].float()


@register_method(
    "avsl",
    description="AVSL: multi-level similarity nodes rectified through CAM-overlap edges, "
    "exhaustive ranking by the learned distance",
)
class AVSLHead(
    Method,
    LossShaper,
    HostReader,
    ProcessBound,
    Tunable,
    Reranker,
    PairScorer,
    Explainer,
    PairExplainer,
    FigureMaker,
):
    """Per level GAP + GMP and a 1x1 conv to r dims; nodes, CAM edges and reliabilities."""

    label = "AVSL"
    figure_tuples = ("pair",)
    paper = PAPER
    rerank_fields = ("levels", "certainty")
    supported_losses = SUPPORTED_LOSSES

    def __init__(
        self,
        *,
        channels,
        embedding_size,
        levels: int = 3,
        topk: int = 128,
        momentum: float = 0.5,
        reliability_gain: float = 1.0,
        rectify: bool = True,
        cam: str = "decomposed",
        cam_shift: str = "map",
        level_weights: Sequence[float] | None = None,
        final_weight: float = 1.0,
        rank: str = "exhaustive",
        rerank_k: int = 100,
        inference_lr_scale: float = 1.0,
        distance: str = "euclidean",
        link_ties: str = "index",
        final_neg_margin: float | None = None,
        collector_lr: float = 0.0,
        proxies_in_collector: bool = False,
        batch_proxies: bool = False,
        level_miner: str = "protocol",
        hard_cutoff: float = 0.5,
        final_loss: str = "shared",
        clip_units: str = "group",
    ):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if not 1 <= int(levels) <= 3:
            raise ValueError(f"levels must be 1, 2 or 3, got {levels}")
        check_choices(
            cam, cam_shift, rank, distance, link_ties, level_miner, final_loss, clip_units
        )
        check_ranges(momentum, topk, collector_lr, rank, rerank_k)
        weights = checked_level_weights(levels, level_weights)
        self.num_levels = int(levels)
        self.stages = ("s8", "s16", "s32")[3 - self.num_levels :]
        self.topk = min(int(topk), embedding_size)
        self.momentum, self.reliability_gain = float(momentum), float(reliability_gain)
        self.rectify = bool(rectify) and self.num_levels > 1
        self.cam, self.cam_shift = cam, cam_shift
        self.level_weights, self.final_weight = weights, float(final_weight)
        self.rank, self.exhaustive_pairs = rank, rank == "exhaustive"
        self.rerank_k = int(rerank_k) if rank == "rerank" else 0
        self.inference_lr_scale = float(inference_lr_scale)
        self.distance, self.link_ties = distance, link_ties
        self.final_neg_margin = None if final_neg_margin is None else float(final_neg_margin)
        self.collector_lr = float(collector_lr)
        self.proxies_in_collector = bool(proxies_in_collector)
        self.batch_proxies = bool(batch_proxies)
        self.level_miner, self.final_loss = level_miner, final_loss
        self.hard_cutoff = float(hard_cutoff)
        self.clip_units = clip_units
        separate = final_loss == "separate" and self.rectify and self.final_weight != 0
        self.metric_loss_copies = self.num_levels + (1 if separate else 0)
        self._build(channels, embedding_size)

    def _build(self, channels: dict[str, int], r: int) -> None:
        """The per-level projections g^l (kaiming-normal fan_out weights, zero bias, as the
        code), alpha and beta of Eq. 6 and the edge buffers of Eq. 4 (r = embedding size)."""
        self.project = nn.ModuleList()
        for stage in self.stages:
            conv = nn.Linear(channels[stage], r)  # a 1x1 conv on pooled features
            init.kaiming_normal_(conv.weight, mode="fan_out")
            init.zeros_(conv.bias)
            self.project.append(conv)
        self.alphas = nn.ParameterList(
            [nn.Parameter(torch.ones(r)) for _ in range(self.num_levels - 1)]
        )
        self.betas = nn.ParameterList(
            [nn.Parameter(torch.zeros(r)) for _ in range(self.num_levels - 1)]
        )
        for level in range(1, self.num_levels):  # rows: level l nodes, cols: l-1
            self.register_buffer(f"edges_{level}", torch.zeros(r, r))
        self.edge_updates: torch.Tensor
        self.register_buffer("edge_updates", torch.zeros((), dtype=torch.long))

    # ----------------------------------------------------------------- graph state

    def edge_buffers(self) -> list[torch.Tensor]:
        return [getattr(self, f"edges_{level}") for level in range(1, self.num_levels)]

    def edge_matrices(self) -> list[torch.Tensor]:
        """The normalised top-k edges omega~ (Eqs. 7-8) of levels 2..L."""
        return [normalized_edges(e, self.topk, ties=self.link_ties) for e in self.edge_buffers()]

    def graph(self) -> Graph:
        """The learned graph (edges omega~, alpha, beta, gain) that rectifies d^ (Eqs. 6-9)."""
        return Graph(
            self.edge_matrices(),
            list(self.alphas),
            list(self.betas),
            gain=self.reliability_gain,
            rectify=self.rectify,
        )

    @torch.no_grad()
    def update_edges(self, cams: Sequence[torch.Tensor]) -> None:
        """Eq. 4 with the batch estimate of Eq. 3; the first update overwrites (the code).
        Which of the two is chosen on the device (:func:`torch.where`): reading the update
        count would make every training step wait for the device."""
        first = self.edge_updates == 0
        for level, buf in enumerate(self.edge_buffers(), start=1):
            new = edge_estimate(cams[level].float(), cams[level - 1].float())
            buf.copy_(torch.where(first, new, self.momentum * buf + (1 - self.momentum) * new))
        self.edge_updates += 1

    # ---------------------------------------------------------------------- embed

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        levels, cams, certs = [], [], []
        for fmap, conv in zip(maps, cast(Sequence[nn.Linear], self.project), strict=True):
            pooled = fmap.mean(dim=(2, 3)) + fmap.amax(dim=(2, 3))
            levels.append(F.normalize(conv(pooled), dim=-1))
            with torch.no_grad(), torch.autocast(device_type=fmap.device.type, enabled=False):
                cam = class_activation_maps(
                    fmap.detach().float(), conv.weight.float(), conv.bias.float(), mode=self.cam
                )
                cams.append(cam)
                certs.append(cam_certainty(cam, shift=self.cam_shift))
        if self.training and self.num_levels > 1:
            self.update_edges(cams)
        return HeadOutput(
            embedding=levels[-1],
            levels=levels,
            cams=cams,
            extras={"certainty": torch.stack(certs, 1)},
        )

    # ------------------------------------------------------------------ evaluation

    def score_pairs(
        self, query: Mapping[str, torch.Tensor], gallery: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """-d^ of every (query, gallery) pair: Q x G from Q x L x r and G x L x r fields."""
        (q_lev, q_cert), (g_lev, g_cert) = _fields(query), _fields(gallery)
        return -pair_distance_matrix(self, q_lev, q_cert, g_lev, g_cert)

    def rerank_similarity(
        self, query: dict[str, torch.Tensor], candidates: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """-d^ of Q x K pairs (query fields Q x L x r, candidates Q x K x L x r)."""
        (q_lev, q_cert), (c_lev, c_cert) = _fields(query), _fields(candidates)
        return -self.graph().distance(q_lev[:, None], c_lev, q_cert[:, None], c_cert)

    def attribute_pair(
        self, query: HeadOutput, gallery: HeadOutput
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 11 for one pair (batches of one): lambda (L x r) and contributions (L x r)."""
        record = self.pair_attribution(query, gallery)
        return record.lambdas, record.contributions

    @torch.no_grad()
    def pair_attribution(self, query: HeadOutput, gallery: HeadOutput) -> PairAttribution:
        """Eq. 11 for one pair (batches of one) with what Figs. 6-7 show: per level the
        nodes delta, reliabilities p (levels >= 2), lambda and contributions lambda * delta."""
        (xl, xc), (yl, yc) = _output_fields(query), _output_fields(gallery)
        return pair_attribution(self.graph(), xl[0], xc[0], yl[0], yc[0])

    def figures(
        self, kind: str, images: list[torch.Tensor], outputs: list[HeadOutput]
    ) -> FigureSet | None:
        """Figs. 6 and 7 for a (query, nearest neighbour) pair (:func:`reliable_nodes_figure`,
        :func:`node_expansion_figure`), and the pair's attribution as data (JSON)."""
        query, gallery = outputs
        if not (query.levels and query.cams and "certainty" in query.extras) or self.num_levels < 2:
            return None
        assert gallery.cams is not None  # a head output of this head, as the query's
        record = self.pair_attribution(query, gallery)
        cams = tuple([c[0].float().cpu() for c in cams] for cams in (query.cams, gallery.cams))
        query_image, gallery_image = images
        return FigureSet(
            figures=(
                reliable_nodes_figure(query_image, gallery_image, cams, record),
                node_expansion_figure(query_image, gallery_image, cams, record),
            ),
            records={"_avsl_attribution": record.to_dict()},
        )

    @torch.no_grad()
    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eq. 11 drawn on the images: every node's weight lambda_i^l (P pairs at once) on its
        rectified CAM (positive part, L1-normalised: :func:`~harness.methods.avsl_figures.rectified_cams`; not Eq. 5's
        min-shifted one, whose offsets sum to a flat map), summed over the nodes and the
        levels (each level's map resized to the finest level's grid).

        A pair of two classes is explained by the nodes' contributions to the distance,
        lambda_i^l delta_i^l (Eq. 11, summing to d^); a same-class pair by lambda_i^l
        relu(e_i e'_i), the node's term of the cosine (for unit vectors d^l = 2 - 2 sum_i
        e_i e'_i): a harness choice, the paper attributes the distance only."""
        (xl, xc), (yl, yc) = _output_fields(query), _output_fields(gallery)
        lam, contributions = self.graph().attribution(xl, yl, xc, yc)
        same = torch.as_tensor(same, device=lam.device)[:, None, None]
        # P x L x r
        weights = torch.where(same, lam * (xl * yl).clamp_min(0), contributions).clamp_min(0)
        assert query.cams is not None and gallery.cams is not None  # embed keeps the CAMs
        size = tuple(query.cams[0].shape[-2:])
        return (
            node_weight_maps(query.cams, weights, size),
            node_weight_maps(gallery.cams, weights, size),
        )

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """Per level (K = L maps), the mean of the nodes' rectified CAMs at image size, in [0, 1]."""
        if not output.cams:
            return None
        return level_maps(output.cams, tuple(images.shape[-2:]))

    # -------------------------------------------------------------------- training

    @classmethod
    def cross_process_refusal(cls, options: dict[str, Any]) -> str:
        return (
            "its CAM edges are momentum buffers updated from each batch: each process would "
            "update them from its share, and DistributedDataParallel would overwrite them with "
            "process 0's; train it in one process"
        )

    def loss_terms(self, output: HeadOutput, batch: TrainingBatch) -> dict[str, torch.Tensor]:
        """Eq. 10: sum_l w_l L^m(level l) + w_f L^f(d^) (see the module docstring)."""
        labels = batch.labels
        metric = batch.metric_loss
        terms = {}
        assert output.levels is not None  # embed always returns the levels
        for level, emb in enumerate(output.levels):
            copy = level if metric.copies > 1 else 0
            with (
                level_distance(metric.module(copy), squared=self.distance == "squared") as module,
                loss_labels(module, labels, batch_proxies=self.batch_proxies) as targets,
            ):
                if mines_hard(module, self.level_miner):
                    dist = module.distance(emb.detach().float())
                    indices = hard_level_tuples(metric, dist, targets, module, self.hard_cutoff)
                    loss = metric(emb, targets, copy=copy, indices=indices)
                else:
                    loss = metric(emb, targets, copy=copy)
            terms[f"metric_level{level + 1}"] = self.level_weights[level] * loss
        if self.rectify and self.final_weight:
            terms["final"] = self.final_weight * self._final_loss(output, batch)
        return terms

    def _final_loss(self, output, batch) -> torch.Tensor:
        metric = batch.metric_loss
        top = metric.copies - 1 if metric.copies > 1 else 0
        loss = metric.module(top)
        distance = getattr(loss, "distance", None)
        if distance is None:
            raise HarnessError(
                f"AVSL's final loss needs a PML loss with a distance, got {type(loss).__name__}"
            )
        with torch.autocast(device_type=output.embedding.device.type, enabled=False):
            levels = _stacked(output.levels).float()
            cert = output.extras["certainty"].float()
            found = [
                getattr(metric.module(min(c, metric.copies - 1)), "proxies", None)
                for c in range(self.num_levels)
            ]
            proxies = [p for p in found if p is not None]
            if len(proxies) == len(found):  # the code: compare with each level's proxies
                ref, ref_cert = proxy_references(
                    proxies, cert, batch.labels, batch_proxies=self.batch_proxies
                )
                d = pair_distance_matrix(self, levels, cert, ref, ref_cert, detach_nodes=True)
            else:
                d = pair_distance_matrix(self, levels, cert, levels, cert, detach_nodes=True)
            matrix = final_loss_matrix(d, distance, squared=self.distance == "squared")
            emb = output.embedding.float()
            # The code's fourth HardSelector, on d^ (link_avsl_margin.yaml).
            if mines_hard(loss, self.level_miner):
                indices = hard_level_tuples(metric, matrix, batch.labels, loss, self.hard_cutoff)
            else:
                indices = metric.mine(emb, batch.labels)
            with (
                distance_replaced(
                    loss, PrecomputedDistance(matrix, is_inverted=distance.is_inverted)
                ),
                neg_margin(loss, self.final_neg_margin),
                loss_labels(loss, batch.labels, batch_proxies=self.batch_proxies) as targets,
            ):
                return apply_loss(loss, emb, targets, indices)

    def _collector_lr(self, lr_head: float) -> float:
        """The rate of the code's collector (alpha, beta, and the proxies with
        ``proxies_in_collector``): ``collector_lr``, else ``lr_head x inference_lr_scale``."""
        return self.collector_lr or lr_head * self.inference_lr_scale

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        inference = list(self.alphas.parameters()) + list(self.betas.parameters())
        ids = {id(p) for p in inference}
        head = [p for p in self.head_parameters() if id(p) not in ids]
        groups = [param_group(head, lr, weight_decay, "head")]
        if inference:  # the code's collector (clipped with the proxies with clip_units="code")
            groups.append(inference_group(inference, self._collector_lr(lr), weight_decay, self))
        return groups

    def loss_optimizer_groups(self, loss_fn: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
        """With ``proxies_in_collector``, the loss copies' proxies train as the code's
        collector does (its ``proxy_<i>`` parameters, avsl_collector.py lines 104-110,
        optimised by AdamW_collectors.yaml at ``--lr_collector`` with ``--wd``): at the
        collector's rate with the protocol's ``weight_decay``; the loss's other parameters
        (a margin beta) stay in the loss group (``clip_units``: :func:`collector_proxy_groups`)."""
        rate = self._collector_lr(optimizer.lr_head)
        return collector_proxy_groups(loss_fn, optimizer, rate, self.proxies_in_collector, self)

    def step_host_reads(self) -> str:
        reasons = []
        if self.batch_proxies:
            reasons.append(
                "batch_proxies: the batch's classes (torch.unique) size the proxies the loss sees"
            )
        if self.level_miner == "hard":
            reasons.append(
                "level_miner='hard': the anchors with a positive (torch.nonzero) size the tuples"
            )
        return "; ".join(reasons)

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        ks = sorted({min(k, embedding_size) for k in (32, 64, 128, 256)})
        return {
            "topk": trial.suggest_categorical("topk", ks),
            "momentum": trial.suggest_float("momentum", 0.3, 0.9),
            "reliability_gain": trial.suggest_categorical("reliability_gain", [1.0, 10.0]),
        }
