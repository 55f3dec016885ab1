"""Protocols as data: validation, overrides as named deviations, fingerprints."""

from __future__ import annotations

import pytest

from harness.base.errors import HarnessError
from harness.config.catalog import list_protocols
from harness.config.fingerprint import fingerprint
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol


@pytest.mark.parametrize("name", ["smoke", "roth2020", "agrouping"])
def test_shipped_protocols_load(name):
    assert name in list_protocols()
    protocol = load_protocol(name)
    assert protocol.name == name
    assert protocol.selection.mode == "validation"  # fair by default
    hash(protocol.canonical_json())


def test_roth2020_matches_the_field_facts():
    p = load_protocol("roth2020")
    assert (p.backbone.name, p.backbone.pretrained, p.backbone.freeze_bn) == (
        "resnet50",
        True,
        True,
    )
    assert (p.sampling.classes_per_batch, p.sampling.samples_per_class) == (56, 2)
    assert (p.optimizer.name, p.optimizer.lr_backbone, p.optimizer.weight_decay) == (
        "adam",
        1e-5,
        4e-4,
    )
    assert (p.image.size, p.image.resize) == (224, 256)
    assert p.evaluation.recall_k_for("sop") == (1, 10, 100, 1000)
    assert p.evaluation.recall_k_for("cub200") == (1, 2, 4, 8)


def test_agrouping_protocol_is_sec_4_3():
    p = load_protocol("agrouping")
    assert p.embedding.size == 512
    assert p.methods["agrouping"]["groups"] == 4
    assert p.optimizer.lr_backbone == 1e-5
    assert p.sampling.batch_size == 112


def _write(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, key",
    [
        ("seedz = [0]\n", "seedz"),
        ("[optimizer]\nlr_bakbone = 1e-5\n", "optimizer.lr_bakbone"),
        ("[backbone]\nname = 'resnet50'\npretrainde = true\n", "backbone.pretrainde"),
    ],
)
def test_unknown_key_is_an_error_naming_it(tmp_path, text, key):
    with pytest.raises(HarnessError, match=f"unknown protocol key '{key}'"):
        load_protocol(_write(tmp_path, text))


def test_mistyped_value_names_the_key(tmp_path):
    with pytest.raises(
        HarnessError,
        match="protocol key 'embedding.size' = \"big\": expected an integer >= 2 and <= 8192",
    ):
        load_protocol(_write(tmp_path, "[embedding]\nsize = 'big'\n"))


def test_invalid_selection_mode(tmp_path):
    with pytest.raises(HarnessError, match="selection.mode"):
        load_protocol(_write(tmp_path, "[selection]\nmode = 'test'\n"))


def test_malformed_toml_names_the_file(tmp_path):
    with pytest.raises(HarnessError, match="malformed protocol file"):
        load_protocol(_write(tmp_path, "[optimizer\n"))


def test_unknown_protocol_lists_valid_names():
    with pytest.raises(HarnessError, match="unknown protocol 'smok'.*smoke"):
        load_protocol("smok")


def test_override_is_a_named_deviation_and_changes_the_fingerprint():
    p = load_protocol("smoke")
    q, deviations = apply_overrides(p, ["schedule.epochs=7", "optimizer.lr_head=2e-4"])
    assert q.schedule.epochs == 7 and q.optimizer.lr_head == 2e-4
    assert {d.field for d in deviations} == {"schedule.epochs", "optimizer.lr_head"}
    assert str(deviations[0]) == "schedule.epochs: 1 -> 7"
    assert fingerprint(p, "split") != fingerprint(q, "split")


def test_override_to_the_same_value_is_no_deviation():
    p = load_protocol("smoke")
    _, deviations = apply_overrides(p, {"schedule.epochs": p.schedule.epochs})
    assert deviations == ()


def test_override_of_unknown_field_is_an_error():
    with pytest.raises(HarnessError, match="unknown protocol key 'schedule.epoch'"):
        apply_overrides(load_protocol("smoke"), ["schedule.epoch=3"])


def test_fingerprint_covers_protocol_split_and_loss():
    p = load_protocol("smoke")
    base = fingerprint(p, "a", loss="margin")
    assert base == fingerprint(load_protocol("smoke"), "a", loss="margin")  # stable
    assert base != fingerprint(p, "b", loss="margin")
    assert base != fingerprint(p, "a", loss="triplet")
    assert len(base) == 16


def test_protocol_is_frozen():
    p = load_protocol("smoke")
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        p.schedule.epochs = 5  # type: ignore[misc]


def test_validation_selection_needs_validation_classes(tmp_path):
    with pytest.raises(
        HarnessError, match="'splits.validation_classes' = 0.0: expected > 0 when selection.mode is"
    ):
        load_protocol(_write(tmp_path, "[splits]\nvalidation_classes = 0.0\n"))
    paper = load_protocol(
        _write(tmp_path, "[splits]\nvalidation_classes = 0.0\n[selection]\nmode = 'test-paper'\n")
    )
    assert paper.selection.mode == "test-paper"


