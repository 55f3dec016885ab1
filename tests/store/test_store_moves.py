"""A tracking store that moves: the SQLite file and its ``mlartifacts`` folder copied
elsewhere (the original deleted) give byte-identical tables, paired-bootstrap marks
included; a per-query artifact removed from the copy is named on stderr with its run,
marked in the table, and ``harness table --strict`` fails on it. ``harness ui`` on the
copy serves its artifacts, and its models load."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import mlflow
import pytest

from harness.cli.main import main
from harness.components.evaluation import PER_QUERY_ARTIFACT

TINY_PROTOCOL = Path(__file__).parents[1] / "protocols" / "tiny.toml"


def _table(store: Path, experiment: str, fmt: str, out: Path, monkeypatch, *extra: str) -> int:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
    return main(
        [
            "table",
            "--experiment",
            experiment,
            "--format",
            fmt,
            "--metrics",
            "recall_at_1,nmi",
            "--baseline",
            "plain",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def built_store(tmp_path_factory) -> tuple[Path, str]:
    """A store of its own (database and artifacts in one folder) with a tiny grid run in
    it: plain and ngrouping, two seeds each, every run with its per-query artifact."""
    root = tmp_path_factory.mktemp("moving")
    store, experiment = root / "store", f"tiny-{uuid.uuid4().hex[:6]}"
    grid = root / "grid.toml"
    grid.write_text(
        f'name = "{experiment}"\nprotocol = "{TINY_PROTOCOL}"\nmethods = ["plain", "ngrouping"]\n'
        'losses = ["margin"]\nbackbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\n'
        "seeds = [0, 1]\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
        assert (
            main(["sweep", "--grid", str(grid), "--storage", f"sqlite:///{root / 'optuna.db'}"])
            == 0
        )
    return store, experiment


def test_a_copied_store_gives_the_same_tables_and_names_a_missing_artifact(
    built_store, tmp_path, monkeypatch, capsys
):
    store, experiment = built_store
    monkeypatch.chdir(tmp_path)
    assert (store / "mlartifacts").is_dir()  # the artifacts live beside the database
    original = {}
    for fmt in ("markdown", "latex"):
        assert _table(store, experiment, fmt, tmp_path / f"original.{fmt}", monkeypatch) == 0
        original[fmt] = (tmp_path / f"original.{fmt}").read_bytes()
    assert b"(Q=" in original["markdown"]  # the paired bootstrap read the per-query artifacts
    assert "‡" not in original["markdown"].decode()

    moved = tmp_path / "elsewhere" / "store"
    shutil.copytree(store, moved)
    shutil.rmtree(store)  # nothing of the original is left to read
    try:
        capsys.readouterr()
        for fmt in ("markdown", "latex"):
            assert _table(moved, experiment, fmt, tmp_path / f"moved.{fmt}", monkeypatch) == 0
            assert (tmp_path / f"moved.{fmt}").read_bytes() == original[fmt]
        assert "tables: run" not in capsys.readouterr().err

        mlflow.set_tracking_uri(f"sqlite:///{moved / 'mlflow.db'}")
        run = next(
            r
            for r in mlflow.search_runs(experiment_names=[experiment], output_format="list")
            if r.data.tags.get("method") == "ngrouping"  # the table run has none
        )
        artifact = moved / "mlartifacts" / run.info.run_id / "artifacts" / PER_QUERY_ARTIFACT
        artifact.unlink()
        assert _table(moved, experiment, "markdown", tmp_path / "missing.md", monkeypatch) == 0
        err = capsys.readouterr().err
        line = next(x for x in err.splitlines() if run.info.run_id in x)
        assert PER_QUERY_ARTIFACT in line and "ngrouping" in line and "R@1" in line
        text = (tmp_path / "missing.md").read_text()
        ngrouping_row = next(x for x in text.splitlines() if x.startswith("| N-grouping"))
        assert "‡" in ngrouping_row and "per-query results of 1 run(s) are missing" in text

        assert (
            _table(moved, experiment, "markdown", tmp_path / "strict.md", monkeypatch, "--strict")
            == 2
        )
        assert "error: --strict: 1 run(s) lack results" in capsys.readouterr().err
        assert not (tmp_path / "strict.md").exists()
    finally:
        shutil.copytree(moved, store)  # other tests of the module may read the store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _explanation_image(store: Path, runs: list) -> tuple[object, str]:
    """A run with an explanation figure, and the figure's artifact path."""
    for run in runs:
        folder = store / "mlartifacts" / run.info.run_id / "artifacts"
        for image in sorted(folder.glob("explanations/*.png")):
            return run, image.relative_to(folder).as_posix()
    raise AssertionError(f"no run in {store} logged an explanation figure")


