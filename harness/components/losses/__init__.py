"""Metric losses and miners by name, through pytorch-metric-learning (PML).

PML is reused wherever it has the loss; only the binomial deviance loss (used by
three of the seeds) and the quadruplet loss (SAM's Table 1; PML has none) are written
here, against PML's ``BaseMetricLossFunction`` interface so that miners, reducers and
distances compose with them as usual.
Every entry carries its default hyperparameters as data; a protocol's
``[loss.args.<name>]`` table overrides them, and an unknown argument is an error.

``reduction`` is one more argument of every loss: how its per-pair or per-triplet terms
become one number. ``"pml"`` (the default) is the reduction PML gives the loss: the fair
protocols' choice; ``"dgml"`` and ``"roth"`` follow the arithmetic of the seeds' released
code (:mod:`harness.components.losses.reductions` has each one, with the code's lines).

The modules: :mod:`~harness.components.losses.tuple_losses` (losses over the batch's pairs,
triplets and quadruplets), :mod:`~harness.components.losses.proxy_losses` (losses against
learned class proxies), :mod:`~harness.components.losses.miners`,
:mod:`~harness.components.losses.mined` (fixed-shape tuples and the losses that take them
as a mask), :mod:`~harness.components.losses.reductions` (the ``reduction`` argument),
:mod:`~harness.components.losses.sync_free_reducers` (PML's reducers computed without a
host sync), :mod:`~harness.components.losses.registry`
(every loss and miner by name, and building them), :mod:`~harness.components.losses.metric_loss`
(the run's loss as a plugin receives it) and :mod:`~harness.components.losses.distances`
(losses on a matrix a method computes itself).
"""

from __future__ import annotations

from harness.components.losses.distances import PrecomputedDistance, distance_replaced
from harness.components.losses.metric_loss import MetricLoss, step_seed
from harness.components.losses.mined import MinedPairs, MinedTriplets, apply_loss
from harness.components.losses.miners import (
    FixedDistanceWeightedMiner,
    FixedShapeMiner,
    HardNegativeMiner,
    IndexedHardNegativeMiner,
    IndexedRothDistanceWeightedMiner,
    MultiSimilarityPairMiner,
    RothDistanceWeightedMiner,
    hard_triplet_indices,
    hard_triplets,
)
from harness.components.losses.proxy_losses import ProxyAnchorLoss
from harness.components.losses.reductions import PML_REDUCTION, ActiveTripletReducer, Reduction
from harness.components.losses.registry import (
    LOSSES,
    MINERS,
    check_loss_args,
    create_loss,
    create_miner,
    loss_defaults,
    loss_reductions,
    miner_for,
)
from harness.components.losses.search_spaces import (
    LOSS_PARAMETER_RATE,
    LOSS_SEARCH_SPACES,
    MINER_SEARCH_SPACES,
    Range,
    loss_search_space,
    miner_search_space,
)
from harness.components.losses.tuple_losses import (
    BinomialDevianceLoss,
    MultiSimilarityLoss,
    QuadrupletLoss,
)

__all__ = [
    "BinomialDevianceLoss",
    "MultiSimilarityLoss",
    "QuadrupletLoss",
    "ProxyAnchorLoss",
    "RothDistanceWeightedMiner",
    "ActiveTripletReducer",
    "LOSSES",
    "MINERS",
    "PML_REDUCTION",
    "Reduction",
    "MetricLoss",
    "create_loss",
    "create_miner",
    "check_loss_args",
    "loss_reductions",
    "step_seed",
    "PrecomputedDistance",
    "distance_replaced",
    "miner_for",
    "loss_defaults",
    "HardNegativeMiner",
    "hard_triplets",
    "MinedTriplets",
    "MinedPairs",
    "MultiSimilarityPairMiner",
    "apply_loss",
    "FixedShapeMiner",
    "FixedDistanceWeightedMiner",
    "IndexedRothDistanceWeightedMiner",
    "IndexedHardNegativeMiner",
    "hard_triplet_indices",
    "LOSS_SEARCH_SPACES",
    "Range",
    "loss_search_space",
    "miner_search_space",
    "MINER_SEARCH_SPACES",
    "LOSS_PARAMETER_RATE",
]
