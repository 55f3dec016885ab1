"""Bad inputs refused before any work (issue #42's list): files that are not UTF-8 or nest
thousands deep, values past the declared ranges, names that are not registered, repeated
seeds and methods, empty names, bad dataset index lines. Each case must pass
:func:`tests.refusals.assert_refused` (exit 2, one ``error:`` line, no traceback, nothing
new on disk or in the store); ``{dir}`` is the case's folder, where ``prepare`` writes.
Stores that cannot work (9, 10, 11) are ``test_bad_input_stores.py``'s."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import TINY_PROTOCOL
from tests.fixtures import make_cub
from tests.refusals import Refusal, assert_refused, assert_refused_in, unwritable_folder
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


RUN = ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL))


CUB_RUN = (
    *RUN,
    "--dataset",
    "cub200",
    "--data-root",
    "{dir}/cub",
    "--set",
    "splits.max_test_images_per_class=0",
)


CUB = "{dir}/cub/CUB_200_2011"


TUNE = ("tune", "--method", "plain", "--trials", "1", "--protocol", str(TINY_PROTOCOL))


GRID_HEAD = (
    f'protocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
    'backbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\n'
)


#: Arrays nested this deep overflow a recursive parser's stack.
DEEP = 5000


BINARY = bytes(range(256)) * 4


def _cub(damage: Callable[[Path], object]) -> Callable[[Path], object]:
    """A CUB tree (one image per class) under ``cub/`` of the case's folder, then ``damage(tree)``."""
    return lambda folder: damage(make_cub(folder / "cub", classes=200, per_class=1))


def _cut(relpath: str) -> Callable[[Path], object]:
    """Cut the image ``relpath`` of a CUB tree to half its bytes (a copy interrupted)."""

    def damage(tree: Path) -> None:
        image = tree / "images" / relpath
        image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])

    return damage


def _append(name: str, line: str) -> Callable[[Path], object]:
    return lambda tree: (tree / name).write_text((tree / name).read_text() + line + "\n")


def _loop(relpath: str) -> Callable[[Path], object]:
    """Replace the image ``relpath`` by a symlink to itself."""

    def damage(tree: Path) -> None:
        image = tree / "images" / relpath
        image.unlink()
        image.symlink_to(image.name)

    return damage


def _bytes(name: str, data: bytes) -> Callable[[Path], object]:
    return lambda folder: (folder / name).write_bytes(data)


def _text(name: str, text: str) -> Callable[[Path], object]:
    return lambda folder: (folder / name).write_text(text, encoding="utf-8")


