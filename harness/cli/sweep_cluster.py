"""``sweep --executor slurm|local``, ``sweep --status`` and ``sweep --cancel``: a grid's
cells as the tasks of one job array (:mod:`harness.engine.grid.cluster`), and the view and the
cancel of what was submitted (:mod:`harness.engine.grid.status`).

Everything that can be refused is refused before anything is written or submitted: the
options against the executor, Slurm's presence, the partition and its limits, and Slurm's
own dry run of the jobs (``sbatch --test-only``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import optuna

from harness.base.errors import HarnessError
from harness.cli.sweep_tuned import progress_lines
from harness.config.grids import Grid
from harness.engine.grid.cluster import (
    DEFAULT_MINUTES,
    check_local_gpus,
    read_jobs,
    submit_tasks,
    task_spec,
)
from harness.engine.grid.slurm import (
    SlurmOptions,
    check_resources,
    partition_limits,
    require_slurm,
    test_submission,
)
from harness.engine.grid.status import cancel_sweep, cell_states, live_tasks, status_lines
from harness.engine.grid.sweep import open_storage, storage_url
from harness.engine.tuning.sweep import run_worker, unfinished_tuned_cells

__all__ = ["cluster_options", "preflight", "submit", "status", "cancel"]

#: The options that ask Slurm for resources, as (flag, attribute): the grid's
#: ``[executor.slurm]`` keys.
RESOURCE_FLAGS = (
    ("--partition", "partition"),
    ("--gpus-per-task", "gpus_per_task"),
    ("--cpus-per-task", "cpus_per_task"),
    ("--mem", "mem"),
    ("--time", "time"),
    ("--array-parallelism", "array_parallelism"),
    ("--account", "account"),
    ("--qos", "qos"),
)
#: What the local executor honours of them (it runs on this machine's processes).
LOCAL_FLAGS = ("gpus_per_task", "time")


def cluster_options(args: argparse.Namespace, grid: Grid) -> SlurmOptions:
    """The tasks' resources: the grid's ``[executor.slurm]`` with the options on top.
    A resource option without ``--executor``, or one the local executor cannot honour, is
    refused rather than ignored."""
    given = {attr: getattr(args, attr) for _, attr in RESOURCE_FLAGS}
    for flag, attr in RESOURCE_FLAGS:
        if given[attr] is None:
            continue
        if args.executor is None:
            which = "slurm or local" if attr in LOCAL_FLAGS else "slurm"
            raise HarnessError(f"{flag} applies to --executor {which}; give --executor")
        if args.executor == "local" and attr not in LOCAL_FLAGS:
            raise HarnessError(f"{flag} is a Slurm resource; --executor local does not use it")
    if args.wait and args.executor is None:
        raise HarnessError("--wait applies to --executor slurm or local")
    table = (
        grid.slurm
        if args.executor == "slurm"
        else {k: v for k, v in grid.slurm.items() if k in LOCAL_FLAGS}
    )
    merged = {**table, **{k: v for k, v in given.items() if v is not None}}
    return SlurmOptions(**merged)


def preflight(args: argparse.Namespace, options: SlurmOptions) -> SlurmOptions:
    """The executor's answer before anything is written. Local: the GPUs a task asks for
    are on this machine. Slurm: Slurm installed, the partition known, the resources within
    its limits, ``sbatch --test-only`` accepting the jobs; the options are returned with a
    time limit (the partition's when none is given)."""
    if args.executor == "local":
        check_local_gpus(options)
        return options
    if args.executor != "slurm":
        return options

    require_slurm()
    limits = partition_limits(options.partition)
    check_resources(options, limits)
    if options.time is None:
        minutes = limits.minutes if limits.minutes is not None else DEFAULT_MINUTES
        options = dataclasses.replace(options, time=str(int(minutes)))
    test_submission(options)
    return options


def submit(
    args: argparse.Namespace,
    grid: Grid,
    options: SlurmOptions,
    counts: dict,
    settings: dict,
    submitter: Any = None,
) -> dict | None:
    """Submit the grid's queued cells as tasks (``--workers`` of them, else one per cell to
    run) through ``submitter`` (default :func:`harness.engine.grid.cluster.submit_tasks`);
    returns the submitted array's record, None when no cell is left to run."""

    to_run = counts["queued"] + counts["pending"]
    if not to_run and not counts["waiting"]:
        print(f"grid {grid.name}: every cell is finished; nothing submitted")
        return None
    tasks = args.workers or max(1, to_run)
    gpus = options.gpus_per_task or 0
    spec = task_spec(
        grid,
        storage_url(args.storage),
        args.heartbeat,
        args.grace,
        {**settings, "processes": gpus if gpus > 1 else 1},
        run_worker,
    )
    record = (submitter or submit_tasks)(args.executor, grid, spec, options, tasks)
    limit = f", time {options.time}" if options.time else ""
    print(
        f"submitted {args.executor} array {record['array']}: {tasks} task(s) for {to_run} "
        f"cell(s){limit}; watch: python -m harness sweep --status {args.grid}"
        f"{' --smoke' if args.smoke else ''}",
        flush=True,
    )
    return record


def _existing_study(grid: Grid, storage: str | None):
    """The grid's queue, or None when the sweep was never started (nothing is created)."""

    url = storage_url(storage)
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return None
    try:
        return optuna.load_study(study_name=f"sweep:{grid.name}", storage=open_storage(url))
    except KeyError:
        return None


def status(args: argparse.Namespace, grid: Grid) -> int:
    """Print each cell's state from the queue and the live tasks (``squeue``)."""

    records = read_jobs(grid)
    storage = args.storage or (records[-1]["storage"] if records else None)
    live = live_tasks(records)
    if grid.tune is not None:  # a tuned grid: each study's trials, then its final cells
        print(f"studies of {grid.name} (trials of the budget, best validation value %):")
        print("\n".join(progress_lines(grid, storage_url(storage))))
        missing = unfinished_tuned_cells(grid)
        print(f"final cells: {len(grid.cells) - len(missing)}/{len(grid.cells)} finished")
        return 0
    states = cell_states(grid, _existing_study(grid, storage), live)
    print("\n".join(status_lines(grid, states, live, records)))
    return 0


def cancel(args: argparse.Namespace, grid: Grid) -> int:
    """Cancel the grid's submitted tasks; finished cells stay, running ones are queued
    again by the next start."""

    records = read_jobs(grid)
    if not records:
        raise HarnessError(f"grid {grid.name}: no job was submitted for it (nothing to cancel)")
    storage = args.storage or records[-1]["storage"]
    done = cancel_sweep(grid, storage, _existing_study(grid, storage), records)
    still = (
        f"; {done['still_running']} task(s) still ending (their cells go back to the queue "
        f"when their heartbeat is --grace seconds old)"
        if done["still_running"]
        else ""
    )
    print(
        f"grid {grid.name}: cancelled {done['tasks']} task(s); {done['cells']} running cell(s) "
        f"stopped, queued again by the next start; finished cells kept{still}"
    )
    return 0
