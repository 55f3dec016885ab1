"""The plugin interface every paper's method implements: the head, written once.

A method is a head over backbone feature maps (`Method`): it embeds and trains, and that is
all it must do. Its public `forward` checks the inputs and calls the one member every
plugin writes, `Method.embed`. What a paper's head does beyond that (re-ranking,
explanation maps, figures, a search space, needs of its training step) is a role, one
protocol each in :mod:`harness.methods.roles`, which the head declares by subclassing it;
the engine asks for a role (``isinstance(head, Reranker)``) and never calls a head for one
it lacks.

The members of `Method` a plugin writes (B: images, D: embedding size);
``tests/project/test_method_contract.py`` checks that this table names them and nothing else:

| member | what the engine does with it |
|---|---|
| `stages` | the backbone points whose maps `embed` receives, in chain order |
| `setup` | called once with the backbone at build time (other `stages`, pretrained segment copies) |
| `embed` | maps of `stages` (B x C_s x H_s x W_s each) -> `HeadOutput`; `embedding` (B x D) is ranked |
| `loss_terms` | named loss terms of a `TrainingBatch` (batch means; pairs via its `metric_loss`), summed |
| `optimizer_groups` | the head's optimizer parameter groups (per-part learning rates) |

Registration data on the class, read by the registry and the tables: `paper`, `label`,
`revision`. Paper defaults are the constructor's keyword defaults; named variants are
registered with preset options (and may carry their own `label`). What a head returns and
receives (`HeadOutput`, `TrainingBatch`, `PaperInfo`) is defined in
`harness.methods.head_data`, what a figure returns (`FigureSet`, `FigureData`, `Panel`,
`Link`) in `harness.methods.figures`; both are exported here.

A subclass that writes a role's hooks without declaring the role is adapted for this
release (:mod:`harness.methods.adapter`: the role's defaults fill what it lacks) with a
`DeprecationWarning` naming the role to declare.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from harness.base.errors import HarnessError
from harness.base.registry import METHOD_PLUGIN_GROUP, Registry
from harness.methods.adapter import adapt_role_hooks
from harness.methods.figures import FIGURE_TUPLES, FigureData, FigureSet, Link, Panel
from harness.methods.head_data import HeadOutput, PaperInfo, TrainingBatch
from harness.methods.names import method_name_rule
from harness.methods.roles import LossShaper, TrainsAsAnother

if TYPE_CHECKING:
    from harness.components.backbones import Backbone

__all__ = [
    "HeadOutput",
    "Method",
    "MethodEntry",
    "PaperInfo",
    "TrainingBatch",
    "METHODS",
    "PLUGIN_GROUP",
    "Panel",
    "Link",
    "FigureData",
    "FigureSet",
    "FIGURE_TUPLES",
    "register_method",
    "register_variant",
    "create_method",
    "check_method_options",
    "list_methods",
]


class Method(nn.Module):
    """Base class of every plugin head: :meth:`embed` is written by every subclass;
    ``stages``, :meth:`setup`, :meth:`loss_terms` and :meth:`optimizer_groups` have
    defaults. A head's other roles are the protocols of :mod:`harness.methods.roles`."""

    #: Registry name of the configurable class (variants add their own names).
    name: ClassVar[str] = ""
    paper: ClassVar[PaperInfo | None] = None
    #: Row label in tables, formatted with the run's method options by
    #: :meth:`MethodEntry.display_name` (``"+ DIABLO (N = {entries})"``); "" labels a row by
    #: its registry name.
    label: ClassVar[str] = ""
    #: Backbone points whose maps ``embed`` receives, in chain order (``"s8"``, ``"s16"``,
    #: ``"s32"`` on every backbone); :meth:`setup` may declare others per backbone.
    stages: tuple[str, ...] = ("s32",)
    #: Bump when a change alters what the method computes with the same options. It
    #: enters grid cell keys and checkpoint keys (from 2 on, so that revision-1 keys never
    #: change): finished cells of older code are rerun, not reused, and runs record it.
    revision: ClassVar[int] = 1
    #: The name the head was built under (:func:`create_method`; "" when built directly).
    registry_name: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        adapt_role_hooks(cls)

    def __init__(self, *, channels: dict[str, int], embedding_size: int):
        super().__init__()
        self.channels = dict(channels)
        self.in_channels = channels["s32"]
        self.embedding_size = embedding_size
        #: Pretrained copies of backbone segments (:meth:`setup`): trained at the
        #: protocol's backbone learning rate, not the head's.
        self.pretrained = nn.ModuleDict()
        self._backbone: Backbone | None = None

    # ------------------------------------------------------------------ required hook

    def forward(self, maps: list[torch.Tensor]) -> HeadOutput:
        """``maps``: one B x C_s x H_s x W_s tensor per entry of ``stages``; checks them and
        the B x D embedding :meth:`embed` returns."""
        if len(maps) != len(self.stages):
            raise ValueError(
                f"{type(self).__name__} expects {len(self.stages)} feature maps, got {len(maps)}"
            )
        out = self.embed(maps)
        batch = maps[-1].shape[0]
        if out.embedding.shape != (batch, self.embedding_size):
            raise ValueError(
                f"{type(self).__name__}.embed returned {tuple(out.embedding.shape)}, "
                f"expected ({batch}, {self.embedding_size})"
            )
        return out

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        """The head: one B x C_s x H_s x W_s map per entry of ``stages`` -> a
        :class:`HeadOutput` whose ``embedding`` (B x D, L2-normalised) the engine ranks by
        cosine and passes to the metric loss by default; the other fields are the head's
        structured outputs, read by its own hooks."""
        raise NotImplementedError

    # ------------------------------------------------------------------ building

    def setup(self, backbone: Backbone) -> None:
        """Called once with the :class:`~harness.components.backbones.Backbone` at build
        time, before training or loading weights. The default keeps a reference
        (``self.backbone``, not a submodule: its parameters stay the backbone's). Override
        to declare other ``stages``, keep pretrained copies of backbone segments
        (``self.pretrained``, trained at the backbone's learning rate) or run the
        backbone's later segments (``self.backbone.run``)."""
        object.__setattr__(self, "_backbone", backbone)  # not registered: no shared params

    @property
    def backbone(self) -> Backbone:
        if self._backbone is None:
            raise HarnessError(
                f"{type(self).__name__} was not set up with a backbone (call setup first)"
            )
        return self._backbone

    # ------------------------------------------------------------------ training

    def loss_terms(self, output: HeadOutput, batch: TrainingBatch) -> dict[str, torch.Tensor]:
        """Named scalar loss terms of one batch; the trainer sums them, steps, and logs each
        by name. ``output``: this head's output for the B training images; ``batch``: their
        labels, the run's metric loss (``metric_loss_copies`` instances sized
        ``metric_loss_dim``), and the images and model for a second pass. Default: the
        metric loss on the embedding."""
        return {"metric": batch.metric_loss(output.embedding, batch.labels)}

    def head_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the head proper (not the ``pretrained`` copies): a helper
        for :meth:`optimizer_groups`."""
        copied = {id(p) for p in self.pretrained.parameters()}
        return [p for p in self.parameters() if p.requires_grad and id(p) not in copied]

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Parameter groups of the head (``{"params", "lr", "weight_decay", "name"}``) at the
        protocol's head ``lr`` and ``weight_decay``; override for per-part rates. The
        ``pretrained`` copies are not here: the trainer puts them in the backbone's group."""
        return [
            {
                "params": self.head_parameters(),
                "lr": lr,
                "weight_decay": weight_decay,
                "name": "head",
            }
        ]


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
    #: This variant's row label in tables (:attr:`Method.label` when empty).
    label: str = ""

    def options(self) -> dict[str, Any]:
        """All options with their defaults: the class signature, then the preset."""
        sig = inspect.signature(self.cls.__init__)
        defaults = {
            k: p.default
            for k, p in sig.parameters.items()
            if p.kind is p.KEYWORD_ONLY
            and p.default is not p.empty
            and k not in ("channels", "embedding_size")
        }
        return {**defaults, **self.preset}

    def option_types(self) -> dict[str, Any]:
        """The declared type of each option (the constructor's annotation; ``Any`` where it
        has none): with :meth:`options`, the schema a protocol's ``[methods.<name>]`` table
        is validated against (``harness.config.options``)."""
        hints = typing.get_type_hints(self.cls.__init__)
        return {name: hints.get(name, Any) for name in self.options()}

    def display_name(self, recorded: Mapping[str, Any] | None = None) -> str:
        """Row label in tables for a run that recorded the method options ``recorded``
        (the others at their defaults): this variant's ``label`` or the class's
        :attr:`Method.label`, formatted with them; the registry name when neither is set."""
        options = {**self.options(), **(recorded or {})}
        template = self.label or self.cls.label
        return template.format_map(options) if template else self.name

    def key_fields(self) -> dict[str, int]:
        """What a cell or checkpoint key adds for this method: its revision from 2 on."""
        return {"method_revision": self.cls.revision} if self.cls.revision > 1 else {}