CASES = [
    # 1. Files that are not text.
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "{dir}/p.toml is not a UTF-8 TOML file",
        _bytes("p.toml", BINARY),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "{dir}/g.toml is not a UTF-8 TOML file",
        _bytes("g.toml", BINARY),
    ),
    Refusal(
        ("table", "--experiment", "x", "--published", "{dir}/p.csv"),
        "{dir}/p.csv is not a UTF-8 CSV file",
        _bytes("p.csv", BINARY),
    ),
    # 2. Files nested thousands deep.
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "malformed protocol file {dir}/p.toml: nested too deeply",
        _text("p.toml", "seeds = " + "[" * DEEP + "]" * DEEP + "\n"),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "malformed grid file {dir}/g.toml: nested too deeply",
        _text("g.toml", GRID_HEAD + "seeds = " + "[" * DEEP + "]" * DEEP + "\n"),
    ),
    # 3. A grid of more cells than a sweep runs without --yes.
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid g has 6,000 cells, more than 5,000 (each a training run); "
        "check its axes, or give --yes",
        _text("g.toml", GRID_HEAD + f"seeds = {list(range(6000))}\n"),
    ),
    # 4. Numbers past what a run can use.
    Refusal(
        (*RUN, "--seeds", "99999999999999999999"),
        "run: argument --seeds: expected integers >= 0 and < 2**32",
    ),
    Refusal(
        (*RUN, "--set", "sampling.batches_per_epoch=99999999999999999999"),
        "'sampling.batches_per_epoch' = 99999999999999999999: expected an integer >= 0 and <= 100000",
    ),
    Refusal(
        (*RUN, "--epochs", "99999999999999999999"),
        "run: argument --epochs: expected an integer >= 0 and <= 100000",
    ),
    Refusal(
        (*RUN, "--set", "seeds=[4294967296]"),
        "'seeds[0]' = 4294967296: expected an integer >= 0 and < 4294967296",
    ),
    Refusal(
        (*RUN, "--set", "schedule.epochs=100001"),
        "'schedule.epochs' = 100001: expected an integer >= 0 and <= 100000",
    ),
    Refusal(
        (*TUNE, "--seed", "4294967296"),
        "tune: argument --seed: expected an integer >= 0 and <= 4294967295",
    ),
    # 5. Sizes that train nothing meaningful, or cannot fit in memory.
    Refusal(
        (*RUN, "--set", "embedding.size=1"),
        "'embedding.size' = 1: expected an integer >= 2 and <= 8192",
    ),
    Refusal(
        (*RUN, "--set", "image.size=1"), "'image.size' = 1: expected an integer >= 32 and <= 1024"
    ),
    Refusal(
        (*RUN, "--set", "image.size=100000"),
        "'image.size' = 100000: expected an integer >= 32 and <= 1024",
    ),
    Refusal((*RUN, "--set", "image.resize=1"), "'image.resize' = 1: expected >= image.size (32)"),
    # 6. A JPEG cut short, in the training split (class 7) and in the test split (class 150).
    Refusal(
        CUB_RUN,
        f"corrupt image {CUB}/images/007.Bird_7/Bird_7_0000.jpg: OSError",
        _cub(_cut("007.Bird_7/Bird_7_0000.jpg")),
    ),
    Refusal(
        CUB_RUN,
        f"corrupt image {CUB}/images/150.Bird_150/Bird_150_0000.jpg: OSError",
        _cub(_cut("150.Bird_150/Bird_150_0000.jpg")),
    ),
    Refusal(
        ("datasets", "verify", "cub200", "--data-root", "{dir}/cub"),
        "corrupt image",
        _cub(_cut("150.Bird_150/Bird_150_0000.jpg")),
    ),
    # 7. Index lines: an id given again with another value, an id that is not a number.
    Refusal(
        CUB_RUN,
        f"{CUB}/images.txt:201: image id 1 again, with path '150.Bird_150/Bird_150_0000.jpg' "
        "(line 1 gives '001.Bird_1/Bird_1_0000.jpg')",
        _cub(_append("images.txt", "1 150.Bird_150/Bird_150_0000.jpg")),
    ),
    Refusal(
        CUB_RUN,
        f"{CUB}/image_class_labels.txt:201: image id 1 again, with class id '150' (line 1 gives '1')",
        _cub(_append("image_class_labels.txt", "1 150")),
    ),
    Refusal(
        CUB_RUN,
        f"{CUB}/images.txt:201: image id 'x201' is not an integer >= 0",
        _cub(_append("images.txt", "x201 001.Bird_1/Bird_1_0000.jpg")),
    ),
    Refusal(
        CUB_RUN,
        f"{CUB}/image_class_labels.txt:201: malformed class id 'one': expected an integer >= 1",
        _cub(_append("image_class_labels.txt", "201 one")),
    ),
    # 8. An image that is a symlink loop.
    Refusal(
        CUB_RUN,
        f"broken image {CUB}/images/042.Bird_42/Bird_42_0000.jpg: Too many levels of symbolic links",
        _cub(_loop("042.Bird_42/Bird_42_0000.jpg")),
    ),
    # 14. Metrics that do not exist, and a training cap that leaves no positive pair.
    Refusal(
        ("table", "--experiment", "x", "--metrics", "recall_at_1,nope"),
        "--metrics: unknown metric 'nope'",
    ),
    Refusal(
        (*RUN, "--set", 'evaluation.metrics=["precision_at_1", "nope"]'),
        "protocol key 'evaluation.metrics': unknown metric 'nope'",
    ),
    Refusal(
        (*RUN, "--set", 'selection.metric="map_at_r"'),
        "protocol key 'selection.metric': unknown metric 'map_at_r'",
    ),
    Refusal(
        (*RUN, "--set", "splits.max_train_images_per_class=1"),
        "'splits.max_train_images_per_class' = 1: expected 0 (all) or >= 2",
    ),
    # 15. A study of no trials.
    Refusal(
        ("tune", "--method", "plain", "--trials", "0"),
        "tune: argument --trials: expected an integer >= 1, got '0'",
    ),
    # 16. Devices and component names, refused before the dataset loads.
    Refusal((*RUN, "--device", "tpu"), "unknown device 'tpu'; valid: auto, cpu, cuda"),
    Refusal(("sweep", "--grid", "fair-roth2020", "--device", "tpu"), "unknown device 'tpu'"),
    Refusal((*TUNE, "--device", "tpu"), "unknown device 'tpu'"),
    Refusal(
        (*RUN, "--device", "cpu", "--cuda-graphs"),
        "--cuda-graphs replays the compiled step as a CUDA graph and needs a GPU; "
        "--device cpu is cpu here",
    ),
    Refusal(
        (*RUN, "--set", 'backbone.name="resnet5"'),
        "protocol key 'backbone.name': unknown backbone 'resnet5'; did you mean 'resnet50'?",
    ),
    Refusal(
        (*RUN, "--set", 'miner.name="distance_weigted"'),
        "protocol key 'miner.name': unknown miner 'distance_weigted'; did you mean 'distance_weighted'?",
    ),
    Refusal(
        (*RUN, "--set", 'image.train_transform="random_crop"'),
        "protocol key 'image.train_transform': unknown transform 'random_crop'",
    ),
    Refusal(
        (*RUN, "--set", 'image.eval_transform="center"'),
        "protocol key 'image.eval_transform': unknown transform",
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'backbone.name': unknown backbone 'resnet5'",
        _text("p.toml", '[backbone]\nname = "resnet5"\n'),
    ),
    # 17. The same seed or method twice.
    Refusal((*RUN, "--seeds", "0,0"), "run: argument --seeds: '0' is given twice in '0,0'"),
    Refusal(
        ("run", "--methods", "plain,plain"),
        "run: argument --methods: 'plain' is given twice in 'plain,plain'",
    ),
    Refusal(
        ("tune", "--method", "plain", "--trials", "1", "--seeds", "1,2,1"),
        "tune: argument --seeds: '1' is given twice",
    ),
    # 18. An empty experiment name.
    Refusal(
        (*RUN, "--experiment", ""),
        "run: argument --experiment: expected an experiment name, got ''",
    ),
    Refusal(
        (*TUNE, "--experiment", " "), "tune: argument --experiment: expected an experiment name"
    ),
    Refusal(
        ("table", "--experiment", ""), "table: argument --experiment: expected an experiment name"
    ),
    Refusal(
        ("explain-table", "--experiment", ""),
        "explain-table: argument --experiment: expected an experiment name",
    ),
]