@pytest.fixture(scope="module")
def moved_store(tmp_path_factory, data_root, tracking_dir) -> tuple[Path, object]:
    """A store of one ``run --methods agrouping`` (a method that draws its explanations,
    its model logged) copied elsewhere, the original deleted; the copy and the run."""
    root = tmp_path_factory.mktemp("moved")
    store, moved = root / "store", root / "elsewhere" / "store"
    previous = mlflow.get_tracking_uri()  # the session's store; the run points MLflow at its own
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(root)
            patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
            patch.setenv("DML_HARNESS_LOG_MODEL", "1")
            arguments = ["--methods", "agrouping", "--protocol", str(TINY_PROTOCOL)]
            assert main(["run", *arguments, "--experiment", "moving"]) == 0
    finally:
        mlflow.set_tracking_uri(previous)
    shutil.copytree(store, moved)
    shutil.rmtree(store)
    client = mlflow.MlflowClient(f"sqlite:///{moved / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("moving").experiment_id
    return moved, client.search_runs([experiment])[0]


@pytest.mark.slow
def test_a_moved_store_serves_its_artifacts_and_models_from_the_copy(
    moved_store, tmp_path, monkeypatch
):
    """``harness ui`` on the copy serves the run's explanation figure as the UI fetches it,
    and its model loads through that server and, in this process, from the copy's SQLite
    URI: runs and models record proxied URIs relative to the store, not the original's
    absolute path."""
    import mlflow.pytorch
    import torch

    from harness.engine.run.export import example_images
    from harness.store.artifacts import resolve_proxied_locally

    moved, run = moved_store
    uri = f"sqlite:///{moved / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    previous, server = mlflow.get_tracking_uri(), None
    try:
        mlflow.set_tracking_uri(uri)
        run, image = _explanation_image(moved, [run])
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
        port, log = _free_port(), tmp_path / "ui.log"
        with log.open("w") as sink:
            server = subprocess.Popen(
                [sys.executable, "-m", "harness", "ui", "--port", str(port)],
                env=dict(os.environ),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{port}"
        _wait_for(f"{base}/health", server, log)
        query = urllib.parse.urlencode({"path": image, "run_uuid": run.info.run_id})
        with urllib.request.urlopen(f"{base}/get-artifact?{query}", timeout=30) as response:
            served = response.read()
        expected = (moved / "mlartifacts" / run.info.run_id / "artifacts" / image).read_bytes()
        assert served == expected and served.startswith(b"\x89PNG")
        _show_in_browser(
            f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/artifacts/{image}"
        )

        images = torch.from_numpy(example_images(32))
        mlflow.set_tracking_uri(base)  # through the server, as any MLflow client
        through_server = mlflow.pytorch.load_model(run.data.tags["model_uri"])(images)
        mlflow.set_tracking_uri(uri)  # the copy's SQLite URI, in this process
        resolve_proxied_locally()
        local = mlflow.pytorch.load_model(run.data.tags["model_uri"])(images)
        assert through_server.shape == (2, 16) and torch.equal(through_server, local)
    finally:
        mlflow.set_tracking_uri(previous)
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


#: A notebook's code: MLflow and torch, the copy's SQLite URI from the environment, and
#: nothing of the harness (its name is not in the text). It prints the embedding of the
#: images in file argv[2] and the modules of package argv[3] the process ended up with
#: (those MLflow loaded itself).
NOTEBOOK = textwrap.dedent("""
    import json, sys
    import mlflow.pytorch, numpy, torch
    model = mlflow.pytorch.load_model(sys.argv[1])
    embedding = model(torch.from_numpy(numpy.load(sys.argv[2])))
    loaded = sorted(name for name in sys.modules if name.split(".")[0] == sys.argv[3])
    print(json.dumps({"embedding": embedding.tolist(), "loaded": loaded}))
""")


@pytest.mark.slow
def test_a_model_loads_from_the_moved_copy_in_python_that_never_imports_the_harness(
    moved_store, tmp_path
):
    """A fresh Python process (a notebook) with ``MLFLOW_TRACKING_URI`` set to the copy's
    SQLite database and the original deleted: ``mlflow.pytorch.load_model`` of the run's
    model loads it from the copy and embeds images as this process does. MLflow resolves the
    proxied URI through the repository the package declares for the scheme (an
    ``mlflow.artifact_repository`` entry point): the process's own code imports nothing of
    the harness, and MLflow loads one module of it."""
    from importlib.metadata import entry_points

    import mlflow.pytorch
    import numpy as np
    import torch

    from harness.engine.run.export import example_images
    from harness.store.artifacts import resolve_proxied_locally

    declared = {e.name: e.value for e in entry_points(group="mlflow.artifact_repository")}
    assert declared.get("mlflow-artifacts") == "harness.store.artifacts:proxied_repository", (
        "the installed package does not declare its artifact repository: pip install -e ."
    )
    moved, run = moved_store
    uri = f"sqlite:///{moved / 'mlflow.db'}"
    images = example_images(32)
    np.save(tmp_path / "images.npy", images)
    assert "harness" not in NOTEBOOK
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MLFLOW_TRACKING_URI": uri}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            NOTEBOOK,
            run.data.tags["model_uri"],
            str(tmp_path / "images.npy"),
            "harness",
        ],
        cwd=tmp_path,  # not the checkout: the harness is found as installed, or not at all
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["loaded"] == ["harness", "harness.store", "harness.store.artifacts"]
    previous = mlflow.get_tracking_uri()
    try:
        mlflow.set_tracking_uri(uri)
        resolve_proxied_locally()
        expected = mlflow.pytorch.load_model(run.data.tags["model_uri"])(torch.from_numpy(images))
    finally:
        mlflow.set_tracking_uri(previous)
    got = np.array(printed["embedding"], dtype=np.float32)
    assert got.shape == (2, 16)
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=0, atol=1e-6)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # L2-normalised embeddings


def _show_in_browser(url: str) -> None:
    """Where Chromium and selenium are installed: the artifact page ``url`` shows its image
    in headless Chromium, saved as ``moved-artifact.png`` beside the browser test's
    screenshots (:mod:`tests.cli.test_ui_browser`) for a person to look at."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None or importlib.util.find_spec("selenium") is None:
        return
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from tests.cli.test_ui_browser import SCREENSHOTS

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(url)
        deadline = time.time() + 120
        script = (  # the figure, fetched from the server (an object URL or its address)
            "return Array.from(document.images).some(i => i.naturalWidth > 0 && "
            "(i.src.startsWith('blob:') || i.src.includes('get-artifact')))"
        )
        while not driver.execute_script(script):
            assert time.time() < deadline, f"the artifact page {url} showed no image within 120 s"
            time.sleep(1)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOTS / "moved-artifact.png"))
    finally:
        driver.quit()


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"the UI did not answer at {url} within {timeout:.0f} s")
