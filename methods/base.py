"""The plugin interface every paper's method implements.

A method is a head over backbone feature maps (:class:`Method`). Its public
``forward`` checks the inputs and calls the one hook every plugin fills,
:meth:`Method.embed`. The other hooks are optional and default to "not used":

==========================  ==============================================================
hook                        carries
==========================  ==============================================================
``embed``                   maps -> :class:`HeadOutput` (embedding + structured outputs:
                            groups, a grid of local embeddings, levels with CAMs, attention)
``loss_terms``              metric loss (applied per group, per level, ...) + extra terms
``masked_images``           images for a second forward pass (e.g. SAM's soft masks)
``masked_loss_terms``       loss terms on that second pass
``rerank_similarity``       re-scores (query, candidate) pairs at evaluation (DIML, AVSL);
                            ``rerank_by_ids`` feeds it from the stored fields
``explain``                 explanation maps (B x K x H x W) for images
``search_space``            the method's Optuna search space
==========================  ==============================================================

Paper metadata lives on the class as data (:class:`PaperInfo`); paper defaults
are ``defaults``; named variants are registered with preset options.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from harness.errors import HarnessError
from harness.registry import Registry

__all__ = ["HeadOutput", "Method", "MethodEntry", "PaperInfo", "METHODS", "register_method",
           "register_variant", "create_method", "list_methods"]


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


#: The run's metric loss (with the protocol's miner): ``metric_loss(embeddings, labels)``.
#: When a head asks for ``metric_loss_copies = P > 1`` the trainer holds P independent
#: instances (each with its own learnable parameters, e.g. margin betas or proxies), says
#: so in ``metric_loss.copies`` and takes ``metric_loss(embeddings, labels, copy=p)``.
MetricLoss = Callable[..., torch.Tensor]


class Method(nn.Module):
    """Base class of every plugin head. Subclasses implement :meth:`embed`."""

    #: Registry name of the configurable class (variants add their own names).
    name: ClassVar[str] = ""
    paper: ClassVar[PaperInfo | None] = None
    #: Backbone stages the head reads ("s8", "s16", "s32"); the last is the final map.
    stages: ClassVar[tuple[str, ...]] = ("s32",)
    #: Head-output fields the evaluation must keep for :meth:`rerank_similarity`.
    rerank_fields: ClassVar[tuple[str, ...]] = ()
    #: Independent instances of the metric loss the head needs (see :data:`MetricLoss`).
    metric_loss_copies: int = 1
    #: Bump when a change alters what the method computes with the same options. It
    #: enters grid cell keys and checkpoint keys (from 2 on, so that revision-1 keys never
    #: change): finished cells of older code are rerun, not reused, and runs record it.
    revision: ClassVar[int] = 1

    def __init__(self, *, channels: dict[str, int], embedding_size: int):
        super().__init__()
        self.channels = dict(channels)
        self.in_channels = channels["s32"]
        self.embedding_size = embedding_size
        #: Size of the vectors the head passes to the metric loss (proxies are sized by it).
        self.metric_loss_dim = embedding_size

    # ------------------------------------------------------------------ required hook

    def forward(self, maps: list[torch.Tensor]) -> HeadOutput:
        """``maps``: one B x C_s x H_s x W_s tensor per entry of ``stages``."""
        if len(maps) != len(self.stages):
            raise ValueError(f"{type(self).__name__} expects {len(self.stages)} feature maps, got {len(maps)}")
        out = self.embed(maps)
        batch = maps[-1].shape[0]
        if out.embedding.shape != (batch, self.embedding_size):
            raise ValueError(
                f"{type(self).__name__}.embed returned {tuple(out.embedding.shape)}, "
                f"expected ({batch}, {self.embedding_size})"
            )
        return out

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        raise NotImplementedError

    # ------------------------------------------------------------------ optional hooks

    def loss_terms(self, output: HeadOutput, labels: torch.Tensor,
                   metric_loss: MetricLoss) -> dict[str, torch.Tensor]:
        """Named loss terms, summed by the trainer. Default: the metric loss on the embedding."""
        return {"metric": metric_loss(output.embedding, labels)}

    def masked_images(self, model: nn.Module, images: torch.Tensor, output: HeadOutput,
                      labels: torch.Tensor) -> torch.Tensor | None:
        """Images for a second forward pass (SAM), or None for no second pass."""
        return None

    def masked_loss_terms(self, masked_output: HeadOutput, output: HeadOutput, labels: torch.Tensor,
                          metric_loss: MetricLoss) -> dict[str, torch.Tensor]:
        return {}

    def rerank_similarity(self, query: dict[str, torch.Tensor],
                          candidates: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Scores for Q x K candidate pairs from the ``rerank_fields`` (query: Q x ...,
        candidates: Q x K x ...), or None when the method does not re-rank."""
        return None

    def rerank_by_ids(self, query_fields: dict[str, torch.Tensor], gallery_fields: dict[str, torch.Tensor],
                      query_ids, candidate_ids) -> torch.Tensor:
        """:meth:`rerank_similarity` from stored fields (every query's and gallery item's
        ``rerank_fields``) and ids (Q,) / (Q x K). The default gathers the candidates and
        calls :meth:`rerank_similarity`; a method may gather lazily to save memory."""
        q_ids = torch.as_tensor(query_ids, dtype=torch.long)
        c_ids = torch.as_tensor(candidate_ids, dtype=torch.long)
        return self.rerank_similarity({k: v[q_ids] for k, v in query_fields.items()},
                                      {k: v[c_ids] for k, v in gallery_fields.items()})

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """Explanation maps B x K x H x W in [0, 1] at image resolution, or None."""
        return None

    def pair_figure(self, query_image: torch.Tensor, gallery_image: torch.Tensor, query: HeadOutput,
                    gallery: HeadOutput, path) -> object | None:
        """Write a figure explaining one (query, gallery) similarity, or None (no such figure).
        Images: 3 x H x W in [0, 1]; outputs: this head's outputs for a batch of one each."""
        return None

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Parameter groups of the head (override for per-part learning rates)."""
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": lr,
                 "weight_decay": weight_decay, "name": "head"}]

    @classmethod
    def search_space(cls, trial) -> dict[str, Any]:
        """Optuna search space over the method's options: ``{option: trial.suggest_*(...)}``."""
        return {}


