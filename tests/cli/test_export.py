"""``harness export RUN_ID DIR``: a run's embedder as an MLflow model folder of its own, read
back from a store of one tiny ``run --methods plain`` with its model logged. The folder
embeds images as the harness does, at the protocol's 32 px and at 224 px, in batches of one
and three; it holds the run's fingerprint; an earlier export is replaced whole and any other
folder refused; every bad input is one line, exit 2, nothing written. Loading the run's
logged model from a copy of the store leaves every file of the copy as it was, and the
model is named as its run. The slow test loads the folder in a fresh virtual environment
with only torch and MLflow."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import mlflow
import mlflow.pyfunc
import mlflow.pytorch
import numpy as np
import pytest
import torch
from packaging.requirements import Requirement

from harness.base.atomic import staged_folder
from harness.cli.export_command import MANIFEST, earlier_export
from harness.cli.main import main
from harness.config.protocol_files import load_protocol
from harness.engine.run.export import ImageEmbedder, example_images
from harness.engine.run.model import build_model
from harness.store.weights import load_finished_weights
from tests.refusals import Refusal, assert_refused_in

TINY_PROTOCOL = Path(__file__).parents[1] / "protocols" / "tiny.toml"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, data_root) -> dict:
    """A store of its own (database and artifacts in one folder) and a checkpoint root
    holding one tiny run of ``plain``, its model logged."""
    root = tmp_path_factory.mktemp("export")
    store, out = root / "store", root / "run.json"
    previous = mlflow.get_tracking_uri()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(root)
            patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
            patch.setenv("DML_HARNESS_LOG_MODEL", "1")
            argv = ["run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL)]
            assert main([*argv, "--experiment", "export", "--json", str(out)]) == 0
    finally:
        mlflow.set_tracking_uri(previous)
    (record,) = json.loads(out.read_text())
    return {
        "store": store,
        "checkpoints": root / "results" / "checkpoints",
        "run_id": record["mlflow_run_id"],
    }


@pytest.fixture
def here(recorded, tmp_path, monkeypatch) -> Path:
    """A copy of the recorded store, the tracking URI and the checkpoint root pointed at it
    and the recorded checkpoints, the working folder ``tmp_path``; the copy."""
    copy = tmp_path / "store"
    shutil.copytree(recorded["store"], copy)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{copy / 'mlflow.db'}")
    monkeypatch.setenv("DML_HARNESS_CHECKPOINTS", str(recorded["checkpoints"]))
    mlflow.set_tracking_uri(f"sqlite:///{copy / 'mlflow.db'}")
    return copy


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _harness_embeddings(run_id: str, images: np.ndarray) -> np.ndarray:
    """The run's embeddings of ``images`` as the harness computes them (its network with
    the selected weights, behind the protocol's normalisation)."""
    protocol = load_protocol(str(TINY_PROTOCOL)).for_dataset("synthetic")
    model = build_model(protocol, "plain", {})
    load_finished_weights(model, run_id, flag="test")
    with torch.inference_mode():
        return ImageEmbedder(model.eval(), protocol.image)(torch.from_numpy(images)).numpy()


@pytest.mark.slow  # 32 s on 2 cores; the fresh-environment test checks the same sizes loaded by MLflow
def test_an_export_embeds_as_the_run_at_the_protocols_size_and_at_224_px(recorded, here):
    run_id = recorded["run_id"]
    folder = here.parent / "model"
    assert main(["export", run_id, str(folder)]) == 0
    assert {"MLmodel", "data/model.pt2", "input_example.json", MANIFEST} <= set(_digests(folder))
    assert earlier_export(folder)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []
    run = mlflow.MlflowClient().get_run(run_id)
    info = mlflow.models.get_model_info(str(folder))
    assert info.metadata["fingerprint"] == run.data.tags["fingerprint"]
    assert info.metadata["run_name"] == run.info.run_name == "plain-synthetic-margin-seed0"
    assert info.metadata["image_sizes_checked"] == [32, 224]
    loaded = mlflow.pytorch.load_model(str(folder))
    for size in (32, 224):
        for count in (1, 3):
            images = example_images(size, count=count, seed=size)
            with torch.inference_mode():
                got = loaded(torch.from_numpy(images)).numpy()
            assert got.shape == (count, 16)
            np.testing.assert_allclose(got, _harness_embeddings(run_id, images), atol=1e-5)
    images = example_images(224, count=3, seed=1)
    predicted = mlflow.pyfunc.load_model(str(folder)).predict(images)
    np.testing.assert_allclose(predicted, _harness_embeddings(run_id, images), atol=1e-5)