@pytest.mark.parametrize("name", list_protocols())
def test_every_shipped_protocol_builds_its_method_options(name):
    """Method options a protocol fixes are real options of registered plugins."""
    from harness.methods import create_method

    protocol = load_protocol(name)
    for method, options in protocol.methods.items():
        head = create_method(
            method,
            channels={"s8": 8, "s16": 16, "s32": 64},
            embedding_size=protocol.embedding.size,
            **options,
        )
        assert head.embedding_size == protocol.embedding.size


def test_dataset_sections_are_part_of_the_protocol_not_deviations():
    roth = load_protocol("roth2020")
    sop, cub = roth.for_dataset("sop"), roth.for_dataset("cub200")
    assert (sop.schedule.epochs, cub.schedule.epochs) == (
        100,
        150,
    )  # Roth et al.'s code: sop_runs.sh --n_epochs 100
    assert sop.for_dataset("sop") == sop and not sop.datasets  # resolved once: idempotent
    # An override made after resolution stays in force and is measured against 100.
    overridden, deviations = apply_overrides(sop, ["schedule.epochs=3"])
    assert overridden.for_dataset("sop").schedule.epochs == 3
    assert [str(d) for d in deviations] == ["schedule.epochs: 100 -> 3"]
    # A protocol without sections keeps its canonical form (and fingerprints) unchanged.
    assert "datasets" not in load_protocol("smoke").for_dataset("synthetic").to_dict()


def test_grid_cells_take_the_dataset_section():
    from harness.config.grids import load_grid

    cells = load_grid("diml-table1").cells
    assert {c.protocol.schedule.epochs for c in cells if c.dataset == "sop"} == {100}
    assert {c.protocol.schedule.epochs for c in cells if c.dataset != "sop"} == {150}
    assert all(not c.deviations for c in cells)


