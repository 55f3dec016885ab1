"""Signals and child processes of the command line: SIGTERM unwinds like Ctrl-C, and a
server (``ui``) runs in its own process group, stopped whole."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["terminated", "serve_process_group", "stop_process_group"]


def terminated(signum, frame):
    """SIGTERM's handler: SIGTERM (a sweep stopping its workers, a cluster's time limit)
    unwinds like Ctrl-C, so the current run is marked KILLED instead of left RUNNING in
    the tracking store."""
    raise KeyboardInterrupt


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live (not zombie) member. Zombies count
    as members for ``killpg`` until reaped, and a container's PID 1 may never reap them."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def stop_process_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM every process of group ``pgid``, wait up to ``grace`` seconds, SIGKILL the rest."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def serve_process_group(
    cmd: list[str], grace: float = 10.0, env: dict[str, str] | None = None
) -> int:
    """Run ``cmd`` (a server) in its own session and process group until it exits; on
    SIGTERM or SIGINT stop the whole group, then exit.

    ``mlflow server`` starts worker processes of its own (uvicorn / gunicorn); a signal
    to the server alone, or to a process that exec-ed into it, left those workers
    running and holding the port. Here every process it starts shares its group, and
    ``killpg`` reaches them all. Returns the server's exit status; a signal ends in
    ``KeyboardInterrupt`` (exit 130 through :func:`main`) once the group is gone. ``env``:
    the server's environment (default: this process's)."""
    previous = signal.signal(signal.SIGTERM, terminated)
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    try:
        return proc.wait()
    finally:  # interrupted (or failed): the server and its workers go with us
        signal.signal(signal.SIGTERM, previous)
        stop_process_group(proc.pid, grace)
        proc.wait()
