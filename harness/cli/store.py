"""What every command that opens the tracking store does first: runs whose process ended
without finishing them (killed outright, out of memory, power lost) are marked FAILED,
so that no table, sweep or UI shows them RUNNING (:func:`harness.store.tracking.fail_dead_runs`)."""

from __future__ import annotations

import sys

__all__ = ["open_store"]


def open_store() -> None:
    """Mark FAILED the runs left RUNNING by dead processes of this host, one line each."""
    from harness.store.tracking import fail_dead_runs

    for run_id in fail_dead_runs():
        print(f"run {run_id} was left RUNNING by a process that ended without finishing it: marked FAILED "
              f"(run --resume continues it from its last checkpoint)", file=sys.stderr)
