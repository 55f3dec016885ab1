"""A run whose process ended without finishing it (SIGKILL, the out-of-memory killer, a
power loss) is marked FAILED, with a ``failure`` tag saying why, by the next command that
opens the tracking store; ``run --resume`` continues it in the same MLflow run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import mlflow
import pytest

from harness.base.atomic import writer_tag
from harness.cli.faults import FAULT_ENV
from harness.cli.main import main
from harness.store.dead_runs import CHECKPOINT_DIR_TAG, under_checkpoint_root
from harness.store.location import tracking_uri


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _client() -> mlflow.MlflowClient:
    mlflow.set_tracking_uri(tracking_uri())
    return mlflow.MlflowClient()


def test_a_run_of_a_dead_process_is_failed_by_the_next_command(workdir, capsys):
    client = _client()
    experiment = client.create_experiment(f"dead-{uuid.uuid4().hex[:8]}")
    dead = _dead_pid()
    host = socket.gethostname()
    orphan = client.create_run(experiment, tags={"harness_worker": f"{host}:{dead}"}).info.run_id
    alive = client.create_run(
        experiment, tags={"harness_worker": f"{host}:{os.getpid()}"}
    ).info.run_id
    elsewhere = client.create_run(
        experiment, tags={"harness_worker": f"other-host.invalid:{dead}"}
    ).info.run_id

    assert (
        main(["table", "--experiment", "no-such-experiment"]) == 2
    )  # opens the store, then refuses

    run = client.get_run(orphan)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure"] == (
        f"process {dead} on {host} ended without finishing the run "
        f"(killed, out of memory or power lost)"
    )
    assert f"run {orphan} was left RUNNING" in capsys.readouterr().err
    assert client.get_run(alive).info.status == "RUNNING"  # its process (this one) still runs
    assert (
        client.get_run(elsewhere).info.status == "RUNNING"
    )  # another host's pid cannot be checked
    for run_id in (alive, elsewhere):
        client.set_terminated(run_id, status="FINISHED")


@pytest.mark.slow
def test_a_killed_run_is_failed_by_the_next_command_and_resumes(workdir, tiny_protocol):
    """SIGKILL lands in epoch 2 (batch 4 of 3 per epoch), after epoch 1's checkpoint."""
    experiment = f"killed-{uuid.uuid4().hex[:8]}"
    argv = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "--methods",
        "plain",
        "--protocol",
        str(tiny_protocol),
        "--experiment",
        experiment,
    ]
    killed = subprocess.Popen(
        argv,
        cwd=workdir,
        env={**os.environ, FAULT_ENV: "train_batch:4:kill"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = killed.communicate(timeout=600)
    assert killed.returncode == -9, err
    assert list((workdir / "results" / "checkpoints").glob("*/last.pt")), (
        "no checkpoint before the kill"
    )
    client = _client()
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "RUNNING"  # nothing ran after SIGKILL to end it

    listed = subprocess.run(
        [sys.executable, "-m", "harness", "explain-table", "--experiment", experiment],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"run {run.info.run_id} was left RUNNING" in listed.stderr
    failed = client.get_run(run.info.run_id)
    assert failed.info.status == "FAILED"
    assert failed.data.tags["failure"] == (
        f"process {killed.pid} on {socket.gethostname()} ended without "
        f"finishing the run (killed, out of memory or power lost)"
    )

    resumed = subprocess.run(
        [*argv, "--resume"], cwd=workdir, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming plain seed 0 after epoch 1" in resumed.stderr
    finished = client.get_run(run.info.run_id)  # the same MLflow run, continued
    assert finished.info.status == "FINISHED"
    assert "failure" not in finished.data.tags
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/epoch_loss")] == [
        1,
        2,
    ]


def test_a_recorded_path_is_read_under_the_checkpoint_root_or_as_recorded(tmp_path, monkeypatch):
    """``checkpoint_dir`` and ``model_path`` are recorded relative to the checkpoint root
    and read under the root in effect; an absolute one is read as recorded."""
    monkeypatch.setenv("DML_HARNESS_CHECKPOINTS", str(tmp_path / "root"))
    assert under_checkpoint_root("key/model.pt") == tmp_path / "root" / "key" / "model.pt"
    assert under_checkpoint_root("key", tmp_path / "moved") == tmp_path / "moved" / "key"
    assert under_checkpoint_root(str(tmp_path / "old" / "key")) == tmp_path / "old" / "key"
    assert under_checkpoint_root("../key") is None
    assert under_checkpoint_root("") is None


def test_a_dead_runs_partial_checkpoint_is_removed_under_the_root_it_names(
    workdir, monkeypatch, capsys
):
    """A killed run's ``checkpoint_dir`` (relative) names its folder under the checkpoint
    root; the command that fails the run removes the dead writer's partial file there."""
    root = workdir / "checkpoints"
    folder = root / "run-key"
    folder.mkdir(parents=True)
    dead = _dead_pid()
    partial = folder / f".last.pt.{writer_tag(dead)}.abc123de.tmp"
    partial.write_bytes(b"x")
    (folder / "last.pt").write_bytes(b"x")
    monkeypatch.setenv("DML_HARNESS_CHECKPOINTS", str(root))
    client = _client()
    experiment = client.create_experiment(f"partial-{uuid.uuid4().hex[:8]}")
    run = client.create_run(
        experiment,
        tags={"harness_worker": f"{socket.gethostname()}:{dead}", CHECKPOINT_DIR_TAG: "run-key"},
    ).info.run_id
    assert main(["table", "--experiment", "no-such-experiment"]) == 2  # opens the store
    assert client.get_run(run).info.status == "FAILED"
    assert sorted(p.name for p in folder.iterdir()) == ["last.pt"]
