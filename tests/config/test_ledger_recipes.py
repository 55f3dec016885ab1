"""AVSL's and DIML's recipes as released (zbr17/AVSL@fd2686e with zbr17/GeDML@5ce0a09,
wl-zhao/DIML@c15dbea), matched by the reproduce grids or named by a deviation, and the
ledger entries that say so: each test fails where a setting keeps the harness's value
unnamed or an entry cites another configuration than the cells it applies to."""

from __future__ import annotations

import pytest

from harness.config.grids import load_grid
from harness.config.ledger import check_ledger, load_ledger
from harness.config.protocol_files import load_protocol


def _cells(grid: str, **axes):
    return [
        c
        for c in load_grid(grid).cells
        if all(getattr(c, axis) == value for axis, value in axes.items())
    ]


def _checks(paper: str, key: str, **axes):
    return [
        c
        for c in check_ledger(load_ledger(paper))
        if c.entry.key == key and all(getattr(c.case, a) == v for a, v in axes.items())
    ]


# ------------------------------------------------------------------ 1. BatchNorm


@pytest.mark.parametrize("dataset", ["cub200", "cars196"])
def test_avsl_cells_freeze_batchnorm_weights_and_biases_as_well_as_statistics(dataset):
    """resnet50_decom.py:20-25 (GeDML resnet50.py:20-25): eval mode and requires_grad off."""
    cells = _cells("avsl-table1", dataset=dataset)
    assert cells and all(
        c.protocol.backbone.freeze_bn and c.protocol.backbone.freeze_bn_affine for c in cells
    )
    assert {c.status for c in _checks("avsl", "backbone.freeze_bn_affine", dataset=dataset)} == {
        "matched"
    }


def test_avsl_sop_cells_name_both_batchnorm_settings_as_a_deviation():
    checks = _checks("avsl", "backbone.freeze_bn_affine", dataset="sop")
    assert checks and {(c.status, c.entry.value, c.actual) for c in checks} == {
        ("deviating", False, True)
    }
    assert all(
        "frozen_batchnorm_sop" in c.paper_deviations for c in _cells("avsl-table1", dataset="sop")
    )


def test_roth_protocols_keep_batchnorm_affine_trained():
    """DIML@c15dbea and DGML@7834411 architectures/resnet50.py: eval mode only."""
    for name in ("diml", "roth2020", "agrouping"):
        assert load_protocol(name).backbone.freeze_bn_affine is False


# ----------------------------------------------------------------- 2. baseline head


def test_avsl_baseline_pools_average_plus_max_with_a_kaiming_embedder():
    """GeDML basic_models/resnet50.py:37-40 and mlp.py:11-14."""
    cells = _cells("avsl-table1", method="plain")
    assert cells and all(
        c.method_options == {"pool": "avg+max", "init": "kaiming_normal_fan_out"} for c in cells
    )
    assert {c.status for c in _checks("avsl", "methods.plain.pool")} == {"matched"}


# ----------------------------------------------------------------------- 3. epochs


def test_avsl_trains_the_managers_61_epochs_with_the_warm_up_shifted_steps():
    """GeDML base_manager.py:250; the schedulers step only after the 5 warm-up epochs
    (base_trainer.py:334), so x0.5 every 10 stepped epochs falls at 15, 25, ..."""
    milestones = {
        "cub200": (15, 25, 35, 45, 55),
        "cars196": (10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60),
        "sop": (20, 35, 50),
    }
    for dataset, expected in milestones.items():
        protocol = load_protocol("avsl").for_dataset(dataset)
        assert protocol.schedule.epochs == 61
        assert protocol.schedule.milestones == expected
    assert {c.status for c in _checks("avsl", "schedule.epochs")} == {"matched"}
    selection = load_protocol("avsl").deviations["validation_selection"]
    assert "61 epochs" in selection.paper and "15 evaluations" in selection.paper
    assert "flaw" in selection.why and "test split" in selection.why


# ---------------------------------------------------- 4, 5. the Margin rows' settings


def test_margin_avsl_loss_weights_are_args_csv_defaults_through_the_margin_link():
    """args.csv:57-59 (1.0 / 0.2 / 1.0) reach the final loss, level 0 and level 1
    (link_avsl_margin.yaml); level 2 is unweighted: levels [0.2, 1, 1], final 1."""
    checks = _checks("avsl", "methods.avsl.level_weights", method="avsl", loss="margin")
    assert checks and {(tuple(c.entry.value), c.status) for c in checks} == {
        ((0.2, 1.0, 1.0), "deviating")
    }
    assert {c.entry.deviation for c in checks} == {"margin_avsl_loss_weights"}
    final = _checks("avsl", "methods.avsl.final_weight", method="avsl", loss="margin")
    assert final and all("args.csv:57" in c.entry.source for c in final)


