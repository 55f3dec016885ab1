"""AVSL's losses around the run's metric loss (Zhang et al., CVPR 2022, Eq. 10), with the
released code's (zbr17/AVSL) arithmetic where :class:`harness.methods.avsl.AVSLHead`'s
options select it: the distance the final loss sees, the batch's proxies, the final
loss's negative margin, and the proxies trained as the code's collector."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance
from torch import nn

from harness.base.errors import HarnessError
from harness.components.losses import MetricLoss, distance_replaced, hard_triplets

__all__ = [
    "DISTANCES",
    "LEVEL_MINERS",
    "FINAL_LOSSES",
    "SUPPORTED_LOSSES",
    "level_distance",
    "loss_labels",
    "mines_hard",
    "hard_level_tuples",
    "final_loss_matrix",
    "batch_class_proxies",
    "neg_margin",
    "proxy_references",
    "param_group",
    "collector_proxy_groups",
    "CLIP_UNITS",
    "loss_copy_groups",
    "inference_group",
]

#: The distance each level's loss and the final loss run on, for Euclidean-distance losses.
DISTANCES = ("euclidean", "squared")
#: Which tuples each level's loss and the final loss train on: the protocol's miner, or
#: GeDML's HardSelector per level and on d^ (:func:`~harness.components.losses.hard_triplets`).
LEVEL_MINERS = ("protocol", "hard")
#: Whether the final loss L^f is the top level's loss copy (sharing, e.g., its margin beta)
#: or a copy of its own, as the code's fourth loss (``lossfinal`` / ``loss``).
FINAL_LOSSES = ("shared", "separate")
#: What ``optimizer.clip_grad_norm`` clips as one unit: each optimizer group (``"group"``:
#: alpha and beta apart from the proxies, every loss copy's parameters together), or the
#: code's parts (``"code"``: the collector, alpha, beta and the proxies, as one unit and each
#: loss copy on its own; GeDML's gradclipper per collector and per loss, zbr17/AVSL
#: examples/config/links/link_avsl_margin.yaml lines 44-51, link_avsl_proxyanchor.yaml
#: lines 36-39).
CLIP_UNITS = ("group", "code")
#: Loss names the head trains with (the final loss needs a pair distance or `proxies`).
SUPPORTED_LOSSES = (
    "margin",
    "multi_similarity",
    "contrastive",
    "triplet",
    "binomial_deviance",
    "circle",
    "lifted_structure",
    "ntxent",
    "proxy_anchor",
    "proxy_nca",
)


def _is_euclidean(distance) -> bool:
    return isinstance(distance, LpDistance) and distance.p == 2 and not distance.is_inverted


def level_distance(loss: nn.Module, *, squared: bool):
    """A context in which a level's loss runs on its own distance, or, when ``squared`` (the
    head's ``distance="squared"``) and the loss is Euclidean, on the squared Euclidean
    distance of the unit embeddings, sum_i delta_i^l: the code's ``metric_mat``
    (avsl_collector.py lines 227-234), which its margin loss reads as it is."""
    if squared and _is_euclidean(getattr(loss, "distance", None)):
        return distance_replaced(loss, LpDistance(p=2, power=2, normalize_embeddings=True))
    return nullcontext(loss)


def loss_labels(loss: nn.Module, labels: torch.Tensor, *, batch_proxies: bool):
    """A context yielding the labels the loss sees: with ``batch_proxies`` and a proxy loss,
    only the batch's classes' proxies in ``loss`` (:func:`batch_class_proxies`); a loss
    without proxies is unchanged (the code's rule concerns ``use_proxy`` only)."""
    if batch_proxies and isinstance(getattr(loss, "proxies", None), nn.Parameter):
        return batch_class_proxies(loss, labels)
    return nullcontext(labels)


def mines_hard(loss: nn.Module, level_miner: str) -> bool:
    """``level_miner="hard"`` mines the tuples of a loss without proxies; a proxy loss
    keeps the protocol's miner (none for ProxyAnchor: the code's DefaultSelector,
    link_avsl_proxyanchor.yaml lines 7-11)."""
    return level_miner == "hard" and getattr(loss, "proxies", None) is None


def hard_level_tuples(
    metric: MetricLoss, dist: torch.Tensor, labels: torch.Tensor, loss: Any, cutoff: float
) -> Any:
    """:func:`~harness.components.losses.hard_triplets` (GeDML's HardSelector at
    ``cutoff``) on ``dist`` under the step's mining seed (``level_miner="hard"``)."""
    if getattr(loss, "distance", None) is None or loss.distance.is_inverted:
        raise HarnessError(
            "AVSL's level_miner='hard' mines on a distance: it needs a Euclidean-distance "
            "loss (margin)"
        )
    return metric.seeded(lambda d, y: hard_triplets(d, y, cutoff=cutoff), dist, labels)


def final_loss_matrix(d: torch.Tensor, distance: Any, *, squared: bool) -> torch.Tensor:
    """d^ (a squared Euclidean distance of unit vectors, Eq. 9) converted to the final loss's
    own ``distance``: the similarity 1 - d^/2 for a cosine loss; for a Euclidean one d^
    itself when the loss's power is 2 or ``squared`` (the head's ``distance="squared"``,
    the code's matrix), else sqrt(d^) to the loss's power."""
    if distance.is_inverted:
        if not isinstance(distance, CosineSimilarity):
            raise HarnessError(
                f"AVSL's final loss needs a cosine or Euclidean loss distance, "
                f"got {type(distance).__name__}"
            )
        return 1 - d / 2
    if not isinstance(distance, LpDistance) or distance.p != 2:
        raise HarnessError(
            f"AVSL's final loss needs a cosine or Euclidean loss distance, "
            f"got {type(distance).__name__}"
        )
    if distance.power == 2 or squared:
        return d
    return d.clamp_min(1e-12).sqrt() ** distance.power


def proxy_references(
    proxies: list[torch.Tensor], cert: torch.Tensor, labels: torch.Tensor, *, batch_proxies: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the code's final loss compares each image with when every level's loss has
    proxies: the proxies (C x L x r, unit vectors per level; with ``batch_proxies`` only the
    batch's classes', as the level losses see them) and their CAM stds, the batch mean of
    each level's (``cert`` B x L x r)."""
    if batch_proxies:
        classes = torch.unique(labels)
        proxies = [p[classes] for p in proxies]
    ref = torch.stack([F.normalize(p.float(), dim=-1) for p in proxies], 1)
    ref_cert = cert.mean(dim=(0, 2))[None, :, None].expand(ref.shape[0], -1, ref.shape[2])
    return ref, ref_cert


@contextmanager
def batch_class_proxies(loss: Any, labels: torch.Tensor):
    """``loss`` with only the proxies of the batch's classes inside the block (yields the
    labels renumbered 0..k-1 in the order of those classes): the code's collector on more
    than 1,000 classes (zbr17/AVSL src/avsl/collectors/avsl_collector.py lines 153-163),
    whose ProxyAnchor then averages the negative terms over those k proxies (src/avsl/losses/
    proxy_anchor_loss.py line 87). Only those rows of the proxies get a gradient."""
    proxies = getattr(loss, "proxies", None)
    if not isinstance(proxies, nn.Parameter):
        raise HarnessError(
            f"AVSL's batch_proxies needs a proxy loss (proxy_anchor), got {type(loss).__name__}"
        )
    classes, local = torch.unique(labels, return_inverse=True)
    num_classes = loss.num_classes
    del loss._parameters["proxies"]
    try:
        loss.__dict__["proxies"] = proxies[classes]
        loss.num_classes = len(classes)
        yield local
    finally:
        del loss.__dict__["proxies"]
        loss._parameters["proxies"] = proxies
        loss.num_classes = num_classes


@contextmanager
def neg_margin(loss: Any, margin: float | None):
    """``loss`` with its ``neg_margin`` set to ``margin`` inside the block (None: unchanged)."""
    if margin is None:
        yield loss
        return
    if not hasattr(loss, "neg_margin"):
        raise HarnessError(
            f"AVSL's final_neg_margin needs a loss with a negative margin (proxy_anchor), "
            f"got {type(loss).__name__}"
        )
    old, loss.neg_margin = loss.neg_margin, margin
    try:
        yield loss
    finally:
        loss.neg_margin = old


def collector_proxy_groups(
    loss_fn: nn.Module, optimizer, rate: float, in_collector: bool = True, head: Any = None
) -> list[dict[str, Any]]:
    """The metric loss's parameter groups. ``in_collector``: its proxies train as the code's
    collector trains them (its ``proxy_<i>`` parameters, avsl_collector.py lines 104-110,
    optimised by AdamW_collectors.yaml at ``--lr_collector`` with ``--wd``), at ``rate``
    with the protocol's ``weight_decay``; the loss's other parameters (a margin beta; every
    parameter without ``in_collector``) are the loss group at ``lr_loss`` with
    ``loss_weight_decay``. ``optimizer``: the protocol's
    :class:`~harness.config.protocol.OptimizerSpec`. With the ``head``'s
    ``clip_units="code"`` (:data:`CLIP_UNITS`) the proxies are clipped with the collector
    (``"clip": "collector"``) and the loss group is one group per loss copy
    (:func:`loss_copy_groups`)."""
    clip = getattr(head, "clip_units", "group")
    proxies = [
        p
        for name, p in loss_fn.named_parameters()
        if in_collector and p.requires_grad and name.split(".")[-1] == "proxies"
    ]
    ids = {id(p) for p in proxies}
    if clip == "code":
        groups = loss_copy_groups(loss_fn, optimizer, exclude=ids)
    else:
        rest = [p for p in loss_fn.parameters() if p.requires_grad and id(p) not in ids]
        groups = (
            [param_group(rest, optimizer.lr_loss, optimizer.loss_weight_decay, "loss")]
            if rest
            else []
        )
    if proxies:
        unit = "collector" if clip == "code" else None
        groups.append(param_group(proxies, rate, optimizer.weight_decay, "proxies", unit))
    return groups


def loss_copy_groups(
    loss_fn: nn.Module, optimizer, *, exclude: set[int] | None = None
) -> list[dict[str, Any]]:
    """One ``loss`` group per loss copy (``loss_fn`` a ModuleList of copies, or one loss),
    at ``lr_loss`` with ``loss_weight_decay``, so that each copy is clipped on its own as
    the code's gradclipper clips each of its margin losses (link_avsl_margin.yaml lines
    48-51). Parameters in ``exclude`` (ids) are left out; a copy without any gets none."""
    copies = list(loss_fn) if isinstance(loss_fn, nn.ModuleList) else [loss_fn]
    groups = []
    for copy in copies:
        params = [
            p for p in copy.parameters() if p.requires_grad and id(p) not in (exclude or set())
        ]
        if params:
            groups.append(
                param_group(params, optimizer.lr_loss, optimizer.loss_weight_decay, "loss")
            )
    return groups


def inference_group(params: list, rate: float, weight_decay: float, head: Any) -> dict[str, Any]:
    """The group of the collector's alpha and beta (``inference``) at ``rate``; with the
    head's ``clip_units="code"`` clipped with the proxies (``"clip": "collector"``)."""
    clip = "collector" if head.clip_units == "code" else None
    return param_group(params, rate, weight_decay, "inference", clip)


def param_group(
    params: list, lr: float, weight_decay: float, name: str, clip: str | None = None
) -> dict[str, Any]:
    """One optimizer parameter group, as :meth:`~harness.methods.base.Method.optimizer_groups`
    returns them; ``clip`` names the clipping unit it belongs to
    (:func:`harness.components.gradients.clip_units`), None: clipped on its own."""
    group = {"params": params, "lr": lr, "weight_decay": weight_decay, "name": name}
    return group if clip is None else {**group, "clip": clip}
