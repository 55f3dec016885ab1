"""Each loss's hyperparameters as an Optuna search space, with where each range comes from.

A tuned grid searches these beside the method's own ``search_space`` and the protocol's
learning rates, so that a baseline loss is tuned as hard as the method it is compared
with (Musgrave et al., "A Metric Learning Reality Check", ECCV 2020, Sec. 4.2: every loss
gets the same budget of Bayesian-optimisation trials over its own parameters). The ranges
are MLRC's where the paper searched the loss (the bounds of its committed search plots,
:data:`MLRC_PLOTS`; CUB's where the datasets' differ, each cited beside its range); for
losses MLRC did not run, the range around the paper's own sensitivity study.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Range",
    "LOSS_SEARCH_SPACES",
    "MINER_SEARCH_SPACES",
    "LOSS_PARAMETER_RATE",
    "MLRC_PLOTS",
    "loss_search_space",
    "miner_search_space",
]


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


#: Where MLRC's ranges are written down. powerful-benchmarker's ``metric-learning`` branch
#: (commit 222790a) keeps no configuration file of the loss ranges; the authors committed
#: the Ax plots of every search (``docs/papers/mlrc_plots/<dataset>_<loss>.html``), whose
#: slice and contour grids run from each parameter's lower to its upper bound (log-spaced
#: for a log-scaled parameter): the bounds below are those grids' first and last values.
#: The optima are the supplementary's table (``docs/papers/mlrc.md``, lines 35-49).
MLRC_PLOTS = "powerful-benchmarker@222790a docs/papers/mlrc_plots"


def _mlrc(plot: str, optimum_line: int) -> str:
    return f"{MLRC_PLOTS}/{plot}.html (Ax search grid bounds); optima docs/papers/mlrc.md:{optimum_line}"


#: ``{loss: {argument: Range}}``: the arguments of ``[loss.args.<loss>]`` a tuned grid searches.
LOSS_SEARCH_SPACES: dict[str, dict[str, Range]] = {
    # Wu et al. 2017: the margin alpha and the boundary beta's initial value (learned per
    # class, at the loss parameters' rate). MLRC's optima: beta 0.78-1.32.
    "margin": {
        "margin": Range(-0.2, 2.0, source=_mlrc("cub_margin_no_weight_decay", 41)),
        "beta": Range(-0.2, 2.0, source=_mlrc("cub_margin_no_weight_decay", 41)),
    },
    # With its miner, as the harness always runs it (MLRC's "with_ms_miner" search).
    # Linear, not log: the plots' grids are evenly spaced (the README's example of a
    # log-scaled range is an example, not MLRC's search). Optima: alpha 7.49-17.97.
    "multi_similarity": {
        "alpha": Range(0.01, 100.0, source=_mlrc("cub_multi_similarity_with_ms_miner", 49)),
        "beta": Range(0.01, 100.0, source=_mlrc("cub_multi_similarity_with_ms_miner", 49)),
        "base": Range(0.0, 1.0, source=_mlrc("cub_multi_similarity_with_ms_miner", 49)),
    },
    "triplet": {"margin": Range(-0.2, 2.0, source=_mlrc("cub_triplet", 38))},
    # Euclidean distance (pytorch-metric-learning's default, as MLRC ran it); the positive
    # margin may be negative (MLRC's CUB optimum: -0.2, the range's lower end).
    "contrastive": {
        "pos_margin": Range(-0.2, 2.0, source=_mlrc("cub_contrastive", 37)),
        "neg_margin": Range(-0.2, 2.0, source=_mlrc("cub_contrastive", 37)),
    },
    "proxy_nca": {"softmax_scale": Range(0.01, 100.0, source=_mlrc("cub_proxy_nca", 40))},
    "normalized_softmax": {
        "temperature": Range(0.01, 100.0, log=True, source=_mlrc("cub_normalized_softmax", 43))
    },
    # ArcFace's margin in degrees, as pytorch-metric-learning takes it.
    "arcface": {
        "margin": Range(0.0, 90.0, source=_mlrc("cub_arcface", 45)),
        "scale": Range(0.01, 200.0, source=_mlrc("cub_arcface", 45)),
    },
    # Not in MLRC. Kim et al. 2020, Sec. 5.4 and Fig. 6: alpha from 4 to 128 and delta from
    # 0 to 0.4 (pytorch-metric-learning's defaults, alpha 32 and margin 0.1, inside).
    "proxy_anchor": {
        "alpha": Range(4.0, 128.0, log=True, source="Kim et al. 2020, Sec. 5.4 and Fig. 6"),
        "margin": Range(0.0, 0.4, source="Kim et al. 2020, Sec. 5.4 and Fig. 6"),
    },
    # Not in MLRC. Yi et al. 2014 (A-grouping's Table 1 setting alpha 2, margin 0.5 inside).
    "binomial_deviance": {
        "alpha": Range(0.5, 8.0, log=True, source="Yi et al. 2014, Sec. 3.2"),
        "margin": Range(0.0, 1.0, source="Yi et al. 2014, Sec. 3.2"),
    },
}

#: ``{loss: {miner argument: Range}}``: the arguments of the miner a loss brings (MLRC
#: searched multi-similarity's miner with the loss, "multi_similarity_with_ms_miner").
MINER_SEARCH_SPACES: dict[str, dict[str, Range]] = {
    "multi_similarity": {
        "epsilon": Range(0.0, 1.0, source=_mlrc("cub_multi_similarity_with_ms_miner", 49))
    },
}

#: The loss parameters' learning rate (a margin loss's betas, a proxy loss's proxies):
#: MLRC's metric-loss optimizer, RMSprop with a Bayesian-searched log-uniform rate; the
#: trunk's and embedder's rates were fixed (``config_optimizers/default.yaml`` lines 1-11).
LOSS_PARAMETER_RATE = Range(
    1e-6,
    1.0,
    log=True,
    source="powerful-benchmarker@222790a src/powerful_benchmarker/configs/config_optimizers/"
    "with_metric_loss_optimizer_bayes_opt.yaml:4",
)


def miner_search_space(loss: str) -> dict[str, Range]:
    """The searched arguments of the miner ``loss`` brings (empty for none)."""
    return dict(MINER_SEARCH_SPACES.get(loss, {}))


def loss_search_space(loss: str) -> dict[str, Range]:
    """The loss's searched arguments (empty for a loss with none listed)."""
    return dict(LOSS_SEARCH_SPACES.get(loss, {}))
