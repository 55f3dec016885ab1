"""Faults injected into ``run``, restarted with ``run --resume``."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from .checks import (
    Row,
    count_running,
    count_twice,
    ended_by_fault,
    json_state,
    one_clear_line,
    runs_of,
)
from .lab import TINY_PROTOCOL, Lab

RUN_ARGS = ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL), "--device", "cpu")


class RunFaults:
    """``run`` (tiny protocol, 2 epochs of 3 batches), restarted with ``run --resume``."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self.store = lab.store("run")
        self.reference: dict | None = None
        self.reference_seconds = 0.0

    def prepare(self) -> None:
        cwd = self.lab.root / "run-reference"
        proc = self.lab.harness(
            cwd,
            (*RUN_ARGS, "--experiment", "reference", "--json", "out.json"),
            self.lab.env(self.store),
        )
        if proc.rc != 0:
            raise RuntimeError(f"reference run failed:\n{proc.err[-3000:]}")
        self.reference = json.loads((cwd / "out.json").read_text())[0]
        # Again, timed: the first run also generated the dataset and created the store,
        # which would push the random moments past the end of a run.
        again = self.lab.harness(
            cwd,
            (*RUN_ARGS, "--experiment", "reference-again", "--json", "again.json"),
            self.lab.env(self.store),
        )
        if (
            again.rc != 0
            or json.loads((cwd / "again.json").read_text())[0]["metrics"]
            != self.reference["metrics"]
        ):
            raise RuntimeError(
                f"a second uninterrupted run did not reproduce the first:\n{again.err[-3000:]}"
            )
        self.reference_seconds = again.seconds

    def _finish(
        self,
        row: Row,
        name: str,
        cwd: Path,
        fault_ok: bool,
        env: dict | None = None,
        extra: tuple[str, ...] = (),
    ) -> Row:
        """Restart with ``--resume`` and fill the row."""
        row.half_read = int(json_state(cwd / "out.json") == "half")
        (cwd / "out.json").unlink(missing_ok=True)
        restart = self.lab.harness(
            cwd,
            (*RUN_ARGS, "--experiment", name, "--resume", "--json", "out.json", *extra),
            env or self.lab.env(self.store),
        )
        row.recovered = fault_ok and restart.rc == 0 and json_state(cwd / "out.json") == "whole"
        if row.recovered:
            record = json.loads((cwd / "out.json").read_text())[0]
            row.identical = (
                record["metrics"] == self.reference["metrics"]
                and record["selected_epoch"] == self.reference["selected_epoch"]
            )
        elif restart.rc != 0:
            row.note = (
                row.note + " restart: " + restart.err.strip().splitlines()[-1][:120]
            ).strip()
        runs = runs_of(self.store, name)
        row.twice = count_twice(
            runs, lambda r: (r.data.tags.get("method"), r.data.tags.get("seed"))
        )
        row.running = count_running(runs)
        return row

    def hook(self, point: str, n: int, action: str) -> Row:
        """Fail at the ``n``-th use of the part ``point`` (:mod:`harness.cli.faults`)."""
        name = f"run-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        spec = f"{point}:{n}:{action}"
        proc = self.lab.harness(
            cwd,
            (*RUN_ARGS, "--experiment", name, "--json", "out.json"),
            self.lab.env(self.store, spec),
        )
        row = Row(
            "run",
            {"kill": "SIGKILL", "term": "SIGTERM", "enospc": "disk full (ENOSPC)"}[action],
            f"{point} #{n}",
        )
        return self._finish(row, name, cwd, ended_by_fault(proc, action))

    def random_signal(self, sig: int) -> Row:
        name = f"run-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        at = self.lab.rng.uniform(0.15, 0.95) * self.reference_seconds
        proc = self.lab.harness(
            cwd,
            (*RUN_ARGS, "--experiment", name, "--json", "out.json"),
            self.lab.env(self.store),
            signal_at=at,
            sig=sig,
        )
        row = Row("run", signal.Signals(sig).name, f"random, t={at:.1f}s")
        if "ended before the signal" in proc.err:
            row.note = "ended before the signal"
        fault_ok = (
            proc.rc in (0, -signal.SIGKILL, -signal.SIGTERM, 130) and "Traceback" not in proc.err
        )
        return self._finish(row, name, cwd, fault_ok)

    def damaged_checkpoint(self, how: str) -> Row:
        """Killed during its second checkpoint write (``last.pt`` holds epoch 1), then
        ``last.pt`` truncated at a random byte or one byte flipped: the resume must refuse
        it in one line and start from scratch."""
        name = f"run-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        proc = self.lab.harness(
            cwd,
            (*RUN_ARGS, "--experiment", name, "--json", "out.json"),
            self.lab.env(self.store, "write:last.pt:2:kill"),
        )
        (checkpoint,) = cwd.glob("results/checkpoints/*/last.pt")
        data = bytearray(checkpoint.read_bytes())
        at = self.lab.rng.randrange(len(data))
        if how == "truncated":
            checkpoint.write_bytes(bytes(data[:at]))
        else:
            data[at] ^= 0x5A
            checkpoint.write_bytes(bytes(data))
        row = Row("run", f"{how} checkpoint", f"last.pt byte {at} of {len(data)}")
        row = self._finish(row, name, cwd, ended_by_fault(proc, "kill"))
        return row

    def locked_store(self, seconds: float) -> Row:
        """Another writer holds the tracking store's SQLite write lock (``BEGIN EXCLUSIVE``) for
        ``seconds`` from a random moment of the run: under MLflow's 20 s busy timeout the run
        waits; beyond it the run must stop with one line, and the resume finish it."""
        name = f"run-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        at = self.lab.rng.uniform(0.3, 0.7) * self.reference_seconds

        def hold() -> None:
            time.sleep(at)
            db = sqlite3.connect(
                self.store.removeprefix("sqlite:///"), timeout=120, isolation_level=None
            )
            db.execute("BEGIN EXCLUSIVE")
            time.sleep(seconds)
            db.execute("ROLLBACK")
            db.close()

        holder = threading.Thread(target=hold)
        holder.start()
        proc = self.lab.harness(
            cwd, (*RUN_ARGS, "--experiment", name, "--json", "out.json"), self.lab.env(self.store)
        )
        holder.join()
        row = Row("run", "store locked by another writer", f"{seconds:.0f}s from t={at:.1f}s")
        row.note = (
            "the run waited"
            if proc.rc == 0
            else ("one line" if one_clear_line(proc) else "traceback")
        )
        return self._finish(row, name, cwd, proc.rc == 0 or one_clear_line(proc))

    def moved_store(self) -> Row:
        """Train, move the tracking store and checkpoint root elsewhere, then
        ``run --methods diml --evaluate-only --init-from RUN`` with the new locations."""
        name = f"run-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        store = f"sqlite:///{cwd / 'own.db'}"
        cwd.mkdir(parents=True)
        shutil.copy(self.store.removeprefix("sqlite:///"), cwd / "own.db")  # migrated already
        trained = self.lab.harness(
            cwd, (*RUN_ARGS, "--experiment", name, "--json", "plain.json"), self.lab.env(store)
        )
        run_id = json.loads((cwd / "plain.json").read_text())[0]["mlflow_run_id"]
        moved = self.lab.root / f"{name}-moved"
        moved.mkdir()
        shutil.move(cwd / "own.db", moved / "own.db")
        shutil.move(cwd / "results" / "checkpoints", moved / "checkpoints")
        env = self.lab.env(
            f"sqlite:///{moved / 'own.db'}", DML_HARNESS_CHECKPOINTS=str(moved / "checkpoints")
        )
        proc = self.lab.harness(
            cwd,
            (
                "run",
                "--methods",
                "diml",
                "--protocol",
                str(TINY_PROTOCOL),
                "--device",
                "cpu",
                "--experiment",
                name,
                "--evaluate-only",
                "--init-from",
                run_id,
                "--json",
                "diml.json",
            ),
            env,
        )
        row = Row(
            "run", "store + checkpoint root moved", "before --init-from (diml --evaluate-only)"
        )
        row.recovered = trained.rc == 0 and proc.rc == 0
        if row.recovered:
            diml = json.loads((cwd / "diml.json").read_text())[0]["metrics"]
            row.identical = all(
                diml[f"global_{k}"] == v for k, v in self.reference["metrics"].items()
            )
        else:
            row.note = proc.err.strip().splitlines()[-1][:120] if proc.err.strip() else ""
        runs = runs_of(f"sqlite:///{moved / 'own.db'}", name)
        row.twice = count_twice(
            runs, lambda r: (r.data.tags.get("method"), r.data.tags.get("seed"))
        )
        row.running = count_running(runs)
        return row
