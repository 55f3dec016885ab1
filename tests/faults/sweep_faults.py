"""Faults injected into ``sweep`` (3 workers), restarted by running the same sweep again,
and into ``table`` over the sweep's experiment."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

from .checks import Row, children, count_running, count_twice, ended_by_fault, frozen, runs_of
from .lab import TINY_PROTOCOL, Lab

SWEEP_TIMING = ("--heartbeat", "1", "--grace", "6")


class SweepFaults:
    """``sweep --workers 3`` over a 3-cell grid (plain, seeds 0-2), restarted by running
    the same sweep again."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self.store = lab.store("sweep")
        self.reference: dict[str, dict] = {}
        self.reference_seconds = 0.0

    def _grid(self, cwd: Path, name: str) -> Path:
        cwd.mkdir(parents=True, exist_ok=True)
        path = cwd / "grid.toml"
        path.write_text(
            f'name = "{name}"\nprotocol = "{TINY_PROTOCOL}"\nexperiment = "{name}"\n'
            'methods = ["plain"]\nlosses = ["margin"]\nbackbones = ["efficientnet_lite0"]\n'
            'datasets = ["synthetic"]\nseeds = [0, 1, 2]\n'
        )
        return path

    def _args(self, cwd: Path, name: str) -> tuple[str, ...]:
        return (
            "sweep",
            "--grid",
            str(self._grid(cwd, name)),
            "--storage",
            f"sqlite:///{cwd / 'optuna.db'}",
            "--workers",
            "3",
            "--device",
            "cpu",
            *SWEEP_TIMING,
        )

    def _metrics(self, name: str) -> dict[str, dict]:
        return {
            r.data.tags["cell_key"]: {
                k: v for k, v in r.data.metrics.items() if k.startswith("test/")
            }
            for r in runs_of(self.store, name)
            if r.info.status == "FINISHED" and "cell_key" in r.data.tags
        }

    def prepare(self) -> None:
        cwd = self.lab.root / "sweep-reference"
        proc = self.lab.harness(cwd, self._args(cwd, "sweep-reference"), self.lab.env(self.store))
        if proc.rc != 0:
            raise RuntimeError(f"reference sweep failed:\n{proc.err[-3000:]}")
        self.reference = self._metrics("sweep-reference")
        self.reference_seconds = proc.seconds

    def _finish(self, row: Row, name: str, cwd: Path, fault_ok: bool) -> Row:
        restart = self.lab.harness(cwd, self._args(cwd, name), self.lab.env(self.store))
        row.recovered = fault_ok and restart.rc == 0
        if restart.rc != 0:
            row.note = (
                row.note + " restart: " + (restart.err.strip().splitlines() or [""])[-1][:120]
            ).strip()
        got = self._metrics(name)
        # Cell keys hold the grid's name: compare cell by cell in grid order (seeds 0-2).
        row.identical = row.recovered and sorted(map(frozen, got.values())) == sorted(
            map(frozen, self.reference.values())
        )
        runs = runs_of(self.store, name)
        row.twice = count_twice(runs, lambda r: r.data.tags.get("cell_key"))
        row.running = count_running(runs)
        return row

    def hook(self, point: str, n: int, action: str) -> Row:
        """Every worker fails at its ``n``-th arrival at ``point`` (the variable reaches all three)."""
        name = f"sweep-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        self.lab.harness(
            cwd, self._args(cwd, name), self.lab.env(self.store, f"{point}:{n}:{action}")
        )
        row = Row(
            "sweep", {"kill": "SIGKILL", "term": "SIGTERM"}[action], f"{point} #{n}, all 3 workers"
        )
        return self._finish(row, name, cwd, True)

    def random_worker_signal(self, sig: int) -> Row:
        name = f"sweep-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        at = self.lab.rng.uniform(0.2, 0.8) * self.reference_seconds
        pick = self.lab.rng.randrange(3)

        def worker(pid: int) -> int | None:
            kids = children(pid)
            return kids[pick % len(kids)] if kids else None

        proc = self.lab.harness(
            cwd,
            self._args(cwd, name),
            self.lab.env(self.store),
            signal_at=at,
            sig=sig,
            target=worker,
        )
        row = Row("sweep", signal.Signals(sig).name, f"random, one worker, t={at:.1f}s")
        if "ended before the signal" in proc.err:
            row.note = "ended before the signal"
        return self._finish(
            row,
            name,
            cwd,
            "Traceback" not in proc.err.split("[fault-injection]")[0] or sig == signal.SIGKILL,
        )

    def random_coordinator_term(self) -> Row:
        """SIGTERM to ``sweep`` itself: it stops its workers (SIGTERM), their runs are KILLED."""
        name = f"sweep-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        at = self.lab.rng.uniform(0.2, 0.8) * self.reference_seconds
        proc = self.lab.harness(
            cwd, self._args(cwd, name), self.lab.env(self.store), signal_at=at, sig=signal.SIGTERM
        )
        row = Row("sweep", "SIGTERM", f"random, the sweep command, t={at:.1f}s")
        return self._finish(row, name, cwd, proc.rc in (0, 130))


class TableFaults:
    """``table`` over the reference sweep's experiment, written to a file, then again."""

    def __init__(self, lab: Lab, sweep: SweepFaults):
        self.lab, self.sweep = lab, sweep
        self.reference = ""

    def _args(self, out: Path) -> tuple[str, ...]:
        return (
            "table",
            "--experiment",
            "sweep-reference",
            "--format",
            "markdown",
            "--out",
            str(out),
        )

    def prepare(self) -> None:
        cwd = self.lab.root / "table-reference"
        proc = self.lab.harness(cwd, self._args(cwd / "t.md"), self.lab.env(self.sweep.store))
        if proc.rc != 0:
            raise RuntimeError(f"reference table failed:\n{proc.err[-3000:]}")
        self.reference = (cwd / "t.md").read_text()

    def hook(self, action: str) -> Row:
        cwd = self.lab.root / f"table-{uuid.uuid4().hex[:8]}"
        out = cwd / "t.md"
        proc = self.lab.harness(
            cwd, self._args(out), self.lab.env(self.sweep.store, f"write:t.md:1:{action}")
        )
        row = Row(
            "table",
            {"kill": "SIGKILL", "term": "SIGTERM", "enospc": "disk full (ENOSPC)"}[action],
            "table write",
        )
        row.half_read = int(out.exists())  # the fault hit before the rename: no file, not a part
        leftovers = [p.name for p in cwd.glob(".t.md.*")]
        if leftovers and action != "kill":
            row.half_read += 1
            row.note = f"temporary left: {leftovers}"
        restart = self.lab.harness(cwd, self._args(out), self.lab.env(self.sweep.store))
        row.recovered = ended_by_fault(proc, action) and restart.rc == 0
        row.identical = row.recovered and out.read_text() == self.reference
        if action == "kill" and leftovers:
            after = [p.name for p in cwd.glob(".t.md.*")]
            row.note = (
                "SIGKILL left its temporary file (never read); the restart removed it"
                if not after
                else f"SIGKILL left its temporary file (never read); still there after the restart: {after}"
            )
        return row