@pytest.mark.parametrize(
    "section, message",
    [
        (
            "[datasets.sop.schedule]\nepohcs = 100\n",
            "section datasets.sop: unknown protocol key 'schedule.epohcs'",
        ),
        (
            "[datasets.sop.embedding]\nsize = 'big'\n",
            "section datasets.sop: protocol key 'embedding.size' = \"big\": expected an integer >= 2 and <= 8192",
        ),
        ("[datasets.sop]\nname = 'x'\n", "'datasets.sop' must be a table of protocol settings"),
    ],
)
def test_bad_dataset_sections_fail_at_load_naming_the_key(tmp_path, section, message):
    with pytest.raises(HarnessError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_protocol(_write(tmp_path, section))


def test_set_accepts_any_declared_method_option_and_records_it():
    """``--set methods.<m>.<opt>=v`` for an option the protocol file does not list: accepted,
    a deviation from the method's default; setting the default changes nothing."""
    from harness.config.fingerprint import fingerprint
    from harness.config.protocol import apply_overrides
    from harness.config.protocol_files import load_protocol

    smoke = load_protocol("smoke")
    assert "agrouping" not in smoke.methods
    changed, deviations = apply_overrides(smoke, ["methods.agrouping.groups=2"])
    assert changed.methods["agrouping"] == {"groups": 2}
    assert [(d.field, d.protocol_value, d.value) for d in deviations] == [
        ("methods.agrouping.groups", 4, 2)
    ]
    assert fingerprint(changed, "x") != fingerprint(smoke, "x")
    same, none = apply_overrides(smoke, ["methods.agrouping.groups=4"])
    assert none == () and fingerprint(same, "x") == fingerprint(smoke, "x")
    with pytest.raises(HarnessError, match="unknown option 'group' for method 'agrouping'"):
        apply_overrides(smoke, ["methods.agrouping.group=2"])


def test_agrouping_schedules_are_dgml_masters_per_dataset_configs():
    """DGML-master configs/<dataset>.yaml: n_epochs, MultiStepLR milestones (tau), gamma 0.3."""
    for name in ("agrouping", "agrouping-sec42", "agrouping-googlenet"):
        p = load_protocol(name)
        got = {
            d: (s.name, s.epochs, s.milestones, s.gamma)
            for d in ("cub200", "cars196", "sop", "inshop")
            for s in [p.for_dataset(d).schedule]
        }
        assert got == {
            "cub200": ("multistep", 100, (55,), 0.3),
            "cars196": ("multistep", 200, (100,), 0.3),
            "sop": ("multistep", 150, (100,), 0.3),
            "inshop": ("multistep", 150, (100,), 0.3),
        }, name
    # Table 4 reports SOP R@2.
    assert 2 in load_protocol("agrouping").evaluation.recall_k_for("sop")


def test_a_loss_can_have_its_own_miner_in_the_protocol():
    """``[loss.miners.<loss>]``: A-grouping's binomial deviance takes all pairs (DGML-master's
    criterion has no batch miner) while its margin and contrastive losses keep the protocol's."""
    from harness.components.losses import miner_for

    p = load_protocol("agrouping")
    assert miner_for(
        "binomial_deviance", p.miner.name, p.miner.args, loss_miners=p.loss.miners
    ) == ("none", {})
    assert (
        miner_for("margin", p.miner.name, p.miner.args, loss_miners=p.loss.miners)[0]
        == "distance_weighted_roth"
    )
    assert (
        miner_for("contrastive", p.miner.name, p.miner.args, loss_miners=p.loss.miners)[0]
        == "distance_weighted_roth"
    )
    # Protocols without the section keep their canonical form, hence their fingerprints.
    for name in ("smoke", "roth2020", "diablo"):
        assert "miners" not in load_protocol(name).to_dict()["loss"]


@pytest.mark.parametrize(
    "section, message",
    [
        ("[loss.miners.binomal]\nname = 'none'\n", "'loss.miners.binomal': unknown loss 'binomal'"),
        (
            "[loss.miners.margin]\nname = 'distance'\n",
            "'loss.miners.margin.name': unknown miner 'distance'",
        ),
        (
            "[loss.miners.margin]\nname = 'none'\nargz = {}\n",
            "unknown protocol key 'loss.miners.margin.argz'",
        ),
        (
            "[loss.miners.margin]\nargs = {}\n",
            "'loss.miners.margin' must be a table with a miner 'name'",
        ),
    ],
)
def test_bad_loss_miners_fail_at_load_naming_the_key(tmp_path, section, message):
    with pytest.raises(HarnessError, match=message.replace(".", r"\.")):
        load_protocol(_write(tmp_path, section))


def test_roth2020_samples_with_roth_et_als_distance_weighted_miner():
    """Roth et al. 2020's code (and the DIML and DGML copies of it): no upper cutoff, one
    triplet per anchor; not PML's DistanceWeightedMiner."""
    from harness.components.losses import RothDistanceWeightedMiner, create_miner

    for name in ("roth2020", "agrouping", "agrouping-sec42", "agrouping-googlenet"):
        p = load_protocol(name)
        assert isinstance(create_miner(p.miner.name, p.miner.args), RothDistanceWeightedMiner), name
    assert load_protocol("roth2020").miner.args == {"cutoff": 0.5}


def test_training_section_is_out_of_the_fingerprint_and_checked():
    base = load_protocol("smoke")
    assert (
        "training" not in base.to_dict()
    )  # absent at its defaults: shipped canonical forms unchanged
    changed, deviations = apply_overrides(base, {"training.sync_every": 7})
    assert changed.training.sync_every == 7 and changed.to_dict()["training"] == {"sync_every": 7}
    assert deviations == ()  # it changes no number: no run is flagged for it
    assert fingerprint(changed, "split") == fingerprint(base, "split")
    with pytest.raises(HarnessError, match="training.sync_every"):
        apply_overrides(base, {"training.sync_every": 0})


def test_evaluation_examples_is_out_of_the_fingerprint_and_checked():
    base = load_protocol("smoke")
    assert base.evaluation.examples == 6
    # absent at its default: shipped canonical forms (and cell keys) unchanged
    assert "examples" not in base.to_dict()["evaluation"]
    for count in (0, 12):
        changed, deviations = apply_overrides(base, {"evaluation.examples": count})
        assert changed.evaluation.examples == count and deviations == ()  # nothing to flag
        assert changed.to_dict()["evaluation"]["examples"] == count
        assert fingerprint(changed, "split") == fingerprint(base, "split")
    other, deviations = apply_overrides(base, {"evaluation.batch_size": 7})
    assert fingerprint(other, "split") != fingerprint(base, "split")  # its section still counts
    assert [d.field for d in deviations] == ["evaluation.batch_size"]
    for bad in (-1, 61):
        with pytest.raises(HarnessError, match="evaluation.examples"):
            apply_overrides(base, {"evaluation.examples": bad})


def test_the_maps_points_are_out_of_the_fingerprint_and_checked():
    smoke, fair = load_protocol("smoke"), load_protocol("roth2020")
    assert smoke.evaluation.map_points == 500 and fair.evaluation.map_points == 5000
    assert "map_points" not in fair.to_dict()["evaluation"]  # absent at its default
    changed, deviations = apply_overrides(fair, {"evaluation.map_points": 500})
    assert deviations == () and fingerprint(changed, "split") == fingerprint(fair, "split")
    for bad in (49, 5001):
        with pytest.raises(HarnessError, match="evaluation.map_points"):
            apply_overrides(fair, {"evaluation.map_points": bad})


def test_a_protocol_file_is_read_again_when_its_text_changes(tmp_path):
    path = tmp_path / "edited.toml"
    path.write_text('name = "edited"\n[embedding]\nsize = 64\n')
    first = load_protocol(path)
    assert load_protocol(path) is first  # the same text: parsed once
    path.write_text('name = "edited"\n[embedding]\nsize = 32\n')  # same size, new value
    assert load_protocol(path).embedding.size == 32
    path.write_text('name = "edited"\n[embedding]\nsize = "wide"\n')
    with pytest.raises(HarnessError, match="embedding.size"):
        load_protocol(path)
