"""The ``reduction`` argument of every loss, and the arithmetic of released code it selects.

``reduction`` is one more argument of every loss: how its per-pair or per-triplet terms
become one number. ``"pml"`` (the default) is the reduction PML gives the loss: the fair
protocols' choice. ``"dgml"`` is the arithmetic of the A-grouping authors' released code
(XinyiXuXD/DGML-master, ``criteria/``), which the A-grouping protocols select:

======================  ==========================================  =====================================
loss                    ``"dgml"`` (the code)                       ``"pml"`` (the default)
======================  ==========================================  =====================================
``margin``              summed hinge terms / triplets with an       / active hinge terms, a triplet's two
                        active term (``margin.py`` l. 67-75;        counted apart (``DivisorReducer``)
                        :class:`ActiveTripletReducer`)
``contrastive``         each hinge term's mean over all sampled     mean over the non-zero terms
                        pairs, zeros included (``contrastive.py``   (``AvgNonZeroReducer``)
                        l. 35-40; ``MeanReducer``)
``binomial_deviance``   the B self-pairs among the positives        distinct pairs only
                        (``binomial_deviance.py`` l. 15-22, 57;
                        ``self_pairs=True``)
======================  ==========================================  =====================================

DGML-master's ``main.py`` cannot run its contrastive or binomial deviance criteria:
``criteria/__init__.py`` (XinyiXuXD/DGML-master@7834411, l. 7-10) maps those names to
the modules themselves, which ``select`` then calls (l. 18), a ``TypeError``. The
``"dgml"`` reductions of those two losses follow the criteria's files (``contrastive.py``,
``binomial_deviance.py``), what the code would compute had it run them; the margin
loss's (``Margin``, a class) is what the code runs.

``"roth"`` is the arithmetic of Roth et al.'s code as the DIML authors ship it and train
their baselines with (wl-zhao/DIML@c15dbea, ``criteria/``), which the ``diml-table1``
grid selects:

======================  ==========================================  =====================================
loss                    ``"roth"`` (the code)                       ``"pml"`` (the default)
======================  ==========================================  =====================================
``margin``              summed hinge terms / triplets with an       / active hinge terms, a triplet's two
                        active term (``margin.py`` l. 59-67;        counted apart (``DivisorReducer``)
                        :class:`ActiveTripletReducer`)
``contrastive``         each hinge term's mean over all sampled     mean over the non-zero terms
                        triplets, zeros included (``contrastive.py`` (``AvgNonZeroReducer``)
                        l. 34-37; ``MeanReducer``)
``multi_similarity``    mean over the anchors that kept at least    mean over every anchor of the
                        one positive and one negative pair, the     batch, an anchor with mined pairs
                        others skipped (``multisimilarity.py``      of one kind counted with that
                        l. 41-55; ``kept_anchors_only=True``)       term alone (``MeanReducer``)
======================  ==========================================  =====================================

The margin and contrastive arithmetic is DGML's too (DGML's criteria derive from the
same code); the names say whose code a protocol follows. Each entry's ``reductions``
holds the same as data (:class:`Reduction`, :data:`CODE_REDUCTIONS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pytorch_metric_learning.reducers import MeanReducer

from harness.base.errors import HarnessError
from harness.components.losses.sync_free_reducers import SyncFreeDivisorReducer

__all__ = ["PML_REDUCTION", "Reduction", "ActiveTripletReducer", "CODE_REDUCTIONS"]

#: The reduction every loss offers: the one pytorch-metric-learning gives it.
PML_REDUCTION = "pml"


@dataclass(frozen=True)
class Reduction:
    """A loss's arithmetic as some released code has it, where PML's differs: the code it
    follows, and the constructor arguments that select it, given the loss's resolved
    arguments (it refuses those the followed code has no counterpart for)."""

    follows: str
    arguments: Callable[[dict[str, Any]], dict[str, Any]]


class ActiveTripletReducer(SyncFreeDivisorReducer):
    """Each triplet's loss (for PML's ``MarginLoss``: its positive plus its negative hinge
    term), summed and divided by the number of triplets whose loss is non-zero, i.e. with
    at least one active hinge term; zero when none is.

    This is the DGML code's margin loss (``criteria/margin.py`` l. 70-75: ``pair_count =
    sum((pos_loss > 0) + (neg_loss > 0))`` adds boolean tensors, a logical or, so it counts
    triplets). PML's own reducer for the margin loss (``DivisorReducer``) divides by the
    number of active hinge terms, the positive and the negative term of a triplet counted
    apart, which gives 0.5-1x this value. Sub-losses that are not per triplet (the beta
    regulariser) keep ``DivisorReducer``'s arithmetic, computed without a host sync
    (:class:`~harness.components.losses.sync_free_reducers.SyncFreeDivisorReducer`).
    """

    def triplet_reduction(self, losses, loss_indices, embeddings, labels, divisor=1):
        return self.sum_and_divide(losses, embeddings, torch.sum(losses > 0))


def _active_triplet_margin(
    reduction: str, source: str
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The margin loss divided by the triplets with an active term, as ``source`` (a
    criteria/margin.py without a usable beta regulariser, so ``nu`` must be 0)."""

    def loss_kwargs(args: dict[str, Any]) -> dict[str, Any]:
        if args.get("nu", 0):
            raise HarnessError(
                f"loss 'margin': reduction '{reduction}' follows {source}: nu must be 0, got {args['nu']}"
            )
        return {"reducer": ActiveTripletReducer()}

    return loss_kwargs