#: The entry-point group through which an installed package registers method plugins
#: (``[project.entry-points."dml_harness.methods"]``): :data:`METHODS` imports each of its
#: entry points once, at its first lookup.
PLUGIN_GROUP = METHOD_PLUGIN_GROUP

METHODS: Registry[MethodEntry] = Registry(
    "method", entry_point_group=PLUGIN_GROUP, name_rule=method_name_rule
)


def register_method(name: str, *, description: str = "", **preset):
    """Class decorator: register the configurable class under ``name``."""

    def add(cls: type[Method]) -> type[Method]:
        METHODS.register(name)(
            MethodEntry(name, cls, preset, description or (cls.__doc__ or "").split("\n")[0])
        )
        return cls

    return add


def register_variant(
    name: str,
    cls: type[Method],
    *,
    description: str = "",
    ablation: bool = False,
    label: str = "",
    **preset,
) -> None:
    """A thin named variant: the same class with preset options (like timm's variants).
    ``ablation=True`` marks a component-study variant, left out of ``--methods all``;
    ``label``: its row label in tables (a :attr:`Method.label` template), when not the class's."""
    METHODS.register(name)(MethodEntry(name, cls, preset, description, ablation, label))


def list_methods(pattern: str = "*", *, ablations: bool = True) -> list[str]:
    """Registered names matching ``pattern``; ``ablations=False`` drops ablation variants."""
    return [n for n in METHODS.list(pattern) if ablations or not METHODS.get(n).ablation]


