"""``sweep --executor slurm`` against a real Slurm: a single-node cluster from Debian's
packages (``apt-get install slurm-wlm munge``), started for the test from a ``slurm.conf``
in a temporary folder and stopped at its end.

The smoke grid of a paper (``avsl-table1``, the smallest: 8 cells) goes to the cluster as
an array of 2 tasks on the CPU; one task is ``scancel``-ed while it runs a cell. Every cell
must end FINISHED exactly once, with no second FINISHED run of any cell, and ``sweep
--status`` must agree with ``squeue`` whenever both are read. Slurm's own refusals (an
unknown partition, more CPUs than a node has) are checked on the way in.

Needs root (``slurmd`` starts jobs as their users) and the packages; skipped otherwise,
with the daemons' own error when they are installed but do not start.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from harness.cli.main import main
from harness.config.grids import load_grid
from harness.engine.grid.cluster import read_jobs
from harness.engine.grid.slurm import queue_states
from harness.engine.grid.sweep import CELL_ATTR
from tests.refusals import assert_refused
from tests.waiting import run_in_progress

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "srun")
#: The grid on the cluster, and how long its 8 cells may take on 2 loaded cores.
GRID, DEADLINE = "avsl-table1", 40 * 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(base: Path, socket_path: Path) -> str:
    """A one-node ``slurm.conf``: this host, its CPUs and most of its memory, no
    accounting, processes tracked without cgroups, everything under ``base``."""
    node = socket.gethostname().split(".")[0]
    mem_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    return "\n".join(
        [
            "ClusterName=harness-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket_path}",
            f"StateSaveLocation={base / 'state'}",
            f"SlurmdSpoolDir={base / 'spool'}",
            f"SlurmctldPidFile={base / 'slurmctld.pid'}",
            f"SlurmdPidFile={base / 'slurmd.pid'}",
            f"SlurmctldLogFile={base / 'slurmctld.log'}",
            f"SlurmdLogFile={base / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=10",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} "
            f"RealMemory={mem_kb // 1024 * 8 // 10} State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _last_errors(*logs: Path) -> str:
    lines = [
        line.strip()
        for log in logs
        if log.is_file()
        for line in log.read_text(errors="replace").splitlines()
        if "error" in line.lower() or "fatal" in line.lower()
    ]
    return " | ".join(lines[-4:]) or "no error logged"


def _wait_idle(env: dict[str, str], timeout: float = 90) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = subprocess.run(
            ["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True, text=True
        )
        if done.returncode == 0 and done.stdout.strip() == "idle":
            return True
        time.sleep(1)
    return False


def _stop(procs: list[subprocess.Popen], env: dict[str, str]) -> None:
    """Cancel what is left on the cluster, then stop the daemons, slurmd first."""
    subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        done = subprocess.run(["squeue", "--noheader"], env=env, capture_output=True, text=True)
        if done.returncode != 0 or not done.stdout.strip():
            break
        time.sleep(1)
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture
def slurm() -> Iterator[dict[str, str]]:
    """A running one-node Slurm cluster; yields the environment its clients need.

    The daemons run in sessions of their own and a SIGTERM to the test becomes an
    interrupt, so that a test stopped from outside still cancels its jobs and stops the
    daemons (the jobs' processes outlive the daemons otherwise)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a real Slurm node (slurmd) needs root")
    base = Path(tempfile.mkdtemp(prefix="harness-slurm-"))
    for folder in ("state", "spool"):
        (base / folder).mkdir()
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket_path = base / "munge.sock"
    (base / "slurm.conf").write_text(_conf(base, socket_path))
    env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}
    procs: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        munge = [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
            f"--log-file={base / 'munged.log'}", f"--pid-file={base / 'munged.pid'}",
            f"--seed-file={base / 'munged.seed'}",
        ]  # fmt: skip
        procs.append(subprocess.Popen(munge, stderr=subprocess.DEVNULL, start_new_session=True))
        for _ in range(50):
            if socket_path.exists():
                break
            time.sleep(0.1)
        for daemon in ("slurmctld", "slurmd"):
            out = (base / f"{daemon}.out").open("w")
            conf = str(base / "slurm.conf")
            procs.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", conf],
                    env=env,
                    stdout=out,
                    stderr=out,
                    cwd=base,
                    start_new_session=True,
                )
            )
        if not _wait_idle(env):
            logs = [base / n for n in ("munged.log", "slurmctld.out", "slurmd.out")]
            pytest.skip(f"a one-node Slurm did not start here: {_last_errors(*logs)}")
        yield {"SLURM_CONF": str(base / "slurm.conf")}
    finally:
        _stop(procs, env)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(base, ignore_errors=True)


def _status(grid_name: str, capsys) -> dict[str, str]:
    """``sweep --status``: ``{cell label: job}`` of the cells it shows running."""
    capsys.readouterr()
    assert main(["sweep", "--status", grid_name, "--smoke"]) == 0
    out = capsys.readouterr().out
    running = {}
    for line in out.splitlines():
        match = re.match(r"\s+running\s+(\S+)\s+job (\S+)$", line)
        if match:
            running[match.group(1)] = match.group(2)
    return running


def _finished_runs(experiment: str) -> list:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name(experiment)
    runs = mlflow.MlflowClient().search_runs([exp.experiment_id], max_results=1000)
    assert all(r.info.status in ("FINISHED", "KILLED", "FAILED") for r in runs)
    return [r for r in runs if r.info.status == "FINISHED"]


