"""SAM: similarity attention and similarity mining (Zheng, Karanam, Chen, Radke, Wu,
"Visual Similarity Attention", IJCAI 2022; arXiv 1911.07381, first titled "Learning
Similarity Attention"). The authors released no code: this file implements the paper's
text; every choice the text leaves open is named below. (A third-party TensorFlow SAM
differs from the paper: learnable mask parameters, no gradient through the attention.)

The head is the plain DML head (GAP -> Linear -> L2, :mod:`harness.methods.plain`); SAM changes
training and explanation, not the embedding.

Similarity attention (Sec. 3.1). For a tuple of unit embeddings, a weight vector w
picks the dimensions that make the tuple satisfy its criterion:

=================  ==========================================================================
``form``           w (element-wise products, all vectors unit-norm)
=================  ==========================================================================
``triplet``        w = (1 - |f_a - f_p|) * |f_a - f_n|                    (Sec. 3.1, "w^p . w^n")
``siamese``        w = 1 - |f_1 - f_2| for a positive pair, |f_1 - f_2| for a negative (Sec. 3.1.1)
``quadruplet``     w = (1 - |f_a - f_p|) * |f_a - f_n1| * |f_a - f_n2|                (Sec. 3.1.1)
=================  ==========================================================================

Each image i of the tuple gets the score s^i = w . f^i and the attention map
M^i = ReLU(sum_k alpha_k A_k), alpha_k = GAP(ds^i / dA_k) (Eq. 1), on the feature map A of
backbone point ``stage``. On the last map (``s32``) under GAP -> Linear -> L2 the
gradient is constant over space and Eq. 1 has a closed form (no double backward)::

    e = W GAP(A) + b,  f = e / |e|,  g = ds/de = (w - (w . f) f) / |e|,
    alpha = W^T g / (h w),  M = ReLU(sum_k alpha_k A_k)

(:func:`closed_form_attention`). An earlier ``stage`` runs the rest of the backbone
and the head again from the map and takes the vector-Jacobian product with autograd
(``create_graph=True`` in training, :func:`autograd_attention`). Attention is computed
in float32 with autocast disabled, from the map the backbone produced (its embedding is
recomputed in float32 too, and w is built from that).

Similarity mining (Sec. 3.2). Each attention map is upsampled to the image, normalised
and turned into a soft mask 1 - Sigma(M), Sigma(Z) = sigmoid(alpha (Z - beta)); the masked
images x * (1 - Sigma(M)) go through the same model again (``batch.model``) and

* triplet (Eq. 2):     L_sm = | ||f*a - f*p|| - ||f*a - f*n|| |
* siamese (3.2.1):     L_sm = -||f*1 - f*2||, positive pairs only
* quadruplet (3.2.1):  L_sm = L_sm(a, p, n1) + L_sm(a, p, n2)

averaged over the tuples. The total is Eq. 3, L = L_ml + gamma L_sm: ``loss_terms``
returns ``{"metric": L_ml, "similarity_mining": gamma * L_sm}``. As the paper says ("all
operations leading up to Equation 1 ... are differentiable"), L_sm's gradient flows
through the masks into M, and through M into the backbone, the head and w.

Tuples: L_ml is the run's metric loss on the tuples its miner chose
(``idx = batch.metric_loss.mine(f, y)``, ``batch.metric_loss(f, y, indices=idx)``); L_sm
uses tuples from the *same* ``idx`` (converted to pairs / triplets as PML does; all
tuples of the batch when the protocol has no miner), see :func:`select_tuples`.

Architectures of Table 1 and the registered names (the loss is the run's ``--loss``;
Table 1 pairs Siamese with contrastive, triplet with triplet, quadruplet with the
harness's ``quadruplet`` loss, Chen et al. 2017):

==================  ===========  ==============================================================
name                ``form``     note
==================  ===========  ==============================================================
``sam``             triplet      the paper's main model: Sec. 3 is written for it, and "since the
                                 triplet model gives the best performance among the three
                                 architectures considered in Table 1, for all subsequent
                                 experiments, we only report results with the triplet variant"
                                 (Sec. 4.1; Table 2's SAM row)
``sam_siamese``     siamese      Table 1 ablation
``sam_quadruplet``  quadruplet   Table 1 ablation
==================  ===========  ==============================================================

Choices where the paper is silent (assumptions; each is an option and in the search space):

* ``stage`` (Sec. 3.1: A is "from one of the intermediate layers"): default ``"s32"``, the
  last convolutional map, as in Grad-CAM, which Eq. 1 follows (and the closed form).
* ``alpha``, ``beta`` of Sigma (Sec. 3.2: "pre-set, by cross validation, constants", values not
  printed): default alpha = 10, beta = 0.5, the values of GAIN (Li et al. 2018a, cited by the
  paper for trainable attention), whose soft mask sigmoid(omega (A - sigma)) Sigma is.
* ``gamma`` (Eq. 3): given only for re-identification, 0.2 (Sec. 4.2); used for retrieval too.
* ``normalize``, how M is brought to the scale beta lives on (not said): M is upsampled
  bilinearly to the image size, then ``"max"`` (default) divides each map by its maximum
  (zeros of the ReLU stay 0, the peak is 1) or ``"minmax"`` rescales it to [0, 1].
  Masked pixels tend to 0 in the *normalised* input, i.e. to the dataset's mean colour.
* ``detach_weights``: Eq. 1 differentiates s = w . f with w held constant (w selects
  dimensions, as a class weight does in Grad-CAM; the text differentiates "these sample
  scores" and says nothing of w's own dependence on f). In training, w is itself a function
  of the embeddings; default False lets L_sm's gradient reach the embeddings through w
  too ("all operations ... are differentiable"); True holds w constant there as well.
* ``mining``, which mined tuples are masked: each image is masked at most once per step, as
  in the paper's triplet model, where a batch is a set of triplets and each image belongs to
  one (Fig. 2). Mined tuples are taken greedily, skipping any that shares an image with one
  already taken, in random order (``"random"``, default) or hardest first (``"hardest"``:
  largest d(a, p) - d(a, n), or largest d(1, 2) for Siamese positives). A quadruplet extends a
  mined triplet (a, p, n1) by a second negative n2 of a class other than a's and n1's (Chen
  et al. 2017's constraint; the paper only says both are negatives of a): random, or the
  nearest to a. So the masked pass sees at most one batch of images (about 2 forward passes
  per step in all). ``selection`` says where this greedy pass runs, none of which the
  paper constrains:

  - ``"fixed"`` (default): on the device in a fixed shape
    (:func:`~harness.methods.sam_tuples.select_fixed_tuples`): B // k rounds, each keeping
    the first candidate in the pass's order that is still free, into B // k tuple slots
    with a mask of those kept. Hardest first it keeps the host's tuples; in random order it
    draws the order (and a quadruplet's random n2) from the device's generator: the host's
    distribution, other draws (tests/methods/test_sam_fixed_tuples.py). The masked pass
    always embeds the B // k slots' images (k * (B // k) <= B), the unkept slots' L_sm
    weighted 0, so nothing in the step depends on the data and ``run --compile`` captures
    it as one graph. Under BatchNorm in training mode (``freeze_bn = false``) those
    placeholder images would enter the masked pass's batch statistics: use ``"host"``
    there to keep them out.
  - ``"host"``: the sequential pass on the host, from one transfer per step, its random
    order from the CPU generator.
  - ``"device"`` (pairs and triplets): the sequential pass's parallel form on the device
    (:func:`~harness.methods.sam_tuples.disjoint_on_device`), the host's tuples in the
    host's order (tests/methods/test_sam_tuples.py; benchmarks/bench_sam_tuples.py counts
    the rounds it needs), with one read of the number kept.
* L_sm's reduction over tuples (not said): the mean over the tuples kept, so gamma does not
  depend on the batch.

A deviation of the ``sam`` protocol, not of the head: the paper trains on the whole training
split (Sec. 4.1, the splits of Wang et al. 2019) and says nothing of model selection; the
protocol carves 20% of the training classes (class-disjoint, seed 0) as a validation set
that picks the epoch, so the model trains on 80% of the training classes.

Both passes run the model in training mode: with the protocols' frozen BatchNorm the
masked images leave the running statistics alone and images do not interact (which
Eq. 1 by autograd on an earlier stage also assumes); with ``freeze_bn = false`` the
masked pass updates them too, as a second forward of the same network does.

Explanation (not a training choice): :meth:`SAMHead.explain` gives, per image, the
similarity attention of the image with its nearest neighbour in the batch under the
Siamese positive-pair weight w = 1 - |f - f_nn| (why the retrieval's top-1 is similar; an
image alone is paired with itself, w = 1). :meth:`SAMHead.pair_maps` gives the same for
(query, gallery) pairs as data (what ``harness explain`` scores),
:meth:`SAMHead.triplet_maps` Fig. 4's anchor / positive / negative maps under the triplet
weight, both in closed form on the last map; the run logs them as figures
(:meth:`SAMHead.figures`).

This file has the head, its variants and the paper's metadata, and exports every piece:
the weights, Eq. 1, the masks and L_sm are :mod:`harness.methods.sam_attention`, the
selection of the tuples to mask :mod:`harness.methods.sam_tuples`, and Fig. 4's maps and
layout :mod:`harness.methods.sam_figures`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from harness.base.errors import HarnessError
from harness.components.explanation.maps import upsample_maps
from harness.methods.base import (
    FigureSet,
    HeadOutput,
    Method,
    PaperInfo,
    TrainingBatch,
    register_method,
    register_variant,
)
from harness.methods.roles import (
    Explainer,
    FigureMaker,
    HostReader,
    PairExplainer,
    ProcessBound,
    Tunable,
)
from harness.methods.sam_attention import (
    FORMS,
    NORMALIZATIONS,
    TUPLE_SIZE,
    autograd_attention,
    closed_form_attention,
    eq1_attention,
    normalize_attention,
    pair_weights,
    quadruplet_weights,
    similarity_mining_loss,
    soft_mask,
    triplet_weights,
    tuple_weights,
)
from harness.methods.sam_figures import attention_row, local_pair_maps, triplet_maps, tuple_figures
from harness.methods.sam_tuples import (
    MININGS,
    SELECTIONS,
    candidate_tuples,
    select_fixed_tuples,
    select_tuples,
)

if TYPE_CHECKING:
    from optuna.trial import Trial

    from harness.components.backbones import Backbone

__all__ = [
    "SAMHead",
    "PAPER",
    "FORMS",
    "TUPLE_SIZE",
    "triplet_weights",
    "pair_weights",
    "quadruplet_weights",
    "tuple_weights",
    "eq1_attention",
    "closed_form_attention",
    "autograd_attention",
    "soft_mask",
    "normalize_attention",
    "similarity_mining_loss",
    "candidate_tuples",
    "select_tuples",
    "attention_row",
]

# The text transcribed here is titled "Visual Similarity Attention" and set in IJCAI's
# template (2022); arXiv 1911.07381 is the same work, first posted as "Learning Similarity
# Attention" (the name the harness's issues use).
PAPER = PaperInfo(
    title="Visual Similarity Attention",
    authors="Meng Zheng, Srikrishna Karanam, Terrence Chen, Richard J. Radke, Ziyan Wu",
    year=2022,
    venue="IJCAI",
    arxiv="1911.07381",
    tables=("1", "2"),
    published_selection=(
        "SAM: the paper names no validation split and no code was released (test-set selection cannot be "
        "excluded)"
    ),
)

STAGES = ("s8", "s16", "s32")


# ------------------------------------------------------------------ the head


@register_method(
    "sam",
    description="SAM: similarity attention + similarity mining on soft-masked images "
    "(triplet form), GAP + linear head",
)
class SAMHead(Method, HostReader, ProcessBound, Tunable, Explainer, PairExplainer, FigureMaker):
    """The plain head (GAP -> Linear -> L2) trained with SAM's similarity mining (see the
    module docstring). Options: ``form`` (``"triplet"`` | ``"siamese"`` | ``"quadruplet"``),
    ``stage`` (the map of Eq. 1), ``alpha`` / ``beta`` (Sigma), ``gamma`` (Eq. 3),
    ``normalize`` (M's scale), ``detach_weights`` (w constant in training), ``mining``
    (which mined tuples are masked), ``selection`` (where the greedy pass over them runs:
    ``"fixed"``, in a fixed shape on the device, ``"host"``, or ``"device"`` for pairs and
    triplets); all but ``form`` are assumptions, see above."""

    label = "SAM"
    figure_tuples = ("pair", "triplet")
    paper = PAPER

    def __init__(
        self,
        *,
        channels,
        embedding_size,
        form: str = "triplet",
        stage: str = "s32",
        alpha: float = 10.0,
        beta: float = 0.5,
        gamma: float = 0.2,
        normalize: str = "max",
        detach_weights: bool = False,
        mining: str = "random",
        selection: str = "fixed",
    ):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if not alpha > 0:
            raise ValueError(f"alpha (mask sharpness) must be > 0, got {alpha}")
        if not 0 <= beta <= 1:
            raise ValueError(
                f"beta (mask threshold on the normalised map) must be in [0, 1], got {beta}"
            )
        if not gamma >= 0:
            raise ValueError(f"gamma (Eq. 3) must be >= 0, got {gamma}")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        if mining not in MININGS:
            raise ValueError(f"mining must be one of {MININGS}, got {mining!r}")
        if selection not in SELECTIONS or (selection == "device" and form == "quadruplet"):
            raise ValueError(
                f"selection must be one of {SELECTIONS} ('host' or 'fixed' for quadruplets), "
                f"got {selection!r}"
            )
        self.form, self.stage, self.normalize, self.mining = form, stage, normalize, mining
        self.selection = selection
        self.alpha, self.beta, self.gamma = float(alpha), float(beta), float(gamma)
        self.detach_weights = bool(detach_weights)
        self.project = nn.Linear(self.in_channels, embedding_size)

    @property
    def closed_form(self) -> bool:
        return self.stage == "s32"

    def setup(self, backbone: Backbone) -> None:
        """Attention on an earlier map: the backbone stops there and :meth:`embed` runs the
        rest (``backbone.run``), so the map is in the graph of the embedding."""
        super().setup(backbone)
        if self.stage != "s32":
            self.stages = (self.stage,)

    # ---------------------------------------------------------------------- forward

    def _last_map(self, fmap: torch.Tensor) -> torch.Tensor:
        return (
            fmap
            if self.stage == "s32"
            else cast(torch.Tensor, self.backbone.run(fmap, start=self.stage))
        )

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        fmap = maps[-1]
        last = self._last_map(fmap)
        e = self.project(last.mean(dim=(2, 3)))
        out = HeadOutput(embedding=F.normalize(e, dim=-1), extras={"map": fmap})
        if (
            not self.training
        ):  # per-location embeddings W A_ij, for the closed-form explanation maps
            out.local = torch.einsum(
                "bchw,dc->bhwd", last, self.project.weight.to(last.dtype)
            ).flatten(1, 2)
        return out

    # ---------------------------------------------------------------------- Eq. 1

    def features32(self, maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e, f) in float32 from maps of ``stage`` (call with autocast disabled): the head
        (and, for an earlier stage, the rest of the backbone) run again in float32."""
        last = self._last_map(maps)
        e = F.linear(
            last.float().mean(dim=(2, 3)), self.project.weight.float(), self.project.bias.float()
        )
        return e, F.normalize(e, dim=-1)

    def attention(
        self,
        maps: torch.Tensor,
        e: torch.Tensor,
        f: torch.Tensor,
        w: torch.Tensor,
        *,
        closed_form: bool | None = None,
        create_graph: bool = True,
    ) -> torch.Tensor:
        """Eq. 1 for N rows: ``maps`` (float32, of ``stage``), (e, f) = :meth:`features32` of
        them, ``w`` N x D. Closed form on ``s32`` (``closed_form`` None), else autograd
        (``maps`` must then require grad and (e, f) come from them)."""
        if self.closed_form if closed_form is None else closed_form:
            if self.stage != "s32":
                raise HarnessError("SAM's closed form holds on the last map (stage s32) only")
            return closed_form_attention(maps, e, f, w, self.project.weight.float())
        return autograd_attention(maps, f, w, create_graph=create_graph)

    def _fp32(self, device: torch.device):
        return torch.autocast(device_type=device.type, enabled=False)

    def tuple_attention(
        self, maps: torch.Tensor, form: str | None = None, create_graph: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention maps of T tuples' images: ``maps`` (T*k) x C x h x w, rows tuple by tuple
        in role order. Returns (M (T*k) x h x w, w T x D), float32 under any autocast."""
        form = form or self.form
        k = TUPLE_SIZE[form]
        with self._fp32(maps.device), nullcontext() if self.closed_form else torch.enable_grad():
            a = maps.float()
            if not self.closed_form and not a.requires_grad:
                a = a.detach().requires_grad_()
            e, f = self.features32(a)
            w = tuple_weights(f.view(-1, k, f.shape[-1]), form)
            if self.detach_weights:
                w = w.detach()
            m = self.attention(a, e, f, w.repeat_interleave(k, dim=0), create_graph=create_graph)
        return m, w

    # ---------------------------------------------------------------------- Sec. 3.2

    def masks(self, attention: torch.Tensor, size) -> torch.Tensor:
        """N x h x w attention -> N x 1 x H x W soft masks 1 - Sigma(M) at image size."""
        up = F.interpolate(
            attention[:, None], size=tuple(size), mode="bilinear", align_corners=False
        )
        return soft_mask(normalize_attention(up, self.normalize), self.alpha, self.beta)

    @classmethod
    def cross_process_refusal(cls, options: dict[str, Any]) -> str:
        return (
            "its similarity mining runs a second pass of the model on masked images and "
            "differentiates the similarity with autograd.grad, which DistributedDataParallel "
            "does not support; train it in one process"
        )

    def step_host_reads(self) -> str:
        if self.selection == "fixed":
            return ""
        if self.selection == "device":
            return (
                "similarity mining selects its disjoint tuples on the device (select_tuples, "
                "selection='device'); the number kept, which sizes the masked pass, is read "
                "once per step, and the random order is drawn on the host"
            )
        return (
            "similarity mining selects disjoint tuples greedily on the host (select_tuples): the "
            "mined candidates, and for quadruplets the labels and the distances they need, come "
            "over in one transfer per step; the random order is drawn on the host"
        )

    def loss_terms(self, output: HeadOutput, batch: TrainingBatch) -> dict[str, torch.Tensor]:
        """Eq. 3: the metric loss on the mined tuples, and gamma L_sm on soft-masked images of
        (a selection of) the same tuples, through a second pass of ``batch.model``."""
        f, labels = output.embedding, batch.labels
        indices = batch.metric_loss.mine(f, labels)
        terms = {"metric": batch.metric_loss(f, labels, indices=indices)}
        if batch.images is None or batch.model is None:
            raise HarnessError(
                "SAM's similarity mining needs the batch's images and model (a second pass)"
            )
        fmap = output.extras.get("map")
        if fmap is None:
            raise HarnessError(
                "SAM's loss needs the feature map its embed keeps (output.extras['map'])"
            )
        kept = None
        if self.selection == "fixed":  # batch // k slots, a mask of those kept
            tuples, kept = select_fixed_tuples(indices, labels, self.form, f, self.mining)
        else:
            tuples = select_tuples(indices, labels, self.form, f, self.mining, self.selection)
        if len(tuples) == 0:
            terms["similarity_mining"] = f.sum() * 0
            return terms
        rows = tuples.flatten()
        attention, _ = self.tuple_attention(fmap[rows])
        masks = self.masks(attention, batch.images.shape[-2:])
        masked = batch.images[rows] * masks.to(batch.images.dtype)
        f_star = batch.model(masked).embedding.float()
        f_star = f_star.view(len(tuples), -1, f_star.shape[-1])
        terms["similarity_mining"] = self.gamma * similarity_mining_loss(f_star, self.form, kept)
        return terms

    # ---------------------------------------------------------------------- explanation

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """One map per image (K = 1): its similarity attention with its nearest neighbour in
        the batch under w = 1 - |f - f_nn| (itself, w = 1, when alone), upsampled to the
        image and min-max normalised. Works under ``no_grad`` / ``inference_mode``."""
        fmap = output.extras.get("map")
        if fmap is None:
            return None
        grad = nullcontext() if self.closed_form else torch.enable_grad()
        with torch.inference_mode(False), self._fp32(fmap.device), grad:
            a = fmap.detach().clone().float()
            if not self.closed_form:
                a.requires_grad_()
            e, f = self.features32(a)
            if len(f) > 1:
                sims = f.detach() @ f.detach().T
                sims.fill_diagonal_(-float("inf"))
                partner = sims.argmax(dim=1)
            else:
                partner = torch.arange(len(f), device=f.device)
            w = pair_weights(f, f[partner], True).detach()
            m = self.attention(a, e, f, w, create_graph=False)
        return upsample_maps(m.detach()[:, None], images.shape[-2:])

    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eq. 1 for P pairs at once, on the feature map of ``stage``: each image's similarity
        attention under the Siamese weight of Sec. 3.1.1, w = 1 - |f_q - f_g| for a same-class
        pair (what makes it similar), |f_q - f_g| for a pair of two classes (what tells it
        apart). P x h x w each."""
        query_map, gallery_map = query.extras.get("map"), gallery.extras.get("map")
        if query_map is None or gallery_map is None:
            return None
        grad = nullcontext() if self.closed_form else torch.enable_grad()
        with torch.inference_mode(False), self._fp32(query_map.device), grad:
            a_q, a_g = (
                m.detach().clone().float().requires_grad_(not self.closed_form)
                for m in (query_map, gallery_map)
            )
            (e_q, f_q), (e_g, f_g) = self.features32(a_q), self.features32(a_g)
            w = pair_weights(f_q.detach(), f_g.detach(), torch.as_tensor(same, device=f_q.device))
            return (
                self.attention(a_q, e_q, f_q, w, create_graph=False).detach(),
                self.attention(a_g, e_g, f_g, w, create_graph=False).detach(),
            )

    def _bias(self) -> torch.Tensor:
        return self.project.bias.detach().float().cpu()

    def local_pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, *, same: bool = True, image_size=(1, 1)
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One (query, gallery) pair's similarity attention in closed form from ``local``
        (what the run's figure draws; :func:`~harness.methods.sam_figures.local_pair_maps`).
        For an earlier ``stage`` the maps are of ``s32`` (the closed form needs the last
        map)."""
        return local_pair_maps(query, gallery, self._bias(), same=same, image_size=image_size)

    def triplet_maps(
        self, anchor: HeadOutput, positive: HeadOutput, negative: HeadOutput, image_size=(1, 1)
    ) -> list[torch.Tensor] | None:
        """Fig. 4's maps as data (:func:`~harness.methods.sam_figures.triplet_maps`)."""
        return triplet_maps(anchor, positive, negative, self._bias(), image_size)

    def figures(
        self, kind: str, images: list[torch.Tensor], outputs: list[HeadOutput]
    ) -> FigureSet | None:
        """Fig. 4's layout: each image with its similarity attention
        (:func:`~harness.methods.sam_figures.tuple_figures`)."""
        return tuple_figures(kind, images, outputs, self._bias(), stage=self.stage)

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        """The paper-silent choices: stage, alpha, beta, gamma, M's normalisation, w held
        constant or not, which mined tuples are masked."""
        return {
            "stage": trial.suggest_categorical("stage", ["s16", "s32"]),
            "alpha": trial.suggest_float("alpha", 2.0, 50.0, log=True),
            "beta": trial.suggest_float("beta", 0.2, 0.8),
            "gamma": trial.suggest_float("gamma", 0.01, 1.0, log=True),
            "normalize": trial.suggest_categorical("normalize", list(NORMALIZATIONS)),
            "detach_weights": trial.suggest_categorical("detach_weights", [False, True]),
            "mining": trial.suggest_categorical("mining", list(MININGS)),
        }


register_variant(
    "sam_siamese",
    SAMHead,
    ablation=True,
    form="siamese",
    label="SAM (Siamese)",
    description="SAM Table 1: Siamese form (positive pairs masked; L_sm = -||f*1 - f*2||)",
)
register_variant(
    "sam_quadruplet",
    SAMHead,
    ablation=True,
    form="quadruplet",
    label="SAM (quadruplet)",
    description="SAM Table 1: quadruplet form (L_sm = Eq. 2 on (a, p, n1) + on (a, p, n2))",
)