def create_method(name: str, *, channels: dict[str, int], embedding_size: int, **options) -> Method:
    """Build a registered method; an unknown option or a bad value is a
    :class:`~harness.base.errors.HarnessError` naming the method and the option.

    Options that are None are dropped, so unset command-line flags never override
    a variant's preset (timm's ``create_model`` convention).
    """
    entry = METHODS.get(name)
    valid = entry.options()
    options = {k: v for k, v in options.items() if v is not None}
    for key in options:
        if key not in valid:
            raise HarnessError(
                f"unknown option '{key}' for method '{name}'; valid: {', '.join(sorted(valid)) or 'none'}"
            )
    try:
        model = entry.cls(
            channels=channels, embedding_size=embedding_size, **{**entry.preset, **options}
        )
    except (ValueError, TypeError) as err:  # a constructor's check of a value
        raise HarnessError(f"method '{name}': {err}") from None
    model.registry_name = name
    return model


def training_base(name: str, protocol_options: dict[str, dict[str, Any]]) -> str:
    """The method whose training is ``name``'s under a protocol's method options
    (``protocol.methods``): what its :meth:`~harness.methods.roles.TrainsAsAnother.trains_as`
    declares, when that method's own resolved options match the declared ones; "" when it
    trains its own way."""

    def resolved(method: str) -> dict[str, Any]:
        return {**METHODS.get(method).options(), **protocol_options.get(method, {})}

    cls = METHODS.get(name).cls
    declared = cls.trains_as(resolved(name)) if issubclass(cls, TrainsAsAnother) else None
    if declared is None:
        return ""
    base, options = declared
    same = base != name and all(resolved(base).get(k) == v for k, v in options.items())
    return base if same else ""


#: Stand-in widths for :func:`check_method_options` (values are checked, nothing is run).
_PLACEHOLDER_CHANNELS = {"s8": 8, "s16": 16, "s32": 32}


def check_method_options(
    name: str, options: dict[str, Any], *, embedding_size: int, loss: str = ""
) -> Method:
    """Build the method once on placeholder channels, so that a bad option value (or a
    loss the head cannot train with) is one clear error before any dataset or backbone
    loads; returns that placeholder head (for checks of its declared behaviour)."""
    head = create_method(
        name, channels=_PLACEHOLDER_CHANNELS, embedding_size=embedding_size, **options
    )
    supported = head.supported_losses if isinstance(head, LossShaper) else None
    if loss and supported is not None and loss not in supported:
        raise HarnessError(
            f"method '{name}' cannot train with loss '{loss}' with these options; "
            f"valid: {', '.join(supported)}"
        )
    return head
