"""What a recipe ledger's entry claims about a run, read from the run as the harness
builds it: the model, the loss, the optimizer and its clipping units, the scheduler, the
training transform and the batch sampler's draws (:mod:`harness.config.ledger`).

A protocol key can hold the authors' value while the run does something else: BatchNorm
put in eval mode whose weights still train, a pooling the key does not name, a learning
rate a head overrides. :func:`observe` reads the value an entry's key stands for from a
:class:`BuiltRun` (:func:`build_run`: the cell's protocol, method and loss on tiny
labels, the backbone without its pretrained weights, which change none of these); an
entry's ``observe`` names a claim its key cannot show (:data:`CLAIMS`). Keys without an
observer here are read from the protocol only (documentation, evaluation settings).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision import transforms as T

from harness.components.data.sampling import ShuffledBatchSampler, batch_sampler
from harness.components.data.transforms import MultiScaleCrop, build_transform
from harness.components.gradients import clip_gradients, clip_units, clips_at
from harness.config.protocol import Protocol
from harness.engine.run.model import (
    EmbeddingModel,
    build_model,
    build_optimizer,
    build_scheduler,
    create_criterion,
)

__all__ = [
    "BuiltRun",
    "build_run",
    "observe",
    "observes",
    "claim_holds",
    "CLAIMS",
    "UNOBSERVED",
]

#: What :func:`observe` returns for a key it has no observer for (or none on this run).
UNOBSERVED = object()

#: Tiny labels for the sampler's draws: 100 classes of 12 images and 20 of 6, so that
#: draws with replacement repeat and a batch of 45 classes leaves classes out.
_LABELS = np.concatenate([np.repeat(np.arange(100), 12), np.repeat(np.arange(100, 120), 6)])
_EPOCHS = 3
#: The methods of the grouping family (A-grouping's head with each grouping module).
GROUPING_METHODS = ("ngrouping", "mgrouping", "ggrouping", "cgrouping", "agrouping")


@dataclass
class BuiltRun:
    """One cell's run as built: its protocol, method and loss, and the built objects."""

    protocol: Protocol
    method: str
    loss: str
    model: EmbeddingModel
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    labels: np.ndarray


def build_run(
    protocol: Protocol, method: str, loss: str, options: dict[str, Any] | None = None
) -> BuiltRun:
    """The model, loss, optimizer and scheduler of a run of ``method`` with ``loss`` under
    ``protocol`` (its method options, or ``options``), as :class:`~harness.engine.run.trainer.Trainer`
    builds them, on :data:`_LABELS`' classes; the backbone is built without its
    pretrained weights (offline, and no observed setting depends on their values)."""
    built = dataclasses.replace(
        protocol,
        backbone=dataclasses.replace(protocol.backbone, pretrained=False, weights=""),
    )
    torch.manual_seed(0)
    options = protocol.methods.get(method, {}) if options is None else options
    model = build_model(built, method, options)
    num_classes = len(np.unique(_LABELS))
    criterion = create_criterion(
        model.head, loss, protocol.loss_args(loss), num_classes=num_classes
    )
    optimizer = build_optimizer(built, model, criterion)
    return BuiltRun(
        protocol,
        method,
        loss,
        model,
        criterion,
        optimizer,
        build_scheduler(built, optimizer),
        _LABELS,
    )


# --------------------------------------------------------------------------- model


def _batchnorms(run: BuiltRun) -> list[nn.Module]:
    return [
        m for m in run.model.backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def _bn_statistics_frozen(run: BuiltRun) -> Any:
    """True when every backbone BatchNorm stays in eval mode after ``train()``, False when
    every one trains its statistics."""
    run.model.train()
    modes = {m.training for m in _batchnorms(run)}
    return UNOBSERVED if len(modes) != 1 else not modes.pop()


def _bn_affine_frozen(run: BuiltRun) -> Any:
    """True when no backbone BatchNorm weight or bias requires a gradient or sits in an
    optimizer group, False when every one does both."""
    params = [p for m in _batchnorms(run) for p in (m.weight, m.bias) if p is not None]
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    trained = {p.requires_grad and id(p) in held for p in params}
    return UNOBSERVED if len(trained) != 1 else not trained.pop()


def _forward(run: BuiltRun):
    run.model.eval()
    with torch.no_grad():
        return run.model(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)))


def _embedding_size(run: BuiltRun) -> Any:
    """The width of the unit-norm embedding the model returns."""
    out = _forward(run)
    norms = out.embedding.norm(dim=-1)
    return int(out.embedding.shape[-1]) if torch.allclose(norms, torch.ones_like(norms)) else -1


