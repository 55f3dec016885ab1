"""A-grouping: attentive grouping for deep metric learning, with the grouping baselines
it is compared against (Xu, Wang, Deng, Yuan, Ji; code: DGML-master).

Deep grouped metric learning (DGML, Sec. 3.1) replaces the single D-dimensional
embedding with P groups of d = D / P dimensions. The metric loss is applied to each
group separately and averaged, and a diversity loss (Eq. 4) pushes the P groups of
the same image apart; the total loss is Eq. 14. This file has one configurable head,
:class:`GroupingHead`, whose ``grouping`` option picks the module that turns the last
feature map into P groups (Sec. 4.3, Tables 3-4):

=============  ============  =======================================================
registry name  ``grouping``  module
=============  ============  =======================================================
``agrouping``  attention     :class:`AttentiveGrouping`: shared key / value 1x1 convs,
                             one learnable query per group, softmax over the H*W
                             positions (Sec. 3.2, Eq. 5-8)
``mgrouping``  linear        :class:`MultiLinearGrouping`: GAP -> Linear(C -> P*d),
                             split (M-grouping, BIER-style)
``ggrouping``  gate          :class:`GateGrouping`: per-group spatial-channel gates,
                             GAP(x * mask), shared Linear (G-grouping, ABE-style)
``cgrouping``  channel       :class:`ChannelGrouping`: per-group squeeze-excitation
                             channel weights, GAP, shared Linear (C-grouping)
``ngrouping``  linear, P=1   no grouping: GAP -> Linear(C -> D) (N-grouping)
=============  ============  =======================================================

Every variant returns ``groups`` (B x P x d, each group L2-normalised) and
``embedding`` = the groups concatenated and divided by sqrt(P). The concatenation of
P unit vectors has norm exactly sqrt(P), so this *is* the re-normalised concatenation
(unit norm); its cosine similarity is the mean of the per-group cosines. The released
code evaluates the un-divided concatenation with L2 distance, which ranks neighbours
identically.

Where the paper is silent or disagrees with the released code (DGML-master):

* Diversity scale: Table 1 gives beta0 = 1 for the negative term that Eq. 4 reuses; the
  code uses 25 (``cons = -1 * pos + C * neg`` with ``C = opt.cn = 25``). Code followed
  (``diversity_beta=25``), as the harness's binomial deviance loss does.
* Diversity average: Eq. 14 averages over the N_g group pairs (followed, default
  ``diversity_reduction="mean"``); the code averages each pair over the images, sums
  over the P(P-1)/2 pairs and divides by P - 1, i.e. P/2 times larger
  (``diversity_reduction="dgml"``).
* lambda2 ||W||^2 of Eq. 14 is not a loss term here: as in the code it is the
  optimizer's weight decay (for Adam the gradient gains lambda2 * W, i.e. the
  (lambda2 / 2)||W||^2 form), applied per parameter group by :meth:`optimizer_groups`:
  the queries get ``query_weight_decay`` (code: ``que_decay`` 0.001; paper Sec. 4.3:
  lambda2 = 0.001), everything else the protocol's weight decay (code: ``decay`` 0.003)
  or ``head_weight_decay``.
* A-grouping is the code's ``LearnQ_fen`` (no projection after the attention); the
  ``LearnQ_he`` alternative with an extra d x d linear is not in the paper.
* The baselines' exact layers (Appendix A is not in our copy of the text) follow the
  code's ``group_layers.py``, except that G-grouping's masks pass through a sigmoid as
  in ABE (the code's gate has none; ``gate_sigmoid=False`` reproduces it).
* Loss parameters per group. Eq. 14 only sums the groups' metric losses; the code's
  criteria hold them per group (``criteria/margin.py``: beta of shape groups x classes),
  so a learnable margin beta or proxy is learnt for each group separately. Code followed
  (``loss_per_group=True``: the trainer holds one loss instance per group);
  ``loss_per_group=False`` shares one instance across the groups.
* Loss arithmetic. The paper prints the losses of Table 1, not how their terms are
  averaged; the code's criteria average differently from pytorch-metric-learning (margin,
  contrastive, binomial deviance). The A-grouping protocols follow the code
  (``reduction = "dgml"``, see :mod:`harness.components.losses.reductions`); the fair protocols keep
  PML's reductions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.components.explanation.maps import grouped_pair_maps, upsample_maps
from harness.methods.base import (
    HeadOutput,
    Method,
    PaperInfo,
    TrainingBatch,
    register_method,
    register_variant,
)
from harness.methods.roles import Explainer, LossShaper, PairExplainer, Tunable

if TYPE_CHECKING:
    from optuna.trial import Trial

__all__ = [
    "GroupingHead",
    "SingleEmbeddingHead",
    "AttentiveGrouping",
    "MultiLinearGrouping",
    "GateGrouping",
    "ChannelGrouping",
    "GROUPINGS",
    "diversity_loss",
    "PAPER",
]

PAPER = PaperInfo(
    title="Towards Improved and Interpretable Deep Metric Learning via Attentive Grouping",
    authors="Xinyi Xu, Zhengyang Wang, Cheng Deng, Hao Yuan, Shuiwang Ji",
    year=2022,
    venue="IEEE TPAMI",
    arxiv="2011.08877",
    code_url="https://github.com/XinyiXuXD/DGML-master",
    tables=("2", "3", "4"),
    published_selection=(
        "A-grouping: no validation split in the paper; the released code (DGML-master) keeps the checkpoint with the "
        "best test-set score"
    ),
)

#: Binomial-deviance constants of the diversity loss (Table 1 and the code: alpha = 2, m = 0.5).
DIVERSITY_ALPHA = 2.0
DIVERSITY_MARGIN = 0.5
DIVERSITY_REDUCTIONS = ("mean", "dgml")


def diversity_loss(
    groups: torch.Tensor,
    *,
    alpha: float = DIVERSITY_ALPHA,
    margin: float = DIVERSITY_MARGIN,
    beta: float = 25.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Eq. 4: binomial deviance on the cosine between two groups of the same image,
    negative pairs only: ``softplus(alpha * beta * (cos(g_i, g_j) - margin))``.

    ``groups``: B x P x d (normalised here). ``reduction="mean"`` averages over all
    images and the P(P-1)/2 group pairs (Eq. 14's 1/N_g; ordered pairs i != j give the
    same mean); ``"dgml"`` is the released code's sum over pairs of the per-pair image
    mean, divided by P - 1. Zero (with a graph) when P = 1.
    """
    if groups.dim() != 3:
        raise ValueError(f"groups must be B x P x d, got shape {tuple(groups.shape)}")
    if reduction not in DIVERSITY_REDUCTIONS:
        raise ValueError(f"reduction must be one of {DIVERSITY_REDUCTIONS}, got {reduction!r}")
    num = groups.shape[1]
    if num < 2:
        return groups.sum() * 0
    unit = F.normalize(groups.to(torch.promote_types(groups.dtype, torch.float32)), dim=-1)
    cos = unit @ unit.transpose(1, 2)  # B x P x P
    i, j = torch.triu_indices(num, num, offset=1, device=groups.device)
    pairs = F.softplus(alpha * beta * (cos[:, i, j] - margin))  # B x P(P-1)/2
    if reduction == "mean":
        return pairs.mean()
    return pairs.mean(dim=0).sum() / (num - 1)


