"""Each loss's hyperparameters as an Optuna search space, with where each range comes from.

A tuned grid searches these beside the method's own ``search_space`` and the protocol's
learning rates, so that a baseline loss is tuned as hard as the method it is compared
with (Musgrave et al., "A Metric Learning Reality Check", ECCV 2020, Sec. 4.2: every loss
gets the same budget of Bayesian-optimisation trials over its own parameters). The ranges
are MLRC's where the paper searched the loss (its supplementary's search space, as
powerful-benchmarker's README writes the multi-similarity one); for losses MLRC did not
run, the range around the paper's own sensitivity study.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Range", "LOSS_SEARCH_SPACES", "loss_search_space"]


@dataclass(frozen=True)
class Range:
    """A float searched uniformly in ``[low, high]`` (log-uniformly when ``log``)."""

    low: float
    high: float
    log: bool = False
    #: Where the range comes from.
    source: str = ""

    def suggest(self, trial, name: str) -> float:
        return float(trial.suggest_float(name, self.low, self.high, log=self.log))


_MLRC = "Musgrave et al. 2020, supplementary search space"
_MLRC_MS = "Musgrave et al. 2020; powerful-benchmarker README (MultiSimilarityLoss, 50 iterations)"

#: ``{loss: {argument: Range}}``: the arguments of ``[loss.args.<loss>]`` a tuned grid searches.
LOSS_SEARCH_SPACES: dict[str, dict[str, Range]] = {
    # Wu et al. 2017: the margin alpha and the boundary beta's initial value.
    "margin": {
        "margin": Range(0.0, 1.0, source=_MLRC),
        "beta": Range(0.0, 1.0, source=_MLRC),
    },
    "multi_similarity": {
        "alpha": Range(0.01, 100.0, log=True, source=_MLRC_MS),
        "beta": Range(0.01, 100.0, log=True, source=_MLRC_MS),
        "base": Range(0.0, 1.0, source=_MLRC_MS),
    },
    "triplet": {"margin": Range(0.0, 1.0, source=_MLRC)},
    "contrastive": {
        "pos_margin": Range(0.0, 1.0, source=_MLRC),
        "neg_margin": Range(0.0, 1.0, source=_MLRC),
    },
    # Kim et al. 2020, Sec. 5.4 and Fig. 6: alpha from 4 to 128 and delta from 0 to 0.4
    # (pytorch-metric-learning's defaults, alpha 32 and margin 0.1, inside).
    "proxy_anchor": {
        "alpha": Range(4.0, 128.0, log=True, source="Kim et al. 2020, Sec. 5.4"),
        "margin": Range(0.0, 0.4, source="Kim et al. 2020, Sec. 5.4"),
    },
    # Yi et al. 2014 (A-grouping's Table 1 setting alpha 2, margin 0.5 inside).
    "binomial_deviance": {
        "alpha": Range(0.5, 8.0, log=True, source="Yi et al. 2014, Sec. 3.2"),
        "margin": Range(0.0, 1.0, source="Yi et al. 2014, Sec. 3.2"),
    },
}


def loss_search_space(loss: str) -> dict[str, Range]:
    """The loss's searched arguments (empty for a loss with none listed)."""
    return dict(LOSS_SEARCH_SPACES.get(loss, {}))
