"""Dataset loaders on fixture trees in the official formats, and the split rules."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from PIL import Image

from harness.base.errors import HarnessError
from harness.components.data import (
    DATASETS,
    ArrayImageSet,
    cap_per_class,
    carve_validation,
    indices_by_class,
    seen_class_control,
)
from harness.components.data.fashion_mnist import read_idx
from harness.components.data.synthetic import (
    PARTS,
    generate,
    load_part_mask,
    load_synthetic,
    make_classes,
    render,
)
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.engine.run.data import prepare_splits
from tests.fixtures import make_cars, make_cub, make_fashion_mnist, make_inshop, make_sop


def _disjoint(a, b):
    return not set(np.unique(a.labels)) & set(np.unique(b.labels))


def test_cub200_official_split(tmp_path):
    make_cub(tmp_path)
    splits = DATASETS.get("cub200").load(tmp_path)
    assert set(np.unique(splits.train.labels)) == set(range(1, 101))
    assert set(np.unique(splits.test.labels)) == set(range(101, 201))
    assert len(splits.train) == len(splits.test) == 200
    assert splits.train.read(0).size == (24, 20)
    # The root may be given as the dataset folder itself, too.
    assert len(DATASETS.get("cub200").load(tmp_path / "CUB_200_2011").test) == 200


def test_cars196_reads_the_mat_file_and_ignores_its_test_flag(tmp_path):
    make_cars(tmp_path)
    splits = DATASETS.get("cars196").load(tmp_path)
    assert set(np.unique(splits.train.labels)) == set(range(1, 99))
    assert set(np.unique(splits.test.labels)) == set(range(99, 197))
    assert len(splits.train) == 98 * 2
    assert splits.test.read(0).mode == "RGB"


def test_sop_reads_ebay_files(tmp_path):
    make_sop(tmp_path)
    splits = DATASETS.get("sop").load(tmp_path)
    assert splits.train.num_classes == 6 and splits.test.num_classes == 5
    assert _disjoint(splits.train, splits.test)
    assert splits.gallery is None
    splits.test.read(len(splits.test) - 1)


def test_sop_rejects_a_wrong_header(tmp_path):
    base = make_sop(tmp_path)
    (base / "Ebay_train.txt").write_text("id class path\n1 1 x.jpg\n")
    with pytest.raises(HarnessError, match="expected header"):
        DATASETS.get("sop").load(tmp_path)


def test_inshop_query_against_gallery(tmp_path):
    make_inshop(tmp_path)
    splits = DATASETS.get("inshop").load(tmp_path)
    assert (len(splits.train), len(splits.test), len(splits.gallery)) == (7, 4, 6)
    assert set(splits.test.labels) == {4, 5, 6}
    assert set(splits.gallery.labels) == {4, 5, 6, 7}
    assert _disjoint(splits.train, splits.test)
    splits.gallery.read(0)


@pytest.mark.parametrize(
    "name, marker",
    [
        ("cub200", "images.txt"),
        ("cars196", "cars_annos.mat"),
        ("sop", "Ebay_train.txt"),
        ("inshop", "list_eval_partition.txt"),
    ],
)
def test_missing_dataset_names_the_expected_file(tmp_path, name, marker):
    with pytest.raises(HarnessError, match=f"dataset '{name}' not found: expected .*{marker}"):
        DATASETS.get(name).load(tmp_path)


def test_fashion_mnist_zero_shot_split(tmp_path):
    make_fashion_mnist(tmp_path)
    splits = DATASETS.get("fashion-mnist").load(tmp_path)
    assert set(splits.train.labels) == {0, 1, 2, 3, 4}
    assert set(splits.test.labels) == {5, 6, 7, 8, 9}
    assert len(splits.train) == len(splits.test) == 30  # train and t10k pooled
    assert splits.train.read(0).size == (28, 28)


def test_idx_reader_rejects_truncated_files(tmp_path):
    base = make_fashion_mnist(tmp_path)
    import gzip

    data = gzip.open(base / "train-images-idx3-ubyte.gz").read()
    bad = tmp_path / "bad-idx3-ubyte"
    bad.write_bytes(data[:-10])
    with pytest.raises(HarnessError, match="truncated"):
        read_idx(bad)


def test_carve_validation_is_class_disjoint_and_seeded(tmp_path):
    make_cub(tmp_path)
    a = carve_validation(DATASETS.get("cub200").load(tmp_path), 0.2, seed=3)
    b = carve_validation(DATASETS.get("cub200").load(tmp_path), 0.2, seed=3)
    c = carve_validation(DATASETS.get("cub200").load(tmp_path), 0.2, seed=4)
    assert a.val.num_classes == 20 and a.train.num_classes == 80
    assert _disjoint(a.train, a.val) and _disjoint(a.val, a.test)
    assert np.array_equal(a.val.labels, b.val.labels)
    assert not np.array_equal(a.val.labels, c.val.labels)
    assert a.digest() == b.digest() != c.digest()


def test_carve_validation_refuses_too_few_classes(tmp_path):
    make_sop(tmp_path, train_classes=2)
    with pytest.raises(HarnessError, match="too few classes"):
        carve_validation(DATASETS.get("sop").load(tmp_path), 0.5, seed=0)


def test_cap_per_class(tmp_path):
    make_cub(tmp_path, per_class=3)
    capped = cap_per_class(DATASETS.get("cub200").load(tmp_path).train, 2, seed=0)
    assert np.bincount(capped.labels).max() == 2 and capped.num_classes == 100


def test_capping_keeps_the_images_a_scan_of_each_class_keeps():
    """The grouping by one sort gives each class's indices in the order, and the seeded
    draws, of a scan of the labels per class (unsorted labels, classes of 1 to 9 images)."""
    labels = np.random.default_rng(3).integers(0, 40, 200)
    draws, kept = np.random.default_rng(7), []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        assert np.array_equal(indices_by_class(labels)[len(kept)], idx)
        kept.append(np.sort(draws.choice(idx, size=4, replace=False)) if idx.size > 4 else idx)
    images = ArrayImageSet(np.zeros((200, 2, 2, 3), np.uint8), labels)
    capped = cap_per_class(images, 4, seed=7)
    assert np.array_equal(capped.labels, labels[np.sort(np.concatenate(kept))])


def test_seen_class_control_trains_on_other_images_of_the_test_classes(tmp_path):
    make_fashion_mnist(tmp_path)  # 6 images per class
    protocol, _ = apply_overrides(
        load_protocol("smoke"),
        ["splits.max_test_images_per_class=4", "splits.max_train_images_per_class=2"],
    )
    real = prepare_splits(protocol, "fashion-mnist", tmp_path)
    control = prepare_splits(protocol, "fashion-mnist", tmp_path, control="seen-class")
    assert list(control.test.keys()) == list(real.test.keys())
    assert list(control.val.keys()) == list(real.val.keys())
    assert set(control.train.labels) == set(control.test.labels) == {5, 6, 7, 8, 9}
    assert not set(control.train.keys()) & set(control.test.keys())
    assert np.bincount(control.train.labels).max() == 2
    assert control.digest() != real.digest()


def test_shuffled_labels_control_permutes_the_training_labels_only(tmp_path):
    make_fashion_mnist(tmp_path)
    protocol = load_protocol("smoke")
    real = prepare_splits(protocol, "fashion-mnist", tmp_path)
    control = prepare_splits(protocol, "fashion-mnist", tmp_path, control="shuffled-labels")
    assert list(control.train.keys()) == list(real.train.keys())
    assert sorted(control.train.labels) == sorted(real.train.labels)
    assert (control.train.labels != real.train.labels).mean() > 0.5
    assert list(control.test.labels) == list(real.test.labels)
    assert list(control.val.labels) == list(real.val.labels)
    assert control.digest() != real.digest()
    again = prepare_splits(protocol, "fashion-mnist", tmp_path, control="shuffled-labels")
    assert again.digest() == control.digest()  # seeded: a rerun trains on the same labels
    with pytest.raises(HarnessError, match="unknown control"):
        prepare_splits(protocol, "fashion-mnist", tmp_path, control="shuffled")


def test_seen_class_control_needs_spare_test_class_images(tmp_path):
    make_fashion_mnist(tmp_path)
    with pytest.raises(HarnessError, match="tests on all of them"):
        prepare_splits(load_protocol("smoke"), "fashion-mnist", tmp_path, control="seen-class")
    make_inshop(tmp_path)
    inshop = DATASETS.get("inshop").load(tmp_path)
    with pytest.raises(HarnessError, match="against a gallery"):
        seen_class_control(inshop, inshop.test, 0, 0)


def test_synthetic_is_deterministic_and_has_part_masks(tmp_path):
    a = generate(tmp_path / "a", seed=5, num_classes=4, images_per_class=2, size=48)
    b = generate(tmp_path / "b", seed=5, num_classes=4, images_per_class=2, size=48)
    files = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    assert len(files) == 16  # 8 images + 8 masks
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes()
    # The pack training reads holds each PNG's pixels, in the manifest's order.
    items = json.loads((a / "manifest.json").read_text())["items"]
    decoded = [np.asarray(Image.open(a / it["path"]).convert("RGB")) for it in items]
    assert np.array_equal(np.load(a / "images.npy"), np.stack(decoded))
    mask = load_part_mask(a, "masks/000/000.png")
    assert mask.shape == (48, 48)
    assert (
        set(np.unique(mask)) <= set(range(len(PARTS) + 1))
        and (mask > 0).any()
        and (mask == 0).any()
    )
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written left behind


def _rendered_digest(framing: str) -> str:
    digest = hashlib.sha256()
    for c, cls in enumerate(make_classes(np.random.default_rng(5), 4)):
        for i in range(2):
            image, labels = render(cls, np.random.default_rng([5, c, i]), 48, framing)
            digest.update(image.tobytes())
            digest.update(labels.tobytes())
    return digest.hexdigest()[:16]


def test_the_wide_framing_renders_the_synthetic_set_pixel_for_pixel_as_it_always_did():
    assert _rendered_digest("wide") == "90c8943f40e2771b"
    assert _rendered_digest("closeup") != "90c8943f40e2771b"


def test_the_closeup_set_draws_the_same_classes_and_scenes_with_larger_creatures(tmp_path):
    wide = load_synthetic(tmp_path, 5, num_classes=4, images_per_class=2, size=64)
    close = load_synthetic(
        tmp_path, 5, num_classes=4, images_per_class=2, size=64, framing="closeup"
    )
    assert close.name == "synthetic-closeup" and wide.name == "synthetic"
    assert close.extras["root"] != wide.extras["root"]
    assert close.train.keys() == wide.train.keys() and (close.test.labels == wide.test.labels).all()

    def object_share(splits):
        masks = [load_part_mask(splits.extras["root"], m) for m in splits.extras["masks"].values()]
        return np.mean([(m > 0).mean() for m in masks])

    assert object_share(close) > 2 * object_share(wide)
    # the same background draws: a corner pixel no creature reaches is the same
    first = wide.train.keys()[0]
    wide_mask = load_part_mask(wide.extras["root"], wide.extras["masks"][first])
    close_mask = load_part_mask(close.extras["root"], close.extras["masks"][first])
    free = (wide_mask == 0) & (close_mask == 0)
    assert free.any()
    same = np.asarray(wide.train.read(0)) == np.asarray(close.train.read(0))
    assert same.all(-1)[free].mean() > 0.99


def test_synthetic_registry_entry(data_root):
    splits = DATASETS.get("synthetic").load(data_root)
    assert splits.train.num_classes == 60 and splits.test.num_classes == 60
    assert _disjoint(splits.train, splits.test)
    assert len(splits.train) == 60 * 24
    path = splits.train.keys()[0]
    mask = load_part_mask(splits.extras["root"], splits.extras["masks"][path])
    assert mask.shape == (128, 128)


# ------------------------------------------------------- checks on every load


def test_a_class_in_both_train_and_test_is_refused(tmp_path):
    base = make_sop(tmp_path)
    test_file = base / "Ebay_test.txt"
    lines = test_file.read_text().splitlines()
    image_id, _, super_id, path = lines[1].split()
    test_file.write_text(
        "\n".join([*lines, f"{int(image_id) + 1000} 1 {super_id} {path}"]) + "\n"
    )  # class 1 trains
    with pytest.raises(
        HarnessError,
        match="1 class\\(es\\) are in both the training and the test split \\(e.g. class 1\\)",
    ):
        DATASETS.get("sop").load(tmp_path)
    inshop = make_inshop(tmp_path / "shop")
    listing = inshop / "list_eval_partition.txt"
    listing.write_text(listing.read_text().replace("id_00000004 query", "id_00000001 query", 1))
    with pytest.raises(HarnessError, match="class-disjoint"):
        DATASETS.get("inshop").load(tmp_path / "shop")


def _cub_index(root, per_class):
    """CUB index files only (the loader reads no image): ``per_class[c - 1]`` images of class c."""
    base = root / "CUB_200_2011"
    base.mkdir(parents=True)
    images, labels, image_id = [], [], 1
    for c, count in enumerate(per_class, start=1):
        for i in range(count):
            images.append(f"{image_id} {c:03d}.Bird/{i}.jpg")
            labels.append(f"{image_id} {c}")
            image_id += 1
    (base / "images.txt").write_text("\n".join(images) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")


def test_a_full_tree_must_have_the_official_counts(tmp_path, capsys):
    """CUB: 5,864 train images of classes 1-100, 5,924 test of 101-200 (Wah et al. 2011;
    DIML Sec. 4.1). A tree listing as many images as the release is held to them; a
    smaller one is partial (the test fixtures): one stderr line, no check."""
    official = [59] * 64 + [58] * 36 + [60] * 24 + [59] * 76  # 5,864 + 5,924 = 11,788
    _cub_index(tmp_path / "ok", official)
    splits = DATASETS.get("cub200").load(tmp_path / "ok")
    assert (len(splits.train), len(splits.test)) == (5_864, 5_924)
    assert capsys.readouterr().err == ""
    moved = [
        *official[:99],
        official[99] - 1,
        official[100] + 1,
        *official[101:],
    ]  # one image, other class
    _cub_index(tmp_path / "moved", moved)
    with pytest.raises(
        HarnessError,
        match="lists 11,788 images, a full release, but not the official splits: "
        "train images 5,863 \\(official 5,864\\), test images 5,925",
    ):
        DATASETS.get("cub200").load(tmp_path / "moved")
    _cub_index(tmp_path / "more", [*official[:-1], official[-1] + 5])
    with pytest.raises(HarnessError, match="test images 5,929 \\(official 5,924\\)"):
        DATASETS.get("cub200").load(tmp_path / "more")
    make_cub(tmp_path / "fixture")
    DATASETS.get("cub200").load(tmp_path / "fixture")
    assert (
        "400 of the official release's 11,788 images listed (a partial tree)"
        in capsys.readouterr().err
    )


def test_official_counts_match_the_seed_papers():
    """DIML / AVSL / A-grouping Sec. 4.1, DIABLO Sec. 5; In-Shop: Liu et al. 2016."""
    counts = {name: DATASETS.get(name).official for name in ("cub200", "cars196", "sop", "inshop")}
    assert {n: (c.images, c.train_classes + c.test_classes) for n, c in counts.items()} == {
        "cub200": (11_788, 200),
        "cars196": (16_185, 196),
        "sop": (120_053, 22_634),
        "inshop": (52_712, 7_982),
    }
    assert (counts["inshop"].test_images, counts["inshop"].gallery_images) == (14_218, 12_612)