# --------------------------------------------------------------------- grouping modules
# Each maps a B x C x H x W feature map to (B x P x d raw group features, aux maps).


class AttentiveGrouping(nn.Module):
    """A-grouping (Sec. 3.2). Key K = 1x1 conv C -> C/r and value V = 1x1 conv C -> d,
    both without bias (Eq. 5-6); one learnable query per group, Q: P x C/r; attention
    A = Softmax(Q^T K) over the H*W positions, unscaled (Eq. 7); groups F = A V^T (Eq. 8).

    The queries are one P x C/r parameter (the code has P bias-free 1x1 convs C/r -> 1,
    the same function), initialised like those convs: U(-1/sqrt(C/r), 1/sqrt(C/r)).
    Permuting the H*W positions of the input leaves the output unchanged (Theorem 1).
    ``aux["attention"]``: B x P x H x W, each map summing to one.
    """

    def __init__(self, in_channels: int, groups: int, dim: int, *, reduction: int = 8):
        super().__init__()
        key_dim = max(1, in_channels // reduction)
        self.key = nn.Conv2d(in_channels, key_dim, kernel_size=1, bias=False)
        self.value = nn.Conv2d(in_channels, dim, kernel_size=1, bias=False)
        bound = 1.0 / math.sqrt(key_dim)
        self.queries = nn.Parameter(torch.empty(groups, key_dim).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b, _, h, w = x.shape
        key = self.key(x).flatten(2)  # B x C/r x N  (Eq. 5)
        value = self.value(x).flatten(2)  # B x d x N    (Eq. 6)
        attention = torch.einsum("pk,bkn->bpn", self.queries, key).softmax(
            dim=-1
        )  # B x P x N (Eq. 7)
        feats = torch.einsum("bpn,bdn->bpd", attention, value)  # B x P x d    (Eq. 8)
        return feats, {"attention": attention.view(b, -1, h, w)}  # Eq. 9 (fold)


class MultiLinearGrouping(nn.Module):
    """M-grouping (BIER-style): GAP, one bias-free Linear(C -> P*d), split into P groups
    (code: ``MulLinear``). With P = 1 it is N-grouping (code: ``LinearEmb``)."""

    def __init__(self, in_channels: int, groups: int, dim: int):
        super().__init__()
        self.groups = groups
        self.project = nn.Linear(in_channels, groups * dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.project(x.mean(dim=(2, 3))).unflatten(-1, (self.groups, -1)), {}


class GateGrouping(nn.Module):
    """G-grouping (ABE-style, code: ``Gate``): a shared 1x1 conv C -> C/r, then per group a
    1x1 conv C/r -> C giving a B x C x H x W mask (sigmoid unless ``sigmoid=False``);
    group p = Linear(GAP(x * mask_p)) with one bias-free Linear(C -> d) shared by the groups.

    The P per-group convs are stored as one conv C/r -> P*C (same function, same
    initialisation). ``aux["gate_maps"]``: each group's mask averaged over channels,
    B x P x H x W, the spatial view used for explanations.
    """

    def __init__(
        self, in_channels: int, groups: int, dim: int, *, reduction: int = 8, sigmoid: bool = True
    ):
        super().__init__()
        self.groups, self.sigmoid = groups, sigmoid
        hidden = max(1, in_channels // reduction)
        self.shared = nn.Conv2d(in_channels, hidden, kernel_size=1)
        self.masks = nn.Conv2d(hidden, groups * in_channels, kernel_size=1)
        self.project = nn.Linear(in_channels, dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b, c, h, w = x.shape
        masks = self.masks(self.shared(x)).view(b, self.groups, c, h, w)
        if self.sigmoid:
            masks = masks.sigmoid()
        pooled = (x.unsqueeze(1) * masks).mean(dim=(3, 4))  # B x P x C
        return self.project(pooled), {"gate_maps": masks.mean(dim=2)}


class _SqueezeExcite(nn.Module):
    """Channel weights sigmoid(W2 relu(W1 GAP(x))), bias-free, reduction r (Hu et al. 2018)."""

    def __init__(self, channels: int, reduction: int):
        super().__init__()
        hidden = max(1, channels // reduction)
        self.fc = nn.Sequential(
            nn.Linear(channels, hidden, bias=False),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, channels, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.fc(pooled)


class ChannelGrouping(nn.Module):
    """C-grouping (code: ``Channel``): per group a squeeze-excitation block (reduction 5)
    re-weights the channels; group p = Linear(GAP(x * w_p)) with one Linear(C -> d, bias)
    shared by the groups. GAP(x * w_p) = w_p * GAP(x) since w_p is constant over space.
    ``aux["channel_weights"]``: B x P x C."""

    def __init__(self, in_channels: int, groups: int, dim: int, *, reduction: int = 5):
        super().__init__()
        self.excite = nn.ModuleList(_SqueezeExcite(in_channels, reduction) for _ in range(groups))
        self.project = nn.Linear(in_channels, dim, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pooled = x.mean(dim=(2, 3))  # B x C
        weights = torch.stack([se(pooled) for se in self.excite], dim=1)  # B x P x C
        return self.project(weights * pooled.unsqueeze(1)), {"channel_weights": weights}


#: ``grouping`` option -> (module, its default ``reduction`` or None when it has none).
GROUPINGS: dict[str, tuple[type[nn.Module], int | None]] = {
    "attention": (AttentiveGrouping, 8),
    "linear": (MultiLinearGrouping, None),
    "gate": (GateGrouping, 8),
    "channel": (ChannelGrouping, 5),
}


# ------------------------------------------------------------------------------ the head


class GroupingHead(Method, LossShaper, Tunable, Explainer, PairExplainer):
    """Deep grouped metric learning head (Sec. 3.1-3.2): feature map -> P groups of
    d = D / P dims, each L2-normalised; ``embedding`` = concatenation / sqrt(P).

    Options: ``grouping`` (one of :data:`GROUPINGS`), ``groups`` (P), ``reduction``
    (key / gate C -> C/r, SE reduction; None = the module's default: 8, 8, 5),
    ``gate_sigmoid`` (G-grouping only), ``diversity_weight`` (lambda1 of Eq. 14),
    ``diversity_beta`` and ``diversity_reduction`` (see :func:`diversity_loss`),
    ``query_weight_decay`` (lambda2 on the queries, A-grouping only),
    ``head_weight_decay`` (the other head parameters; None = the protocol's) and
    ``normalize_groups``.

    ``normalize_groups`` (default True): each group L2-normalised before the losses, as
    DGML-master's ResNet-50 architecture ``resnet50_frozen_normalize`` does
    (``architectures/resnet50.py`` lines 43-49). Its GoogLeNet architecture normalises only
    when ``normalize`` is in the architecture's name, and the one name it has is
    ``'googlenet'`` (``architectures/googlenet.py`` lines 40-41, ``configs/defaults.py``
    line 10); no GoogLeNet script is released, so which the authors ran is not known.
    False hands the raw groups to the losses; the embedding evaluated is their
    concatenation L2-normalised as a whole, as every method's is. A loss whose distance
    normalises its inputs (PML's default, ``normalize_embeddings=True``) sees unit groups
    either way: the code's criteria, which take raw distances, are not reproduced then.
    """

    label = "A-grouping"
    paper = PAPER
    stages = ("s32",)
    revision = 2  # 2: one metric-loss instance per group (loss_per_group=True)

    def __init__(
        self,
        *,
        channels,
        embedding_size,
        grouping: str = "attention",
        groups: int = 4,
        reduction: int | None = None,
        gate_sigmoid: bool = True,
        diversity_weight: float = 0.01,
        diversity_beta: float = 25.0,
        diversity_reduction: str = "mean",
        query_weight_decay: float = 0.001,
        head_weight_decay: float | None = None,
        loss_per_group: bool = True,
        normalize_groups: bool = True,
    ):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {tuple(GROUPINGS)}, got {grouping!r}")
        if groups < 1 or embedding_size % groups:
            raise ValueError(
                f"groups must divide the embedding size {embedding_size}, got {groups}"
            )
        if diversity_reduction not in DIVERSITY_REDUCTIONS:
            raise ValueError(
                f"diversity_reduction must be one of {DIVERSITY_REDUCTIONS}, "
                f"got {diversity_reduction!r}"
            )
        if reduction is not None and reduction < 1:
            raise ValueError(f"reduction must be >= 1, got {reduction}")
        module, default_reduction = GROUPINGS[grouping]
        kwargs: dict[str, Any] = {}
        if default_reduction is not None:
            kwargs["reduction"] = reduction or default_reduction
        if grouping == "gate":
            kwargs["sigmoid"] = gate_sigmoid
        self.grouping_name = grouping
        self.groups, self.group_dim = groups, embedding_size // groups
        self.grouping = module(self.in_channels, groups, self.group_dim, **kwargs)
        self.diversity_weight, self.diversity_beta = diversity_weight, diversity_beta
        self.diversity_reduction = diversity_reduction
        self.query_weight_decay, self.head_weight_decay = query_weight_decay, head_weight_decay
        self.metric_loss_copies = groups if loss_per_group else 1
        self.metric_loss_dim = self.group_dim
        self.normalize_groups = normalize_groups

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        feats, aux = self.grouping(maps[-1])
        if self.normalize_groups:
            groups = F.normalize(feats, dim=-1)  # B x P x d, unit rows
            embedding = groups.flatten(1) / math.sqrt(self.groups)  # unit norm
        else:  # the raw groups to the losses; the embedding unit-norm as a whole
            groups = feats
            embedding = F.normalize(feats.flatten(1), dim=-1)
        return HeadOutput(
            embedding=embedding, groups=groups, attention=aux.pop("attention", None), extras=aux
        )

    def loss_terms(self, output: HeadOutput, batch: TrainingBatch) -> dict[str, torch.Tensor]:
        """Eq. 14 without the L2 term (that is weight decay, see :meth:`optimizer_groups`):
        ``metric`` = the metric loss on each group separately, averaged over the P groups
        (the protocol's miner runs per group too, as in the code; group p uses loss
        instance p when the trainer holds one per group); ``diversity`` = lambda1 * Eq. 4,
        already weighted (absent when P = 1 or lambda1 = 0)."""
        groups, metric_loss = output.groups, batch.metric_loss
        assert groups is not None  # embed always returns the groups
        per_group = metric_loss.copies > 1
        metric = torch.stack(
            [
                metric_loss(groups[:, p].contiguous(), batch.labels, copy=p if per_group else 0)
                for p in range(groups.shape[1])
            ]
        ).mean()
        terms = {"metric": metric}
        if groups.shape[1] > 1 and self.diversity_weight:
            terms["diversity"] = self.diversity_weight * diversity_loss(
                groups, beta=self.diversity_beta, reduction=self.diversity_reduction
            )
        return terms

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """lambda2 of Eq. 14 as weight decay, per part as in the code's ``set_lr``: the
        queries (A-grouping) get ``query_weight_decay``; the rest of the head (key, value,
        baselines' layers) ``head_weight_decay``, defaulting to the protocol's."""
        head_decay = weight_decay if self.head_weight_decay is None else self.head_weight_decay
        queries = getattr(self.grouping, "queries", None)  # only the attentive grouping has them
        rest = [p for p in self.head_parameters() if p is not queries]
        out = [{"params": rest, "lr": lr, "weight_decay": head_decay, "name": "head"}]
        if queries is not None and queries.requires_grad:
            out.append(
                {
                    "params": [queries],
                    "lr": lr,
                    "weight_decay": self.query_weight_decay,
                    "name": "head.queries",
                }
            )
        return out

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """Eq. 9-10: the attention maps (A-grouping) or the channel-mean gate masks
        (G-grouping), B x P x h x w, bilinearly resized to the image and min-max
        normalised per map to [0, 1]; None for the M-, C- and N-grouping heads."""
        maps = output.attention if output.attention is not None else output.extras.get("gate_maps")
        if maps is None:
            return None
        return upsample_maps(maps, images.shape[-2:])

    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eq. 9's raw maps (attention, or G-grouping's gates) of each image, weighted by each
        group's share of the pair's (dis)similarity (:func:`~harness.components.explanation.maps.grouped_pair_maps`);
        None for the M-, C- and N-grouping heads, which have no spatial maps."""

        def maps(out: HeadOutput) -> torch.Tensor | None:
            return out.attention if out.attention is not None else out.extras.get("gate_maps")

        query_maps, gallery_maps = maps(query), maps(gallery)
        if query_maps is None or gallery_maps is None:
            return None
        assert query.groups is not None and gallery.groups is not None
        return grouped_pair_maps(query_maps, gallery_maps, query.groups, gallery.groups, same)

    @property
    def explains_pairs(self) -> bool:
        """Only the attentive (A-) and gated (G-) groupings have spatial maps."""
        return self.grouping_name in ("attention", "gate")

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        """P in {2, 4, 8} (only values dividing ``embedding_size``) and lambda1
        log-uniform in [1e-3, 1e-1]."""
        choices = [g for g in (2, 4, 8) if embedding_size % g == 0]
        return {
            "groups": trial.suggest_categorical("groups", choices),
            "diversity_weight": trial.suggest_float("diversity_weight", 1e-3, 1e-1, log=True),
        }


@register_method(
    "ngrouping",
    grouping="linear",
    groups=1,
    description="N-grouping: GAP + linear, one group (A-grouping's no-grouping baseline)",
)
class SingleEmbeddingHead(GroupingHead):
    """N-grouping (Table 3, "1 x 512"): the grouping head with one linear group, so the
    metric loss sees the whole embedding and there is no diversity term. A class of its
    own only so that its search space is empty (tuning must not turn it into M-grouping)."""

    label = "N-grouping"

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        return {}


register_variant(
    "mgrouping",
    GroupingHead,
    grouping="linear",
    label="M-grouping",
    description="M-grouping: GAP + Linear(C -> D) split into P groups (BIER-style) "
    "+ diversity loss",
)
register_variant(
    "ggrouping",
    GroupingHead,
    grouping="gate",
    label="G-grouping",
    description="G-grouping: per-group gate masks, GAP(x * mask), shared Linear "
    "(ABE-style) + diversity loss",
)
register_variant(
    "cgrouping",
    GroupingHead,
    grouping="channel",
    label="C-grouping",
    description="C-grouping: per-group SE channel weights, GAP, shared Linear + diversity loss",
)
# Registered after its baselines: tables list a block's rows in registration order.
register_method(
    "agrouping",
    description="A-grouping: learnable queries attend over positions, P groups + diversity loss",
)(GroupingHead)
