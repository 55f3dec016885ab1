"""Test-only fault injection: ``DML_HARNESS_FAULT=POINT:N:ACTION`` makes the process fail
at the N-th time it reaches a named point.

Used by the fault-injection suite (``tests/faults/``, ``benchmarks/fault_injection.py``)
to land a kill exactly "during a checkpoint write" or "during evaluation", which a
signal sent from outside at a random moment rarely does. Unset (always, outside those
tests) every hook is one dictionary look-up and nothing happens.

Points (``POINT``; a ``write:`` point matches the written file's name with
:func:`fnmatch.fnmatch`, e.g. ``write:last.pt`` or ``write:*.tex``):

* ``train_batch``: after a training batch's optimizer step;
* ``evaluate``: when an evaluation (validation or test) has embedded its queries;
* ``final_run``: before a tuned grid's final run of a fold starts (its search is over);
* ``write:NAME``: inside :func:`harness.base.atomic.atomic_write`, once the data is in the
  temporary file and before it is fsynced and renamed over ``NAME``.

Actions: ``kill`` (SIGKILL to itself: nothing runs after it), ``term`` (SIGTERM to
itself: the harness's handler unwinds as from Ctrl-C) and ``enospc`` (raise
``OSError(ENOSPC)``: a full disk, simulated where the write fails, because this machine
has no small file system to fill; the temporary file then holds part of the data, as
after a real short write).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal

__all__ = ["ENV", "fault_point"]

ENV = "DML_HARNESS_FAULT"
_ACTIONS = ("kill", "term", "enospc")
_counts: dict[str, int] = {}


def _spec() -> tuple[str, int, str] | None:
    text = os.environ.get(ENV, "")
    if not text:
        return None
    point, _, rest = text.rpartition(":")  # the point may hold ':' (write:NAME)
    point, _, count = point.rpartition(":")
    if rest not in _ACTIONS or not count.isdigit() or not point:
        raise ValueError(
            f"{ENV}={text!r}: expected POINT:N:ACTION with ACTION one of {', '.join(_ACTIONS)}"
        )
    return point, int(count), rest


def fault_point(point: str, name: str = "") -> None:
    """Count one arrival at ``point`` (``write`` with the file ``name``) and fail here if
    ``$DML_HARNESS_FAULT`` asks for this arrival."""
    spec = _spec()
    if spec is None:
        return
    wanted, count, action = spec
    here = f"{point}:{name}" if name else point
    if not (
        here == wanted
        or (
            point == "write"
            and wanted.startswith("write:")
            and fnmatch.fnmatch(name, wanted.removeprefix("write:"))
        )
    ):
        return
    _counts[wanted] = _counts.get(wanted, 0) + 1
    if _counts[wanted] != count:
        return
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected by {ENV})")
    # ``term``: the harness's handler raises KeyboardInterrupt in the main thread at its
    # next bytecode, i.e. right here.
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGTERM)
