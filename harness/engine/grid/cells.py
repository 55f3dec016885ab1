"""Where a sweep's cell runs, as the sweep's worker sees it: the Slurm job it runs in (its
ids go on the cell's MLflow run and trial, so a result leads back to its job and its log),
the files its output goes to, and, for a cell on several GPUs, the ``torchrun`` processes
that train it through the DDP path of ``run`` (:mod:`harness.engine.run.distributed`).

Kept apart from :mod:`harness.engine.grid.sweep` (the queue) so that the queue's worker loop
stays the same with or without a cluster: each piece here is off unless the sweep's
settings ask for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.store.environment import slurm_ids

__all__ = [
    "job_of_this_task",
    "log_name",
    "cell_output",
    "processes_command",
    "train_in_processes",
]


def job_of_this_task(settings: dict) -> str:
    """The job that holds this worker, as ``squeue`` or ``sweep --status`` name it: the
    array task (``<array job>_<task>``) under Slurm, the job id the executor gave
    (``settings["job_id"]``: the local executor's process) elsewhere; "" for a worker
    started by hand."""
    ids = slurm_ids()
    if "slurm_array_job_id" in ids and "slurm_array_task_id" in ids:
        return f"{ids['slurm_array_job_id']}_{ids['slurm_array_task_id']}"
    return ids.get("slurm_job_id") or str(settings.get("job_id") or "")


def log_name(label: str) -> str:
    """The file name (no suffix) of a cell's output: its label with ``/`` as ``__``
    (``efficientnet_lite0__margin__plain__synthetic__seed0``)."""
    return label.replace("/", "__")


@contextlib.contextmanager
def cell_output(folder: str | os.PathLike | None, label: str, header: str) -> Iterator[None]:
    """Send this process's stdout and stderr (its file descriptors, so that the data
    loader's workers and ``torchrun``'s processes write there too) to ``<label>.out`` and
    ``<label>.err`` under ``folder`` while the block runs; each try of the cell appends,
    after a ``header`` line naming its job and trial. No ``folder``: output stays where it is."""
    if folder is None:
        yield
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    files = [open(Path(folder) / f"{log_name(label)}{ext}", "a") for ext in (".out", ".err")]
    try:
        for handle, fd in zip(files, (1, 2), strict=True):
            handle.write(f"==== {header}\n")
            handle.flush()
            os.dup2(handle.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        for handle in files:
            handle.close()


def processes_command(
    grid_path: Path, smoke: bool, key: str, settings: dict, record: Path
) -> list[str]:
    """``torchrun`` starting ``settings["processes"]`` processes on this machine that train
    the cell ``key`` together (``sweep --cell``: each process builds the cell's run as the
    worker would and enters the DDP path of ``run``); process 0 writes the run's record
    to ``record``. ``--standalone`` gives each cell a free rendezvous port, so several
    tasks on one node do not collide."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={int(settings['processes'])}",
        "-m",
        "harness",
        "sweep",
        "--grid",
        str(grid_path),
        "--yes",  # the grid was accepted when the sweep started
        "--cell",
        key,
        "--cell-record",
        str(record),
        "--device",
        str(settings.get("device", "auto")),
    ]
    if smoke:
        cmd.append("--smoke")
    for option, name in (
        ("--storage", "storage"),
        ("--data-root", "data_root"),
        ("--loader-workers", "loader_workers"),
        ("--checkpoint-root", "checkpoint_root"),
    ):
        if settings.get(name) is not None:
            cmd += [option, str(settings[name])]
    return cmd


def train_in_processes(grid_path: Path, smoke: bool, key: str, settings: dict) -> dict[str, Any]:
    """Train the cell ``key`` on ``settings["processes"]`` processes (:func:`processes_command`)
    and return process 0's record of the run; a failure of any process is the cell's."""
    with tempfile.TemporaryDirectory(prefix="harness-cell-") as tmp:
        record = Path(tmp) / "record.json"
        done = subprocess.run(processes_command(grid_path, smoke, key, settings, record))
        if done.returncode != 0 or not record.is_file():
            raise HarnessError(
                f"the {settings['processes']} processes training cell {key} exited with status "
                f"{done.returncode} (their output is in the cell's log)"
            )
        return json.loads(record.read_text(encoding="utf-8"))