@pytest.mark.slow  # a real cluster running a smoke grid on 2 cores: 10 to 30 minutes
def test_a_smoke_grid_on_a_real_slurm_survives_a_cancelled_task(
    slurm, workdir, data_root, capsys, monkeypatch
):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
    # Slurm's own refusals, quoted, before anything is written or submitted.
    submit = ["sweep", "--grid", GRID, "--smoke", "--executor", "slurm"]
    assert_refused([*submit, "--partition", "nope"], "Partition nope not found", capsys, [workdir])
    assert_refused(
        [*submit, "--cpus-per-task", str(os.cpu_count() + 1)],
        f"its largest node has {os.cpu_count()} CPUs",
        capsys,
        [workdir],
    )
    grid = load_grid(GRID, smoke=True)
    common = ["--device", "cpu", "--heartbeat", "2", "--grace", "20"]
    assert main([*submit, "--workers", "2", "--cpus-per-task", "1", *common]) == 0
    [record] = read_jobs(grid)
    assert len(record["tasks"]) == 2

    agreed, victim = 0, None
    deadline = time.time() + DEADLINE
    while time.time() < deadline:
        running = _status(GRID, capsys)
        queue = queue_states([record["array"]])
        for label, job in running.items():  # --status says running: squeue must too
            assert queue.get(job) == "RUNNING" or victim == job, (label, job, queue)
            agreed += 1
        if victim is None and len(set(running.values())) == 2:
            job = sorted(running.values())[-1]
            cell = next(label for label, held in running.items() if held == job)
            # Mid-cell: the cell's run is training (a state, not a number of seconds).
            if run_in_progress(grid.experiment, after_an_epoch=False, grid_cell=cell):
                victim = job
                subprocess.run(["scancel", victim], check=True)
        if not queue and victim is not None:
            break
        time.sleep(3)
    assert victim is not None, "the two tasks never ran cells at once"
    assert not queue_states([record["array"]]), "the array did not end in time"
    assert agreed >= 4

    finished = _finished_runs(grid.experiment)
    keys = sorted(r.data.tags[CELL_ATTR] for r in finished)
    assert keys == sorted(c.key for c in grid.cells)  # every cell FINISHED exactly once
    array_tasks = {r.data.tags["slurm_array_task_id"] for r in finished}
    assert {r.data.tags["slurm_array_job_id"] for r in finished} == {record["array"]}
    assert array_tasks <= {"0", "1"}
    # The cell the cancelled task held went back to the queue (its heartbeat went stale)
    # and the other task ran it to its one FINISHED run.
    import optuna

    trials = optuna.load_study(
        study_name=f"sweep:{grid.name}", storage=f"sqlite:///{workdir / 'results' / 'optuna.db'}"
    ).trials
    [lost] = [t for t in trials if t.state.name == "FAIL" and t.user_attrs.get("job") == victim]
    rerun = next(r for r in finished if r.data.tags[CELL_ATTR] == lost.user_attrs[CELL_ATTR])
    assert f"{record['array']}_{rerun.data.tags['slurm_array_task_id']}" != victim
    capsys.readouterr()
    assert main(["sweep", "--status", GRID, "--smoke"]) == 0
    assert "8 cells: 8 finished" in capsys.readouterr().out
    with capsys.disabled():  # the figures of this run, for whoever reads the log
        print(
            f"\nslurm array {record['array']}: task {victim} cancelled while it ran cell "
            f"{lost.user_attrs['cell']}, which task {rerun.data.tags['slurm_array_task_id']} "
            f"then ran; {len(finished)}/{len(grid.cells)} cells FINISHED once; {agreed} running "
            f"cells shown by --status, each RUNNING in squeue"
        )


@pytest.mark.slow  # a tuned grid's search and final phase on a real cluster: 5 to 20 minutes
def test_a_tuned_grid_on_a_real_slurm_ends_as_a_local_sweep(slurm, workdir, monkeypatch):
    """The tuned test grid (2 studies x 3 trials x 2 folds, then 4 final cells) as an array
    of 2 tasks, against the same grid swept by 2 local workers: every study complete with
    the same trials, and the same tables, byte for byte."""
    import optuna

    from harness.engine.tuning.studies import settled, tuned_studies

    grid_file = str(Path(__file__).resolve().parents[1] / "grids" / "tiny-tuned.toml")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread per worker on either side
    monkeypatch.setenv("DML_HARNESS_LOG_MODEL", "0")
    outcome = {}
    for where in ("local", "slurm"):
        folder = workdir / where
        folder.mkdir()
        monkeypatch.chdir(folder)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{folder / 'mlflow.db'}")
        monkeypatch.setenv("DML_HARNESS_CHECKPOINTS", str(folder / "checkpoints"))
        if where == "slurm":
            for key, value in slurm.items():
                monkeypatch.setenv(key, value)
        storage = f"sqlite:///{folder / 'optuna.db'}"
        argv = ["sweep", "--grid", grid_file, "--storage", storage, "--workers", "2"]
        argv += ["--device", "cpu", "--heartbeat", "2", "--grace", "20"]
        if where == "slurm":
            argv += ["--executor", "slurm", "--cpus-per-task", "1", "--wait"]
        assert main(argv) == 0
        grid = load_grid(grid_file)
        rdb = optuna.storages.RDBStorage(storage)
        trials = {
            s.label: {
                n: (t.params, t.value)
                for n, t in settled(optuna.load_study(study_name=s.name, storage=rdb)).items()
            }
            for s in tuned_studies(grid)
        }
        assert all(len(t) == 3 for t in trials.values())  # every study has its whole budget
        tables = folder / "results" / "tables"
        texts = {p.name: p.read_text() for p in sorted(tables.glob("tiny-tuned*.md"))}
        outcome[where] = (trials, texts)
    assert outcome["slurm"] == outcome["local"]
    assert "tiny-tuned.md" in outcome["slurm"][1]
