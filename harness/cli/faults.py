"""Test-only fault injection at the command's edge: ``DML_HARNESS_FAULT=PART:N:ACTION`` makes
the process fail at the N-th time a run's part is used.

Used by the fault-injection suite (``tests/faults/``, ``benchmarks/fault_injection.py``),
which runs the real command line in other processes (sweep workers among them) and needs
a kill to land exactly "during a checkpoint" or "during evaluation", which a signal sent
from outside at a random moment rarely does. :func:`run_main` of :mod:`harness.cli.main`
reads the variable, in this one place, and hands the commands that train a
:func:`fault_train`: :func:`~harness.engine.run.training.train_run` with the named part of
each run's :class:`~harness.engine.run.trainer.Trainer` wrapped. Unset (always, outside
those tests) nothing is wrapped.

Parts (``PART``; the count runs over every run of the process):

* ``train_batch``: the step, after a training batch's optimizer step;
* ``evaluate``: the evaluator, before an evaluation (validation or test) embeds anything;
* ``checkpoint``: the checkpointer, before an epoch's checkpoint is saved;
* ``selected``: the checkpointer, before the selected weights are saved;
* ``write:NAME``: the atomic writer (:func:`harness.base.atomic.sync_to_disk`, wrapped), once
  a file whose name matches ``NAME`` (:func:`fnmatch.fnmatch`: ``write:last.pt``,
  ``write:*.md``) holds its data in its temporary file, before the rename; any command,
  not only those that train.

Actions: ``kill`` (SIGKILL to itself: nothing runs after it), ``term`` (SIGTERM to
itself: the harness's handler unwinds as from Ctrl-C) and ``enospc`` (the write fails
as on a full disk: one line naming the file; for ``train_batch`` and ``evaluate`` an
``OSError(ENOSPC)``; for ``write:NAME`` the ``OSError(ENOSPC)`` the disk would raise, which
the atomic writer turns into its line, the temporary file holding part of the data as
after a real short write).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.base import atomic
from harness.base.errors import HarnessError

__all__ = ["FAULT_ENV", "Fault", "FaultyCheckpointer", "fault_train"]

FAULT_ENV = "DML_HARNESS_FAULT"
_PARTS = ("train_batch", "evaluate", "checkpoint", "selected")
_ACTIONS = ("kill", "term", "enospc")


@dataclass
class Fault:
    """One fault: the ``action`` at the ``count``-th use of ``part`` (:meth:`arrive`)."""

    part: str
    count: int
    action: str
    arrived: int = field(default=0, init=False)

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``PART:N:ACTION`` (``PART`` may be ``write:NAME``)."""
        head, _, action = text.rpartition(":")
        part, _, count = head.rpartition(":")
        known = part in _PARTS or (part.startswith("write:") and len(part) > len("write:"))
        if not known or not count.isdigit() or action not in _ACTIONS:
            raise HarnessError(
                f"{FAULT_ENV}={text!r}: expected PART:N:ACTION with PART one of "
                f"{', '.join(_PARTS)} or write:NAME and ACTION one of {', '.join(_ACTIONS)}"
            )
        return cls(part, int(count), action)

    def arrive(self, part: str, what: str = "") -> None:
        """Count one use of ``part`` (writing ``what``); fail here when it is the wanted one."""
        if part == "write":
            if not fnmatch.fnmatch(what, self.part.removeprefix("write:")):
                return
        elif part != self.part:
            return
        self.arrived += 1
        if self.arrived != self.count:
            return
        if self.action == "enospc":
            if part == "write":  # as the disk says it; the atomic writer names the file
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if what:
                raise HarnessError(f"cannot write {what}: {os.strerror(errno.ENOSPC)}")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        # ``term``: the harness's handler raises KeyboardInterrupt in the main thread at its
        # next bytecode, i.e. right here.
        os.kill(os.getpid(), signal.SIGKILL if self.action == "kill" else signal.SIGTERM)


@dataclass
class FaultyCheckpointer:
    """A checkpointer that counts its saves into ``fault`` before handing them to ``inner``."""

    inner: Any
    fault: Fault

    def save(self, checkpoint: dict[str, Any]) -> None:
        self.fault.arrive("checkpoint", "last.pt")
        self.inner.save(checkpoint)

    def load(self) -> dict[str, Any] | None:
        return self.inner.load()

    def save_selected(self, weights: dict[str, Any]) -> Any:
        self.fault.arrive("selected", "model.pt")
        return self.inner.save_selected(weights)


def _counted(fault: Fault, part: str, inner: Callable[..., Any], after: bool) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not after:
            fault.arrive(part)
        result = inner(*args, **kwargs)
        if after:
            fault.arrive(part)
        return result

    return call


def _wrap(fault: Fault, trainer: Any) -> Any:
    """``trainer`` with the part ``fault`` names wrapped."""
    if fault.part == "train_batch":
        trainer.step = _counted(fault, "train_batch", trainer.step, after=True)
    elif fault.part == "evaluate":
        trainer.evaluator = _counted(fault, "evaluate", trainer.evaluator, after=False)
    else:
        trainer.checkpointer = FaultyCheckpointer(trainer.checkpointer, fault)
    return trainer


def _wrap_writer(fault: Fault) -> None:
    """The atomic writer's step before each rename counted into ``fault``."""
    inner = atomic.sync_to_disk

    def sync_to_disk(fh: Any, path: Any) -> None:
        inner(fh, path)
        fault.arrive("write", path.name)

    atomic.sync_to_disk = sync_to_disk


def fault_train(spec: str) -> Callable[..., dict[str, Any]] | None:
    """What trains a run under the fault ``spec`` (``PART:N:ACTION``); for a ``write:NAME``
    fault, which any command meets, the atomic writer is wrapped and None (train as usual)
    is returned."""
    fault = Fault.parse(spec)
    if fault.part.startswith("write:"):
        _wrap_writer(fault)
        return None
    # deferred: the training stack (torch, ~1 s) only where the suite asks for a fault
    from harness.engine.run.training import train_run

    def train(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return train_run(*args, wrap_parts=lambda trainer: _wrap(fault, trainer), **kwargs)

    return train
