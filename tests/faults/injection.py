"""The fault-injection engine: inject a fault into ``run``, ``sweep`` (3 workers), ``tune`` or
``table``, restart the way a user would, and measure what survived.

Each scenario runs the real command line (``python -m harness ...``) in subprocesses, in a
folder of its own (its checkpoints, artifacts, tables), against a tracking store shared by
the scenarios of one command (one experiment each; a new store costs seconds of
migrations). A fault is either a signal sent from outside at a seeded random moment, or
a part of the run or the atomic writer wrapped at the command's edge by
:mod:`harness.cli.faults` (``DML_HARNESS_FAULT=PART:N:ACTION``), which lands a kill exactly at
a named part's use (a checkpoint, an evaluation, a file's write). Then the normal restart
runs (``run --resume``, the sweep again, tune again, the table again) and
the scenario's row records:

* ``recovered``: the restart exited 0 with its result, and the fault's own exit was
  either a signal or one clear ``error:`` line (no traceback);
* ``identical``: the final metrics (or table text) equal the uninterrupted reference's;
* ``twice``: cells (run: the one run; sweep: grid cells; tune: trials and final runs)
  with more than one FINISHED MLflow run;
* ``running``: runs of the scenario left RUNNING;
* ``half_read``: a result file present after the fault that is not whole (0 expected).

The lab (folders, store, the forking zygote) is ``lab.py``, the rows and their checks
``checks.py``, and each command's faults ``run_faults.py``, ``sweep_faults.py`` (with the
table's) and ``tune_faults.py``. Used by ``tests/faults/`` (a few scenarios, slow-marked) and by
``benchmarks/fault_injection.py`` (all of them, the table in docs/faults.md).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from .checks import Row
from .lab import Lab
from .run_faults import RunFaults
from .sweep_faults import SweepFaults, TableFaults
from .tune_faults import TuneFaults


def scenarios(
    lab: Lab, *, commands: tuple[str, ...] = ("run", "sweep", "tune", "table")
) -> list[Callable[[], Row]]:
    """Every scenario, in order (each a callable returning its row); references first."""
    out: list[Callable[[], Row]] = []
    run, sweep, tune = RunFaults(lab), SweepFaults(lab), TuneFaults(lab)
    rng = lab.rng
    if "run" in commands:
        out.append(run.prepare)
        batches = [rng.randrange(1, 7) for _ in range(3)]  # 2 epochs x 3 batches
        out += [lambda n=n: run.hook("train_batch", n, "kill") for n in batches]
        out += [lambda n=n: run.hook("train_batch", n, "term") for n in batches[:2]]
        out += [lambda n=n: run.hook("write:last.pt", n, "kill") for n in (1, 2)]
        out += [lambda: run.hook("write:last.pt", 2, "term")]
        out += [
            lambda n=n, a=a: run.hook("evaluate", n, a)
            for n, a in ((1, "kill"), (2, "term"), (3, "kill"))
        ]
        out += [lambda: run.hook("write:model.pt", 1, "kill")]
        out += [
            lambda: run.hook("write:last.pt", 2, "enospc"),
            lambda: run.hook("write:model.pt", 1, "enospc"),
            lambda: run.hook("write:out.json", 1, "enospc"),
        ]
        out += [lambda: run.random_signal(signal.SIGKILL) for _ in range(3)]
        out += [lambda: run.random_signal(signal.SIGTERM) for _ in range(2)]
        out += [lambda: run.damaged_checkpoint("truncated") for _ in range(2)]
        out += [lambda: run.damaged_checkpoint("corrupted")]
        out += [
            lambda: run.locked_store(10),
            lambda: run.locked_store(45),
            lambda: run.moved_store(),
        ]
    if "sweep" in commands or "table" in commands:
        out.append(sweep.prepare)
    if "sweep" in commands:
        out += [
            lambda: sweep.hook("write:last.pt", 2, "kill"),
            lambda: sweep.hook("train_batch", 4, "term"),
            lambda: sweep.random_worker_signal(signal.SIGKILL),
            lambda: sweep.random_coordinator_term(),
        ]
    if "tune" in commands:
        out.append(tune.prepare)
        out += [
            lambda: tune.hook("train_batch", 8, "kill"),
            lambda: tune.hook("write:last.pt", 3, "kill"),
            lambda: tune.hook("evaluate", 4, "term"),
            lambda: tune.random_signal(signal.SIGKILL),
        ]
    if "table" in commands:
        table = TableFaults(lab, sweep)
        out.append(table.prepare)
        out += [lambda a=a: table.hook(a) for a in ("kill", "term", "enospc")]
    return out


def format_table(rows: list[Row]) -> str:
    head = (
        "| command | fault | point | recovered | final metrics identical | cells run twice "
        "| runs left RUNNING | half-written read | note |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    yes = {True: "yes", False: "**no**"}
    return head + "".join(
        f"| {r.command} | {r.fault} | {r.point} | {yes[r.recovered]} | {yes[r.identical]} | {r.twice} | "
        f"{r.running} | {r.half_read} | {r.note} |\n"
        for r in rows
    )
