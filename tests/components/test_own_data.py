"""Your own images as a dataset (:mod:`harness.components.data.own`): both formats read,
every image mode turned into what a viewer shows, the split rules, the fingerprint that
follows the files, and the cell keys of a grid on such a dataset."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from harness.base.errors import HarnessError
from harness.components.data import DATASETS, ArrayImageSet, DatasetSplits
from harness.components.data.manifest import FileManifest
from harness.components.data.own import (
    OwnDatasetInfo,
    as_rgb,
    class_order,
    dataset_manifest,
    dataset_name,
    looks_like_path,
)
from harness.config.grids import load_grid
from tests.conftest import TINY_PROTOCOL
from tests.own_data import ROTATED, ROTATED_SIZE_ON_DISK, make_class_folders, make_csv, write_rows


def _splits(name: str):
    return DATASETS.get(name).load(None)


def _image(folder: Path, label: int, index: int) -> Path:
    """The file of image ``index`` of class ``label`` (its suffix depends on its format)."""
    (path,) = (folder / f"class_{label:02d}").glob(f"img_{index}.*")
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    return make_class_folders(tmp_path / "my_images", classes=8, per_class=3)


# ------------------------------------------------------------------------ the images


def test_an_exif_rotated_jpeg_is_turned_upright(folder):
    splits = _splits(dataset_name(str(folder)))
    with Image.open(folder / ROTATED) as raw:
        assert raw.size == ROTATED_SIZE_ON_DISK  # stored on its side
    image = splits.train.read(splits.train.relpaths.index(ROTATED))
    assert image.mode == "RGB" and image.size == ROTATED_SIZE_ON_DISK[::-1]


def test_every_mode_is_read_as_rgb_and_transparency_as_white(folder):
    splits = _splits(dataset_name(str(folder)))
    suffixes = set()
    for images in (splits.train, splits.test):
        for index, relpath in enumerate(images.relpaths):
            suffixes.add(Path(relpath).suffix)
            assert images.read(index).mode == "RGB", relpath
    assert suffixes == {".jpg", ".png", ".webp"}
    modes = {Image.open(folder / p).mode for p in splits.train.relpaths + splits.test.relpaths}
    assert {"RGB", "L", "RGBA", "P", "CMYK"} <= modes
    rgba = next(p for p in splits.train.relpaths if Image.open(folder / p).mode == "RGBA")
    # The transparent pixel is black underneath; a viewer shows the page behind it.
    assert splits.train.read(splits.train.relpaths.index(rgba)).getpixel((0, 0)) == (255, 255, 255)
    gray = next(p for p in splits.train.relpaths if Image.open(folder / p).mode == "L")
    r, g, b = splits.train.read(splits.train.relpaths.index(gray)).split()
    assert r.tobytes() == g.tobytes() == b.tobytes()


def test_sixteen_bit_grayscale_is_scaled_to_eight_bits():
    wide = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    assert as_rgb(wide).getpixel((0, 0)) == (255, 255, 255)
    half = Image.fromarray(np.full((4, 4), 257 * 100, dtype=np.uint16))
    assert as_rgb(half).getpixel((0, 0)) == (100, 100, 100)


# ------------------------------------------------------------------------ the splits


def test_a_folder_splits_its_classes_by_name_first_half_training(folder):
    name = dataset_name(str(folder))
    assert name == "my_images" and isinstance(DATASETS.get(name), OwnDatasetInfo)
    splits = _splits(name)
    train = {p.split("/")[0] for p in splits.train.relpaths}
    test = {p.split("/")[0] for p in splits.test.relpaths}
    assert train == {f"class_{c:02d}" for c in range(4)}
    assert test == {f"class_{c:02d}" for c in range(4, 8)}
    assert splits.val is None and splits.gallery is None
    assert splits.files is not None and len(splits.files.rows) == 8 * 3 + 1


def test_an_odd_number_of_classes_gives_training_the_extra_one(tmp_path):
    root = make_class_folders(tmp_path / "odd", classes=5, per_class=2)
    splits = _splits(dataset_name(str(root)))
    assert splits.train.num_classes == 3 and splits.test.num_classes == 2


def test_integer_class_names_sort_as_numbers():
    assert class_order(["10", "9", "1", "2"]) == ["1", "2", "9", "10"]
    assert class_order(["b", "10", "9"]) == ["10", "9", "b"]


def test_a_csv_in_open_metric_learnings_layout_tests_on_its_validation_rows(tmp_path):
    csv_path = make_csv(tmp_path / "data", classes=8, per_class=3)
    name = dataset_name(str(csv_path))
    assert name == "products"
    splits = _splits(name)
    assert len(splits.train) == 12 and len(splits.test) == 12
    assert splits.val is None  # carved by the protocol from the training classes
    assert (
        splits.gallery is None
    )  # every test row is both query and gallery: searched against itself


def test_query_and_gallery_roles_give_in_shop_style_evaluation(tmp_path):
    csv_path = make_csv(tmp_path / "data", classes=8, per_class=4, roles=True)
    splits = _splits(dataset_name(str(csv_path), name="roles"))
    assert len(splits.test) == 8 and splits.gallery is not None and len(splits.gallery) == 8
    assert not set(splits.test.relpaths) & set(splits.gallery.relpaths)


def test_a_given_validation_split_is_kept_and_not_carved(tmp_path, tiny_protocol):
    from harness.config.protocol_files import load_protocol
    from harness.engine.run.data import prepare_splits

    make_class_folders(tmp_path / "images", classes=6, per_class=2)
    rows = []
    for c in range(6):
        split = ("train", "train", "validation", "validation", "test", "test")[c]
        rows += [
            f"{c},images/class_{c:02d}/{f},{split}"
            for f in sorted(os.listdir(tmp_path / "images" / f"class_{c:02d}"))
        ]
    csv_path = write_rows(tmp_path / "three.csv", "label,path,split", *rows)
    name = dataset_name(str(csv_path))
    splits = prepare_splits(load_protocol(str(tiny_protocol)), name, None, seed=0)
    assert splits.val is not None and splits.val_given
    assert {p.split("/")[1] for p in splits.val.relpaths} == {"class_02", "class_03"}
    assert splits.train.num_classes == 2 and splits.test.num_classes == 2


def test_a_csv_without_split_follows_the_class_rule(tmp_path):
    csv_path = make_csv(tmp_path / "data", classes=8, per_class=2, split=False, name="plain.csv")
    splits = _splits(dataset_name(str(csv_path)))
    assert sorted(set(splits.train.labels.tolist())) == [0, 1, 2, 3]
    assert sorted(set(splits.test.labels.tolist())) == [4, 5, 6, 7]


# ------------------------------------------------------------------ names and paths


def test_names_stay_names_and_paths_are_read(tmp_path, monkeypatch):
    assert dataset_name("cub200") == "cub200"
    assert looks_like_path("./x") and looks_like_path("x.csv") and not looks_like_path("sop")
    make_class_folders(tmp_path / "shelf", classes=4, per_class=2)
    monkeypatch.chdir(tmp_path)
    assert dataset_name("shelf") == "shelf"  # an existing folder, without a separator
    assert dataset_name("./shelf", name="books") == "books"
    with pytest.raises(HarnessError, match="unknown dataset 'cub'; did you mean 'cub200'"):
        dataset_name("cub")


def test_a_name_given_again_is_the_newest_path(tmp_path):
    first = make_class_folders(tmp_path / "a" / "same", classes=4, per_class=2)
    second = make_class_folders(tmp_path / "b" / "same", classes=6, per_class=2)
    dataset_name(str(first))
    assert dataset_name(str(second)) == "same"
    assert len(_splits("same").train) + len(_splits("same").test) == 6 * 2 + 1


def test_files_without_an_image_suffix_are_left_out_and_counted(folder, capsys):
    (folder / "class_01" / "notes.txt").write_text("bought in March")
    (folder / "README.md").write_text("my photos")  # beside the class folders: not a class
    (folder / ".hidden").mkdir()
    splits = _splits(dataset_name(str(folder)))
    assert "class_01/notes.txt" not in splits.train.relpaths
    assert (
        "1 file(s) without an image suffix left out (e.g. class_01/notes.txt)"
        in capsys.readouterr().err
    )


# ------------------------------------------------------------------ the fingerprint


def _fingerprint(path: Path) -> str:
    files = dataset_manifest(dataset_name(str(path)))
    assert files is not None
    return files.fingerprint


def test_the_fingerprint_changes_when_one_file_changes(folder):
    before = _fingerprint(folder)
    assert _fingerprint(folder) == before  # read again: the same
    image = _image(folder, 5, 1)
    image.write_bytes(image.read_bytes() + b"\0")  # one byte more, same name and label
    assert _fingerprint(folder) != before


def test_the_fingerprint_changes_with_a_label_and_says_what_changed(folder):
    old = dataset_manifest(dataset_name(str(folder)))
    moved = _image(folder, 2, 0)
    shutil.move(moved, folder / "class_03" / moved.name)
    _image(folder, 6, 2).unlink()
    shutil.copy(_image(folder, 7, 0), folder / "class_07" / "extra.png")
    new = dataset_manifest(dataset_name(str(folder)))
    assert old is not None and new is not None and new.fingerprint != old.fingerprint
    assert new.changes_since(old) == "1 file added, 1 removed, 1 relabelled"
    assert FileManifest.from_json(new.to_json()) == new


def test_the_splits_digest_follows_the_files_and_built_in_digests_do_not_move(folder):
    name = dataset_name(str(folder))
    before = _splits(name).digest()
    image = _image(folder, 0, 0)
    image.write_bytes(image.read_bytes() + b"\0")
    assert _splits(dataset_name(str(folder))).digest() != before
    # A dataset without a file list hashes what it always did: name, splits, keys, labels.
    pixels = np.zeros((1, 2, 2), np.uint8)
    built_in = DatasetSplits("x", train=ArrayImageSet(pixels, [0]), test=ArrayImageSet(pixels, [1]))
    expected = hashlib.sha256(b"x")
    for part in (b"train", b"0\t0\n", b"test", b"0\t1\n"):
        expected.update(part)
    assert built_in.digest() == expected.hexdigest()[:16]


def test_a_grids_cell_keys_follow_the_files(tmp_path):
    folder = make_class_folders(tmp_path / "shelf", classes=8, per_class=3)
    grid_file = tmp_path / "grid.toml"
    grid_file.write_text(
        f'protocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
        'backbones = ["efficientnet_lite0"]\ndatasets = ["shelf"]\nseeds = [0]\n'
    )
    (cell,) = load_grid(grid_file).cells
    assert cell.dataset == "shelf"
    assert load_grid(grid_file).cells[0].key == cell.key
    image = _image(folder, 1, 1)
    image.write_bytes(image.read_bytes() + b"\0")
    assert load_grid(grid_file).cells[0].key != cell.key


def test_verify_stamps_the_folder_and_the_stamp_leaves_the_fingerprint_alone(folder, tmp_path):
    from harness.components.data.verify import STAMP, check_images, verify_dataset

    name = dataset_name(str(folder))
    before = _fingerprint(folder)
    said: list[str] = []
    assert verify_dataset(name, None, say=said.append) == folder / STAMP
    assert said == [f"dataset '{name}': 25 images decoded, all readable; stamp {folder / STAMP}"]
    assert _fingerprint(folder) == before  # the stamp is no image of a class
    check_images(dataset_name(str(folder)), None, say=said.append)
    assert len(said) == 1  # a current stamp: no header check, nothing said

    csv_path = make_csv(tmp_path / "tables", classes=8, per_class=2)
    assert (
        verify_dataset(dataset_name(str(csv_path)), None, say=said.append)
        == csv_path.parent / STAMP
    )


def test_a_table_says_when_the_validation_split_came_with_the_dataset():
    import pandas as pd

    from harness.reports.tables.notes import selection_notes

    runs = pd.DataFrame(
        {
            "selection": ["validation", "validation"],
            "validation_classes": ["dataset", "dataset"],
            "selection_metric": ["mean_average_precision_at_r"] * 2,
        }
    )
    (note,) = selection_notes(runs, None)
    assert note.endswith("on the dataset's own class-disjoint validation split.")
    carved = runs.assign(validation_classes=["0.2", "0.2"])
    assert "validation split of 20% of the training classes" in selection_notes(carved, None)[0]


def test_a_tune_study_is_one_per_file_list(folder):
    """``tune``'s grid names the dataset by its registered name; its study (as any tuned
    grid's) is keyed by the file list's fingerprint, so a changed file makes another."""
    import argparse

    from harness.cli.tune import add_tune_parser
    from harness.cli.tune_command import tune_grid
    from harness.engine.tuning.studies import tuned_studies

    parser = argparse.ArgumentParser()
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["tune", "--method", "plain", "--trials", "1", "--protocol", str(TINY_PROTOCOL)]
    args = parser.parse_args([*argv, "--dataset", str(folder)])
    grid = tune_grid(args)
    name = dataset_name(str(folder))
    (study,) = tuned_studies(grid)
    assert study.first.dataset == name and f"/{name}:" in study.name
    assert grid.experiment == f"tune-plain-{name}-tiny"
    image = _image(folder, 3, 0)
    image.write_bytes(image.read_bytes() + b"\0")
    changed = tuned_studies(tune_grid(args))[0]
    assert changed.name != study.name
