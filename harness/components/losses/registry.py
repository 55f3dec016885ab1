"""Every loss and miner by name, with its default hyperparameters as data, and building
them from a protocol's ``[loss.args.<name>]``, ``[miner]`` and ``[loss.miners.<name>]``."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners

from harness.base.errors import HarnessError, unknown_name
from harness.base.registry import Registry
from harness.components.losses.miners import (
    FixedDistanceWeightedMiner,
    HardNegativeMiner,
    IndexedHardNegativeMiner,
    IndexedRothDistanceWeightedMiner,
    MultiSimilarityPairMiner,
    RothDistanceWeightedMiner,
)
from harness.components.losses.proxy_losses import ProxyAnchorLoss
from harness.components.losses.reductions import CODE_REDUCTIONS, PML_REDUCTION, Reduction
from harness.components.losses.sync_free_reducers import use_sync_free_reducers
from harness.components.losses.tuple_losses import (
    BinomialDevianceLoss,
    MultiSimilarityLoss,
    QuadrupletLoss,
)

__all__ = [
    "LossEntry",
    "LOSSES",
    "MINERS",
    "miner_for",
    "loss_defaults",
    "loss_reductions",
    "check_loss_args",
    "create_loss",
    "create_miner",
]


@dataclass(frozen=True)
class LossEntry:
    cls: type
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Whether the loss holds parameters sized by the classes (proxies, per-class beta).
    needs_classes: bool = False
    description: str = ""
    #: The miner this loss always uses instead of the protocol's (see :func:`miner_for`);
    #: None: the protocol's.
    miner: str | None = None
    #: Reductions besides :data:`PML_REDUCTION`, by the name ``[loss.args.<name>]``'s
    #: ``reduction`` selects them with.
    reductions: dict[str, Reduction] = field(default_factory=dict)


LOSSES: Registry[LossEntry] = Registry("loss")
MINERS: Registry[LossEntry] = Registry("miner")


def _loss(name, cls, description, needs_classes=False, miner=None, reductions=None, **defaults):
    LOSSES.register(name)(
        LossEntry(cls, defaults, needs_classes, description, miner, reductions or {})
    )


_loss(
    "contrastive",
    pml_losses.ContrastiveLoss,
    "Hadsell et al. 2006; A-grouping Table 1 (m = 1)",
    reductions=CODE_REDUCTIONS["contrastive"],
    pos_margin=0.0,
    neg_margin=1.0,
)
_loss("triplet", pml_losses.TripletMarginLoss, "Schroff et al. 2015", margin=0.2)
_loss(
    "quadruplet",
    QuadrupletLoss,
    "Chen et al. 2017; SAM Table 1 (quadruplet architecture)",
    margin=0.2,
    margin2=0.1,
)
_loss(
    "margin",
    pml_losses.MarginLoss,
    "Wu et al. 2017, learnable per-class beta; A-grouping Table 1 (m = 0.2, eta = 1.2)",
    needs_classes=True,
    reductions=CODE_REDUCTIONS["margin"],
    margin=0.2,
    nu=0.0,
    beta=1.2,
    triplets_per_anchor="all",
    learn_beta=True,
)
_loss(
    "binomial_deviance",
    BinomialDevianceLoss,
    "Yi et al. 2014; A-grouping Table 1",
    reductions=CODE_REDUCTIONS["binomial_deviance"],
    alpha=2.0,
    margin=0.5,
    pos_scale=1.0,
    neg_scale=25.0,
)
_loss(
    "multi_similarity",
    MultiSimilarityLoss,
    "Wang et al. 2019",
    miner="multi_similarity",
    reductions=CODE_REDUCTIONS["multi_similarity"],
    alpha=2.0,
    beta=50.0,
    base=0.5,
)
_loss(
    "proxy_anchor",
    ProxyAnchorLoss,
    "Kim et al. 2020 (neg_margin: a negative margin of its own)",
    needs_classes=True,
    miner="none",
    margin=0.1,
    alpha=32.0,
)
_loss(
    "proxy_nca",
    pml_losses.ProxyNCALoss,
    "Movshovitz-Attias et al. 2017",
    needs_classes=True,
    miner="none",
    softmax_scale=1.0,
)
_loss(
    "arcface",
    pml_losses.ArcFaceLoss,
    "Deng et al. 2019",
    needs_classes=True,
    miner="none",
    margin=28.6,
    scale=64.0,
)
_loss(
    "normalized_softmax",
    pml_losses.NormalizedSoftmaxLoss,
    "Zhai & Wu 2019",
    needs_classes=True,
    miner="none",
    temperature=0.05,
)
_loss("circle", pml_losses.CircleLoss, "Sun et al. 2020", m=0.4, gamma=80.0)
_loss(
    "lifted_structure",
    pml_losses.LiftedStructureLoss,
    "Oh Song et al. 2016",
    neg_margin=1.0,
    pos_margin=0.0,
)
_loss("ntxent", pml_losses.NTXentLoss, "Chen et al. 2020 (InfoNCE)", temperature=0.07)
_loss(
    "soft_triple",
    pml_losses.SoftTripleLoss,
    "Qian et al. 2019",
    needs_classes=True,
    miner="none",
    centers_per_class=10,
    la=20.0,
    gamma=0.1,
    margin=0.01,
)

MINERS.register("distance_weighted")(
    LossEntry(
        pml_miners.DistanceWeightedMiner,
        {"cutoff": 0.5, "nonzero_loss_cutoff": 1.4},
        description="Wu et al. 2017 (PML: upper cutoff 1.4, a class's size in triplets per anchor)",
    )
)
MINERS.register("distance_weighted_fixed")(
    LossEntry(
        FixedDistanceWeightedMiner,
        {"cutoff": 0.5, "nonzero_loss_cutoff": 1.4},
        description="distance_weighted's distribution in a fixed shape (a mask over B slots per anchor)",
    )
)
MINERS.register("distance_weighted_roth")(
    LossEntry(
        RothDistanceWeightedMiner,
        {"cutoff": 0.5},
        description="Roth et al. 2020's code: no upper cutoff, one triplet per anchor (fixed shape)",
    )
)
MINERS.register("distance_weighted_roth_indexed")(
    LossEntry(
        IndexedRothDistanceWeightedMiner,
        {"cutoff": 0.5},
        description="distance_weighted_roth returning index lists (a data-dependent shape)",
    )
)
MINERS.register("multi_similarity")(
    LossEntry(
        MultiSimilarityPairMiner,
        {"epsilon": 0.1},
        description="Wang et al. 2019 (pair masks: a fixed shape)",
    )
)
MINERS.register("multi_similarity_indexed")(
    LossEntry(
        pml_miners.MultiSimilarityMiner,
        {"epsilon": 0.1},
        description="multi_similarity returning index lists (PML's; a data-dependent shape)",
    )
)
MINERS.register("triplet_margin")(
    LossEntry(
        pml_miners.TripletMarginMiner,
        {"margin": 0.2, "type_of_triplets": "semihard"},
        description="semihard triplets",
    )
)
MINERS.register("hard_negative")(
    LossEntry(
        HardNegativeMiner,
        {"cutoff": 0.5},
        description="GeDML's HardSelector (AVSL's margin configurations; fixed shape)",
    )
)
MINERS.register("hard_negative_indexed")(
    LossEntry(
        IndexedHardNegativeMiner,
        {"cutoff": 0.5},
        description="hard_negative returning index lists (a data-dependent shape)",
    )
)
MINERS.register("batch_hard")(
    LossEntry(pml_miners.BatchHardMiner, {}, description="Hermans et al. 2017")
)
MINERS.register("pair_margin")(
    LossEntry(pml_miners.PairMarginMiner, {"pos_margin": 0.2, "neg_margin": 0.8}, description="")
)


def miner_for(
    loss: str,
    protocol_miner: str,
    protocol_args: dict[str, Any] | None = None,
    *,
    loss_miners: dict[str, dict[str, Any]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The miner (name, args) a run of ``loss`` uses under a protocol whose miner is
    ``protocol_miner`` and whose per-loss miners (``[loss.miners.<loss>]``) are ``loss_miners``.

    The miner belongs to the loss setting. A protocol fixes one miner for the tuple losses
    (Roth et al. 2020: distance-weighted sampling), and may give one loss another, as the
    setting it transcribes does (A-grouping: DGML's binomial deviance, ``criteria/
    binomial_deviance.py``, takes every pair of the batch, ``REQUIRES_BATCHMINER = False``,
    while its margin and contrastive losses use the distance sampler); that entry wins.
    Otherwise losses over proxies or classes take none: PML would only re-weight their
    samples by the miner's tuples, and Roth et al.'s code (which the DIML seed trains
    with) gives them no batch miner. Multi-similarity brings its own pair mining (Wang
    et al. 2019, Sec. 3.3; PML splits it into ``MultiSimilarityMiner``, epsilon 0.1),
    which Roth et al.'s criterion also runs inside the loss.
    """
    chosen = (loss_miners or {}).get(loss)
    if chosen is not None:
        return chosen["name"], dict(chosen.get("args", {}))
    own = LOSSES.get(loss).miner
    if own is None or own == protocol_miner:
        return protocol_miner, dict(protocol_args or {})
    return own, {}


