"""What a scenario's row records, and the checks that fill it: the runs of an experiment
counted twice or left RUNNING, how the faulted process ended, whether a result is whole."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .lab import Proc


@dataclass
class Row:
    command: str
    fault: str
    point: str
    recovered: bool = False
    identical: bool = False
    twice: int = 0
    running: int = 0
    half_read: int = 0
    note: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.recovered and self.identical and not (self.twice or self.running or self.half_read)
        )


def _client(store: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=store)


def runs_of(store: str, experiment: str) -> list:
    client = _client(store)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], max_results=5000)


def count_twice(runs: list, key: Callable) -> int:
    finished: dict = {}
    for run in runs:
        if run.info.status == "FINISHED":
            k = key(run)
            finished[k] = finished.get(k, 0) + 1
    return sum(1 for n in finished.values() if n > 1)


def count_running(runs: list) -> int:
    return sum(r.info.status == "RUNNING" for r in runs)


def one_clear_line(proc: Proc) -> bool:
    """A failure the command reports itself: exit 2, last line ``error: ...``, no traceback."""
    lines = [ln for ln in proc.err.strip().splitlines() if ln.strip()]
    return (
        proc.rc == 2
        and bool(lines)
        and lines[-1].startswith("error: ")
        and "Traceback" not in proc.err
    )


def ended_by_fault(proc: Proc, action: str) -> bool:
    """The faulted process ended as the fault says: killed (-9), interrupted (130) or one line."""
    if action == "kill":
        return proc.rc == -signal.SIGKILL
    if action == "term":
        return proc.rc in (130, -signal.SIGTERM) and "Traceback" not in proc.err
    return one_clear_line(proc)


def json_state(path: Path) -> str:
    """``absent``, ``whole`` (parses) or ``half`` (present and unreadable: a half-written result)."""
    if not path.exists():
        return "absent"
    try:
        json.loads(path.read_text())
        return "whole"
    except ValueError:
        return "half"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (sweep workers of a coordinator), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


def frozen(metrics: dict) -> tuple:
    """``metrics`` as a sorted tuple of items, to compare and sort."""
    return tuple(sorted(metrics.items()))