def _unit_groups(run: BuiltRun) -> bool:
    """Each group of a grouping head's output has unit norm, and the embedding is their
    concatenation (divided by sqrt(P), a unit vector)."""
    groups = _forward(run).groups
    if groups is None:
        return False
    norms = groups.norm(dim=-1)
    joined = groups.flatten(1) / groups.shape[1] ** 0.5
    return bool(
        torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
        and torch.allclose(joined, _forward(run).embedding, atol=1e-5)
    )


def _groups_normalised(run: BuiltRun, method: str) -> Any:
    """Whether each group a grouping head hands the losses has unit norm (the run's own
    method only)."""
    if run.method != method:
        return UNOBSERVED
    groups = _forward(run).groups
    if groups is None:
        return UNOBSERVED
    norms = groups.norm(dim=-1)
    return bool(torch.allclose(norms, torch.ones_like(norms), atol=1e-5))


def _selection_after(run: BuiltRun) -> Any:
    """The last epoch before the selection's window opens, as the trainer decides
    (``SelectionSpec.due``) over the protocol's epochs."""
    selection, epochs = run.protocol.selection, run.protocol.schedule.epochs
    due = [e for e in range(1, epochs + 1) if selection.due(e, epochs)]
    return due[0] - 1 if due else UNOBSERVED


