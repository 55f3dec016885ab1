"""Faults injected into ``tune``, restarted by running it again."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

from .checks import Row, count_running, count_twice, ended_by_fault, frozen, runs_of
from .lab import TINY_PROTOCOL, Lab

TUNE_ARGS = (
    "--method",
    "plain",
    "--protocol",
    str(TINY_PROTOCOL),
    "--space",
    "optimizer.lr_head",
    "--trials",
    "2",
    "--seeds",
    "0",
    "--device",
    "cpu",
)


class TuneFaults:
    """``tune`` (2 trials, then the best over seed 0: a tuned grid of one study), restarted
    by running it again."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self.store = lab.store("tune")
        self.reference: tuple | None = None
        self.reference_seconds = 0.0

    def _args(self, cwd: Path, name: str) -> tuple[str, ...]:
        return (
            "tune",
            *TUNE_ARGS,
            "--storage",
            f"sqlite:///{cwd / 'optuna.db'}",
            "--experiment",
            name,
        )

    def _result(self, cwd: Path, name: str) -> tuple:
        """The study's completed trials (parameters, values) and the final run's test metrics."""
        import optuna

        storage = f"sqlite:///{cwd / 'optuna.db'}"
        (name_of_study,) = [
            s.study_name
            for s in optuna.get_all_study_summaries(storage)
            if s.study_name.startswith("tune:")
        ]
        study = optuna.load_study(study_name=name_of_study, storage=storage)
        trials = sorted(
            (tuple(sorted(t.params.items())), t.value)
            for t in study.trials
            if t.state.name == "COMPLETE"
        )
        repro = [
            frozen({k: v for k, v in r.data.metrics.items() if k.startswith("test/")})
            for r in runs_of(self.store, name)
            if r.info.status == "FINISHED" and r.data.tags.get("tune_role") == "final"
        ]
        return tuple(trials), tuple(sorted(repro))

    def prepare(self) -> None:
        cwd = self.lab.root / "tune-reference"
        cwd.mkdir(parents=True, exist_ok=True)
        proc = self.lab.harness(cwd, self._args(cwd, "tune-reference"), self.lab.env(self.store))
        if proc.rc != 0:
            raise RuntimeError(f"reference tune failed:\n{proc.err[-3000:]}")
        self.reference = self._result(cwd, "tune-reference")
        self.reference_seconds = proc.seconds

    def _finish(self, row: Row, name: str, cwd: Path, fault_ok: bool) -> Row:
        restart = self.lab.harness(cwd, self._args(cwd, name), self.lab.env(self.store))
        row.recovered = fault_ok and restart.rc == 0
        if restart.rc != 0:
            row.note = (
                row.note + " restart: " + (restart.err.strip().splitlines() or [""])[-1][:120]
            ).strip()
        row.identical = row.recovered and self._result(cwd, name) == self.reference
        runs = runs_of(self.store, name) + runs_of(self.store, f"{name}-search")
        row.twice = count_twice(
            runs,
            lambda r: (
                r.data.tags.get("tune_role"),
                r.data.tags.get("tune_trial"),
                r.data.tags.get("seed"),
            ),
        )
        row.running = count_running(runs)
        return row

    def hook(self, point: str, n: int, action: str) -> Row:
        name = f"tune-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        cwd.mkdir(parents=True)
        proc = self.lab.harness(
            cwd, self._args(cwd, name), self.lab.env(self.store, f"{point}:{n}:{action}")
        )
        row = Row("tune", {"kill": "SIGKILL", "term": "SIGTERM"}[action], f"{point} #{n}")
        return self._finish(row, name, cwd, ended_by_fault(proc, action))

    def random_signal(self, sig: int) -> Row:
        name = f"tune-{uuid.uuid4().hex[:8]}"
        cwd = self.lab.root / name
        cwd.mkdir(parents=True)
        at = self.lab.rng.uniform(0.15, 0.9) * self.reference_seconds
        proc = self.lab.harness(
            cwd, self._args(cwd, name), self.lab.env(self.store), signal_at=at, sig=sig
        )
        row = Row("tune", signal.Signals(sig).name, f"random, t={at:.1f}s")
        if "ended before the signal" in proc.err:
            row.note = "ended before the signal"
        return self._finish(row, name, cwd, "Traceback" not in proc.err)
