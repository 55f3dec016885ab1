"""``run``, ``table``, ``sweep --smoke`` and ``explain`` on your own images, given as a
folder of class folders and as a CSV: each run records the files' fingerprint (tag, MLflow
dataset input, file list artifact), the table names the dataset by its short name, and a
grid resumed on changed files is refused with one line saying what changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest

from harness.cli.main import main
from harness.components.data.manifest import MANIFEST_ARTIFACT
from harness.components.data.own import dataset_manifest, dataset_name
from tests.conftest import TINY_PROTOCOL
from tests.own_data import make_class_folders, make_csv
from tests.refusals import assert_refused


def _dataset(kind: str, folder: Path) -> tuple[str, str]:
    """(``--dataset`` argument, short name) of a generated dataset of ``kind``. In the
    folder, training class ``class_01`` keeps one image: fewer than a batch's two per class."""
    if kind == "folder":
        root = make_class_folders(folder / "shelf", classes=16, per_class=4)
        for extra in sorted((root / "class_01").iterdir())[1:]:
            extra.unlink()
        return str(root), "shelf"
    return str(make_csv(folder / "tables", classes=16, per_class=4)), "products"


def _grid(folder: Path, dataset: str, name: str) -> Path:
    """A grid on ``dataset`` given relative to the grid's folder, with a [smoke] version."""
    path = folder / "grid.toml"
    relative = Path(dataset).relative_to(folder).as_posix()
    path.write_text(
        f'name = "{name}"\nprotocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\n'
        f'losses = ["margin"]\nbackbones = ["efficientnet_lite0"]\ndatasets = ["{relative}"]\n'
        'seeds = [0]\n\n[smoke]\nseeds = [1]\n\n[smoke.set]\n"schedule.epochs" = 1\n'
    )
    return path


def _check_recorded(run_id: str, name: str, dataset: str) -> None:
    """The run names the dataset by its short name and records its files."""
    run = mlflow.MlflowClient().get_run(run_id)
    files = dataset_manifest(dataset_name(dataset))
    assert files is not None
    tags = run.data.tags
    assert tags["dataset"] == name and tags["dataset_fingerprint"] == files.fingerprint
    assert tags["dataset_path"] == files.source
    (entry,) = run.inputs.dataset_inputs
    assert entry.dataset.name == name and entry.dataset.digest == tags["split_digest"]
    source = json.loads(entry.dataset.source)["tags"]
    assert source["dataset_fingerprint"] == files.fingerprint
    assert (
        source["dataset_path"] == files.source and source["loader"] == "harness.components.data.own"
    )
    artifact = mlflow.MlflowClient().download_artifacts(run_id, MANIFEST_ARTIFACT)
    assert json.loads(Path(artifact).read_text())["fingerprint"] == files.fingerprint


def _change(kind: str, dataset: str) -> str:
    """Change the dataset's files; returns what the refusal must say changed."""
    if kind == "folder":
        root = Path(dataset)
        (moved,) = (root / "class_02").glob("img_0.*")  # class_03 has no file of its name
        shutil.move(moved, root / "class_03" / moved.name)
        next((root / "class_12").iterdir()).unlink()
        return "0 files added, 1 removed, 1 relabelled"
    csv_path = Path(dataset)
    lines = csv_path.read_text().splitlines()
    lines[1] = "1" + lines[1][1:]  # the first image of class 0 relabelled as class 1
    csv_path.write_text("\n".join(lines) + "\n")
    return "0 files added, 0 removed, 1 relabelled"


# About 30 s of CPU each (run, table, sweep); the CSV's and the explanation's are marked
# slow, so that the default suite keeps one of them.
@pytest.mark.parametrize("kind", ["folder", pytest.param("csv", marks=pytest.mark.slow)])
def test_run_table_and_a_smoke_sweep_on_your_own_data(
    kind, workdir, data_root, tracking_dir, capsys
):
    dataset, name = _dataset(kind, workdir / "data")
    out = workdir / "out.json"
    run = ["run", "--dataset", dataset, "--methods", "plain", "--protocol", str(TINY_PROTOCOL)]
    assert main([*run, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["dataset"] == name
    _check_recorded(record["mlflow_run_id"], name, dataset)

    table = workdir / "table"
    assert (
        main(["table", "--experiment", f"{name}-tiny", "--format", "markdown", "--out", str(table)])
        == 0
    )
    assert f"{name} R@1" in table.read_text()

    grid = _grid(workdir, dataset, f"own-{kind}")
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    sweep = ["sweep", "--grid", str(grid), "--smoke", "--storage", storage]
    assert main(sweep) == 0
    assert "1/1 cells finished" in capsys.readouterr().out

    changed = _change(kind, dataset)
    line = assert_refused(sweep, changed, capsys, watched=[workdir, tracking_dir])
    assert f"grid own-{kind}-smoke: the files of dataset '{name}' changed" in line


@pytest.mark.slow
def test_explain_finds_a_runs_files_and_is_told_where_they_moved(workdir, capsys):
    dataset, name = _dataset("folder", workdir / "data")
    out = workdir / "out.json"
    run = ["run", "--dataset", dataset, "--methods", "plain", "--protocol", str(TINY_PROTOCOL)]
    assert main([*run, "--json", str(out)]) == 0
    run_id = json.loads(out.read_text())[0]["mlflow_run_id"]
    explain = ["explain", "--run", run_id, "--pairs", "2", "--curve-pairs", "1"]
    assert main([*explain, "--out", str(workdir / "e1")]) == 0
    assert f"plain on {name}" in capsys.readouterr().out

    moved = workdir / "elsewhere" / "shelf"
    shutil.move(dataset, moved)
    assert main([*explain, "--out", str(workdir / "e2")]) == 2
    assert "give where its files are now with --dataset PATH" in capsys.readouterr().err
    assert main([*explain, "--out", str(workdir / "e3"), "--dataset", str(moved)]) == 0


@pytest.mark.slow
def test_every_method_runs_on_a_twenty_class_folder_and_the_table_names_it(workdir, capsys):
    root = make_class_folders(workdir / "my_images", classes=20, per_class=6)
    out = workdir / "all.json"
    argv = ["run", "--dataset", str(root), "--methods", "all", "--epochs", "1", "--json", str(out)]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    from harness.methods import list_methods

    assert {r["method"] for r in records} == set(list_methods(ablations=False))
    assert {r["dataset"] for r in records} == {"my_images"}
    table = workdir / "table"
    assert (
        main(
            [
                "table",
                "--experiment",
                "my_images-smoke",
                "--format",
                "markdown",
                "--out",
                str(table),
            ]
        )
        == 0
    )
    assert "my_images R@1" in table.read_text()
