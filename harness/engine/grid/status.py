"""``sweep --status`` and ``sweep --cancel``: a submitted grid as its queue and its jobs
see it together.

The queue knows which cell a worker holds and which job that worker runs in (the trial's
``job``); Slurm (``squeue``) or this machine's process table knows which jobs still run.
A cell is *running* only when both agree; a cell whose trial is still RUNNING but whose
job has ended was left by a killed task, and is shown as queued again, which it will be
once its heartbeat is ``--grace`` seconds old. Reading the status changes nothing.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config.grids import Cell, Grid
from harness.engine.grid.cluster import release_trials, sweep_folder
from harness.engine.grid.slurm import cancel_jobs, queue_states
from harness.engine.grid.sweep import CELL_ATTR, finished_cells

__all__ = ["CellState", "live_tasks", "cell_states", "status_lines", "cancel_sweep", "wait"]

#: Seconds ``--cancel`` waits for the cancelled tasks to end (Slurm's KillWait is 30 s).
CANCEL_WAIT = 120


@dataclass(frozen=True)
class CellState:
    """One cell as ``--status`` shows it: ``state`` is finished, running, queued, failed,
    waiting (for its base cell) or not queued; ``job`` the task that holds a running cell."""

    cell: Cell
    state: str
    job: str = ""
    detail: str = ""


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, ended but not yet reaped by
    the sweep that started it, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


def live_tasks(records: list[dict[str, Any]]) -> dict[str, str]:
    """``{task id: state}`` of the submitted tasks still queued or running: ``squeue``'s
    view of the Slurm arrays, this machine's processes for the local executor's."""
    arrays = [r["array"] for r in records if r.get("executor") == "slurm"]
    live = queue_states(arrays) if arrays else {}
    for record in records:
        if record.get("executor") == "local" and record.get("host") == socket.gethostname():
            live.update({t: "RUNNING" for t in record["tasks"] if _process_alive(int(t))})
    return live


def _latest_trials(study) -> dict[str, list]:
    """``{cell key: its trials, newest last}``."""
    out: dict[str, list] = {}
    for trial in study.get_trials(deepcopy=False) if study is not None else []:
        if CELL_ATTR in trial.user_attrs:
            out.setdefault(trial.user_attrs[CELL_ATTR], []).append(trial)
    return {k: sorted(v, key=lambda t: t.number) for k, v in out.items()}


def _state_of(cell: Cell, trials: list, live: dict[str, str], done: dict[str, str]) -> CellState:
    """A cell without a finished run, from its trials, the live tasks and the finished
    cells (``done``: a test-time cell waits for its base cell)."""
    states = {t.state.name for t in trials}
    for trial in (t for t in trials if t.state.name == "RUNNING"):
        job = str(trial.user_attrs.get("job", ""))
        if not job:  # a worker started by hand: the queue alone knows
            return CellState(cell, "running", "", f"worker {trial.user_attrs.get('worker', '?')}")
        if live.get(job) == "RUNNING":
            return CellState(cell, "running", job)
        return CellState(
            cell,
            "queued",
            job,
            f"its task {job} ended mid-cell; queued again once its heartbeat is --grace seconds old",
        )
    if "WAITING" in states:
        return CellState(cell, "queued")
    if cell.base_key and cell.base_key not in done:
        return CellState(cell, "waiting", detail="for its base cell")
    if trials and trials[-1].state.name == "FAIL":
        return CellState(cell, "failed", detail=str(trials[-1].user_attrs.get("error", "")))
    return CellState(cell, "not queued", detail="queued by the next sweep start")


def cell_states(grid: Grid, study, live: dict[str, str]) -> list[CellState]:
    """Every cell of the grid with its state; ``study`` None: the grid was never queued."""
    done = finished_cells(grid)
    trials = _latest_trials(study)
    out = []
    for cell in grid.cells:
        if cell.key in done:
            out.append(CellState(cell, "finished", detail=f"run {done[cell.key]}"))
        else:
            out.append(_state_of(cell, trials.get(cell.key, []), live, done))
    return out


def status_lines(
    grid: Grid, states: list[CellState], live: dict[str, str], records: list[dict[str, Any]]
) -> list[str]:
    """What ``--status`` prints: counts, each array as Slurm sees it, then one line a cell."""
    order = ("finished", "running", "queued", "failed", "waiting", "not queued")
    counts = {s: sum(c.state == s for c in states) for s in order}
    lines = [
        f"grid {grid.name}: {len(states)} cells: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    ]
    for record in records:
        tasks = {t: live[t] for t in record["tasks"] if t in live}
        seen = ", ".join(
            f"{sum(v == s for v in tasks.values())} {s.lower()}"
            for s in sorted(set(tasks.values()))
        )
        lines.append(
            f"{record['executor']} array {record['array']} ({len(record['tasks'])} tasks, "
            f"submitted {record.get('submitted', '?')}): {seen or 'no task queued or running'}"
        )
    width = max((len(c.cell.label) for c in states), default=0)
    for c in states:
        where = f"job {c.job}" if c.job else ""
        note = "; ".join(x for x in (where, c.detail) if x)
        lines.append(f"  {c.state:<10}  {c.cell.label:<{width}}  {note}".rstrip())
    lines.append(f"each cell's output: {sweep_folder(grid) / 'cells'}/<cell>.out and .err")
    return lines


def wait(records: list[dict[str, Any]], poll: float = 5.0) -> None:
    """Return once no task of ``records`` is queued or running."""
    while live_tasks(records):
        time.sleep(poll)


def cancel_sweep(grid: Grid, storage: str, study, records: list[dict[str, Any]]) -> dict[str, int]:
    """Cancel every submitted task still queued or running, wait for them to end, then end
    the trials they still hold as failed ("cancelled"): their cells are queued again by the
    next start, and finished cells stay as they are. Returns counts for the report."""
    live = live_tasks(records)
    held = [
        t
        for t in (study.get_trials(deepcopy=False) if study is not None else [])
        if t.state.name == "RUNNING" and str(t.user_attrs.get("job", "")) in live
    ]
    arrays = [r["array"] for r in records if r.get("executor") == "slurm"]
    cancel_jobs([a for a in arrays if any(t.split("_")[0] == a for t in live)])
    for record in (r for r in records if r.get("executor") == "local"):
        for pid in (t for t in record["tasks"] if t in live):
            os.kill(int(pid), signal.SIGINT)  # submitit's local controller stops its task
    deadline = time.monotonic() + CANCEL_WAIT
    while live_tasks(records) and time.monotonic() < deadline:
        time.sleep(2)
    left = live_tasks(records)
    release_trials(
        storage,
        grid.name,
        [t for t in live if t not in left],
        "cancelled by sweep --cancel",
        again=False,
    )
    return {"tasks": len(live), "cells": len(held), "still_running": len(left)}