def loss_defaults(name: str) -> dict[str, Any]:
    return dict(LOSSES.get(name).defaults)


def _known_args(kind: str, name: str, entry: LossEntry, args: dict[str, Any]) -> dict[str, Any]:
    """The entry's defaults updated by ``args``; an argument its class does not take is an error."""
    accepted = set(inspect.signature(vars(entry.cls).get("__init__", entry.cls)).parameters)
    # PML bases take **kwargs (distance, reducer, ...): check against the whole MRO.
    for base in entry.cls.__mro__[1:]:
        if "__init__" in vars(base):
            accepted |= set(inspect.signature(vars(base)["__init__"]).parameters)
    unknown = sorted(set(args) - accepted - {"self", "args", "kwargs"})
    if unknown:
        raise HarnessError(f"unknown argument '{unknown[0]}' for {kind} '{name}'")
    return {**entry.defaults, **args}


def loss_reductions(name: str) -> list[str]:
    """The ``reduction`` values loss ``name`` accepts (:data:`PML_REDUCTION` first)."""
    return [PML_REDUCTION, *LOSSES.get(name).reductions]


def check_loss_args(name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The constructor arguments of loss ``name`` under a protocol's ``[loss.args.<name>]``
    table ``args``: the entry's defaults, ``args``, and what its ``reduction`` selects
    (default :data:`PML_REDUCTION`: nothing). An unknown argument or reduction is a
    :class:`HarnessError` naming the valid ones."""
    entry = LOSSES.get(name)
    args = dict(args or {})
    reduction = args.pop("reduction", PML_REDUCTION)
    resolved = _known_args("loss", name, entry, args)
    if reduction == PML_REDUCTION:
        return resolved
    if reduction not in entry.reductions:
        raise HarnessError(
            f"loss '{name}': {unknown_name('reduction', str(reduction), loss_reductions(name))}"
        )
    return {**resolved, **entry.reductions[reduction].arguments(resolved)}


def create_loss(
    name: str, args: dict[str, Any] | None = None, *, num_classes: int, embedding_size: int
) -> torch.nn.Module:
    """A PML-style loss: ``loss(embeddings, labels, indices_tuple=None) -> scalar``, its
    reducers PML's arithmetic queued on the device without a host sync
    (:mod:`harness.components.losses.sync_free_reducers`)."""
    entry = LOSSES.get(name)
    kwargs = check_loss_args(name, args)
    if entry.needs_classes:
        kwargs["num_classes"] = num_classes
        if "embedding_size" in inspect.signature(entry.cls).parameters:
            kwargs["embedding_size"] = embedding_size
    return use_sync_free_reducers(entry.cls(**kwargs))


def create_miner(name: str, args: dict[str, Any] | None = None):
    """A PML miner, or ``None`` for ``"none"``."""
    if name in ("", "none"):
        return None
    entry = MINERS.get(name)
    return entry.cls(**_known_args("miner", name, entry, dict(args or {})))
