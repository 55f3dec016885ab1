"""Test-only fault injection at the command's edge: ``DML_HARNESS_FAULT=PART:N:ACTION`` makes
the process fail at the N-th time a run's part is used.

Used by the fault-injection suite (``tests/faults/``, ``benchmarks/fault_injection.py``),
which runs the real command line in other processes (sweep workers among them) and needs
a kill to land exactly "during a checkpoint" or "during evaluation", which a signal sent
from outside at a random moment rarely does. :func:`run_main` of :mod:`harness.cli.main`
reads the variable, in this one place, and hands the commands that train a
:func:`fault_train`: :func:`~harness.engine.run.training.run_training` with the named part of
each run's :class:`~harness.engine.run.trainer.Trainer` wrapped. Unset (always, outside
those tests) nothing is wrapped.

Parts (``PART``; the count runs over every run of the process):

* ``train_batch``: the step, after a training batch's optimizer step;
* ``evaluate``: the evaluator, before an evaluation (validation or test) embeds anything;
* ``checkpoint``: the checkpointer, before an epoch's checkpoint is saved;
* ``selected``: the checkpointer, before the selected weights are saved.

Actions: ``kill`` (SIGKILL to itself: nothing runs after it), ``term`` (SIGTERM to
itself: the harness's handler unwinds as from Ctrl-C) and ``enospc`` (the write fails
as on a full disk: one line naming the file; for ``train_batch`` and ``evaluate`` an
``OSError(ENOSPC)``).
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
        """``PART:N:ACTION``."""
        part, _, rest = text.partition(":")
        count, _, action = rest.partition(":")
        if part not in _PARTS or not count.isdigit() or action not in _ACTIONS:
            raise HarnessError(
                f"{FAULT_ENV}={text!r}: expected PART:N:ACTION with PART one of "
                f"{', '.join(_PARTS)} and ACTION one of {', '.join(_ACTIONS)}"
            )
        return cls(part, int(count), action)

    def arrive(self, part: str, what: str = "") -> None:
        """Count one use of ``part`` (writing ``what``); fail here when it is the wanted one."""
        if part != self.part:
            return
        self.arrived += 1
        if self.arrived != self.count:
            return
        if self.action == "enospc":
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


def fault_train(spec: str) -> Callable[..., dict[str, Any]]:
    """What trains a run under the fault ``spec`` (``PART:N:ACTION``)."""
    # deferred: the training stack (torch, ~1 s) only where the suite asks for a fault
    from harness.engine.run.training import run_training

    fault = Fault.parse(spec)

    def train(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return run_training(*args, wrap_parts=lambda trainer: _wrap(fault, trainer), **kwargs)

    return train