if not torch.cuda.is_available():
    CASES.append(
        Refusal(
            (*RUN, "--device", "cuda"), "--device cuda requested but no CUDA device is available"
        )
    )


def test_an_image_path_with_spaces_is_read_whole(tmp_path):
    """``images.txt`` gives the rest of the line as the path: a file name with spaces is kept."""
    from harness.components.data.benchmarks import load_cub200

    tree = make_cub(tmp_path / "cub", classes=200, per_class=1)
    spaced = tree / "images" / "007.Bird_7" / "Bird 7 a.jpg"
    (tree / "images" / "007.Bird_7" / "Bird_7_0000.jpg").rename(spaced)
    (tree / "images.txt").write_text(
        (tree / "images.txt").read_text().replace("Bird_7_0000.jpg", "Bird 7 a.jpg")
    )
    splits = load_cub200(tree)
    assert "images/007.Bird_7/Bird 7 a.jpg" in splits.train.relpaths
    assert len(splits.train) + len(splits.test) == 200


def test_the_table_covers_the_issue():
    assert len(CASES) >= 35


@pytest.mark.parametrize("case", CASES, ids=str)
def test_refused_up_front(case, workdir, data_root, tracking_dir, capsys, tmp_path_factory):
    folder = tmp_path_factory.mktemp("input")
    assert_refused_in(
        case, folder, tracking_dir, capsys, watched=[workdir, data_root, folder, tracking_dir]
    )


# 13. A full disk: the output of a listing, and a checkpoint's weights.
@pytest.mark.parametrize("command", ["schema", "methods"])
def test_output_on_a_full_disk_is_one_line(command, tmp_path):
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", "harness", command],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines == [
        "error: disk full: the output could not be written (No space left on device)"
    ], done.stderr


def test_weights_on_a_full_disk_name_the_file(tmp_path, monkeypatch):
    """``torch.save`` into a file whose writes fail with ENOSPC (``/dev/full`` in place of the
    temporary file): one error naming ``model.pt``, and no temporary file left."""
    from harness.base.atomic import atomic_save_torch
    from harness.base.errors import HarnessError

    real_fdopen = os.fdopen

    def full_disk(fd, mode="r", *args, **kwargs):
        os.close(fd)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), mode, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", full_disk)  # the standard library's: a disk that is full
    target = tmp_path / "model.pt"
    with pytest.raises(HarnessError) as refused:
        atomic_save_torch({"w": torch.zeros(1 << 20)}, target)
    monkeypatch.undo()
    assert str(refused.value).startswith(f"cannot write {target}: No space left on device")
    assert list(tmp_path.iterdir()) == []


