"""``sweep --executor local|slurm``, ``--status`` and ``--cancel`` on this machine: the local
executor (submitit's, the same tasks a Slurm array runs, as processes) runs every cell once,
keeps each cell's output, tags its runs with the job's Slurm ids, hands a preempted task's
cell back to the queue and cancels without touching finished cells; the Slurm submission
is checked as built (its sbatch script, a multi-GPU cell's torchrun command). The real
cluster is ``tests/engine/test_slurm.py``'s."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import mlflow
import optuna
import pytest

from harness.cli.main import build_parser, main
from harness.cli.sweep import cmd_sweep
from harness.config.grids import load_grid
from harness.engine.grid.cells import train_in_processes
from harness.engine.grid.cluster import read_jobs, release_trials, sweep_folder
from harness.engine.grid.queue import hold_trial
from harness.engine.grid.sweep import CELL_ATTR, open_storage
from harness.engine.tuning.sweep import TASK_ATTR
from tests import slurm_fakes
from tests.waiting import run_in_progress, wait_until

TINY_PROTOCOL = Path(__file__).parents[1] / "protocols" / "tiny.toml"


def _grid(
    tmp: Path, *, methods=("plain", "ngrouping"), epochs: int | None = None, extra=""
) -> Path:
    """The tiny grid under a name of its own (the tracking store is the session's);
    ``epochs``: a longer run, to act on a cell while it runs."""
    path = tmp / "grid.toml"
    text = (
        f'name = "cluster-{uuid.uuid4().hex[:6]}"\nprotocol = "{TINY_PROTOCOL}"\n'
        f'methods = {json.dumps(list(methods))}\nlosses = ["margin"]\n'
        f'backbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\nseeds = [0]\n'
    )
    if epochs is not None:
        text += f'set = {{ "schedule.epochs" = {epochs} }}\n'
    path.write_text(text + extra)
    return path


def previous_sigint():
    return signal.getsignal(signal.SIGINT)


def _runs(experiment: str) -> list:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name(experiment)
    return [] if exp is None else mlflow.MlflowClient().search_runs([exp.experiment_id])


def _study(grid, storage: str):
    import optuna

    return optuna.load_study(study_name=f"sweep:{grid.name}", storage=storage)


def _wait_for_running_trial(grid, storage: str, timeout: float = 600):
    """The trial a task holds, once its cell runs (and the task has its signal handlers)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            running = [t for t in _study(grid, storage).trials if t.state.name == "RUNNING"]
        except KeyError:
            running = []
        if running and "job" in running[0].user_attrs:
            return running[0]
        time.sleep(1)
    raise AssertionError("no task started a cell")


def _wait_for_tasks(grid, timeout: float = 900) -> None:
    from harness.engine.grid.status import live_tasks

    deadline = time.time() + timeout
    while live_tasks(read_jobs(grid)):
        assert time.time() < deadline, "the tasks did not end"
        time.sleep(1)


# --------------------------------------------------------------- the local executor


# 26 s on 2 cores; the default run drives the local executor in the status and cancel test
@pytest.mark.slow
def test_local_executor_runs_every_cell_once_with_its_output_and_slurm_ids(
    workdir, capsys, monkeypatch
):
    """Two tasks, two cells: each cell FINISHED once, its output in its own files, its run
    tagged with the (here simulated) Slurm job; a second submission finds nothing to do."""
    ids = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}
    for key, value in ids.items():  # the tasks inherit this environment
        monkeypatch.setenv(key, value)
    grid_path = _grid(workdir, epochs=1)
    grid = load_grid(grid_path)
    argv = ["sweep", "--grid", str(grid_path), "--device", "cpu", "--executor", "local"]
    assert main([*argv, "--workers", "2", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "submitted local array" in out and "2 task(s) for 2 cell(s)" in out
    assert "2/2 cells finished" in out
    runs = _runs(grid.experiment)
    assert sorted(r.data.tags[CELL_ATTR] for r in runs) == sorted(c.key for c in grid.cells)
    assert all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        assert run.data.tags["slurm_job_id"] == "4242"
        assert run.data.tags["slurm_array_job_id"] == "4240"
        assert run.data.tags["slurm_array_task_id"] == "2"
    cells = sweep_folder(grid) / "cells"
    for cell in grid.cells:
        name = cell.label.replace("/", "__")
        err = (cells / f"{name}.err").read_text()
        assert err.startswith("==== trial ") and "job 4240_2" in err.splitlines()[0]
        assert f"{cell.method} seed 0 epoch 1/1" in err
        assert (cells / f"{name}.out").is_file()
    [record] = read_jobs(grid)
    assert record["executor"] == "local" and len(record["tasks"]) == 2

    assert main(["sweep", "--status", str(grid_path)]) == 0
    status = capsys.readouterr().out
    assert f"grid {grid.name}: 2 cells: 2 finished" in status
    assert sum(line.strip().startswith("finished") for line in status.splitlines()) == 2

    assert main([*argv, "--wait"]) == 0
    assert "every cell is finished; nothing submitted" in capsys.readouterr().out
    assert len(_runs(grid.experiment)) == 2 and len(read_jobs(grid)) == 1


def _signal_a_task_mid_cell(workdir, signum: int):
    """Sweep a one-cell grid of 8 epochs as a local task, send the task ``signum`` once its
    cell has logged its first epoch, and wait for the tasks to end; returns the grid, its
    storage URL and the sweep's command line."""
    grid_path = _grid(workdir, methods=("plain",), epochs=8)
    grid = load_grid(grid_path)
    storage = "sqlite:///results/optuna.db"
    argv = ["sweep", "--grid", str(grid_path), "--device", "cpu", "--executor", "local"]
    assert main(argv) == 0
    trial = _wait_for_running_trial(grid, storage)
    cell = {CELL_ATTR: trial.user_attrs[CELL_ATTR]}
    wait_until(lambda: run_in_progress(grid.experiment, **cell), "the cell's first epoch")
    os.kill(int(trial.user_attrs["worker"].rsplit(":", 1)[1]), signum)
    _wait_for_tasks(grid)
    return grid, storage, argv


@pytest.mark.slow  # 30 s on 2 cores
def test_a_preempted_task_hands_its_cell_back_and_is_requeued(workdir, capsys):
    """submitit's preemption signal (USR2) on the task mid-cell (as soon as its run has
    logged the first of 8 epochs): the checkpoint hook fails the cell's trial at once and
    queues the cell again; submitit requeues the task, which runs the cell to its one
    FINISHED run."""
    grid, storage, argv = _signal_a_task_mid_cell(workdir, signal.SIGUSR2)
    trials = sorted(_study(grid, storage).trials, key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[0].user_attrs["error"].startswith("preempted or out of time")
    assert trials[1].user_attrs["job"] == trials[0].user_attrs["job"]  # the requeued task
    finished = [r for r in _runs(grid.experiment) if r.info.status == "FINISHED"]
    assert [r.data.tags[CELL_ATTR] for r in finished] == [grid.cells[0].key]
    # The signal came mid-cell, while the task's output went to the cell's log.
    log = sweep_folder(grid) / "cells" / f"{grid.cells[0].label.replace('/', '__')}.err"
    assert "checkpoint: handed back 1 cell(s)" in log.read_text()


@pytest.mark.slow  # 35 s on 2 cores
def test_a_task_told_to_stop_ends_at_once_and_the_next_start_runs_its_cell(workdir, capsys):
    """SIGTERM to a task mid-cell (what ``scancel`` sends every process of a job): the task
    ends at once, as a killed one, its cell's trial left RUNNING (not failed with an error
    of its own); the next start queues the cell again at once, its worker being gone, and
    runs it to its one FINISHED run."""
    grid, storage, argv = _signal_a_task_mid_cell(workdir, signal.SIGTERM)
    assert [t.state.name for t in _study(grid, storage).trials] == ["RUNNING"]
    assert main([*argv, "--wait"]) == 0
    trials = sorted(_study(grid, storage).trials, key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert "error" not in trials[0].user_attrs
    finished = [r for r in _runs(grid.experiment) if r.info.status == "FINISHED"]
    assert [r.data.tags[CELL_ATTR] for r in finished] == [grid.cells[0].key]


def test_a_tuned_grids_task_of_a_preempted_job_is_handed_back_as_the_same_task(tmp_path):
    """A tuned grid's queue holds search trials and final cells: the task a preempted job
    holds is failed and queued again as that same task, for another worker; a task held
    by another job is left alone."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    queue = optuna.create_study(
        study_name="sweep:tuned", storage=open_storage(url), direction="maximize"
    )
    search = {TASK_ATTR: "trial", "tune_study": "tune:tuned:plain", "tune_trial": 3}
    final = {TASK_ATTR: "final", CELL_ATTR: "c0", "cell": "plain/seed0"}
    for attrs in (search, final):
        queue.enqueue_trial({}, user_attrs=attrs)
    hold_trial(queue.ask(), {"job_id": "41"})
    hold_trial(queue.ask(), {"job_id": "42"})
    assert release_trials(url, "tuned", ["41"], "preempted", again=True) == 1
    trials = sorted(queue.get_trials(), key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["FAIL", "RUNNING", "WAITING"]
    assert trials[0].user_attrs["error"] == "preempted"
    assert trials[1].user_attrs["job"] == "42"
    assert trials[2].user_attrs == search


@pytest.mark.parametrize("in_background", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_status_shows_the_running_cell_and_cancel_stops_it_leaving_finished_cells(
    workdir, capsys, in_background
):
    """A grid with a finished cell and a long one on one task: ``--status`` names the running
    cell's job; ``--cancel`` ends the task, fails that cell's trial, keeps the finished run.
    ``in_background``: the sweep started as a shell's background job (``... &``), which
    ignores SIGINT; its tasks must stop at ``--cancel`` all the same."""
    grid_path = _grid(
        workdir, epochs=400
    )  # far longer than the test: it must still run at --cancel
    grid = load_grid(grid_path)
    finished, running = grid.cells
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    done = client.create_run(
        client.create_experiment(grid.experiment), tags={CELL_ATTR: finished.key}
    )
    client.set_terminated(done.info.run_id, "FINISHED")
    storage = "sqlite:///results/optuna.db"
    argv = ["sweep", "--grid", str(grid_path), "--device", "cpu", "--executor", "local"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if in_background else previous_sigint())
    try:
        assert main(argv) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    trial = _wait_for_running_trial(grid, storage)
    [record] = read_jobs(grid)
    assert trial.user_attrs["job"] == record["tasks"][0]
    capsys.readouterr()
    assert main(["sweep", "--status", str(grid_path)]) == 0
    status = capsys.readouterr().out
    assert status.startswith(f"grid {grid.name}: 2 cells: 1 finished, 1 running")
    assert status.splitlines()[1].endswith(": 1 running")  # the task, as this machine sees it
    [row] = [line for line in status.splitlines() if line.strip().startswith("running")]
    assert row.endswith(f"job {record['tasks'][0]}") and running.label in row

    assert main(["sweep", "--cancel", str(grid_path)]) == 0
    out = capsys.readouterr().out
    assert "cancelled 1 task(s); 1 running cell(s) stopped" in out
    assert main(["sweep", "--status", str(grid_path)]) == 0
    status = capsys.readouterr().out
    assert "1 finished, 1 failed" in status and "no task queued or running" in status
    finished_runs = [r for r in _runs(grid.experiment) if r.info.status == "FINISHED"]
    assert [r.info.run_id for r in finished_runs] == [done.info.run_id]
    assert [t.state.name for t in _study(grid, storage).trials] == ["FAIL"]


# ------------------------------------------------------------------ Slurm, as built


def test_the_slurm_array_is_built_from_the_options_over_the_grid_table(tmp_path):
    """submitit's sbatch script for the grid's tasks: one task per array element, the
    grid's ``[executor.slurm]`` under the options, the array's parallelism, requeue signal."""
    from submitit.slurm.slurm import _make_sbatch_string

    from harness.engine.grid.cluster import executor_parameters
    from harness.engine.grid.slurm import SlurmOptions

    grid = load_grid(
        _grid(
            tmp_path, extra='[executor.slurm]\npartition = "gpu"\ntime = "4:00:00"\nqos = "low"\n'
        )
    )
    assert grid.slurm == {"partition": "gpu", "time": "4:00:00", "qos": "low"}
    options = SlurmOptions(
        **{**grid.slurm, "gpus_per_task": 2, "cpus_per_task": 8, "mem": "32G"},
        account="lab",
        array_parallelism=2,
    )
    params = executor_parameters("slurm", options, 240, grid)
    script = _make_sbatch_string(
        command="python -m submitit.core._submit x", folder=tmp_path, map_count=5, **params
    )
    for line in (
        "#SBATCH --array=0-4%2",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=240",
        "#SBATCH --gpus-per-task=2",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=32G",
        "#SBATCH --account=lab",
        "#SBATCH --qos=low",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --nodes=1",
        "#SBATCH --signal=USR2@90",
    ):
        assert line in script.splitlines(), line
    local = executor_parameters("local", options, 240, grid)
    assert local == {"timeout_min": 240, "gpus_per_node": 2, "tasks_per_node": 1}


def test_the_executor_table_enters_no_cell_key(tmp_path):
    plain = load_grid(_grid(tmp_path))
    table = load_grid(_grid(tmp_path, extra='[executor.slurm]\ngpus_per_task = 4\nmem = "64G"\n'))
    assert [c.key for c in plain.cells] == [c.key for c in table.cells]
    assert plain.slurm == {} and table.slurm == {"gpus_per_task": 4, "mem": "64G"}


def test_the_protocol_s_executor_table_is_under_the_grid_s_and_not_fingerprinted(tmp_path):
    """A protocol's ``[executor.slurm]`` gives a grid's defaults; the grid's own keys win,
    and neither changes the protocol's fingerprint or the cells' keys."""
    from harness.config.fingerprint import fingerprint
    from harness.config.protocol_files import load_protocol

    (tmp_path / "cluster").mkdir()
    protocol = tmp_path / "cluster" / TINY_PROTOCOL.name  # the name enters the fingerprint
    protocol.write_text(
        TINY_PROTOCOL.read_text() + '\n[executor.slurm]\npartition = "gpu"\ntime = "2:00:00"\n'
    )
    path = _grid(tmp_path, extra='[executor.slurm]\ntime = "4:00:00"\nqos = "low"\n')
    path.write_text(path.read_text().replace(str(TINY_PROTOCOL), str(protocol)))
    assert load_grid(path).slurm == {"partition": "gpu", "time": "4:00:00", "qos": "low"}
    assert load_protocol(str(protocol)).executor.slurm.partition == "gpu"
    plain, with_table = load_protocol(str(TINY_PROTOCOL)), load_protocol(str(protocol))
    assert fingerprint(plain, "d") == fingerprint(with_table, "d")
    assert "executor" not in with_table.to_dict()


def test_a_cell_on_several_gpus_is_trained_by_torchrun_through_the_ddp_path(
    workdir, capsys, monkeypatch, tmp_path_factory
):
    """``--gpus-per-task 2``: the submitted tasks train each cell on two processes; the
    command they run is torchrun over ``sweep --cell``, which builds the cell's run in each
    process (checked here as built; ``test_local_executor_trains_a_cell_on_two_processes``
    runs it on CPU, and no test here has GPUs)."""
    from harness.engine.grid.cells import processes_command

    monkeypatch.setenv(
        "PATH", f"{slurm_fakes.install(tmp_path_factory.mktemp('slurm'))}:/usr/bin:/bin"
    )
    submitted = {}

    def capture(kind, grid, spec, options, tasks):
        submitted.update(kind=kind, spec=spec, options=options, tasks=tasks)
        return {"array": "77", "tasks": [f"77_{i}" for i in range(tasks)]}

    grid_path = _grid(workdir)
    argv = ["sweep", "--grid", str(grid_path), "--executor", "slurm", "--partition", "gpu"]
    args = build_parser().parse_args(
        [*argv, "--gpus-per-task", "2", "--device", "cpu", "--loader-workers", "3"]
    )
    assert cmd_sweep(args, submitter=capture) == 0
    assert "submitted slurm array 77: 2 task(s) for 2 cell(s), time 1440" in capsys.readouterr().out
    spec = submitted["spec"]
    assert submitted["options"].gpus_per_task == 2 and spec.settings["processes"] == 2
    assert spec.settings["cell_logs"].endswith(f"sweeps/{load_grid(grid_path).name}/cells")
    command = processes_command(
        Path(spec.grid), spec.smoke, "abc123", spec.settings, Path("r.json")
    )
    assert command[1:6] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
    ]
    assert command[6:12] == ["harness", "sweep", "--grid", str(grid_path), "--yes", "--cell"]
    assert command[command.index("--device") + 1] == "cpu" and "--data-root" not in command
    assert command[command.index("--loader-workers") + 1] == "3"
    assert command[command.index("--storage") + 1] == "sqlite:///results/optuna.db"


@pytest.mark.slow  # two torchrun processes with gloo on the CPU: a minute or more
def test_a_cell_of_a_two_gpu_task_trains_on_two_processes(workdir, monkeypatch):
    """What a task with --gpus-per-task 2 runs for its cell: torchrun's two processes
    training it together, process 0 recording the run (here with gloo on the CPU: the
    local executor refuses more GPUs than the machine has)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    grid_path = _grid(workdir, methods=("plain",))
    grid = load_grid(grid_path)
    settings = {"processes": 2, "device": "cpu", "storage": "sqlite:///results/optuna.db"}
    record = train_in_processes(grid_path, False, grid.cells[0].key, settings)
    [run] = _runs(grid.experiment)
    assert run.info.run_id == record["mlflow_run_id"]
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
