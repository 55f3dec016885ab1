"""The roles a method plugin may take beyond its head: one protocol per role.

A :class:`~harness.methods.base.Method` embeds and trains; what else a paper's head does
is a role, declared by subclassing the role's protocol beside ``Method``
(``class DIMLHead(Method, Reranker, IdReranker, ...)``). The engine asks for a role
(``isinstance(head, Reranker)``, ``issubclass(cls, Tunable)`` for the roles of a class)
and calls its members; a head without the role is never called for it. A protocol's
default bodies are what a subclass inherits for the members it does not write.

Shapes: B images, D the embedding size, Q queries, K candidates per query, G gallery
items, P pairs. Each role's conformance checks are in ``tests/methods/test_roles.py``,
run once per registered plugin that has the role.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from harness.base.errors import HarnessError
from harness.methods.figures import FigureSet
from harness.methods.head_data import HeadOutput

if TYPE_CHECKING:
    from optuna.trial import Trial

__all__ = [
    "ROLES",
    "gathered_rerank",
    "rerank_scores",
    "Explainer",
    "FigureMaker",
    "HostReader",
    "IdReranker",
    "LossShaper",
    "PairExplainer",
    "PairScorer",
    "ProcessBound",
    "Reranker",
    "TrainsAsAnother",
    "Tunable",
    "loss_copies",
    "loss_dim",
    "metric_loss_groups",
    "role_members",
]


def metric_loss_groups(loss_fn: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
    """One parameter group of the metric loss's trained parameters (proxies, margin beta) at
    the protocol's ``optimizer.lr_loss`` and ``optimizer.loss_weight_decay``; none when the
    loss has none. What the engine trains the loss with unless the head is a
    :class:`LossShaper`."""
    params = [p for p in loss_fn.parameters() if p.requires_grad]
    if not params:
        return []
    return [
        {
            "params": params,
            "lr": optimizer.lr_loss,
            "weight_decay": optimizer.loss_weight_decay,
            "name": "loss",
        }
    ]


# ---------------------------------------------------------------------- training


@runtime_checkable
class LossShaper(Protocol):
    """A head whose metric loss is not one instance over its embedding: several copies
    (one per group or level), vectors of another size, only some losses, or the loss's
    parameters trained elsewhere."""

    #: Independent instances of the metric loss the head needs (one per group, level...).
    metric_loss_copies: int = 1
    #: Size of the vectors the head passes to the metric loss (None: the embedding size).
    metric_loss_dim: int | None = None
    #: Registered loss names the head can train with (None: any); checked before a run.
    supported_losses: tuple[str, ...] | None = None

    def loss_optimizer_groups(self, loss_fn: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
        """Parameter groups of the metric loss's trained parameters (``optimizer``: the
        protocol's :class:`~harness.config.sections.OptimizerSpec`); the default is
        :func:`metric_loss_groups` (AVSL's code keeps its proxies in its collector)."""
        return metric_loss_groups(loss_fn, optimizer)


def loss_copies(head: object) -> int:
    """The metric loss instances ``head`` needs: its :class:`LossShaper` count, else 1."""
    return head.metric_loss_copies if isinstance(head, LossShaper) else 1


def loss_dim(head: Any) -> int:
    """The size of the vectors ``head`` passes to its metric loss."""
    own = head.metric_loss_dim if isinstance(head, LossShaper) else None
    return int(own or head.embedding_size)


@runtime_checkable
class HostReader(Protocol):
    """A head whose training step reads values from the device by design (a selection made
    on the host, a solver that stops on each problem's convergence)."""

    def step_host_reads(self) -> str:
        """Why the step reads the device from the host ("" when, with these options, it
        does not). A head without this role queues device work only, which
        ``tests/engine/test_syncs.py`` checks; mining the loss's tuples is not counted."""
        return ""


@runtime_checkable
class ProcessBound(Protocol):
    """A method that cannot train across processes (``torchrun``) under some options."""

    @classmethod
    def cross_process_refusal(cls, options: dict[str, Any]) -> str:
        """Why the method (with ``options``, all resolved) cannot train across processes,
        or "" when it can; the engine refuses such a run with it before anything starts. A
        method can when every pair term goes through ``batch.metric_loss`` (gathered over
        processes) and every other loss term is a mean over the batch's images."""
        return ""


@runtime_checkable
class TrainsAsAnother(Protocol):
    """A method whose training is another's step for step (a test-time-only method)."""

    @classmethod
    def trains_as(cls, options: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The method (registry name, options) whose training this one's is under
        ``options`` (all resolved), or None when it trains its own way. ``run`` then trains
        that method once and evaluates this one on its selected weights."""
        return None


@runtime_checkable
class Tunable(Protocol):
    """A method with an Optuna search space over its options (``harness tune``)."""

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        """``{option: trial.suggest_*(...)}`` over the method's own options
        (``embedding_size``: the protocol's, for options that must divide it)."""
        return {}


# ---------------------------------------------------------------------- evaluation


@runtime_checkable
class Reranker(Protocol):
    """A head that re-scores each query's top ``rerank_k`` cosine candidates from fields it
    keeps per image (the cosine ranking's metrics are logged as ``global_*``)."""

    #: Head-output fields (:meth:`HeadOutput.field`) the evaluation keeps for every image.
    rerank_fields: ClassVar[tuple[str, ...]] = ()
    #: Candidates per query that are re-scored (0: no re-ranking with these options).
    rerank_k: int = 0

    def rerank_similarity(
        self, query: dict[str, torch.Tensor], candidates: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Q x K scores (higher = closer) of (query, candidate) pairs from the
        ``rerank_fields`` (query: Q x ..., candidates: Q x K x ...)."""
        return None


@runtime_checkable
class IdReranker(Protocol):
    """A :class:`Reranker` that gathers its candidates' fields itself (DIML: the Q x K x N x D
    candidate grids are never built)."""

    def rerank_by_ids(
        self,
        query_fields: Mapping[str, torch.Tensor],
        gallery_fields: Mapping[str, torch.Tensor],
        query_ids: Any,
        candidate_ids: Any,
    ) -> torch.Tensor:
        """Q x K scores from the stored ``rerank_fields`` of every query and gallery item (N
        x ... each), Q ``query_ids`` and Q x K ``candidate_ids``. The default gathers the
        candidates for :meth:`Reranker.rerank_similarity`, as the engine does for a
        :class:`Reranker` without this role."""
        head = typing.cast(Reranker, self)
        return gathered_rerank(head, query_fields, gallery_fields, query_ids, candidate_ids)


def gathered_rerank(
    head: Reranker,
    query_fields: Mapping[str, torch.Tensor],
    gallery_fields: Mapping[str, torch.Tensor],
    query_ids: Any,
    candidate_ids: Any,
) -> torch.Tensor:
    """Q x K scores of ``head``'s :meth:`~Reranker.rerank_similarity` on the stored fields of
    Q ``query_ids`` and their Q x K ``candidate_ids``, gathered."""
    q_ids = torch.as_tensor(query_ids, dtype=torch.long)
    c_ids = torch.as_tensor(candidate_ids, dtype=torch.long)
    scores = head.rerank_similarity(
        {k: query_fields[k][q_ids] for k in head.rerank_fields},
        {k: gallery_fields[k][c_ids] for k in head.rerank_fields},
    )
    if scores is None:
        raise HarnessError(f"{type(head).__name__} declares rerank_fields but scores no pairs")
    return scores


def rerank_scores(
    head: Reranker,
    query_fields: Mapping[str, torch.Tensor],
    gallery_fields: Mapping[str, torch.Tensor],
    query_ids: Any,
    candidate_ids: Any,
) -> torch.Tensor:
    """Q x K re-ranking scores: the head's own :meth:`IdReranker.rerank_by_ids` when it has
    that role, else :func:`gathered_rerank`."""
    if isinstance(head, IdReranker):
        return head.rerank_by_ids(query_fields, gallery_fields, query_ids, candidate_ids)
    return gathered_rerank(head, query_fields, gallery_fields, query_ids, candidate_ids)


@runtime_checkable
class PairScorer(Protocol):
    """A head that ranks every query against the whole gallery by its pair scores (the
    engine scores gallery chunks and keeps a running top-k) when ``exhaustive_pairs``."""

    #: Head-output fields the evaluation keeps for every image, for :meth:`score_pairs`.
    rerank_fields: ClassVar[tuple[str, ...]] = ()
    #: Whether, with these options, the head ranks by :meth:`score_pairs`.
    exhaustive_pairs: bool = False

    def score_pairs(
        self, query: dict[str, torch.Tensor], gallery: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Q x G scores (higher = closer) from the ``rerank_fields`` of Q queries and G
        gallery items. The default expands the gallery to Q x G candidates for
        :meth:`Reranker.rerank_similarity`."""
        q = len(next(iter(query.values())))
        out = typing.cast(Reranker, self).rerank_similarity(
            query, {k: v.unsqueeze(0).expand(q, *v.shape) for k, v in gallery.items()}
        )
        if out is None:
            raise HarnessError(f"{type(self).__name__} declares exhaustive_pairs but scores none")
        return out


# ---------------------------------------------------------------------- explanation


@runtime_checkable
class Explainer(Protocol):
    """A head with explanation maps of single images, drawn on test images after training
    (one row per map) and, on datasets with part masks, scored per part."""

    def explain(self, images: torch.Tensor, output: HeadOutput) -> torch.Tensor | None:
        """B x K x H x W maps in [0, 1] at image resolution for B normalised ``images`` and
        this head's ``output`` for them (None: none with these options)."""
        return None


@runtime_checkable
class PairExplainer(Protocol):
    """A head with maps explaining (query, gallery) pairs, scored by ``harness explain``
    against a Grad-CAM baseline."""

    @property
    def explains_pairs(self) -> bool:
        """Whether :meth:`pair_maps` gives maps with these options (default: it does)."""
        return True

    def pair_maps(
        self, query: HeadOutput, gallery: HeadOutput, same: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(P x h x w, P x h' x w') non-negative maps at feature resolution for P pairs:
        ``query`` / ``gallery`` this head's outputs (eval mode), row i = pair i; ``same``:
        P bools, whether pair i is of one class (a positive pair is explained by what makes
        it similar, a negative one by what makes it dissimilar)."""
        return None


@runtime_checkable
class FigureMaker(Protocol):
    """A head that explains tuples of test images as a paper's figure, given as data
    (:class:`~harness.methods.figures.FigureSet`); the engine draws and logs it."""

    #: The tuples (:data:`~harness.methods.figures.FIGURE_TUPLES`) that :meth:`figures` explains.
    figure_tuples: ClassVar[tuple[Literal["pair", "triplet"], ...]] = ()

    def figures(
        self, kind: str, images: list[torch.Tensor], outputs: list[HeadOutput]
    ) -> FigureSet | None:
        """The figure of one ``kind`` of ``figure_tuples`` (``"pair"``: a query and its
        nearest neighbour; ``"triplet"``: anchor, positive, negative). ``images``: 3 x H x W
        in [0, 1]; ``outputs``: this head's outputs for them (eval mode), batches of one."""
        return None


#: Every role, in the order of the API page.
ROLES: tuple[type, ...] = (
    LossShaper,
    HostReader,
    ProcessBound,
    TrainsAsAnother,
    Tunable,
    Reranker,
    IdReranker,
    PairScorer,
    Explainer,
    PairExplainer,
    FigureMaker,
)


def role_members(role: type) -> list[str]:
    """The members of ``role`` in the order its body declares them."""
    own = [n for n in vars(role) if not n.startswith("_")]
    hints = [n for n in getattr(role, "__annotations__", {}) if n not in own]
    return [*hints, *own]