# 12. A data root that is a file, or one the synthetic set cannot be generated in.
@pytest.mark.parametrize(
    "argv, where, match",
    [
        (
            RUN,
            "afile",
            "the data root ($DML_HARNESS_DATA, else ~/.cache/dml-harness) {dir}/afile is a file, not a folder",
        ),
        (
            RUN,
            "ro",
            "the data root ($DML_HARNESS_DATA, else ~/.cache/dml-harness) {dir}/ro/synthetic: cannot write in",
        ),
        (TUNE, "afile", "{dir}/afile is a file, not a folder"),
        (
            ("sweep", "--grid", str(ROOT / "tests" / "grids" / "tiny.toml")),
            "afile",
            "{dir}/afile is a file, not a folder",
        ),
        ((*RUN, "--data-root", "{dir}/ro"), "-", "--data-root {dir}/ro/synthetic: cannot write in"),
    ],
    ids=["run-file", "run-unwritable", "tune-file", "sweep-file", "run-flag-unwritable"],
)
def test_a_bad_data_root_is_refused(
    argv, where, match, workdir, data_root, tracking_dir, capsys, tmp_path_factory, monkeypatch
):
    folder = tmp_path_factory.mktemp("input")
    (folder / "afile").write_text("not a folder\n")
    unwritable_folder(folder)
    if where != "-":
        monkeypatch.setenv("DML_HARNESS_DATA", str(folder / where))
    try:
        assert_refused(
            [a.replace("{dir}", str(folder)) for a in argv],
            match.replace("{dir}", str(folder)),
            capsys,
            watched=[workdir, data_root, folder, tracking_dir],
        )
    finally:
        if not (folder / "ro").is_symlink():
            (folder / "ro").chmod(0o700)


# A bad $DML_HARNESS_LOG_MODEL, and --register where runs log no model.
@pytest.mark.parametrize(
    ("argv", "value", "match"),
    [
        (RUN, "yes", "DML_HARNESS_LOG_MODEL must be 1 (log each run's model) or 0, not 'yes'"),
        ((*RUN, "--register", "embedder"), "0", "--register needs each run's logged model"),
    ],
    ids=["bad-value", "register-without-models"],
)
def test_a_bad_log_model_setting_is_refused(
    argv, value, match, workdir, data_root, tracking_dir, capsys, monkeypatch
):
    monkeypatch.setenv("DML_HARNESS_LOG_MODEL", value)
    assert_refused(list(argv), match, capsys, watched=[workdir, data_root, tracking_dir])


# 19. A synthetic cache cut short is named and made again.
def test_a_cut_synthetic_cache_is_named_and_made_again(tmp_path, capsys):
    import functools

    from harness.components.data.synthetic import load_synthetic, synthetic_root

    load_small = functools.partial(load_synthetic, num_classes=8, images_per_class=2, size=32)
    root = synthetic_root(tmp_path)
    first = load_small(tmp_path)
    expected = np.asarray(first.train.images).copy()
    assert expected.shape == (8, 32, 32, 3)  # the small set: 4 training classes x 2 images
    packed = root / "images.npy"
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    again = load_small(tmp_path)
    assert f"synthetic cache {packed} is corrupt" in capsys.readouterr().err
    assert np.array_equal(np.asarray(again.train.images), expected)

    manifest = root / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    again = load_small(tmp_path)
    assert f"synthetic cache {root} is corrupt (manifest.json:" in capsys.readouterr().err
    assert np.array_equal(np.asarray(again.train.images), expected)


def test_a_sweep_announces_its_cells_and_yes_lifts_the_cap(capsys):
    from harness.base.errors import HarnessError
    from harness.config.grids import load_grid

    grid = str(ROOT / "tests" / "grids" / "tiny.toml")
    counts: list[int] = []
    with pytest.raises(HarnessError, match="grid tiny has 2 cells, more than 1 "):
        load_grid(grid, max_cells=1, on_count=counts.append)
    assert counts == [2]
    assert len(load_grid(grid, max_cells=None).cells) == 2


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, read from ``/proc``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


# 20. SIGTERM to the whole process group (a sweep stopping its workers, a cluster's limit).
@pytest.mark.slow  # about a minute: a run trains until it is stopped
def test_sigterm_to_the_process_group_kills_the_run_quietly(tmp_path):
    import signal
    import sqlite3

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DML_HARNESS_DATA": str(tmp_path / "data"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness",
                "run",
                "--methods",
                "plain",
                "--protocol",
                str(TINY_PROTOCOL),
                "--workers",
                "2",
                "--epochs",
                "50",
                "--set",
                "sampling.batches_per_epoch=200",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        # Into the first epoch, the loader's two workers running (states, not seconds).
        wait_until(
            lambda: (
                "train / " in (tmp_path / "err.txt").read_text() and len(_children(proc.pid)) >= 2
            ),
            "training with the loader's workers",
            timeout=300,
        )
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
    stderr = (tmp_path / "err.txt").read_text()
    assert code == 130, stderr
    assert "Traceback" not in stderr and "error:" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert [status for (status,) in db.execute("SELECT status FROM runs")] == ["KILLED"]
