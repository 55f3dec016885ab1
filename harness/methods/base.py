"""The plugin interface every paper's method implements: the contract, written once.

A method is a head over backbone feature maps (`Method`). Its public
`forward` checks the inputs and calls the one hook every plugin fills,
`Method.embed`. Every other hook has a default that means "not used", and
every attribute the engine reads is declared on `Method` with its default,
so the engine never asks a head what it has (no `hasattr`).

Hooks the engine calls (B: images, D: embedding size, Q queries, K candidates, G
gallery items, P pairs); ``tests/project/test_method_contract.py`` checks that this table
names every hook `Method` defines and nothing else:

| hook | what the engine does with it |
|---|---|
| `embed` | maps of `stages` (B x C_s x H_s x W_s each) -> `HeadOutput`; `embedding` (B x D) is ranked |
| `setup` | called once with the backbone at build time (other `stages`, pretrained segment copies) |
| `loss_terms` | named loss terms of a `TrainingBatch` (batch means; pairs via its `metric_loss`), summed |
| `optimizer_groups` | the head's optimizer parameter groups (per-part learning rates) |
| `loss_optimizer_groups` | the metric loss's trained parameters' groups (proxies, margin beta) |
| `step_host_reads` | why a training step reads the device from the host, or "" (checked: none) |
| `rerank_similarity` | Q x K scores that replace the cosine on each query's top `rerank_k` candidates |
| `rerank_by_ids` | the same from stored fields and ids, what the evaluation calls (default: `rerank_similarity`) |
| `score_pairs` | Q x G scores of every pair, for a head with `exhaustive_pairs` (default: `rerank_similarity`) |
| `explain` | B x K x H x W maps, drawn on test images after training |
| `pair_maps` | P x h x w maps of (query, gallery) pairs, scored by `harness explain` |
| `explains_pairs` | whether `pair_maps` gives maps (default: overrides it); the conformance tests hold it |
| `figures` | a paper figure of a test tuple (`figure_tuples`) as data (`FigureSet`); the engine draws it |
| `search_space` | the Optuna search space over the method's options (`harness tune`) |
| `cross_process_refusal` | why the method cannot train across processes (`torchrun`), or "" |
| `trains_as` | the method whose training is this one's (a test-time-only method) |
| `display_name` | the method's row label in tables, from a run's options (or the `label` attribute) |

Attributes the engine reads (declared below with their defaults): `stages`,
`rerank_fields`, `rerank_k`, `exhaustive_pairs`, `metric_loss_copies`,
`metric_loss_dim`, `supported_losses`, `figure_tuples`, `label`,
`revision`. Paper metadata lives on the class as data (`PaperInfo`); paper
defaults are the constructor's keyword defaults; named variants are registered with
preset options (and may carry their own `label`). What a head returns and receives
(`HeadOutput`, `TrainingBatch`, `PaperInfo`) is defined in `harness.methods.head_data`,
what `figures` returns (`FigureSet`, `FigureData`, `Panel`, `Link`) in
`harness.methods.figures`; both are exported here.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from harness.base.errors import HarnessError
from harness.base.registry import Registry
from harness.methods.figures import FIGURE_TUPLES, FigureData, FigureSet, Link, Panel
from harness.methods.head_data import HeadOutput, PaperInfo, TrainingBatch
from harness.methods.names import method_name_rule

if TYPE_CHECKING:
    from optuna.trial import Trial

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
    """Base class of every plugin head. Subclasses implement :meth:`embed`; every other
    hook and attribute below has a default that means "not used"."""

    #: Registry name of the configurable class (variants add their own names).
    name: ClassVar[str] = ""
    paper: ClassVar[PaperInfo | None] = None
    #: Row label in tables, formatted with the run's method options by :meth:`display_name`
    #: (``"+ DIABLO (N = {entries})"``); "" labels a row by its registry name.
    label: ClassVar[str] = ""
    #: Backbone points whose maps ``embed`` receives, in chain order (``"s8"``, ``"s16"``,
    #: ``"s32"`` on every backbone); :meth:`setup` may declare others per backbone.
    stages: tuple[str, ...] = ("s32",)
    #: Head-output fields (:meth:`HeadOutput.field`) the evaluation keeps for every image,
    #: for :meth:`rerank_similarity` / :meth:`score_pairs`.
    rerank_fields: ClassVar[tuple[str, ...]] = ()
    #: Candidates per query that :meth:`rerank_similarity` re-scores (0: no re-ranking).
    rerank_k: int = 0
    #: Rank every query against the whole gallery by :meth:`score_pairs` instead of
    #: re-ranking the cosine's top ``rerank_k`` (the engine scores gallery chunks and keeps
    #: a running top-k).
    exhaustive_pairs: bool = False
    #: Independent instances of the metric loss the head needs (one per group, level...).
    metric_loss_copies: int = 1
    #: Registered loss names the head can train with (None: any); checked before a run starts.
    supported_losses: tuple[str, ...] | None = None
    #: The tuples of test images (:data:`FIGURE_TUPLES`) that :meth:`figures` explains.
    figure_tuples: ClassVar[tuple[Literal["pair", "triplet"], ...]] = ()
    #: Bump when a change alters what the method computes with the same options. It
    #: enters grid cell keys and checkpoint keys (from 2 on, so that revision-1 keys never
    #: change): finished cells of older code are rerun, not reused, and runs record it.
    revision: ClassVar[int] = 1
    #: The name the head was built under (:func:`create_method`; "" when built directly).
    registry_name: str = ""

    def __init__(self, *, channels: dict[str, int], embedding_size: int):
        super().__init__()
        self.channels = dict(channels)
        self.in_channels = channels["s32"]
        self.embedding_size = embedding_size
        #: Size of the vectors the head passes to the metric loss (proxies are sized by it).
        self.metric_loss_dim = embedding_size
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

    def loss_optimizer_groups(self, loss_fn: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
        """Parameter groups of the metric loss's trained parameters (proxies, margin beta):
        one group at the protocol's ``optimizer.lr_loss`` and ``optimizer.loss_weight_decay``
        (none when the loss has none). ``optimizer`` is the protocol's
        :class:`~harness.config.sections.OptimizerSpec`; override to train them elsewhere
        (AVSL's code keeps its proxies in its collector)."""
        params = [p for p in loss_fn.parameters() if p.requires_grad]
        return (
            [
                {
                    "params": params,
                    "lr": optimizer.lr_loss,
                    "weight_decay": optimizer.loss_weight_decay,
                    "name": "loss",
                }
            ]
            if params
            else []
        )

    def step_host_reads(self) -> str:
        """Why this head's training step reads values from the device, where by its design
        it must (a selection made on the host, a solver that stops on each problem's
        convergence), or "" when it never does. The engine's own step reads nothing: with
        "" the whole step only queues device work, which ``tests/engine/test_syncs.py`` checks for
        every method that declares nothing. Mining the metric loss's tuples (the protocol's
        miner) produces data-dependent shapes by nature and is not counted here."""
        return ""

    @classmethod
    def cross_process_refusal(cls, options: dict[str, Any]) -> str:
        """Why this method (with ``options``, all of them resolved) cannot train across
        processes (``torchrun``), or "" when it can; the engine refuses such a run with it
        before anything starts. A method can when every pair term goes through
        ``batch.metric_loss`` (gathered over processes) and every other loss term is a mean
        over the batch's images (DDP's average then makes it the global mean)."""
        return ""

    @classmethod
    def trains_as(cls, options: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The method (registry name, options) whose training is this one's step for step
        under ``options`` (all of them resolved), or None when it trains its own way.
        ``run`` then trains that method once and evaluates this one on its selected weights
        without training, as a grid's ``[test_time]`` cell does: for test-time-only methods.
        The selected epoch is then the base's (chosen by its own validation score), as when
        a training-free method is applied to a trained baseline; trained alone, this method
        would select its epoch by its own (e.g. re-ranked) validation score."""
        return None

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        """Optuna search space over the method's options: ``{option: trial.suggest_*(...)}``;
        ``harness tune`` (and a tuned grid with ``method_spaces``) builds the method with
        them (``embedding_size``: the protocol's, for options that must divide it)."""
        return {}

    # ------------------------------------------------------------------ evaluation

    def rerank_similarity(
        self, query: dict[str, torch.Tensor], candidates: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Scores (higher = closer) of Q x K (query, candidate) pairs from the
        ``rerank_fields`` (query: Q x ..., candidates: Q x K x ...), or None when the method
        does not re-rank. The evaluation orders each query's top ``rerank_k`` cosine
        candidates by them (logging the cosine ranking's metrics as ``global_*``)."""
        return None

    def rerank_by_ids(
        self,
        query_fields: Mapping[str, torch.Tensor],
        gallery_fields: Mapping[str, torch.Tensor],
        query_ids,
        candidate_ids,
    ) -> torch.Tensor:
        """What the evaluation calls to re-rank: :meth:`rerank_similarity` from the stored
        ``rerank_fields`` of every query and gallery item (N x ... each) and ids, Q
        ``query_ids`` and Q x K ``candidate_ids``; returns Q x K scores. The default gathers
        the candidates; override only to gather lazily (DIML: the Q x K x N x D candidate
        grids are never built)."""
        q_ids = torch.as_tensor(query_ids, dtype=torch.long)
        c_ids = torch.as_tensor(candidate_ids, dtype=torch.long)
        return typing.cast(
            torch.Tensor,
            self.rerank_similarity(
                {k: query_fields[k][q_ids] for k in self.rerank_fields},
                {k: gallery_fields[k][c_ids] for k in self.rerank_fields},
            ),
        )

    def score_pairs(
        self, query: dict[str, torch.Tensor], gallery: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Scores (higher = closer) of every (query, gallery) pair, Q x G, from the
        ``rerank_fields`` of Q queries and G gallery items; the evaluation calls it chunk by
        chunk when the head declares ``exhaustive_pairs``. The default expands the gallery
        to Q x G candidates for :meth:`rerank_similarity`; override for a cheaper form."""
        q = len(next(iter(query.values())))
        out = self.rerank_similarity(
            query, {k: v.unsqueeze(0).expand(q, *v.shape) for k, v in gallery.items()}
        )
        if out is None:
            raise HarnessError(
                f"{type(self).__name__} declares exhaustive_pairs but scores no pairs"
            )
        return out

    # ------------------------------------------------------------------ explanation

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """Explanation maps B x K x H x W in [0, 1] at image resolution for B normalised
        ``images`` and this head's ``output`` for them, or None (the method has none). After
        training the engine draws them on test images (one row per map) and, on datasets
        with part masks, logs each map's share of mass on each part."""
        return None

    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Maps explaining P (query, gallery) pairs, or None (the method has none);
        ``python -m harness explain`` scores them against a Grad-CAM baseline.

        ``query`` / ``gallery``: this head's outputs (eval mode) for the P query and the P
        gallery images, row i = pair i; ``same``: P bools, whether pair i is of one class.
        As SAM's Siamese weights do (Sec. 3.1.1), a positive pair is explained by what makes
        it similar and a negative one by what makes it dissimilar. Returns (P x h x w,
        P x h' x w'), non-negative, at feature resolution (the harness resizes them)."""
        return None

    @property
    def explains_pairs(self) -> bool:
        """Whether :meth:`pair_maps` gives maps (not None): by default, whether the class
        overrides it. A head whose maps depend on its options overrides this too."""
        return type(self).pair_maps is not Method.pair_maps

    def figures(
        self, kind: str, images: list[torch.Tensor], outputs: list[HeadOutput]
    ) -> FigureSet | None:
        """A paper figure explaining a tuple of test images, as data, or None. The engine
        calls it after training for each ``kind`` in ``figure_tuples`` (:data:`FIGURE_TUPLES`:
        ``"pair"``, a query and its nearest neighbour; ``"triplet"``, anchor, positive and
        negative), then draws the :class:`FigureSet`, writes its figures and data and logs
        them with the run. ``images``: the tuple's pictures, 3 x H x W in [0, 1];
        ``outputs``: this head's outputs for them (eval mode), batches of one
        (:meth:`HeadOutput.select`)."""
        return None

    # ------------------------------------------------------------------ reporting

    @classmethod
    def display_name(cls, options: Mapping[str, Any], *, label: str = "") -> str:
        """The method's row label in tables: ``label`` (a registered variant's own) or the
        class's :attr:`label`, formatted with a run's resolved method ``options`` (a run
        records them as ``params.method.<option>``); "" when neither is set (tables then
        use the registry name). Tables call it through :meth:`MethodEntry.display_name`."""
        template = label or cls.label
        return template.format_map(dict(options)) if template else ""


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
        (the others at their defaults): :meth:`Method.display_name`, else the registry name."""
        options = {**self.options(), **(recorded or {})}
        return self.cls.display_name(options, label=self.label) or self.name

    def key_fields(self) -> dict[str, int]:
        """What a cell or checkpoint key adds for this method: its revision from 2 on."""
        return {"method_revision": self.cls.revision} if self.cls.revision > 1 else {}


#: The entry-point group through which an installed package registers method plugins
#: (``[project.entry-points."dml_harness.methods"]``): :data:`METHODS` imports each of its
#: entry points once, at its first lookup.
PLUGIN_GROUP = "dml_harness.methods"

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
    (``protocol.methods``): what its :meth:`Method.trains_as` declares, when that method's
    own resolved options match the declared ones; "" when it trains its own way."""

    def resolved(method: str) -> dict[str, Any]:
        return {**METHODS.get(method).options(), **protocol_options.get(method, {})}

    declared = METHODS.get(name).cls.trains_as(resolved(name))
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
    if loss and head.supported_losses is not None and loss not in head.supported_losses:
        raise HarnessError(
            f"method '{name}' cannot train with loss '{loss}' with these options; "
            f"valid: {', '.join(head.supported_losses)}"
        )
    return head
