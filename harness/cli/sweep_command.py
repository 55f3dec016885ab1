"""``python -m harness sweep --grid NAME``: the sweep's arguments, its local worker
processes and its final report; the queue and the workers are
:mod:`harness.engine.grid.sweep`'s."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.cli.estimates import estimate_or_refuse, say_estimate
from harness.cli.fetch_command import check_dataset
from harness.cli.run_command import check_checkpoint_root
from harness.cli.store import check_study_storage, open_store
from harness.cli.sweep_cluster import (
    cancel,
    cluster_options,
    preflight,
    status,
    submit,
)
from harness.cli.sweep_tuned import check_tuned_tables, queue_tuned_grid, tuned_final_report
from harness.config.catalog import MAX_CELLS
from harness.config.grids import Grid, load_grid
from harness.engine.grid.datasets import check_datasets_unchanged
from harness.engine.grid.slurm import SlurmOptions
from harness.engine.grid.status import wait
from harness.engine.grid.sweep import (
    cell_run_config,
    finished_cells,
    open_study,
    queue_grid,
    run_cell_process,
    storage_url,
    unfinished_cells,
)
from harness.engine.run.data import check_training_split, prepare_splits
from harness.engine.run.estimate import PlannedRun
from harness.engine.run.runtime import default_workers, resolve_device
from harness.engine.tuning.sweep import (
    check_search_size,
    check_tuned_folds,
    check_tuned_grid,
    run_worker,
)
from harness.store.environment import estimates_commands, logs_model

__all__ = ["cmd_sweep"]


def cmd_sweep(args: argparse.Namespace, *, train: Any = None, submitter: Any = None) -> int:
    """Queue the grid's cells and run them here (``train``: default ``train_run``), or
    submit them as tasks (``submitter``: default ``submit_tasks``)."""
    if args.status or args.cancel:
        grid = load_grid(args.status or args.cancel, smoke=args.smoke, max_cells=None)
        check_study_storage(args.storage)
        open_store(read_only=True)
        return status(args, grid) if args.status else cancel(args, grid)
    quiet = args.worker_only or args.cell
    grid, options = _checked_grid(args, quiet=quiet)
    if args.cell:  # one process of a cell on several GPUs (torchrun)
        run_cell_process(grid, args.cell, _settings(args), args.cell_record)
        return 0
    if grid.tune is not None and not quiet:
        # the folds on the loaded splits, up front: before the storage's folder is made
        check_tuned_grid(grid, {"data_root": args.data_root})
    estimated_here = not quiet and grid.tune is None and not args.executor and train is None
    if estimated_here and estimates_commands():
        _estimate(args, grid)  # the cells this machine runs, before anything is queued
    study = open_study(grid, args.storage, heartbeat=args.heartbeat, grace=args.grace)
    if args.worker_only:
        report = run_worker(grid, study, settings=_settings(args), train=train)
        return 1 if report["failed"] else 0
    if not _queue_and_work(args, grid, study, options, train=train, submitter=submitter):
        return 0
    if grid.tune is not None:
        return tuned_final_report(grid, storage_url(args.storage))
    return _final_report(grid, study)


def _checked_grid(args: argparse.Namespace, *, quiet: bool) -> tuple[Grid, SlurmOptions]:
    """The grid, with everything a sweep needs checked before its first cell: the device,
    the cluster's options (before anything is written or any dataset prepared), the
    folders, the stores and the datasets (each worker it starts shares the check)."""

    resolve_device(args.device)
    announce = None if quiet else (lambda n: print(f"grid {args.grid}: {n:,} cells", flush=True))
    grid = load_grid(
        args.grid, smoke=args.smoke, max_cells=None if args.yes else MAX_CELLS, on_count=announce
    )
    if grid.tune is not None:  # its search's trial runs capped as its cells are
        check_search_size(grid, None if args.yes else MAX_CELLS)
    # Nothing is written, and no dataset prepared, before Slurm has its say.
    options = preflight(args, cluster_options(args, grid))
    if args.data_root is not None and not Path(args.data_root).is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    if grid.tune is not None:  # what the datasets tell of the folds, before they are read
        check_tuned_folds(grid, args.data_root)
        check_tuned_tables(grid)
    check_checkpoint_root(args.checkpoint_root)
    check_study_storage(args.storage)
    open_store()
    logs_model()  # a bad $DML_HARNESS_LOG_MODEL is refused before any training
    check_datasets_unchanged(grid)  # before the image checks: a refusal is one line
    if not quiet:  # the workers it starts share the check
        for dataset in sorted({cell.dataset for cell in grid.cells}):
            check_dataset(dataset, args.data_root)
    return grid, options


def _estimate(args: argparse.Namespace, grid: Grid) -> None:
    """Print the estimate of the grid's cells without a finished run, as this machine's
    workers run them; refused on a CPU over an hour without ``--yes``. A cell whose split
    does not fit its batch is left to its worker to report."""
    done = finished_cells(grid)
    worker = _settings(args)
    splits_of: dict = {}
    runs = []
    for cell in (c for c in grid.cells if c.key not in done):
        key = (cell.dataset, repr(cell.protocol.splits), repr(cell.protocol.selection))
        if key not in splits_of:
            splits_of[key] = prepare_splits(cell.protocol, cell.dataset, args.data_root)
        try:
            check_training_split(cell.protocol, cell.dataset, splits_of[key])
        except HarnessError:
            continue
        cfg = cell_run_config(grid, cell, worker)
        runs.append(PlannedRun(cfg, splits_of[key]))
    if not runs:
        return
    device = resolve_device(args.device)
    workers = default_workers(device) if args.loader_workers is None else args.loader_workers
    estimated = estimate_or_refuse(runs, device, workers=workers, yes=args.yes)
    shared = f"; its {args.workers} workers share this device" if (args.workers or 1) > 1 else ""
    say_estimate(estimated, note=shared)


def _queue_and_work(
    args: argparse.Namespace,
    grid: Grid,
    study,
    options: SlurmOptions,
    *,
    train: Any = None,
    submitter: Any = None,
) -> bool:
    """Queue the grid's cells and work them off (here with ``train``, in ``--workers``
    processes, or as a cluster job through ``submitter``); False when the cluster job was
    submitted and not waited for."""
    counts = (
        queue_tuned_grid(grid, study, storage_url(args.storage))
        if grid.tune is not None
        else queue_grid(grid, study, storage_url(args.storage))
    )
    if args.executor:
        record = submit(args, grid, options, counts, _settings(args), submitter)
        if record is None or not args.wait:
            return False

        wait([record])
    elif (args.workers or 1) == 1:
        run_worker(grid, study, settings=_settings(args), train=train)
    else:
        _run_workers(args)
    return True


def _run_workers(args: argparse.Namespace) -> None:
    """``--workers N``: N worker processes of this sweep on this machine, waited for. Each
    gets an equal share of the cores for its math library's threads (``OMP_NUM_THREADS``,
    unless set): N processes of all cores' threads each would oversubscribe them."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.workers)))
    procs = [subprocess.Popen(_worker_command(args), env=env) for _ in range(args.workers)]
    try:
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise


