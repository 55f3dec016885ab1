"""DIABLO's protocols: Sec. 3.5 as data, the multi-scale crop (train) and square resize
(test), Sec. 4.2's run-seeded 50/50 train/val class splits, and the protocol files kept in
step with the ones they extend. CPU only, no training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from harness.base.errors import HarnessError
from harness.cli.main import main
from harness.components.data.transforms import MultiScaleCrop, build_transform
from harness.config.fingerprint import fingerprint
from harness.config.grids import load_grid
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.config.sections import ImageSpec
from harness.engine.grid import sweep
from harness.engine.run.data import prepare_splits
from harness.store.tracking import Tracker
from tests.fixtures import make_cub


def test_diablo_protocol_is_sec_3_5():
    p = load_protocol("diablo")
    assert (p.backbone.name, p.backbone.pretrained, p.embedding.size) == ("googlenet", True, 512)
    assert (
        p.optimizer.name,
        p.optimizer.lr_backbone,
        p.optimizer.lr_head,
        p.optimizer.weight_decay,
    ) == ("adam", 1e-5, 1e-5, 0.0)
    assert p.loss_args("triplet") == {"margin": 0.1}
    assert p.loss_args("contrastive")["neg_margin"] == 0.5
    assert p.loss_args("binomial_deviance") == {
        "alpha": 2.0,
        "margin": 0.5,
        "pos_scale": 1.0,
        "neg_scale": 25.0,
    }
    assert (
        p.image.size,
        p.image.train_transform,
        p.image.multiscale_range,
        p.image.eval_transform,
    ) == (256, "multiscale_crop_flip", (0.8, 1.8), "resize")
    assert p.evaluation.recall_k_for("cub200") == (1, 2, 4, 8, 16, 32)
    assert p.evaluation.recall_k_for("sop") == (1, 10, 100, 1000)
    assert p.evaluation.recall_k_for("inshop") == (1, 10, 20, 30, 40, 50)
    assert p.selection.mode == "validation" and not p.splits.validation_by_run_seed


def _without(data: dict, *keys: str) -> dict:
    return {k: v for k, v in data.items() if k not in keys}


def test_the_ablation_protocol_is_diablo_with_sec_4_2_selection():
    diablo, ablation = load_protocol("diablo").to_dict(), load_protocol("diablo-ablation").to_dict()
    own = ("name", "description", "source", "seeds", "splits", "selection", "datasets")
    assert _without(ablation, *own) == _without(diablo, *own)
    assert ablation["seeds"] == list(range(10))
    assert ablation["splits"] == {
        **diablo["splits"],
        "validation_classes": 0.5,
        "validation_by_run_seed": True,
    }
    assert ablation["selection"] == {**diablo["selection"], "metric": "recall_at_1"}


def test_the_diablo_smoke_protocol_is_smoke_with_diablos_triplet_margin():
    smoke, diablo_smoke = load_protocol("smoke").to_dict(), load_protocol("diablo-smoke").to_dict()
    assert diablo_smoke["loss"]["args"].pop("triplet") == {"margin": 0.1}  # DIABLO Sec. 3.5
    assert smoke["loss"]["args"].pop("triplet") == {"margin": 0.2}
    # smoke.toml runs DIABLO with N = 2 to keep `run --methods all` in budget; the Table 1
    # smoke grid keeps the paper's N = 8 (and 16).
    assert smoke.pop("methods") == {"diablo": {"entries": 2}}
    assert not diablo_smoke.get("methods")
    own = ("name", "description", "source", "methods")
    assert _without(diablo_smoke, *own) == _without(smoke, *own)


@pytest.mark.parametrize("name", ["smoke", "roth2020", "agrouping"])
def test_new_keys_leave_other_protocols_fingerprints_alone(name):
    """multiscale_range and validation_by_run_seed are absent from the canonical form at
    their defaults, so existing runs and sweep cells keep their fingerprints and keys."""
    data = load_protocol(name).to_dict()
    assert (
        "multiscale_range" not in data["image"] and "validation_by_run_seed" not in data["splits"]
    )


def test_run_seeded_carve_is_an_overridable_recorded_key():
    smoke = load_protocol("smoke")
    changed, deviations = apply_overrides(smoke, ["splits.validation_by_run_seed=true"])
    assert (
        changed.splits.validation_by_run_seed
        and changed.to_dict()["splits"]["validation_by_run_seed"]
    )
    assert [str(d) for d in deviations] == ["splits.validation_by_run_seed: False -> True"]
    assert fingerprint(changed, "x") != fingerprint(smoke, "x")


def test_multiscale_crop_needs_its_range(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[image]\ntrain_transform = 'multiscale_crop_flip'\n")
    with pytest.raises(HarnessError, match="image.multiscale_range"):
        load_protocol(path)
    with pytest.raises(HarnessError, match="train transform"):
        build_transform(ImageSpec(train_transform="multiscale_crop"), train=True)


def test_multiscale_crop_samples_the_scale_uniformly_in_its_range_and_outputs_the_crop_size():
    crop = MultiScaleCrop(32, (0.8, 1.8))
    torch.manual_seed(0)
    scales = np.array([crop.sample_scale() for _ in range(4000)])
    assert scales.min() >= 0.8 and scales.max() <= 1.8
    assert scales.min() < 0.81 and scales.max() > 1.79  # the whole range, not a corner of it
    assert abs(np.mean(scales < 1.3) - 0.5) < 0.03  # uniform: half below the midpoint
    assert {crop.side(0.8), crop.side(1.0), crop.side(1.8)} == {26, 32, 58}
    for size in [(10, 40), (200, 90), (32, 32)]:  # any aspect: a square s*32 resize, then the crop
        assert crop(Image.new("RGB", size, (200, 10, 10))).size == (32, 32)
    torch.manual_seed(1)
    first = [crop.sample_scale() for _ in range(5)]
    torch.manual_seed(1)
    assert [crop.sample_scale() for _ in range(5)] == first  # drawn from torch's seeded generator


def test_multiscale_crop_pads_with_the_mean_below_scale_one_and_crops_the_image_above():
    """s < 1: the whole resized image on a mean-coloured canvas (zero after normalisation);
    s > 1: a crop of the resized image, no padding."""
    spec = ImageSpec(
        size=40, resize=40, train_transform="multiscale_crop_flip", multiscale_range=(0.5, 0.5)
    )
    pipeline = build_transform(spec, train=True)
    torch.manual_seed(0)
    out = pipeline(Image.new("RGB", (64, 48), (255, 255, 255)))
    assert tuple(out.shape) == (3, 40, 40)
    white = (out == 255).all(0)
    assert int(white.sum()) == 20 * 20  # the image, resized to 20 x 20, all of it
    mean = torch.tensor([round(255 * m) for m in spec.mean], dtype=out.dtype).view(3, 1)
    assert (out.flatten(1)[:, ~white.flatten()] == mean).all()
    spec = ImageSpec(
        size=40, resize=40, train_transform="multiscale_crop_flip", multiscale_range=(1.5, 1.5)
    )
    out = build_transform(spec, train=True)(Image.new("RGB", (64, 48), (255, 255, 255)))
    assert tuple(out.shape) == (3, 40, 40) and (out == 255).all()


def test_the_eval_transform_resizes_to_a_square_without_cropping():
    out = build_transform(load_protocol("diablo").image, train=False)(Image.new("RGB", (300, 120)))
    assert tuple(out.shape) == (3, 256, 256)


# ------------------------------------------------------------ Sec. 4.2: run-seeded carves


def _classes(images) -> set[int]:
    return set(np.unique(images.labels).tolist())


def test_run_seeded_carves_are_random_class_disjoint_halves_one_per_seed(tmp_path):
    make_cub(tmp_path)  # the official layout: classes 1-100 train, 101-200 test
    protocol = load_protocol("diablo-ablation").for_dataset("cub200")
    a, a_again, b = (prepare_splits(protocol, "cub200", tmp_path, seed=s) for s in (0, 0, 1))
    for splits in (a, b):
        train, val = _classes(splits.train), _classes(splits.val)
        assert (
            len(train) == len(val) == 50 and not train & val and train | val == set(range(1, 101))
        )
        assert _classes(splits.test) == set(range(101, 201))
    assert _classes(a.val) != _classes(b.val)  # two seeds: two splits
    assert (
        _classes(a_again.val) == _classes(a.val) and a_again.digest() == a.digest()
    )  # same seed: same
    assert a.test.keys() == b.test.keys()  # one test set for every seed
    digests = {a.digest(), b.digest()}
    assert len(digests) == 2
    assert len({fingerprint(protocol, d) for d in digests}) == 2  # each split its own fingerprint
    # The fixed carve (splits.seed) ignores the run's seed.
    fixed, _ = apply_overrides(protocol, ["splits.validation_by_run_seed=false"])
    assert _classes(prepare_splits(fixed, "cub200", tmp_path, seed=1).val) == _classes(
        prepare_splits(fixed, "cub200", tmp_path, seed=0).val
    )
    with pytest.raises(HarnessError, match="need the seed of the run"):
        prepare_splits(protocol, "cub200", tmp_path)


def test_sweep_and_run_prepare_one_split_per_seed_when_the_carve_is_run_seeded(tmp_path, workdir):
    """The sweep caches splits per (split, seed) and ``run`` re-carves per seed: each run
    trains on its own seed's split (a CUB tree of small images stands in for the dataset,
    a stand-in that records a finished run for the training)."""
    make_cub(tmp_path, per_class=3)  # 50 training classes of 3 images: a 32 x 4 batch fits
    used: list = []

    def fake_run(cfg, splits=None, on_epoch=None):
        used.append((cfg.seed, frozenset(_classes(splits.val)), id(splits)))
        tracker = Tracker(cfg.experiment or f"{cfg.dataset}-{cfg.protocol.name}", "fake")
        tracker.finish()
        return {
            "method": cfg.method,
            "dataset": cfg.dataset,
            "loss": cfg.loss,
            "seed": cfg.seed,
            "mlflow_run_id": tracker.run_id,
            "metrics": {},
            "protocol": cfg.protocol.name,
            "fingerprint": "f",
            "selection": "validation",
        }

    grid_file = tmp_path / "g.toml"
    grid_file.write_text(
        'protocol = "diablo-ablation"\nmethods = ["plain"]\nlosses = ["binomial_deviance"]\n'
        'backbones = ["googlenet"]\ndatasets = ["cub200"]\nseeds = [0, 1]\n'
    )
    grid = load_grid(grid_file)
    cache: dict = {}
    settings = {"data_root": tmp_path}
    for cell in [*grid.cells, *grid.cells]:  # twice: the second pass is served by the cache
        sweep.run_cell(grid, cell, 0, "s", settings, cache, train=fake_run)
    assert [seed for seed, _, _ in used] == [0, 1, 0, 1] and len(cache) == 2
    assert used[0][1] != used[1][1]  # each seed its own validation classes
    assert used[2][1:] == used[0][1:] and used[3][1:] == used[1][1:]  # the same splits again

    used.clear()
    argv = ["run", "--methods", "plain", "--dataset", "cub200", "--data-root", str(tmp_path)]
    argv += ["--protocol", "diablo-ablation", "--seeds", "3,4", "--loss", "binomial_deviance"]
    assert main(argv, train=fake_run) == 0
    assert [seed for seed, _, _ in used] == [3, 4] and used[0][1] != used[1][1]
