"""The fault-injection engine: inject a fault into ``run``, ``sweep`` (3 workers), ``tune`` or
``table``, restart the way a user would, and measure what survived.

Each scenario runs the real command line (``python -m harness ...``) in subprocesses, in a
folder of its own (its checkpoints, artifacts, tables), against a tracking store shared by
the scenarios of one command (one experiment each; a new store costs seconds of
migrations). A fault is either a signal sent from outside at a seeded random moment, or
the test-only hook of :mod:`harness.base.faults` (``DML_HARNESS_FAULT=POINT:N:ACTION``), which
lands a kill exactly at a named point (a checkpoint write, an evaluation). Then the
normal restart runs (``run --resume``, the sweep again, tune again, the table again) and
the scenario's row records:

* ``recovered``: the restart exited 0 with its result, and the fault's own exit was
  either a signal or one clear ``error:`` line (no traceback);
* ``identical``: the final metrics (or table text) equal the uninterrupted reference's;
* ``twice``: cells (run: the one run; sweep: grid cells; tune: trials and reproductions)
  with more than one FINISHED MLflow run;
* ``running``: runs of the scenario left RUNNING;
* ``half_read``: a result file present after the fault that is not whole (0 expected).

Used by ``tests/faults/`` (a few scenarios, slow-marked) and by
``benchmarks/fault_injection.py`` (all of them, the table in docs/faults.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_PROTOCOL = REPO / "tests" / "protocols" / "tiny.toml"
RUN_ARGS = ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL), "--device", "cpu")
SWEEP_TIMING = ("--heartbeat", "1", "--grace", "6")
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


@dataclass
class Proc:
    rc: int
    err: str
    seconds: float


@dataclass
class Lab:
    """A folder for one command's scenarios: a shared data root and tracking store."""

    root: Path
    data_root: Path
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(self.seed)

    def store(self, name: str) -> str:
        return f"sqlite:///{self.root / f'{name}.db'}"

    def env(self, store: str, fault: str | None = None, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DML_HARNESS_FAULT", "DML_HARNESS_CHECKPOINTS")
        }
        env.update(
            {
                "DML_HARNESS_DATA": str(self.data_root),
                "MLFLOW_TRACKING_URI": store,
                "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
                **extra,
            }
        )
        if fault:
            env["DML_HARNESS_FAULT"] = fault
        return env

    def harness(
        self,
        cwd: Path,
        args: tuple[str, ...],
        env: dict[str, str],
        *,
        signal_at: float | None = None,
        sig: int = signal.SIGKILL,
        target: Callable[[int], int | None] | None = None,
    ) -> Proc:
        """``python -m harness ARGS`` in ``cwd`` (forked from the :class:`Zygote`); ``signal_at``
        seconds after the start, ``sig`` goes to it (or to the pid ``target(pid)`` picks, e.g.
        one of a sweep's workers)."""
        cwd.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        err_file = cwd / f".stderr-{uuid.uuid4().hex[:8]}"
        pid = self.zygote.start(args, cwd, env, err_file)
        note = ""
        if signal_at is not None:
            deadline = started + signal_at
            while not self.zygote.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            victim = (target(pid) if target else pid) if not self.zygote.done() else None
            if victim:
                try:
                    os.kill(victim, sig)
                except ProcessLookupError:
                    note = "\n[fault-injection] the process had ended before the signal\n"
            else:
                note = "\n[fault-injection] the process had ended before the signal\n"
        rc = self.zygote.wait()
        err = err_file.read_text(errors="replace") + note
        err_file.unlink()
        return Proc(rc, err, time.monotonic() - started)

    @property
    def zygote(self) -> Zygote:
        if getattr(self, "_zygote", None) is None:
            self._zygote = Zygote(self.env(self.store("zygote")))
        return self._zygote

    def close(self) -> None:
        if getattr(self, "_zygote", None) is not None:
            self._zygote.close()
            self._zygote = None


class Zygote:
    """A process that imports the harness once (torch, MLflow, Optuna: ~2/3 of a tiny run's
    CPU time on the development machine) and forks one child per command line; each child
    runs ``harness.cli.main.run_main`` (the entry point of ``python -m harness``) with its own
    environment, folder and signal handlers, so faults hit the real command. The zygote
    opens no store and starts no thread, so a fork inherits no connection or lock. Sweep
    workers are real ``python -m harness`` subprocesses of the forked ``sweep``."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.faults.injection import zygote_main; zygote_main()"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the fault-injection zygote did not start")
        self.status: int | None = None

    def start(self, args: tuple[str, ...], cwd: Path, env: dict[str, str], err_file: Path) -> int:
        self.status = None
        self.proc.stdin.write(
            json.dumps({"argv": list(args), "cwd": str(cwd), "env": env, "stderr": str(err_file)})
            + "\n"
        )
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def done(self) -> bool:
        """Whether the child ended (the zygote writes its status as soon as it reaps it)."""
        import select

        if self.status is None and select.select([self.proc.stdout], [], [], 0)[0]:
            self.status = int(self.proc.stdout.readline())
        return self.status is not None

    def wait(self) -> int:
        if self.status is None:
            self.status = int(self.proc.stdout.readline())
        return self.status

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def zygote_main() -> None:
    """The zygote's loop: one JSON request per line in, the child's pid then its exit
    status (negative: the signal that ended it, as ``subprocess`` reports) out."""
    import mlflow  # noqa: F401
    import optuna  # noqa: F401

    import harness.cli.main  # noqa: F401  (the imports a child would otherwise pay for)
    import harness.engine.sweep  # noqa: F401
    import harness.engine.training  # noqa: F401
    import harness.engine.tune  # noqa: F401
    import harness.methods  # noqa: F401
    import harness.reports.tables  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(
            -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True
        )


def _child(request: dict) -> None:
    rc = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["harness", *request["argv"]]
        from harness.cli.main import run_main

        rc = run_main(request["argv"])
    except SystemExit as exit_:
        rc = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


# ---------------------------------------------------------------------------- checks


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


# ------------------------------------------------------------------------------- run


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
        """Fail at the ``n``-th arrival at ``point`` (``harness.base.faults``)."""
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


# ----------------------------------------------------------------------------- sweep


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
        row.identical = row.recovered and sorted(map(_frozen, got.values())) == sorted(
            map(_frozen, self.reference.values())
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


def _frozen(metrics: dict) -> tuple:
    return tuple(sorted(metrics.items()))


# ------------------------------------------------------------------------------ tune


class TuneFaults:
    """``tune`` (2 trials, then the best over seed 0), restarted by running it again."""

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
        """The study's completed trials (parameters, values) and the reproduction's test metrics."""
        import optuna

        storage = f"sqlite:///{cwd / 'optuna.db'}"
        (summary,) = optuna.get_all_study_summaries(storage)
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        trials = sorted(
            (tuple(sorted(t.params.items())), t.value)
            for t in study.trials
            if t.state.name == "COMPLETE"
        )
        repro = [
            _frozen({k: v for k, v in r.data.metrics.items() if k.startswith("test/")})
            for r in runs_of(self.store, name)
            if r.info.status == "FINISHED" and r.data.tags.get("tune_role") == "reproduction"
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
        runs = runs_of(self.store, name)
        row.twice = count_twice(
            runs,
            lambda r: (
                r.data.tags.get("tune_role"),
                r.data.tags.get("optuna_trial"),
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


# ----------------------------------------------------------------------------- table


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


# ------------------------------------------------------------------------ scenarios


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