@pytest.mark.slow  # 25 s on 2 cores: two exports
def test_an_earlier_export_is_replaced_whole_and_a_changed_one_refused(recorded, here, capsys):
    """An export over an earlier one left as it was replaces it; one edited since, or a
    folder of other files, is refused before any work and left byte for byte."""
    folder = here.parent / "model"
    folder.mkdir()
    assert main(["export", recorded["run_id"], str(folder)]) == 0  # an empty folder
    first = _digests(folder)
    (folder / "MLmodel").write_text((folder / "MLmodel").read_text() + "# edited\n")
    edited = _digests(folder)
    capsys.readouterr()
    assert main(["export", recorded["run_id"], str(folder)]) == 2
    assert "is not an export of the harness left as it was" in capsys.readouterr().err
    assert _digests(folder) == edited
    (folder / "MLmodel").write_text((folder / "MLmodel").read_text().removesuffix("# edited\n"))
    assert main(["export", recorded["run_id"], str(folder)]) == 0
    assert set(_digests(folder)) == set(first) and earlier_export(folder)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["model", "store"]


def test_a_staged_folder_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "kept").write_text("earlier")
    with pytest.raises(RuntimeError), staged_folder(target) as staged:
        (staged / "half").write_text("written")
        raise RuntimeError("the writer fails")
    assert _digests(target) == {"kept": hashlib.sha256(b"earlier").hexdigest()}
    with staged_folder(target) as staged:
        (staged / "whole").write_text("written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in target.iterdir()] == ["whole"]


def _unfinished_runs(store: Path) -> None:
    """A RUNNING run and a FINISHED one without selected weights, ids ``running`` and
    ``derived`` in the case folder's ``ids.json``."""
    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("export").experiment_id
    running = client.create_run(experiment, tags={"method": "plain"}).info.run_id
    derived = client.create_run(experiment, tags={"method": "plain"}).info.run_id
    client.set_terminated(derived, "FINISHED")
    (store.parent / "ids.json").write_text(json.dumps({"running": running, "derived": derived}))


REFUSALS = [
    Refusal(("export", "0123456789abcdef", "{dir}/model"), "export: no run '0123456789abcdef'"),
    Refusal(("export", "RUN", "{dir}/store/mlartifacts/model"), "the tracking store's artifact"),
    Refusal(
        ("export", "RUN", "{dir}/notes.txt"),
        "is a file, not a folder",
        prepare=lambda folder: (folder / "notes.txt").write_text("mine"),
    ),
    Refusal(
        ("export", "RUN", "{dir}/mine"),
        "exists and is not an export of the harness",
        prepare=lambda folder: (folder / "mine").mkdir() or (folder / "mine" / "a").write_text(""),
    ),
    Refusal(("export", "RUNNING", "{dir}/model"), "is RUNNING, not FINISHED"),
    Refusal(("export", "DERIVED", "{dir}/model"), "has no selected weights (no model_path tag"),
    Refusal(("export", "RUN", "{dir}/model", "--checkpoint-root", "{dir}"), "has no saved model"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=str)
def test_a_bad_input_is_one_line_and_writes_nothing(case, recorded, here, capsys):
    _unfinished_runs(here)
    ids = json.loads((here.parent / "ids.json").read_text())
    argv = tuple(
        {"RUN": recorded["run_id"], "RUNNING": ids["running"], "DERIVED": ids["derived"]}.get(
            arg, arg
        )
        for arg in case.argv
    )
    case = Refusal(argv, case.match, case.prepare)
    assert_refused_in(case, here.parent, here, capsys, watched=[here.parent])


def test_loading_a_logged_model_leaves_every_file_of_the_store_as_it_was(recorded, here):
    """MLflow writes ``registered_model_meta`` into the folder a model's download gives it;
    the store's repository gives a copy, never the stored folder. The logged model is named
    as its run, so ``runs:/<run id>/<run name>`` loads it too."""
    run = mlflow.MlflowClient().get_run(recorded["run_id"])
    before = _digests(here)
    images = torch.from_numpy(example_images(32))
    by_id = mlflow.pytorch.load_model(run.data.tags["model_uri"])(images)
    by_name = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/{run.info.run_name}")(images)
    assert torch.equal(by_id, by_name)
    assert _digests(here) == before
    assert not list(here.rglob("registered_model_meta"))


def test_a_run_recorded_with_absolute_paths_is_read_as_recorded(recorded, here, tmp_path):
    """A record whose ``model_path`` and ``checkpoint_dir`` are absolute (as some records
    hold them) is read as recorded."""
    client = mlflow.MlflowClient()
    tags = client.get_run(recorded["run_id"]).data.tags
    assert not Path(tags["model_path"]).is_absolute()
    assert tags["model_path"] == f"{tags['checkpoint_dir']}/model.pt"
    moved = tmp_path / "elsewhere"
    shutil.copytree(recorded["checkpoints"] / tags["checkpoint_dir"], moved / "run")
    client.set_tag(recorded["run_id"], "model_path", str(moved / "run" / "model.pt"))
    client.set_tag(recorded["run_id"], "checkpoint_dir", str(moved / "run"))
    protocol = load_protocol(str(TINY_PROTOCOL)).for_dataset("synthetic")
    assert load_finished_weights(
        build_model(protocol, "plain", {}),
        recorded["run_id"],
        flag="test",
        checkpoint_root=tmp_path / "nowhere",
    ) == int(tags["selected_epoch"])


#: The loading side of the slow test, run by the fresh environment's Python; argv: the folder.
LOADER = textwrap.dedent("""
    import importlib.metadata, importlib.util, json, sys
    assert importlib.util.find_spec("harness") is None
    import mlflow.pyfunc, numpy
    model = mlflow.pyfunc.load_model(sys.argv[1])
    out = {}
    for size in (32, 96, 224):
        images = numpy.random.default_rng(size).integers(0, 256, (3, 3, size, size), numpy.uint8)
        out[size] = model.predict(images).tolist()
    out["modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "harness")
    out["installed"] = sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions())
    print(json.dumps(out))
""")
LOCK = Path(__file__).resolve().parents[2] / "requirements" / "lock.txt"


def _distributions(root: str) -> set[str]:
    """``root`` and every distribution it requires, installed here (their names)."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _fresh_environment(folder: Path) -> Path:
    """A virtual environment made here with torch and MLflow alone: torch (and what it
    requires) as this environment has it, linked into the new one's site-packages (its CUDA
    build is gigabytes to fetch again), then ``pip install mlflow`` at the lock's versions.
    Its Python, or a skip where pip cannot install MLflow."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
    python = folder / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    entries = {
        file.parts[0]
        for name in _distributions("torch")
        for file in importlib.metadata.distribution(name).files or []
        if file.parts[0] not in ("..", "__pycache__") and not file.name.endswith(".pth")
    }
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in sorted(entries):
        if (here / entry).exists() and not (site / entry).exists():
            (site / entry).symlink_to(here / entry, target_is_directory=(here / entry).is_dir())
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", str(LOCK), "mlflow"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if install.returncode != 0:
        pytest.skip(f"pip cannot install MLflow into a fresh environment: {install.stderr[-300:]}")
    return python


@pytest.mark.slow
def test_an_export_loads_and_embeds_in_a_fresh_environment_of_mlflow_and_torch(
    recorded, here, tmp_path
):
    """The folder loaded by ``mlflow.pyfunc.load_model`` in a virtual environment made for
    the test with only torch and MLflow (and what they require) installed, no harness: it
    embeds 32, 96 and 224 px images as this process does."""
    folder = tmp_path / "model"
    assert main(["export", recorded["run_id"], str(folder)]) == 0
    python = _fresh_environment(tmp_path / "venv")
    done = subprocess.run(
        [python, "-c", LOADER, str(folder)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["modules"] == [] and "dml-harness" not in printed["installed"]
    assert {"mlflow", "torch"} <= set(printed["installed"])
    assert not {"timm", "pytorch-metric-learning", "torchvision"} & set(printed["installed"])
    assert importlib.util.find_spec("harness") is not None  # here, the harness is there
    for size in (32, 96, 224):
        images = np.random.default_rng(size).integers(0, 256, (3, 3, size, size), np.uint8)
        got = np.array(printed[str(size)], dtype=np.float32)
        assert got.shape == (3, 16)
        np.testing.assert_allclose(got, _harness_embeddings(recorded["run_id"], images), atol=1e-5)
