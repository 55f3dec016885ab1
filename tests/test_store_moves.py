"""A tracking store that moves: the SQLite file and its ``mlartifacts`` folder copied
elsewhere (the original deleted) give byte-identical tables, paired-bootstrap marks
included; a per-query artifact removed from the copy is named on stderr with its run,
marked in the table, and ``harness table --strict`` fails on it."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import mlflow
import pytest

from harness.cli.main import main
from harness.components.evaluation import PER_QUERY_ARTIFACT

TINY_PROTOCOL = Path(__file__).parent / "protocols" / "tiny.toml"


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
            if r.data.tags["method"] == "ngrouping"
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
