"""DIABLO: dictionary-based attention block for deep metric learning (Jacob, Picard,
Histace, Klein; Pattern Recognition Letters 2020). The authors released no code: this
file implements the paper's text; every choice the text leaves open is named below.

A feature map F (h x w x c) is turned into N attention-weighted maps, one per entry of a
learnt dictionary (Sec. 3.1, Fig. 1). Attention comes from phi(F), a non-linear
transform (a pretrained copy of backbone stages), compared by cosine with the dictionary:

=================  ==========================================================================
``selection``      attention A (Sec. 3.3 / 3.4)
=================  ==========================================================================
``feature``        one entry d_n in R^m per branch; A^(n)_ij = softmax_n(alpha cos(phi(f_ij),
                   d_n)), the same for every channel (Eqs. 5, 7; merged by Eqs. 8-9)
``dimension``      N x c directions d_k^(n) in R^m; A^(n)_ijk = softmax_n(alpha cos(phi(f_ij),
                   d_k^(n))), one weight per channel k (Eqs. 10-11; merged by Eqs. 12-13)
=================  ==========================================================================

=================  ==========================================================================
``placement``      where attention acts (Sec. 3.2)
=================  ==========================================================================
``pre``            H = psi(M(F; A)): the backbone's own later stages (psi) run on each of
                   the N weighted maps (Eqs. 3-4); psi is shared across the N maps
``post``           H = M(psi(F); A): psi runs once, the attention weighs its output (Eqs. 1-2)
=================  ==========================================================================

Each of the N maps is globally average-pooled, embedded by its own linear layer to D/N
and L2-normalised; the N branches are concatenated (Sec. 3.1, 4.1). One metric loss on
the concatenation (Sec. 3.5: no extra loss term, unlike ABE's divergence loss).

Wiring (Sec. 4.1, GoogLeNet): pre-attention takes F after the max-pooling between the
third and fourth scales (backbone point ``pool3``, 14 x 14 x 480), phi = a pretrained
copy of inception 4a-4e (m = 832), psi = the backbone's own 4a-5b; post-attention takes
F after ``pool4``, phi = a copy of 5a-5b, psi = the backbone's 5a-5b. On any other
backbone (the harness's own design, not the paper's): F = the input of the ``s16``
stage (pre) or of the ``s32`` stage (post), phi = a pretrained copy of that stage, psi =
the backbone from F on. On ResNet-50 that is F = layer2's output, phi = layer3, psi =
layer3 + layer4 (pre), or F = layer3's output, phi = layer4, psi = layer4 (post). Where
phi changes the resolution (ResNet's layer3 has stride 2; GoogLeNet's inception blocks
do not), the attention is resized bilinearly to F's resolution, which keeps each
location's weights summing to one.

Choices where the paper is silent (assumptions, each an option and in the search space):

* ``temperature`` alpha of Eqs. 7 / 11: not given; default 10 (cosines lie in [-1, 1],
  so alpha = 1 would leave every assignment near 1/N).
* The metric loss sees the concatenation of the N unit branches divided by sqrt(N) (unit
  norm). Every loss the harness offers normalises its input (its distance's
  ``normalize_embeddings``, or cosine logits), so the raw concatenation would give the same
  numbers: there is no option for it.
* ``rescale`` (pre-attention), a deviation from Eq. 3 as printed: psi's input is N * A^(n) * F
  (default True), not A^(n) * F (False, the paper's value). psi is the backbone's pretrained
  later stages, with BatchNorm statistics frozen for inputs of F's scale; the N weighted maps
  of Eq. 3 are each about 1/N of F, and the factor N hands psi F itself under a uniform
  assignment (measured on ``synthetic`` at the smoke protocol, before training: P@1 19.0
  with, 7.3 without; docs/performance.md). Retrieval through post-attention is unaffected (the
  factor would cancel in the L2 normalisation).

A deviation of the ``diablo`` protocol, not of the head: the paper trains on the whole
training split (Sec. 5; the standard class splits) and does not say how Tables 1-2's models
were selected; the protocol carves 20% of the training classes (class-disjoint, seed 0) as a
validation set that picks the epoch, so the model trains on 80% of the training classes.
* Dictionary initialisation: standard normal entries (only their direction matters).
* Per-branch embedding layers initialised like ``nn.Linear``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from harness.base.errors import HarnessError
from harness.components.explanation.maps import grouped_pair_maps, upsample_maps
from harness.methods.base import (
    HeadOutput,
    Method,
    PaperInfo,
    TrainingBatch,
    register_method,
    register_variant,
)
from harness.methods.roles import Explainer, PairExplainer, Tunable

if TYPE_CHECKING:
    from optuna.trial import Trial

    from harness.components.backbones import Backbone

__all__ = [
    "DiabloHead",
    "PAPER",
    "SELECTIONS",
    "PLACEMENTS",
    "feature_wise_attention",
    "dimension_wise_attention",
    "merge",
    "attended_energy",
]

PAPER = PaperInfo(
    title="DIABLO: Dictionary-based attention block for deep metric learning",
    authors="Pierre Jacob, David Picard, Aymeric Histace, Edouard Klein",
    year=2020,
    venue="Pattern Recognition Letters",
    tables=("1", "2", "3", "4"),
    published_selection=(
        "DIABLO: Tables 1-2 name no validation split and no code was released (test-set selection cannot be "
        "excluded); Tables 3-4 select on a random half of the training classes"
    ),
)

SELECTIONS = ("feature", "dimension")
PLACEMENTS = ("pre", "post")


def feature_wise_attention(
    phi: torch.Tensor, dictionary: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Eqs. 5 and 7: ``phi`` B x m x h x w, ``dictionary`` N x m -> A: B x N x 1 x h x w,
    the soft-max over the N entries of alpha times the cosine of phi(f_ij) with d^(n).
    The singleton channel axis says that one weight serves every channel (Eq. 8)."""
    cosine = torch.einsum("bmhw,nm->bnhw", F.normalize(phi, dim=1), F.normalize(dictionary, dim=-1))
    return (alpha * cosine).softmax(dim=1)[:, :, None]