def test_the_margin_baseline_rates_are_args_csv_defaults():
    """args.csv:35-36: trunk 1e-5, embedder 1e-4 (no Margin script)."""
    trunk = _checks("avsl", "optimizer.lr_backbone", method="plain", loss="margin")
    assert trunk and {(c.entry.value, c.status) for c in trunk} == {(1e-5, "deviating")}
    head = _checks("avsl", "optimizer.lr_head", method="plain", loss="margin")
    assert head and {(c.entry.value, c.status) for c in head} == {(1e-4, "matched")}


#: Keys whose value the released code sets per configuration: an entry citing a ProxyAnchor
#: script or link for one of them must not apply to a Margin cell.
_PER_CONFIGURATION = (
    "methods.avsl.level_weights",
    "methods.avsl.final_weight",
    "methods.avsl.collector_lr",
    "optimizer.lr_backbone",
    "optimizer.lr_head",
    "schedule.milestones",
    "schedule.gamma",
)
_PROXY_ANCHOR_SOURCES = (
    "samples_avsl.sh",
    "samples_baseline.sh",
    "link_avsl_proxyanchor",
    "link_proxy_anchor",
)


def test_no_entry_applies_a_proxy_anchor_configuration_to_a_margin_cell():
    wrong = sorted(
        {
            f"{c.entry.setting} ({c.entry.source})"
            for c in check_ledger(load_ledger("avsl"))
            if c.case.loss == "margin"
            and c.entry.key in _PER_CONFIGURATION
            and any(s in c.entry.source for s in _PROXY_ANCHOR_SOURCES)
        }
    )
    assert not wrong, wrong


# --------------------------------------------------- 6. the ProxyAnchor baseline


def test_the_released_proxy_anchor_baseline_is_named_not_matched():
    """As released the baseline runs AVSL's loss on the unsquared Euclidean distance (1.8 /
    2.2, alpha 16: args.csv:49-51, metrics/euclid.yaml:3); the CUB and Cars scripts'
    --proxyanchor_* flags are GeDML's, which AVSL's args.csv does not define."""
    for cell in _cells("avsl-table1", loss="proxy_anchor"):
        named = "baseline_proxy_anchor_distance" in cell.paper_deviations
        assert named == (cell.method == "plain")
    plain = _checks("avsl", "loss.args.proxy_anchor.alpha", method="plain")
    assert plain and {(c.entry.value, c.status) for c in plain} == {(16.0, "deviating")}
    for check in check_ledger(load_ledger("avsl")):
        if "--proxyanchor_" in check.entry.source:
            assert check.status != "matched", check.entry.setting


# ---------------------------------------------------------- 7. clipping units


def test_avsl_cells_clip_the_collector_and_each_loss_as_units():
    cells = _cells("avsl-table1", method="avsl")
    assert cells and all(c.method_options["clip_units"] == "code" for c in cells)


# -------------------------------------------------------------- 8. DIML's grid


def test_diml_cells_pool_and_normalise_as_the_released_evaluation():
    """evaluation/eval_diml.py:14-20, 37-39 and utilities/diml.py:32-36."""
    cells = _cells("diml-table1", method="diml")
    assert cells and all(
        c.method_options.get("grid_pool") == "code"
        and c.method_options.get("marginal_norm") == "code"
        for c in cells
    )
    for key in ("methods.diml.grid_pool", "methods.diml.marginal_norm"):
        assert {c.status for c in _checks("diml", key)} == {"matched"}


# -------------------------------------------------------------- ledger texts


def test_a_normalisation_claim_names_the_built_run_check_that_sees_it():
    """A-grouping's unit-norm groups: ``embedding.size`` cannot show a normalisation."""
    for paper in ("agrouping", "avsl", "diml", "diablo", "sam"):
        for entry in load_ledger(paper).entries:
            claims_norm = "normalised" in entry.setting or "unit-norm" in entry.setting
            if claims_norm and entry.key == "embedding.size":
                assert entry.observe == "unit_groups", entry.setting


def test_the_proxy_init_deviation_names_the_baselines_uniform_draw():
    """GeDML proxy_collector.py:104 draws the baseline's proxies by kaiming_uniform_."""
    deviation = load_protocol("avsl").deviations["proxy_init"]
    assert "kaiming_uniform_" in deviation.paper and "proxy_collector.py" in deviation.reference
    assert deviation.losses == ("proxy_anchor",)


def test_the_deviations_command_ends_with_the_new_counts(capsys):
    from harness.cli.main import main

    for grid, ledger in (("avsl-table1", "avsl"), ("diml-table1", "diml")):
        assert main(["deviations", "--grid", grid]) == 0
        out = capsys.readouterr().out.splitlines()
        title = next(i for i, line in enumerate(out) if line.startswith(f"recipe ledger {ledger}"))
        assert len(out) - title == 4 and not any("UNDECLARED" in line for line in out[title:])
