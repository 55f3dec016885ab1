"""What a run trains: the model (a backbone and a method's head), its metric loss, and
the optimizer and learning-rate schedule over both."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.base.errors import HarnessError
from harness.components.backbones import Backbone, create_backbone
from harness.components.losses import create_loss
from harness.config.protocol import Protocol
from harness.methods import HeadOutput, Method, create_method
from harness.methods.roles import LossShaper, loss_copies, loss_dim, metric_loss_groups

__all__ = [
    "EmbeddingModel",
    "build_model",
    "on_device",
    "create_criterion",
    "build_optimizer",
    "build_scheduler",
]


class EmbeddingModel(nn.Module):
    """Backbone (images -> feature maps) followed by a method head (maps -> HeadOutput)."""

    backbone: Backbone
    head: Method

    def __init__(self, backbone: Backbone, head: Method):
        super().__init__()
        self.backbone = backbone
        self.head = head

    @classmethod
    def assemble(
        cls,
        backbone: Backbone,
        method: str,
        *,
        embedding_size: int,
        options: dict[str, Any] | None = None,
    ) -> EmbeddingModel:
        """The method's head on ``backbone`` (``setup``), and the backbone told to stop at
        the last point the head reads."""
        head = create_method(
            method,
            channels=dict(backbone.channels),
            embedding_size=embedding_size,
            **(options or {}),
        )
        head.setup(backbone)
        backbone.set_outputs(head.stages)
        return cls(backbone, head)

    def forward(self, images: torch.Tensor) -> HeadOutput:
        return self.head(self.backbone(images))


def build_model(protocol: Protocol, method: str, options: dict[str, Any]) -> EmbeddingModel:
    """The protocol's backbone with the method's head on it (:meth:`EmbeddingModel.assemble`)."""
    b = protocol.backbone
    backbone = create_backbone(
        b.name,
        pretrained=b.pretrained,
        weights=b.weights,
        freeze_bn=b.freeze_bn,
        freeze_bn_affine=b.freeze_bn_affine,
        input_transform=b.input_transform,
        output_stride=b.output_stride,
    )
    return EmbeddingModel.assemble(
        backbone, method, embedding_size=protocol.embedding.size, options=options
    )


def on_device(model: EmbeddingModel, device: torch.device) -> EmbeddingModel:
    """``model`` moved to ``device``, channels-last on every device: cuDNN's tensor-core
    kernels want it, and oneDNN's CPU convolutions (depthwise ones above all) run 10-15%
    faster with it on the smoke protocol."""
    return model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack Module.to(device, memory_format=...), which it accepts


def create_criterion(
    head: Method, loss_name: str, loss_args: dict[str, Any] | None = None, *, num_classes: int
) -> nn.Module:
    """The metric loss a head trains with: one instance per copy it asks for (a
    :class:`~harness.methods.roles.LossShaper`'s ``metric_loss_copies``, e.g. one per group),
    each sized by its ``metric_loss_dim`` (:func:`~harness.methods.roles.loss_copies`,
    :func:`~harness.methods.roles.loss_dim`). One instance keeps its state-dict keys; several
    are a ModuleList."""
    losses = [
        create_loss(loss_name, loss_args, num_classes=num_classes, embedding_size=loss_dim(head))
        for _ in range(loss_copies(head))
    ]
    return losses[0] if len(losses) == 1 else nn.ModuleList(losses)


def build_optimizer(
    protocol: Protocol, model: EmbeddingModel, criterion: nn.Module
) -> torch.optim.Optimizer:
    """The protocol's optimizer over parameter groups named ``backbone`` (with the
    pretrained copies a head keeps), the head's own groups and the loss's groups
    (a :class:`~harness.methods.roles.LossShaper`'s ``loss_optimizer_groups``, else
    :func:`~harness.methods.roles.metric_loss_groups`)."""
    o = protocol.optimizer
    # Pretrained copies of backbone segments that a head keeps (DIABLO's phi) train like
    # the backbone they came from.
    pretrained = [
        p
        for p in (*model.backbone.parameters(), *model.head.pretrained.parameters())
        if p.requires_grad
    ]
    groups = [
        {
            "params": pretrained,
            "lr": o.lr_backbone,
            "weight_decay": o.weight_decay,
            "name": "backbone",
        }
    ]
    groups += model.head.optimizer_groups(o.lr_head, o.weight_decay)
    head = model.head
    if isinstance(head, LossShaper):
        groups += head.loss_optimizer_groups(criterion, o)
    else:
        groups += metric_loss_groups(criterion, o)
    # Fused Adam: one kernel for all parameters instead of a Python loop over ~200 tensors.
    if o.name == "adam":
        return torch.optim.Adam(groups, fused=True)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, fused=True)
    if o.name == "rmsprop":
        return torch.optim.RMSprop(groups, momentum=o.momentum)
    if o.name == "sgd":
        return torch.optim.SGD(groups, momentum=o.momentum)
    raise HarnessError(f"unknown optimizer '{o.name}'; valid: adam, adamw, rmsprop, sgd")


def build_scheduler(
    protocol: Protocol, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    s = protocol.schedule
    if s.name == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if s.name == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, list(s.milestones), gamma=s.gamma)
    if s.name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, s.epochs))
    raise HarnessError(f"unknown schedule '{s.name}'; valid: constant, multistep, cosine")