def dimension_wise_attention(
    phi: torch.Tensor, directions: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Eqs. 10-11: ``phi`` B x m x h x w, ``directions`` N x c x m -> A: B x N x c x h x w,
    for each channel k the soft-max over the N entries of alpha cos(phi(f_ij), d_k^(n))."""
    cosine = torch.einsum(
        "bmhw,ncm->bnchw", F.normalize(phi, dim=1), F.normalize(directions, dim=-1)
    )
    return (alpha * cosine).softmax(dim=1)


def merge(features: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Eqs. 8-9 and 12-13: H^(n)_ijk = A^(n)_ijk F_ijk. ``features`` B x c x h x w,
    ``attention`` B x N x (1 or c) x h x w -> B x N x c x h x w. The N maps sum back to F."""
    return attention * features[:, None]


def attended_energy(features: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Each entry's attended feature energy at every location, ||H^(n)_ij||^2 = sum_k
    (A^(n)_ijk F_ijk)^2 (Eqs. 8 and 12: H = A F), B x N x h x w: the explanation map of
    entry n. ``features`` B x c x h x w, ``attention`` B x N x (1 or c) x h x w.

    The paper draws no attention (its figures are the architecture's), so the map is the
    harness's: the energy of what entry n's branch pools, high where its attention meets
    strong features. Each entry's share of the energy, sum_k (A F)^2 / sum_k F^2, is not a
    map of where the model looks: the N entries split every location between them (the
    soft-max of Eqs. 7 and 11), so their weighted sum stands nearly flat."""
    return (attention.pow(2) * features.pow(2)[:, None]).sum(2)


def _resize(attention: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """B x N x c x h x w -> B x N x c x H x W, bilinear (convex weights: sums over N stay 1)."""
    if tuple(attention.shape[-2:]) == tuple(size):
        return attention
    b, n, c = attention.shape[:3]
    flat = F.interpolate(attention.flatten(1, 2), size=size, mode="bilinear", align_corners=False)
    return flat.view(b, n, c, *size)


@register_method(
    "diablo",
    description="DIABLO: dictionary attention (dimension-wise, pre-attention, N = 8), "
    "psi run per entry, N branches of D/N",
)
class DiabloHead(Method, Tunable, Explainer, PairExplainer):
    """Dictionary-based attention head (see the module docstring).

    Options: ``selection`` (``"feature"`` | ``"dimension"``), ``placement`` (``"pre"`` |
    ``"post"``), ``entries`` N (must divide the embedding size), ``temperature`` alpha
    (Eqs. 7 / 11) and ``rescale`` (psi's input scale in pre-attention, a deviation from Eq. 3;
    see above). The registered
    ``diablo`` is the paper's headline setting: dimension-wise, pre-attention, N = 8.
    """

    #: The paper's row label (Table 1: "+ DIABLO" under each loss's baseline), with the run's N.
    label = "+ DIABLO (N = {entries})"
    paper = PAPER

    def __init__(
        self,
        *,
        channels,
        embedding_size,
        selection: str = "dimension",
        placement: str = "pre",
        entries: int = 8,
        temperature: float = 10.0,
        rescale: bool = True,
    ):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if selection not in SELECTIONS:
            raise HarnessError(f"DIABLO selection must be one of {SELECTIONS}, got {selection!r}")
        if placement not in PLACEMENTS:
            raise HarnessError(f"DIABLO placement must be one of {PLACEMENTS}, got {placement!r}")
        if not isinstance(entries, int) or entries < 1 or embedding_size % entries:
            raise HarnessError(
                f"DIABLO entries (N) must be a positive divisor of the embedding size "
                f"{embedding_size}, got {entries}"
            )
        if not temperature > 0:
            raise HarnessError(f"DIABLO temperature (alpha) must be > 0, got {temperature}")
        self.selection, self.placement, self.entries = selection, placement, entries
        self.temperature, self.rescale = float(temperature), rescale
        self.branch_dim = embedding_size // entries

    # ---------------------------------------------------------------------- building

    def setup(self, backbone: Backbone) -> None:
        """Cut the backbone (Sec. 4.1): F = the input point of ``s16`` (pre) or ``s32``
        (post); phi = a pretrained copy of that stage; psi = the backbone from F on."""
        super().setup(backbone)
        stage = "s16" if self.placement == "pre" else "s32"
        start = backbone.stage_input(stage)
        if start is None:
            raise HarnessError(
                f"DIABLO cannot cut backbone '{backbone.name}' before its {stage} stage"
            )
        self.input_point, self.stages = start, (start,)
        self.pretrained["phi"] = backbone.segment(start, stage)
        m = backbone.channels[stage]
        # The channels the attention weighs: F's (pre) or psi(F)'s (post).
        c = backbone.channels[start] if self.placement == "pre" else backbone.channels["s32"]
        shape = (self.entries, m) if self.selection == "feature" else (self.entries, c, m)
        self.dictionary = nn.Parameter(torch.randn(shape))
        width = backbone.channels["s32"]
        bound = 1 / math.sqrt(width)  # nn.Linear's default initialisation, per branch
        self.branch_weight = nn.Parameter(
            torch.empty(self.entries, width, self.branch_dim).uniform_(-bound, bound)
        )
        self.branch_bias = nn.Parameter(
            torch.empty(self.entries, self.branch_dim).uniform_(-bound, bound)
        )

    # ---------------------------------------------------------------------- forward

    def attention(self, features: torch.Tensor) -> torch.Tensor:
        """A = S(phi(F); D) at F's resolution: B x N x (1 or c) x h x w, in float32."""
        phi = self.pretrained["phi"](features).float()
        select = feature_wise_attention if self.selection == "feature" else dimension_wise_attention
        return select(phi, self.dictionary.float(), self.temperature)

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        if "phi" not in self.pretrained:
            raise HarnessError("DIABLO was not set up with a backbone (call setup first)")
        features = maps[-1]
        b = features.shape[0]
        if self.placement == "pre":
            attention = _resize(self.attention(features), features.shape[-2:])
            weighted = merge(features.float(), attention)  # Eq. 3
            if self.rescale:  # uniform attention hands psi F itself (see the module docstring)
                weighted = weighted * self.entries
            weighted = weighted.to(features.dtype)
            refined = cast(  # Eq. 4, psi per entry
                torch.Tensor, self.backbone.run(weighted.flatten(0, 1), start=self.input_point)
            )
            pooled = refined.mean(dim=(2, 3)).view(b, self.entries, -1)
            explained_on = features
        else:
            refined = cast(
                torch.Tensor, self.backbone.run(features, start=self.input_point)
            )  # Eq. 1
            attention = _resize(self.attention(features), refined.shape[-2:])
            pooled = merge(refined.float(), attention).mean(dim=(-2, -1))  # Eq. 2, then GAP
            explained_on = refined
        branches = torch.einsum(
            "bnc,ncd->bnd", pooled.to(self.branch_weight.dtype), self.branch_weight
        )
        branches = F.normalize(branches + self.branch_bias, dim=-1)  # B x N x D/N
        shown = attended_energy(explained_on.float().detach(), attention.detach())
        return HeadOutput(
            embedding=branches.flatten(1) / math.sqrt(self.entries),
            groups=branches,
            attention=shown,
        )

    def loss_terms(self, output: HeadOutput, batch: TrainingBatch) -> dict[str, torch.Tensor]:
        """One metric loss on the concatenation of the N branches (Sec. 3.1), at unit norm."""
        return {"metric": batch.metric_loss(output.embedding, batch.labels)}

    # ---------------------------------------------------------------------- explanation

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """Per image, N maps resized to the image and min-max normalised: each entry's
        attended feature energy ||H^(n)_ij||^2 (:func:`attended_energy`)."""
        assert output.attention is not None  # embed always keeps the maps
        return upsample_maps(output.attention, images.shape[-2:])

    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The N entries' maps of each image (the ones :meth:`explain` draws), weighted by
        each branch's share of the pair's (dis)similarity: the embedding's cosine is the mean
        of the N branch cosines (:func:`~harness.components.explanation.maps.grouped_pair_maps`)."""
        assert query.attention is not None and gallery.attention is not None
        assert query.groups is not None and gallery.groups is not None
        return grouped_pair_maps(
            query.attention, gallery.attention, query.groups, gallery.groups, same
        )

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        """alpha log-uniform in [1, 50]; N in {2, 4, 8, 16} dividing the embedding size;
        psi's input rescaled or not."""
        entries = [n for n in (2, 4, 8, 16) if embedding_size % n == 0]
        return {
            "temperature": trial.suggest_float("temperature", 1.0, 50.0, log=True),
            "entries": trial.suggest_categorical("entries", entries),
            "rescale": trial.suggest_categorical("rescale", [True, False]),
        }


register_variant(
    "diablo_n16",
    DiabloHead,
    ablation=True,
    entries=16,
    description="DIABLO Table 1 (binomial): dimension-wise, pre-attention, N = 16",
)
register_variant(
    "diablo_feature_pre",
    DiabloHead,
    ablation=True,
    selection="feature",
    placement="pre",
    label="+ DIABLO (feature-wise, pre-attention, N = {entries})",
    description="DIABLO Table 3: feature-wise selection, pre-attention, N = 8",
)
register_variant(
    "diablo_feature_post",
    DiabloHead,
    ablation=True,
    selection="feature",
    placement="post",
    label="+ DIABLO (feature-wise, post-attention, N = {entries})",
    description="DIABLO Tables 3-4: feature-wise selection, post-attention, N = 8",
)
register_variant(
    "diablo_dimension_post",
    DiabloHead,
    ablation=True,
    placement="post",
    label="+ DIABLO (dimension-wise, post-attention, N = {entries})",
    description="DIABLO Table 3: dimension-wise selection, post-attention, N = 8",
)
