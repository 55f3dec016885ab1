"""Signals and child processes of the command line: SIGTERM unwinds like Ctrl-C, and a
server (``ui``) runs in the command's own process group, so that a signal to that group
(Ctrl-C, a SIGKILL of the group) reaches it and its workers too, and is stopped whole with
every process it started when the command ends; the browser is opened on its page once it
answers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["terminated", "serve_process_group", "stop_tree"]


def terminated(signum, frame):
    """SIGTERM's handler: SIGTERM (a sweep stopping its workers, a cluster's time limit)
    unwinds like Ctrl-C, so the current run is marked KILLED instead of left RUNNING in
    the tracking store."""
    raise KeyboardInterrupt


def _descendants(pid: int) -> list[int]:
    """The processes started by ``pid`` and by them, read from ``/proc`` (empty where there
    is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state != "Z"


def stop_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM ``proc`` and every process it started, wait up to ``grace`` seconds, SIGKILL
    the rest."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids += [p for p in _descendants(proc.pid) if p not in pids]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the server, so that it no longer counts
            if not any(_alive(p) for p in pids):
                return
            time.sleep(0.1)


def serve_process_group(
    cmd: list[str],
    grace: float = 10.0,
    env: dict[str, str] | None = None,
    started: Callable[[subprocess.Popen], object] | None = None,
) -> int:
    """Run ``cmd`` (a server) until it exits; on SIGTERM or SIGINT stop it and every
    process it started, then exit.

    ``mlflow server`` starts worker processes of its own (uvicorn / gunicorn). They stay
    in this command's process group: a signal sent to the group (Ctrl-C in a terminal, a
    supervisor's SIGKILL of the group) ends them with it, and none is left holding the
    port. When the command ends otherwise, the server and its workers are stopped as a
    tree (:func:`stop_tree`). Returns the server's exit status; a signal ends in
    ``KeyboardInterrupt`` (exit 130 through :func:`main`) once they are gone. ``env``: the
    server's environment (default: this process's); ``started``: called with the server's
    process once it is started (e.g. to wait until it answers), before waiting for it."""
    previous = signal.signal(signal.SIGTERM, terminated)
    proc = subprocess.Popen(cmd, env=env)
    try:
        if started is not None:
            started(proc)
        return proc.wait()
    finally:  # interrupted (or failed): the server and its workers go with us
        signal.signal(signal.SIGTERM, previous)
        stop_tree(proc, grace)
        proc.wait()