def _settings(args: argparse.Namespace) -> dict:
    return {
        "data_root": args.data_root,
        "device": args.device,
        "loader_workers": args.loader_workers,
        "storage": storage_url(args.storage),
        "checkpoint_root": args.checkpoint_root,
    }


def _worker_command(args: argparse.Namespace) -> list[str]:
    """This sweep as a ``--worker-only`` process: it pops cells from the same queue."""
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "sweep",
        "--grid",
        str(args.grid),
        "--worker-only",
        "--storage",
        storage_url(args.storage),
        "--device",
        args.device,
        "--heartbeat",
        str(args.heartbeat),
        "--grace",
        str(args.grace),
    ]
    if args.smoke:
        cmd.append("--smoke")
    if args.yes:
        cmd.append("--yes")
    if args.data_root:
        cmd += ["--data-root", str(args.data_root)]
    if args.loader_workers is not None:
        cmd += ["--loader-workers", str(args.loader_workers)]
    if args.checkpoint_root:
        cmd += ["--checkpoint-root", str(args.checkpoint_root)]
    return cmd


def _final_report(grid: Grid, study) -> int:
    missing = unfinished_cells(grid, study)
    print(
        f"grid {grid.name}: {len(grid.cells) - len(missing)}/{len(grid.cells)} cells finished "
        f"(MLflow experiment '{grid.experiment}')"
    )
    for cell, reason in missing:
        print(f"  not finished: {cell.label}: {reason} (queued again on the next start)")
    return 1 if missing else 0
