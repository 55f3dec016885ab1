"""The data a head exchanges with the engine, part of the plugin contract
(:mod:`harness.methods.base` exports it): what a head returns (:class:`HeadOutput`), what
its loss hook receives besides (:class:`TrainingBatch`) and its paper (:class:`PaperInfo`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from harness.components.losses import MetricLoss

__all__ = ["PaperInfo", "HeadOutput", "TrainingBatch"]


@dataclass(frozen=True)
class PaperInfo:
    title: str
    authors: str
    year: int
    venue: str = ""
    arxiv: str = ""
    code_url: str = ""
    #: Tables of the paper this harness transcribes into ``results/published``.
    tables: tuple[str, ...] = ()
    #: How the published numbers were selected (validation split or not), for the
    #: footnote of a table that sets them beside reproduced ones.
    published_selection: str = ""


@dataclass
class HeadOutput:
    """What a head returns. Only ``embedding`` is required.

    * ``embedding``: B x D, L2-normalised, used for retrieval.
    * ``groups``: B x P x d, one normalised embedding per group (A-grouping family).
    * ``local``: B x N x D local embeddings on a grid (DIML).
    * ``levels``: list of B x D_l embeddings per backbone level (AVSL).
    * ``cams``: list of B x D_l x H_l x W_l class activation maps per level (AVSL).
    * ``attention``: B x P x H x W spatial attention over the feature map.
    * ``extras``: anything else a plugin's own hooks need.
    """

    embedding: torch.Tensor
    groups: torch.Tensor | None = None
    local: torch.Tensor | None = None
    levels: list[torch.Tensor] | None = None
    cams: list[torch.Tensor] | None = None
    attention: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def select(self, index: int) -> HeadOutput:
        """Item ``index`` as a batch of one: every tensor field, list of tensors and tensor
        in ``extras`` sliced along its first (batch) axis."""

        def one(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value[index : index + 1]
            if isinstance(value, (list, tuple)):
                return [one(v) for v in value]
            return value

        return HeadOutput(
            **{
                name: one(getattr(self, name))
                for name in self.__dataclass_fields__
                if name != "extras"
            },
            extras={k: one(v) for k, v in self.extras.items()},
        )

    def field(self, name: str) -> torch.Tensor:
        """A stored field by name, as one tensor: an attribute (a list such as ``levels`` is
        stacked along dim 1: B x L x D) or, failing that, an entry of ``extras``."""
        value = getattr(self, name, None) if name in self.__dataclass_fields__ else None
        if value is None:
            if name not in self.extras:
                raise KeyError(f"head output has no field '{name}'")
            value = self.extras[name]
        return torch.stack(list(value), 1) if isinstance(value, (list, tuple)) else value


# DistributedDataParallel finds the tensors a model returns by flattening its output as a
# pytree, to hook the start of the backward pass into them. A dataclass it cannot flatten
# is opaque to it: with parameters that take no part in the loss (the timm classifier the
# heads never call), gradients were then never reduced across processes, and each process
# silently stepped with its own share's gradient.
torch.export.register_dataclass(HeadOutput)


@dataclass
class TrainingBatch:
    """What :meth:`Method.loss_terms` gets besides the head's output.

    * ``labels``: B class ids (0..C-1).
    * ``metric_loss``: the run's :class:`~harness.components.losses.MetricLoss` (loss instances + miner).
    * ``images``: the normalised input batch, and ``model``: the whole embedding model
      (backbone + this head), for methods that run a second pass (SAM's masked images).
    """

    labels: torch.Tensor
    metric_loss: MetricLoss
    images: torch.Tensor | None = None
    model: nn.Module | None = None
