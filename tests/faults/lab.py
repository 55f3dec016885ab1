"""The fault-injection lab: a folder per command with a shared data root and tracking
store, and a zygote that forks each ``python -m harness`` command line, so a fault hits the
real command."""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_PROTOCOL = REPO / "tests" / "protocols" / "tiny.toml"


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
            [sys.executable, "-c", "from tests.faults.lab import zygote_main; zygote_main()"],
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


#: The imports a child would otherwise pay for, done once in the zygote.
_PRELOADED = (
    "mlflow",
    "optuna",
    "harness.cli.main",
    "harness.engine.grid.sweep",
    "harness.engine.run.training",
    "harness.engine.tuning.sweep",
    "harness.methods",
    "harness.reports.tables",
)


def zygote_main() -> None:
    """The zygote's loop: one JSON request per line in, the child's pid then its exit
    status (negative: the signal that ended it, as ``subprocess`` reports) out."""
    for module in _PRELOADED:
        importlib.import_module(module)

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
