"""Bad input of a dataset given by its path, each refused with one ``error:`` line, exit
status 2, nothing written and no MLflow run (:func:`tests.refusals.assert_refused`): paths
that are not there, folders without classes, CSVs whose columns, paths, labels, splits or
roles cannot be read one way only, files that are not images, names that would clash.
``{dir}`` is the case's folder, where ``prepare`` writes the bad input."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.base.errors import HarnessError
from tests.conftest import TINY_PROTOCOL
from tests.own_data import ROTATED, make_class_folders, write_rows
from tests.refusals import Refusal, assert_refused

RUN = ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL))
TUNE = ("tune", "--method", "plain", "--trials", "1", "--protocol", str(TINY_PROTOCOL))
HEADER = "label,path,split"


def _folders(classes: int = 8, per_class: int = 2, then: Callable[[Path], object] | None = None):
    """A folder of class folders at ``{dir}/imgs``, then ``then(folder)``."""

    def prepare(case: Path) -> None:
        folder = make_class_folders(case / "imgs", classes=classes, per_class=per_class)
        if then is not None:
            then(folder)

    return prepare


def _csv(
    *lines: str, header: str = HEADER, then: Callable[[Path], object] | None = None
) -> Callable[[Path], object]:
    """``{dir}/d.csv`` with ``lines`` under ``header``, over the images of ``{dir}/imgs``,
    then ``then(case folder)``."""

    def prepare(case: Path) -> None:
        make_class_folders(case / "imgs", classes=8, per_class=2)
        write_rows(case / "d.csv", header, *lines)
        if then is not None:
            then(case)

    return prepare


def _tuned_grid(dataset: str) -> Callable[[Path], object]:
    """``{dir}/g.toml``: a tuned grid of two folds on ``dataset`` (a path from ``{dir}``)."""
    return lambda case: (case / "g.toml").write_text(
        f'protocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
        f'backbones = ["efficientnet_lite0"]\ndatasets = ["{dataset}"]\nseeds = [0]\n'
        "[tune]\ntrials = 2\nfolds = 2\n"
    )


def _rows(labels: dict[int, str]) -> list[str]:
    """``label,imgs/class_NN/<first image>,split`` for each class: split."""
    return [f"{c},imgs/class_{c:02d}/img_0.{_SUFFIX[c % 6]},{s}" for c, s in labels.items()]


#: The suffix of ``img_0`` of class ``c`` (:func:`tests.own_data.make_class_folders`).
_SUFFIX = {0: "jpg", 1: "png", 2: "png", 3: "webp", 4: "png", 5: "jpg"}
GOOD = _rows({0: "train", 1: "train", 2: "test", 3: "test"})
#: A dataset whose CSV gives train, validation and test rows, a class of each split with
#: two images.
WITH_VALIDATION = (
    *_rows({0: "train", 1: "train", 2: "test", 3: "test", 4: "validation", 5: "validation"}),
    "0,imgs/class_00/img_1.png,train",
    "2,imgs/class_02/img_1.webp,test",
    "4,imgs/class_04/img_1.jpg,validation",
)


def _mkdir(*names: str) -> Callable[[Path], object]:
    def prepare(case: Path) -> None:
        for name in names:
            (case / name).mkdir(parents=True)

    return prepare


def _write(name: str, data: bytes) -> Callable[[Path], object]:
    return lambda case: (case / name).write_bytes(data)


def _not_an_image(folder: Path) -> None:
    (folder / "class_05" / "scan.jpg").write_text("a text file saved as .jpg")


def _flat(case: Path) -> None:
    """Images straight in the folder, no class folder."""
    (case / "flat").mkdir()
    (case / "flat" / "a.jpg").write_bytes(b"")


def _rename(old: str, new: bytes) -> Callable[[Path], object]:
    """Rename ``old`` (below the dataset folder) to the raw bytes ``new`` (a name that
    need not be UTF-8)."""
    return lambda folder: os.rename(bytes(folder / old), bytes(folder) + b"/" + new)


def _cut(relpath: str) -> Callable[[Path], object]:
    """Cut the image ``relpath`` (below the dataset folder) to half its bytes."""

    def cut(folder: Path) -> None:
        data = (folder / relpath).read_bytes()
        (folder / relpath).write_bytes(data[: len(data) // 2])

    return cut


def _one_image_per_class(folder: Path) -> None:
    (folder / ROTATED).unlink()  # the second image of class_00


def _grid(dataset_lines: str) -> Callable[[Path], object]:
    def prepare(case: Path) -> None:
        make_class_folders(case / "a" / "imgs", classes=8, per_class=2)
        make_class_folders(case / "b" / "imgs", classes=8, per_class=2)
        (case / "g.toml").write_text(
            f'protocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
            f'backbones = ["efficientnet_lite0"]\n{dataset_lines}\nseeds = [0]\n'
        )

    return prepare


CASES = [
    # A path that is not there, or not a dataset.
    Refusal(
        (*RUN, "--dataset", "{dir}/nowhere"),
        "dataset {dir}/nowhere does not exist: expected a folder of class folders or a .csv file",
    ),
    Refusal((*RUN, "--dataset", "{dir}/gone.csv"), "dataset {dir}/gone.csv does not exist"),
    Refusal(
        (*RUN, "--dataset", "{dir}/notes.txt"),
        "dataset {dir}/notes.txt is a file but not a .csv",
        _write("notes.txt", b"x"),
    ),
    Refusal(
        (*RUN, "--dataset", "my_imgs"),
        "unknown dataset 'my_imgs'",
    ),
    # Folders without classes to split.
    Refusal(
        (*RUN, "--dataset", "{dir}/empty"),
        "dataset folder {dir}/empty is empty: expected one sub-folder of images per class",
        _mkdir("empty"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/flat"),
        "dataset folder {dir}/flat holds no class folder",
        _flat,
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "dataset {dir}/imgs holds 1 class ('class_00'); the class-disjoint split needs at least 4",
        _folders(classes=1),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "dataset {dir}/imgs holds 3 classes",
        _folders(classes=3),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "class folder {dir}/imgs/class_08 holds no image",
        _folders(then=lambda folder: (folder / "class_08").mkdir()),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "dataset {dir}/imgs: every class of the training split holds one image; expected at "
        "least one class with 2 images or more",
        _folders(per_class=1, then=_one_image_per_class),
    ),
    # Names that are not UTF-8.
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "dataset folder {dir}/imgs: the file name {dir}/imgs/class_00/img_\\xff.jpg is not "
        "UTF-8; expected UTF-8 names",
        _folders(then=_rename("class_00/img_0.jpg", b"class_00/img_\xff.jpg")),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "dataset folder {dir}/imgs: the folder name {dir}/imgs/class_\\xfe is not UTF-8",
        _folders(then=_rename("class_01", b"class_\xfe")),
    ),
    # A file that is not an image, found by the header check before training.
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "corrupt image {dir}/imgs/class_05/scan.jpg: UnidentifiedImageError",
        _folders(then=_not_an_image),
    ),
    Refusal(
        ("datasets", "verify", "{dir}/imgs"),
        "corrupt image {dir}/imgs/class_05/scan.jpg: UnidentifiedImageError",
        _folders(then=_not_an_image),
    ),
    # A PNG cut short (no IEND chunk), in the training split and in the test split.
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "corrupt image {dir}/imgs/class_01/img_0.png: OSError: image file is truncated "
        "(found by the header check before training)",
        _folders(then=_cut("class_01/img_0.png")),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs"),
        "corrupt image {dir}/imgs/class_06/img_1.png: OSError: image file is truncated",
        _folders(then=_cut("class_06/img_1.png")),
    ),
    # CSVs: columns.
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv: missing column 'path' (columns: label, file, split)",
        _csv(*GOOD, header="label,file,split"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv: missing column 'label'",
        _csv("imgs/class_00/img_0.jpg", header="path"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv: column 'is_query' without its pair",
        _csv(*[f"{r},true" for r in GOOD], header=f"{HEADER},is_query"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv: column 'label' appears 2 times (columns 1, 4); expected each column once",
        _csv(*[f"{r},9" for r in GOOD], header=f"{HEADER},label"),
    ),
    Refusal((*RUN, "--dataset", "{dir}/d.csv"), "{dir}/d.csv lists no image", _csv()),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv is not a UTF-8 CSV file",
        _write("d.csv", bytes(range(256))),
    ),
    # CSVs: paths.
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: empty path",
        _csv(*GOOD, "3,,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: path 'imgs/../../outside.jpg' escapes the CSV's folder through '..'",
        _csv(*GOOD, "3,imgs/../../outside.jpg,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: path 'imgs/class_03/im\\x00g_1.jpg' holds a NUL byte",
        _csv(*GOOD, "3,imgs/class_03/im\0g_1.jpg,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: path '/etc/hostname' is absolute",
        _csv(*GOOD, "3,/etc/hostname,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: path 'imgs/class_00/img_0.jpg' is listed again with two labels, "
        "'0' (row 2) and '3'",
        _csv(*GOOD, "3,imgs/class_00/img_0.jpg,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: path 'imgs/class_00/img_0.jpg' is listed again (row 2)",
        _csv(*GOOD, "0,./imgs/class_00/img_0.jpg,train"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "image listed by {dir}/d.csv, row 6 is missing: {dir}/imgs/class_03/lost.jpg",
        _csv(*GOOD, "3,imgs/class_03/lost.jpg,test"),
    ),
    # CSVs: labels and splits.
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: empty label",
        _csv(*GOOD, ",imgs/class_03/img_1.jpg,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "label '0' is in both the train and the test rows (imgs/class_00/img_0.jpg, "
        "imgs/class_00/img_1.png); splits must be class-disjoint",
        _csv(*GOOD, "0,imgs/class_00/img_1.png,test"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 6: split 'val': expected one of train, validation, test",
        _csv(*GOOD, "3,imgs/class_03/img_1.jpg,val"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 2: split '': expected one of train, validation, test",
        _csv("0,imgs/class_00/img_0.jpg,"),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "no row with split 'test' (or 'validation', the test split of a CSV without 'test' rows)",
        _csv(*_rows({0: "train", 1: "train"})),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "the test split holds 1 class ('2'); each split needs at least 2",
        _csv(*_rows({0: "train", 1: "train", 2: "test"})),
    ),
    # CSVs: query and gallery roles.
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "{dir}/d.csv, row 4: is_query 'maybe': expected true or false (or 1 or 0)",
        _csv(
            *[f"{r},true,true" for r in GOOD[:2]],
            f"{GOOD[2]},maybe,true",
            header=f"{HEADER},is_query,is_gallery",
        ),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "test image imgs/class_02/img_0.png is both a query and a gallery image, other test "
        "images one of the two",
        _csv(
            *[f"{r},," for r in GOOD[:2]],
            f"{GOOD[2]},true,true",
            f"{GOOD[3]},true,false",
            header=f"{HEADER},is_query,is_gallery",
        ),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "test image imgs/class_03/img_0.webp has no is_query or is_gallery value",
        _csv(
            *[f"{r},," for r in GOOD[:2]],
            f"{GOOD[2]},true,false",
            f"{GOOD[3]},true,",
            header=f"{HEADER},is_query,is_gallery",
        ),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "no row with split 'train'",
        _csv(*_rows({0: "test", 1: "test"})),
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/d.csv"),
        "test image imgs/class_03/img_0.webp is neither a query nor a gallery image",
        _csv(
            *[f"{r},," for r in GOOD[:2]],
            f"{GOOD[2]},true,false",
            f"{GOOD[3]},false,false",
            header=f"{HEADER},is_query,is_gallery",
        ),
    ),
    # Names.
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs", "--dataset-name", "cub200"),
        "dataset {dir}/imgs would be named 'cub200', a built-in dataset's name",
        _folders(),
    ),
    Refusal(
        (*RUN, "--dataset", "synthetic", "--dataset-name", "mine"),
        "--dataset-name names a dataset given by its path; 'synthetic' is a built-in dataset",
    ),
    Refusal(
        (*RUN, "--dataset", "{dir}/imgs", "--dataset-name", "a/b"),
        "run: argument --dataset-name: expected a name without '/'",
    ),
    # Every command that takes a dataset.
    Refusal(
        (*TUNE, "--dataset", "{dir}/empty"),
        "dataset folder {dir}/empty is empty",
        _mkdir("empty"),
    ),
    Refusal(("datasets", "verify", "{dir}/nowhere"), "dataset {dir}/nowhere does not exist"),
    # Cross-validation folds on a CSV that gives its own validation split, before a study.
    Refusal(
        (*TUNE, "--dataset", "{dir}/d.csv", "--folds", "2"),
        "--folds = 2 draws validation folds from the training classes, but the dataset gives "
        "its own validation split; use folds = 1 (that split) or a dataset without one",
        _csv(*WITH_VALIDATION),
    ),
    Refusal(
        (*TUNE, "--dataset", "{dir}/d.csv", "--folds", "2"),
        "--folds = 2 needs at least 4 training classes (2 per fold); the training split has 2",
        _csv(*GOOD, "0,imgs/class_00/img_1.png,train", "2,imgs/class_02/img_1.webp,test"),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid g, dataset d: tune.folds = 2 draws validation folds from the training classes, "
        "but the dataset gives its own validation split",
        _csv(*WITH_VALIDATION, then=_tuned_grid("d.csv")),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid g, datasets: dataset {dir}/nowhere does not exist",
        _grid('datasets = ["nowhere/"]'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid g: datasets {dir}/a/imgs and {dir}/b/imgs would both be named 'imgs'",
        _grid('datasets = ["a/imgs", "b/imgs"]'),
    ),
    Refusal(
        ("explain", "--run", "0123456789abcdef", "--dataset", "{dir}/nowhere"),
        "--dataset {dir}/nowhere does not exist",
    ),
]


def test_the_table_covers_the_issue():
    """Each bad input the issue names has its row (and more)."""
    lines = " ".join(case.match for case in CASES)
    for named in (
        "does not exist",  # a path that does not exist
        "is empty",  # an empty folder
        "missing column",
        "empty path",
        "escapes the CSV's folder through '..'",
        "with two labels",
        "is in both the train and the test rows",
        "split 'val': expected one of train, validation, test",
        "holds 1 class",  # a folder with one class
    ):
        assert named in lines, named


@pytest.mark.parametrize("case", CASES, ids=str)
def test_refused(case, workdir, data_root, tracking_dir, capsys, tmp_path_factory):
    folder = tmp_path_factory.mktemp("input")
    if case.prepare is not None:
        case.prepare(folder)

    def fill(text: str) -> str:
        return text.replace("{dir}", str(folder)).replace("{store}", str(tracking_dir))

    argv = [fill(arg) for arg in case.argv]
    assert_refused(
        argv, fill(case.match), capsys, watched=[workdir, data_root, folder, tracking_dir]
    )


def test_a_csv_that_holds_its_own_images_is_read(tmp_path):
    """The good rows the cases above spoil are a dataset once a class of each split has a
    second image (the pair rule, checked after every rule the cases break), so that each
    case fails for its one bad line."""
    from harness.components.data.own import dataset_name

    make_class_folders(tmp_path / "imgs", classes=8, per_class=2)
    write_rows(tmp_path / "d.csv", HEADER, *GOOD)
    with pytest.raises(HarnessError, match="every class of the training split holds one image"):
        dataset_name(str(tmp_path / "d.csv"))
    pairs = ("0,imgs/class_00/img_1.png,train", "2,imgs/class_02/img_1.webp,test")
    write_rows(tmp_path / "d.csv", HEADER, *GOOD, *pairs)
    assert dataset_name(str(tmp_path / "d.csv")) == "d"
