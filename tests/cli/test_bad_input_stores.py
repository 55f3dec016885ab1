"""Tracking stores that cannot work (a folder without write access, a server that does
not answer, a missing driver, a database that is not a store), each probed once before any
work and refused in seconds with one line, reading creating none; and the partial
checkpoint of a killed run, removed when the run is marked FAILED."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli.main import main
from tests.conftest import TINY_PROTOCOL
from tests.refusals import assert_refused, unwritable_folder

ROOT = Path(__file__).resolve().parents[2]
RUN = ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL))
TUNE = ("tune", "--method", "plain", "--trials", "1", "--protocol", str(TINY_PROTOCOL))


def _sqlite_file(folder: Path) -> None:
    """``other.db``: an SQLite database that is not an MLflow store."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(folder / "other.db")) as db:
        db.execute("CREATE TABLE runs (id TEXT)")
        db.commit()


# 9, 10, 11. Stores that cannot work, probed once before any work; reading creates none.
STORE_CASES = [
    (
        "sqlite:///{dir}/ro/mlflow.db",
        RUN,
        "the tracking store sqlite:///{dir}/ro/mlflow.db (MLFLOW_TRACKING_URI) "
        "{dir}/ro: cannot write in",
    ),
    (
        "http://127.0.0.1:9",
        RUN,
        "the tracking server http://127.0.0.1:9 does not answer within 5 s",
    ),
    (
        "http://127.0.0.1:9",
        ("table", "--experiment", "x"),
        "the tracking server http://127.0.0.1:9 does not answer",
    ),
    (
        "postgresql+psycopg://user@localhost/db",
        RUN,
        "the tracking store (MLFLOW_TRACKING_URI) localhost/db needs the "
        "database driver 'psycopg', which is not installed: pip install psycopg[binary]",
    ),
    (  # SQLAlchemy's driver for a URL that names none: psycopg (not installed here)
        "postgresql://user@localhost/db",
        RUN,
        "the tracking store (MLFLOW_TRACKING_URI) localhost/db needs the "
        "database driver 'psycopg', which is not installed: pip install psycopg[binary]",
    ),
    (
        "sqlite:///{dir}/none/mlflow.db",
        ("table", "--experiment", "x"),
        "the tracking store sqlite:///{dir}/none/mlflow.db does not exist (MLFLOW_TRACKING_URI); reading creates none",
    ),
    (
        "sqlite:///{dir}/mlflow.db",
        ("explain-table", "--experiment", "x"),
        "does not exist (MLFLOW_TRACKING_URI)",
    ),
    (
        "sqlite:///{dir}/other.db",
        ("table", "--experiment", "x"),
        "the tracking store sqlite:///{dir}/other.db is an SQLite database without MLflow's tables",
    ),
    (
        "",
        (
            "sweep",
            "--grid",
            str(ROOT / "tests" / "grids" / "tiny.toml"),
            "--storage",
            "postgresql+psycopg://u@h/db",
        ),
        "--storage h/db needs the database driver 'psycopg', which is not installed",
    ),
    (
        "",
        (*TUNE, "--storage", "mysql+pymysql://u@h/db"),
        "--storage h/db needs the database driver 'pymysql'",
    ),
]


@pytest.mark.parametrize(
    "uri, argv, match", STORE_CASES, ids=[f"{c[1][0]} {c[0] or c[1][-1]}" for c in STORE_CASES]
)
def test_a_store_that_cannot_work_is_refused_in_seconds(
    uri, argv, match, workdir, data_root, tracking_dir, capsys, tmp_path_factory, monkeypatch
):
    import time

    import mlflow

    folder = tmp_path_factory.mktemp("input")
    unwritable_folder(folder)
    _sqlite_file(folder)
    mlflow.set_tracking_uri(
        f"sqlite:///{tracking_dir / 'mlflow.db'}"
    )  # the contract's own look-ups
    if uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.replace("{dir}", str(folder)))
    start = time.monotonic()
    try:
        assert_refused(
            list(argv),
            match.replace("{dir}", str(folder)),
            capsys,
            watched=[workdir, data_root, folder, tracking_dir],
        )
    finally:
        if not (folder / "ro").is_symlink():
            (folder / "ro").chmod(0o700)
    assert time.monotonic() - start < 10


def test_a_killed_runs_partial_checkpoint_is_removed_when_it_is_failed(
    workdir, tracking_dir, capsys
):
    """A run SIGKILLed while writing ``last.pt`` leaves ``.last.pt.<host>-<pid>.<random>.tmp``
    in its checkpoint folder; the command that marks the run FAILED removes it, and leaves
    the files of live writers and the checkpoint itself."""
    import socket
    import uuid

    import mlflow

    from harness.base.atomic import writer_tag
    from harness.store.dead_runs import CHECKPOINT_DIR_TAG
    from harness.store.location import tracking_uri

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = child.pid
    folder = workdir / "ckpt" / "run-key"
    folder.mkdir(parents=True)
    partial = folder / f".last.pt.{writer_tag(dead)}.abc123de.tmp"
    live = folder / f".last.pt.{writer_tag()}.fgh456ij.tmp"
    for path in (partial, live, folder / "last.pt"):
        path.write_bytes(b"x")
    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    experiment = client.create_experiment(f"partial-{uuid.uuid4().hex[:8]}")
    run = client.create_run(
        experiment,
        tags={"harness_worker": f"{socket.gethostname()}:{dead}", CHECKPOINT_DIR_TAG: str(folder)},
    ).info.run_id

    assert (
        main(["table", "--experiment", "no-such-experiment"]) == 2
    )  # opens the store, then refuses
    assert client.get_run(run).info.status == "FAILED"
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, "last.pt"])
