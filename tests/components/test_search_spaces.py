"""The tuned grids' default space is MLRC's: each range equal to the bounds of the search
it cites (powerful-benchmarker's committed Ax plots, read at 222790a: each parameter's
slice grid runs from its lower to its upper bound, log-spaced when log-scaled), the loss
parameters' rate searched, the trunk and head rates and a method's own options not."""

from __future__ import annotations

import pytest

from harness.components.losses import (
    LOSS_PARAMETER_RATE,
    LOSS_SEARCH_SPACES,
    MINER_SEARCH_SPACES,
    loss_search_space,
)
from harness.config.protocol_files import load_protocol
from harness.config.tuning import TuneSpec, study_space

#: (loss, argument) -> (low, high, log, the plot the bounds were read from), transcribed
#: from the plots' search grids; the optima of docs/papers/mlrc.md lines 37-49 beside.
MLRC_CITED = {
    ("margin", "margin"): (-0.2, 2.0, False, "cub_margin_no_weight_decay"),
    ("margin", "beta"): (-0.2, 2.0, False, "cub_margin_no_weight_decay"),
    ("triplet", "margin"): (-0.2, 2.0, False, "cub_triplet"),
    ("contrastive", "pos_margin"): (-0.2, 2.0, False, "cub_contrastive"),
    ("contrastive", "neg_margin"): (-0.2, 2.0, False, "cub_contrastive"),
    ("multi_similarity", "alpha"): (0.01, 100.0, False, "cub_multi_similarity_with_ms_miner"),
    ("multi_similarity", "beta"): (0.01, 100.0, False, "cub_multi_similarity_with_ms_miner"),
    ("multi_similarity", "base"): (0.0, 1.0, False, "cub_multi_similarity_with_ms_miner"),
    ("proxy_nca", "softmax_scale"): (0.01, 100.0, False, "cub_proxy_nca"),
    ("normalized_softmax", "temperature"): (0.01, 100.0, True, "cub_normalized_softmax"),
    ("arcface", "margin"): (0.0, 90.0, False, "cub_arcface"),
    ("arcface", "scale"): (0.01, 200.0, False, "cub_arcface"),
}
#: MLRC's optima (docs/papers/mlrc.md:41, CUB / Cars / SOP / CUB at batch 256).
MARGIN_BETA_OPTIMA = (0.7838, 1.3164, 1.1072, 0.9762)


@pytest.mark.parametrize("key", sorted(MLRC_CITED), ids="-".join)
def test_each_mlrc_range_equals_the_search_it_cites(key):
    loss, arg = key
    low, high, log, plot = MLRC_CITED[key]
    got = LOSS_SEARCH_SPACES[loss][arg]
    assert (got.low, got.high, got.log) == (low, high, log)
    assert f"mlrc_plots/{plot}.html" in got.source and "222790a" in got.source


def test_every_range_cites_a_file_or_a_paper_section():
    for loss, args in {**LOSS_SEARCH_SPACES, **MINER_SEARCH_SPACES}.items():
        for arg, rng in args.items():
            assert rng.low < rng.high, (loss, arg)
            cited = (
                (key := (loss, arg)) in MLRC_CITED or ".html" in rng.source or "Sec." in rng.source
            )
            assert cited and rng.source, key


def test_the_ranges_cover_mlrcs_optima_and_the_protocols_values():
    beta = loss_search_space("margin")["beta"]
    assert all(beta.low <= b <= beta.high for b in (*MARGIN_BETA_OPTIMA, 1.2))  # 1.2: roth2020's
    assert loss_search_space("contrastive")["pos_margin"].low == -0.2  # MLRC's CUB optimum
    epsilon = MINER_SEARCH_SPACES["multi_similarity"]["epsilon"]
    assert (epsilon.low, epsilon.high) == (0.0, 1.0)
    assert "cub_multi_similarity_with_ms_miner" in epsilon.source


def test_a_studys_default_space_is_the_losss_and_its_parameters_rate_not_the_trunks():
    protocol = load_protocol("roth2020")
    spec = TuneSpec(trials=2)
    margin = study_space(spec, "agrouping", "margin", protocol)
    assert set(margin) == {"loss.args.margin.margin", "loss.args.margin.beta", "optimizer.lr_loss"}
    rate = margin["optimizer.lr_loss"]
    assert (rate.low, rate.high, rate.log) == (1e-6, 1.0, True)
    assert "with_metric_loss_optimizer_bayes_opt.yaml:4" in LOSS_PARAMETER_RATE.source
    ms = study_space(spec, "agrouping", "multi_similarity", protocol)
    assert "loss.miners.multi_similarity.args.epsilon" in ms and "optimizer.lr_loss" not in ms
    assert not any(k in ms for k in ("optimizer.lr_head", "optimizer.lr_backbone"))