# ------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class MethodEntry:
    name: str
    cls: type[Method]
    #: Options preset by this named variant (paper settings, ablations).
    preset: dict[str, Any]
    description: str = ""
    #: Ablation variants (a paper's component study) are left out of ``--methods all``.
    ablation: bool = False

    def options(self) -> dict[str, Any]:
        """All options with their defaults: the class signature, then the preset."""
        sig = inspect.signature(self.cls.__init__)
        defaults = {k: p.default for k, p in sig.parameters.items()
                    if p.kind is p.KEYWORD_ONLY and p.default is not p.empty
                    and k not in ("channels", "embedding_size")}
        return {**defaults, **self.preset}

    def key_fields(self) -> dict[str, int]:
        """What a cell or checkpoint key adds for this method: its revision from 2 on."""
        return {"method_revision": self.cls.revision} if self.cls.revision > 1 else {}


METHODS: Registry[MethodEntry] = Registry("method")


def register_method(name: str, *, description: str = "", **preset):
    """Class decorator: register the configurable class under ``name``."""
    def add(cls: type[Method]) -> type[Method]:
        METHODS.register(name)(MethodEntry(name, cls, preset, description or (cls.__doc__ or "").split("\n")[0]))
        return cls

    return add


def register_variant(name: str, cls: type[Method], *, description: str = "", ablation: bool = False,
                     **preset) -> None:
    """A thin named variant: the same class with preset options (like timm's variants).
    ``ablation=True`` marks a component-study variant, left out of ``--methods all``."""
    METHODS.register(name)(MethodEntry(name, cls, preset, description, ablation))


def list_methods(pattern: str = "*", *, ablations: bool = True) -> list[str]:
    """Registered names matching ``pattern``; ``ablations=False`` drops ablation variants."""
    return [n for n in METHODS.list(pattern) if ablations or not METHODS.get(n).ablation]


def create_method(name: str, *, channels: dict[str, int], embedding_size: int,
                  **options) -> Method:
    """Build a registered method; unknown options are errors naming the option.

    Options that are None are dropped, so unset command-line flags never override
    a variant's preset (timm's ``create_model`` convention).
    """
    entry = METHODS.get(name)
    valid = entry.options()
    options = {k: v for k, v in options.items() if v is not None}
    for key in options:
        if key not in valid:
            raise HarnessError(f"unknown option '{key}' for method '{name}'; valid: {', '.join(sorted(valid)) or 'none'}")
    model = entry.cls(channels=channels, embedding_size=embedding_size, **{**entry.preset, **options})
    model.registry_name = name
    return model