def _plain_pool(run: BuiltRun) -> Any:
    """Which pooling reproduces the plain head's embedding: ``avg``, ``max``, ``avg+max``."""
    head: Any = run.model.head
    fmap = torch.randn(2, head.in_channels, 3, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = head.embed([fmap]).embedding
        pools = {
            "avg": fmap.mean(dim=(2, 3)),
            "max": fmap.amax(dim=(2, 3)),
            "avg+max": fmap.mean(dim=(2, 3)) + fmap.amax(dim=(2, 3)),
        }
        for name, pooled in pools.items():
            if torch.allclose(F.normalize(head.project(pooled), dim=-1), got, atol=1e-5):
                return name
    return UNOBSERVED


def _plain_init(run: BuiltRun) -> Any:
    """``kaiming_normal_fan_out`` for a zero bias and weights of std sqrt(2 / out) (within
    10%), ``default`` for PyTorch's uniform weights within 1 / sqrt(in)."""
    layer: Any = run.model.head.project
    weight, bias = layer.weight.detach(), layer.bias.detach()
    fan_out_std = (2.0 / weight.shape[0]) ** 0.5
    if not bias.any() and abs(float(weight.std()) / fan_out_std - 1) < 0.1:
        return "kaiming_normal_fan_out"
    if float(weight.abs().max()) <= weight.shape[1] ** -0.5:
        return "default"
    return UNOBSERVED


# ----------------------------------------------------------------------- optimizer


def _group(run: BuiltRun, name: str, field: str) -> Any:
    """``field`` of the optimizer groups named ``name`` (all equal), else unobserved."""
    values = {g[field] for g in run.optimizer.param_groups if g.get("name") == name}
    return values.pop() if len(values) == 1 else UNOBSERVED


def _clip_norm(run: BuiltRun) -> Any:
    """The largest gradient norm of a clipping unit after clipping gradients of norm 1e3
    per parameter: the protocol's clip_grad_norm when it clips, 0.0 when nothing is."""
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.full_like(p, 1e3 / p.numel() ** 0.5)
    before = _unit_norms(run.optimizer)
    clip_gradients(run.optimizer, run.protocol.optimizer.clip_grad_norm)
    after = _unit_norms(run.optimizer)
    for p in params:
        p.grad = None
    if all(torch.isclose(a, b) for a, b in zip(after, before, strict=True)):
        return 0.0
    return round(float(max(after)), 2)


def _clip_steps(run: BuiltRun) -> Any:
    """Which of a run's steps clip, as the training step decides (``clips_at``): ``first``
    when only the first step of the first epoch clips, ``every`` when each step clips;
    unobserved when the run does not clip."""
    norm = run.protocol.optimizer.clip_grad_norm
    if norm <= 0:
        return UNOBSERVED
    clipped = []
    for epoch, step in ((0, 0), (0, 1), (1, 0)):
        params = [p for g in run.optimizer.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.full_like(p, 1e3 / p.numel() ** 0.5)
        before = _unit_norms(run.optimizer)
        clip_steps = run.protocol.optimizer.clip_steps
        clip_gradients(run.optimizer, norm if clips_at(clip_steps, epoch, step) else 0.0)
        after = _unit_norms(run.optimizer)
        clipped.append(any(not torch.isclose(a, b) for a, b in zip(after, before, strict=True)))
        for p in params:
            p.grad = None
    readings: dict[tuple[bool, ...], str] = {
        (True, False, False): "first",
        (True, True, True): "every",
    }
    return readings.get(tuple(clipped), UNOBSERVED)


def _unit_norms(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradient norm of each clipping unit."""
    return [
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in unit]))
        for unit in clip_units(optimizer)
    ]


def _avsl_clip_units(run: BuiltRun) -> Any:
    """``code`` when AVSL's collector (alpha, beta and any proxies) is one clipping unit
    and each loss copy's other parameters are one of their own; ``group`` when every
    optimizer group is a unit."""
    units = [{id(p) for p in u} for u in clip_units(run.optimizer)]
    head: Any = run.model.head
    collector = {id(p) for p in (*head.alphas.parameters(), *head.betas.parameters())}
    proxies = {id(p) for n, p in run.criterion.named_parameters() if n.endswith("proxies")}
    copies = list(run.criterion) if isinstance(run.criterion, nn.ModuleList) else [run.criterion]
    rest = [{id(p) for p in c.parameters()} - proxies for c in copies]
    whole = collector | (proxies if head.proxies_in_collector else set())
    if whole in units and all(r in units for r in rest if r):
        return "code"
    if len(units) == len(run.optimizer.param_groups):
        return "group"
    return UNOBSERVED


# ------------------------------------------------------------------------ sampler


def _draws(run: BuiltRun) -> tuple[str, list[np.ndarray]]:
    """The sampler's kind (``classes`` or ``shuffle``) and the images of every batch of
    three epochs of it."""
    s = run.protocol.sampling
    sampler = batch_sampler(
        s,
        run.labels,
        classes_per_batch=s.classes_per_batch,
        samples_per_class=s.samples_per_class,
        seed=0,
        loss=run.loss,
    )
    batches = []
    for epoch in range(_EPOCHS):
        sampler.set_epoch(epoch)
        batches += [np.asarray(b) for b in sampler]
    return ("shuffle" if isinstance(sampler, ShuffledBatchSampler) else "classes"), batches


def _sampling(run: BuiltRun, field: str) -> Any:
    """What the sampler's draws show of ``sampling.<field>``: the images of a class in a
    batch (a class drawn twice fills two slots), the classes per batch, the batches per
    epoch (0: as many as the images fill), whether a class or an image is drawn twice."""
    kind, batches = _draws(run)
    if field == "sampler":
        return kind
    if field == "loss_samplers":
        return {} if kind == run.protocol.sampling.sampler else {run.loss: kind}
    if field == "images_with_replacement":
        return any(len(np.unique(b)) < len(b) for b in batches)
    per_epoch = len(batches) // _EPOCHS
    if field == "batches_per_epoch":
        return 0 if per_epoch == len(run.labels) // run.protocol.sampling.batch_size else per_epoch
    if kind == "shuffle":  # a batch of classes_per_batch x samples_per_class images
        per = run.protocol.sampling.samples_per_class
        return len(batches[0]) // per if field == "classes_per_batch" else UNOBSERVED
    counts = [np.unique(run.labels[b], return_counts=True)[1] for b in batches]
    per_class = int(min(c.min() for c in counts))
    slots = len(batches[0]) // per_class
    observed = {
        "samples_per_class": per_class,
        "classes_per_batch": slots,
        "classes_with_replacement": any(len(c) < slots for c in counts),
    }
    return observed.get(field, UNOBSERVED)


# ---------------------------------------------------------- schedule, loss, transform


def _schedule(run: BuiltRun, field: str) -> Any:
    scheduler = run.scheduler
    if field == "milestones" and isinstance(scheduler, torch.optim.lr_scheduler.MultiStepLR):
        return sorted(scheduler.milestones)
    if field == "gamma" and isinstance(scheduler, torch.optim.lr_scheduler.MultiStepLR):
        return float(scheduler.gamma)
    return UNOBSERVED


def _loss_arg(run: BuiltRun, loss: str, arg: str) -> Any:
    """``arg`` of the built loss (its first copy), for the run's own loss: a margin beta
    is read at its initial value."""
    if loss != run.loss:
        return UNOBSERVED
    module = run.criterion[0] if isinstance(run.criterion, nn.ModuleList) else run.criterion
    value = getattr(module, arg, UNOBSERVED)
    if isinstance(value, torch.Tensor):
        values = {round(float(v), 6) for v in value.detach().flatten()}
        return values.pop() if len(values) == 1 else UNOBSERVED
    return value if isinstance(value, bool | int | float | str) else UNOBSERVED


def _transform(run: BuiltRun, field: str) -> Any:
    """The training transform's crop size, area and ratio ranges, and resize before it
    (or the multi-resolution crop's size and scale range)."""
    ops = build_transform(run.protocol.image, train=True).transforms
    multiscale = [op for op in ops if isinstance(op, MultiScaleCrop)]
    if multiscale and field in ("size", "multiscale_range"):
        crop = multiscale[0]
        return crop.size if field == "size" else [crop.low, crop.high]
    crops = [op for op in ops if isinstance(op, T.RandomResizedCrop)]
    if not crops:
        return UNOBSERVED
    resized = [op.size for op in ops[: ops.index(crops[0])] if isinstance(op, T.Resize)]
    observed = {
        "size": crops[0].size[0],
        "crop_scale": [float(v) for v in crops[0].scale],
        "crop_ratio": [float(v) for v in crops[0].ratio],
        "train_resize": resized[0] if resized else 0,
    }
    return observed.get(field, UNOBSERVED)


# --------------------------------------------------------------------------- entry


_OBSERVERS: dict[str, Callable[[BuiltRun], Any]] = {
    "backbone.name": lambda run: run.model.backbone.name,
    "backbone.freeze_bn": _bn_statistics_frozen,
    "backbone.freeze_bn_affine": _bn_affine_frozen,
    "embedding.size": _embedding_size,
    "optimizer.name": lambda run: type(run.optimizer).__name__.lower(),
    "optimizer.lr_backbone": lambda run: _group(run, "backbone", "lr"),
    "optimizer.weight_decay": lambda run: _group(run, "backbone", "weight_decay"),
    "optimizer.lr_head": lambda run: _group(run, "head", "lr"),
    "optimizer.lr_loss": lambda run: _group(run, "loss", "lr"),
    "optimizer.loss_weight_decay": lambda run: _group(run, "loss", "weight_decay"),
    "optimizer.clip_grad_norm": _clip_norm,
    "optimizer.clip_steps": _clip_steps,
    "selection.after_epoch": _selection_after,
    **{
        f"methods.{m}.normalize_groups": functools.partial(_groups_normalised, method=m)
        for m in GROUPING_METHODS
    },
    "methods.plain.pool": _plain_pool,
    "methods.plain.init": _plain_init,
    "methods.avsl.clip_units": _avsl_clip_units,
    "methods.avsl.collector_lr": lambda run: _group(run, "inference", "lr"),
    "methods.avsl.proxies_in_collector": lambda run: _group(run, "proxies", "name") == "proxies",
}

#: Claims an entry's key cannot show, by the name its ``observe`` gives them.
CLAIMS: dict[str, Callable[[BuiltRun], bool]] = {"unit_groups": _unit_groups}


def observes(key: str) -> bool:
    """Whether :func:`observe` has an observer for ``key`` (it may still find nothing to
    observe on a given run, e.g. a loss group where the loss has no parameters)."""
    parts = key.split(".")
    return (
        key in _OBSERVERS
        or (parts[0] == "sampling" and len(parts) == 2)
        or parts[:2] == ["sampling", "loss_samplers"]
        or key in ("schedule.milestones", "schedule.gamma")
        or (parts[:2] == ["loss", "args"] and len(parts) == 4)
        or key
        in (
            "image.size",
            "image.crop_scale",
            "image.crop_ratio",
            "image.train_resize",
            "image.multiscale_range",
        )
    )


def observe(run: BuiltRun, key: str) -> Any:
    """The value ``key`` stands for, read from the built run (JSON-like: lists), or
    :data:`UNOBSERVED`."""
    parts = key.split(".")
    if key in _OBSERVERS:
        return _OBSERVERS[key](run)
    if parts[0] == "sampling" and len(parts) == 2:
        return _sampling(run, parts[1])
    if parts[:2] == ["sampling", "loss_samplers"] and len(parts) == 3:
        return _sampling(run, "sampler") if parts[2] == run.loss else UNOBSERVED
    if parts[0] == "schedule" and len(parts) == 2:
        return _schedule(run, parts[1])
    if parts[:2] == ["loss", "args"] and len(parts) == 4:
        return _loss_arg(run, parts[2], parts[3])
    if parts[0] == "image" and len(parts) == 2:
        return _transform(run, parts[1])
    return UNOBSERVED


def claim_holds(run: BuiltRun, claim: str) -> bool:
    """Whether the claim ``claim`` (:data:`CLAIMS`) holds on the built run."""
    return CLAIMS[claim](run)
