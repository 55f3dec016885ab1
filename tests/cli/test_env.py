"""``harness env RUN_ID``: a run's recorded environment as a pip constraints file (its
commit and Python as comments, one ``name==version`` per recorded package), and its
refusals. The slow test installs the printed file into a new virtual environment and
compares what pip installed with what the run recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

from harness.cli.env_command import pytorch_index
from harness.cli.main import main
from harness.store.provenance import environment_tags
from tests.refusals import assert_refused

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TAGS = {
    "git_commit": f"{COMMIT}-dirty",
    "mlflow.source.git.commit": COMMIT,
    "torch_build": "2.5.1+cpu",
    "cuda": "None",
    "version.python": "3.11.7",
    "version.torch": "2.5.1+cpu",
    "version.numpy": "1.26.4",
    "version.faiss-cpu": "1.8.0",
    "version.faiss-gpu": "not installed",
    "version.dml-harness": "0.1.0",
    "method": "plain",
}


def _run(experiment: str, tags: dict[str, str]) -> str:
    client = mlflow.MlflowClient()
    found = client.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found else client.create_experiment(experiment)
    run = client.create_run(exp_id, tags=tags)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def _env(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(["env", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_env_prints_the_commit_then_one_pin_per_installed_package(experiment, capsys):
    run_id = _run(experiment, TAGS)
    assert _env([run_id], capsys).splitlines() == [
        f"# run {run_id}",
        f"# commit {COMMIT}",
        "# the run had uncommitted changes: they are stored with it as the artifact "
        "source/uncommitted.patch (git apply it at that commit)",
        "# python 3.11.7",
        "# torch build 2.5.1+cpu, no CUDA",
        "# rebuild at that commit: pip install -c constraints.txt -e .",
        "# torch==2.5.1+cpu is a build PyPI does not serve: "
        "add --extra-index-url https://download.pytorch.org/whl/cpu to the pip line",
        "faiss-cpu==1.8.0",
        "numpy==1.26.4",
        "torch==2.5.1+cpu",
    ]


def test_a_clean_run_has_no_patch_line_and_a_package_outside_the_requirements_is_named(
    experiment, capsys
):
    tags = {
        **TAGS,
        "git_commit": COMMIT,
        "torch_build": "2.4.0+cu121",
        "cuda": "12.1",
        "version.torch": "2.4.0",
        "version.faiss-cpu": "not installed",
        "version.faiss-gpu": "1.7.2",
    }
    lines = _env([_run(experiment, tags)], capsys).splitlines()
    assert lines[1:5] == [
        f"# commit {COMMIT}",
        "# python 3.11.7",
        "# torch build 2.4.0+cu121, CUDA 12.1",
        "# rebuild at that commit: pip install -c constraints.txt -e .",
    ]
    # faiss-gpu is not among the harness's requirements: a constraint alone installs nothing.
    assert (
        "# faiss-gpu is not a requirement of the harness: pip install -c constraints.txt faiss-gpu"
        in lines
    )
    assert [line for line in lines if not line.startswith("#")] == [
        "faiss-gpu==1.7.2",
        "numpy==1.26.4",
        "torch==2.4.0",
    ]


def test_pytorch_builds_are_told_which_index_serves_them():
    assert pytorch_index("cpu") == "https://download.pytorch.org/whl/cpu"
    assert pytorch_index("cu121") == "https://download.pytorch.org/whl/cu121"
    assert pytorch_index("rocm6.2") == "https://download.pytorch.org/whl/rocm6.2"
    assert pytorch_index("mybuild") is None


def test_out_writes_the_same_text_and_replaces_its_own_earlier_file(experiment, capsys, tmp_path):
    run_id = _run(experiment, TAGS)
    printed = _env([run_id], capsys)
    out = tmp_path / "c.txt"
    for _ in range(2):  # the second time over its own earlier output, without --force
        assert _env([run_id, "--out", str(out)], capsys) == ""
    assert out.read_text() == printed.replace("-c constraints.txt", "-c c.txt")
    # no temporary left; beside it the record of what the harness wrote
    assert sorted(p.name for p in tmp_path.iterdir()) == [".harness-written.json", "c.txt"]


def test_an_unknown_run_is_refused(workdir, tracking_dir, capsys):
    assert_refused(
        ["env", "0123456789abcdef0123456789abcdef"],
        "env: no run '0123456789abcdef0123456789abcdef' in the tracking store",
        capsys,
        watched=[workdir, tracking_dir],
    )


def test_a_run_without_versions_is_refused(experiment, workdir, tracking_dir, capsys):
    run_id = _run(experiment, {"method": "plain", "git_commit": COMMIT})
    out = workdir / "c.txt"
    assert_refused(
        ["env", run_id, "--out", str(out)],
        f"env: run '{run_id}' records no installed package versions (no version.* tags)",
        capsys,
        watched=[workdir, tracking_dir],
    )
    assert not out.exists()


def _index_url(python: Path) -> str:
    """The package index pip in ``python``'s environment reads (its configuration, else PyPI)."""
    found = subprocess.run(
        [str(python), "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    return os.environ.get("PIP_INDEX_URL") or found or "https://pypi.org/simple"


def _skip_unless_reachable(url: str) -> None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/pip/", timeout=20):
            pass
    except (urllib.error.URLError, OSError) as err:
        pytest.skip(f"the package index {url} cannot be reached ({err}): the install needs it")


@pytest.mark.slow
def test_the_printed_constraints_rebuild_the_recorded_versions(experiment, capsys, tmp_path):
    """``env RUN_ID > c.txt``, then ``pip install -c c.txt -e <checkout>`` in a new virtual
    environment installs each listed package at the version the run recorded (several GB;
    quick when pip's cache holds the wheels)."""
    tags = environment_tags()
    run_id = _run(experiment, tags)
    constraints = tmp_path / "c.txt"
    constraints.write_text(_env([run_id], capsys))
    lines = constraints.read_text().splitlines()
    pins = dict(line.split("==", 1) for line in lines if not line.startswith("#"))
    # Recorded packages the harness does not require are named on the pip line, as told.
    extra = [line.rsplit(" ", 1)[1] for line in lines if "not a requirement of the harness" in line]
    assert {"torch", "numpy", "mlflow"} <= set(pins)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    _skip_unless_reachable(_index_url(python))
    done = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "-c",
            str(constraints),
            "-e",
            str(ROOT),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probe = "import sys; from importlib.metadata import version; print(*(version(n) for n in sys.argv[1:]))"
    installed = subprocess.run(
        [str(python), "-c", probe, *pins],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert dict(zip(pins, installed, strict=True)) == pins
    assert pins == {
        k.removeprefix("version."): v
        for k, v in tags.items()
        if k.startswith("version.")
        and k not in ("version.python", "version.dml-harness")
        and v != "not installed"
    }
    harness = subprocess.run(
        [str(python), "-c", "import harness; print(harness.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(harness).is_relative_to(ROOT)  # the checkout itself is the -e install