_dgml_margin = _active_triplet_margin(
    "dgml", "DGML's criteria/margin.py, which has no beta regulariser"
)
_roth_margin = _active_triplet_margin(
    "roth",
    "Roth et al.'s criteria/margin.py, whose beta regulariser cannot run (l. 69 adds an undefined name)",
)


# The A-grouping authors' released code (XinyiXuXD/DGML-master, criteria/). Each group's
# loss is then averaged over the groups (margin.py l. 49, contrastive.py l. 51,
# binomial_deviance.py l. 63), as the A-grouping head does for any reduction.
_DGML_MARGIN = Reduction(
    "criteria/margin.py l. 67-75: the triplets' summed hinge terms divided by the number of triplets "
    "with an active term (PML: by the number of active terms)",
    _dgml_margin,
)
_DGML_CONTRASTIVE = Reduction(
    "criteria/contrastive.py l. 35-40: each hinge term averaged over all sampled pairs, zeros included "
    "(PML: over the non-zero ones)",
    lambda args: {"reducer": MeanReducer()},
)
_DGML_BINOMIAL = Reduction(
    "criteria/binomial_deviance.py l. 15-22, 57: the B self-pairs counted among the positives "
    "(here: excluded)",
    lambda args: {"self_pairs": True},
)

# Roth et al.'s code as the DIML authors ship it (wl-zhao/DIML@c15dbea, criteria/), which
# trains DIML's baselines (DIML App. B.2).
_ROTH_MARGIN = Reduction(
    "criteria/margin.py l. 59-67: the triplets' summed hinge terms divided by the number of triplets "
    "with an active term (PML: by the number of active terms)",
    _roth_margin,
)
_ROTH_CONTRASTIVE = Reduction(
    "criteria/contrastive.py l. 34-37: each hinge term averaged over all sampled triplets, zeros included "
    "(PML: over the non-zero ones)",
    lambda args: {"reducer": MeanReducer()},
)
_ROTH_MULTI_SIMILARITY = Reduction(
    "criteria/multisimilarity.py l. 41-55: the mean over the anchors that kept a positive and a negative "
    "pair (PML: over every anchor)",
    lambda args: {"kept_anchors_only": True},
)


#: The reductions besides :data:`PML_REDUCTION` of each loss that has some, by loss name,
#: then by the name ``[loss.args.<name>]``'s ``reduction`` selects them with.
CODE_REDUCTIONS: dict[str, dict[str, Reduction]] = {
    "contrastive": {"dgml": _DGML_CONTRASTIVE, "roth": _ROTH_CONTRASTIVE},
    "margin": {"dgml": _DGML_MARGIN, "roth": _ROTH_MARGIN},
    "binomial_deviance": {"dgml": _DGML_BINOMIAL},
    "multi_similarity": {"roth": _ROTH_MULTI_SIMILARITY},
}
