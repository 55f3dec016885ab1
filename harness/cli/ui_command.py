"""``python -m harness ui``: the MLflow UI over the tracking store, served on 127.0.0.1,
with the first runs page printed (and opened) once the server answers."""

from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.request
import webbrowser

from harness.base.errors import HarnessError
from harness.cli.processes import serve_process_group
from harness.cli.store import open_store
from harness.store.location import tracking_uri
from harness.store.queries import experiments_by_activity
from harness.store.ui import prepare_for_ui, ui_url
from harness.store.ui_runs import prepare_runs
from harness.store.ui_server import server_command, server_environment

__all__ = ["cmd_ui", "check_port_free", "announce_when_up"]


def check_port_free(host: str, port: int) -> None:
    """Refuse a port outside 1-65535, or one that cannot be bound on ``host`` (in use,
    privileged), before the server starts: the server would fail after printing its URL."""
    if not 1 <= port <= 65535:
        raise HarnessError(f"--port {port} is out of range; give a port from 1 to 65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise HarnessError(
            f"--host {host} is not an address of this machine ({err.strerror})"
        ) from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            if (
                sys.platform != "win32"
            ):  # as the server will: a port in TIME_WAIT is free, a listened one not
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise HarnessError(
            f"--port {port}: cannot listen on {host}:{port} ({err.strerror or err}); "
            f"give a free port with --port"
        ) from None


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the MLflow UI (:mod:`harness.store.ui_server`) over the runs prepared for it
    (:func:`harness.store.ui_runs.prepare_runs`); once it answers, print (and with ``--open``
    open) each experiment's runs page, the named or most recently active experiment first."""

    check_port_free(args.host, args.port)
    open_store()
    base = f"http://{args.host}:{args.port}"
    experiments = experiments_by_activity()
    if args.experiment is not None:
        named = [e for e in experiments if e[1] == args.experiment]
        if not named:
            raise HarnessError(
                f"no experiment '{args.experiment}' with runs in {tracking_uri()}; it has: "
                f"{', '.join(name for _, name in experiments) or 'none'}"
            )
        experiments = named + [e for e in experiments if e[1] != args.experiment]
    for exp_id, _ in experiments:
        prepare_for_ui(exp_id)
        prepare_runs(exp_id)  # display copies, colours, the view fitted to the runs
    pages = [(name, ui_url(base, exp_id)) for exp_id, name in experiments] or [
        ("experiments", ui_url(base))
    ]
    print(f"MLflow UI over {tracking_uri()}: starting on {base} ...", file=sys.stderr, flush=True)
    with server_environment() as env:
        return serve_process_group(
            server_command(args.host, args.port),
            env=env,
            started=lambda server: announce_when_up(base, pages, server, open_first=args.open),
        )


def announce_when_up(
    base: str, pages: list[tuple[str, str]], server, *, open_first: bool = False, every: float = 0.5
) -> bool:
    """Once the server at ``base`` answers its index page (a 2xx response), print ``pages``
    (name, URL) and with ``open_first`` open the first in the default web browser; returns
    False, printing nothing, when process ``server`` ends first."""

    while server.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/", timeout=5):
                break
        except OSError:
            time.sleep(every)
    else:
        return False
    print("MLflow UI ready:", file=sys.stderr)
    for name, url in pages:
        print(f"  {name}: {url}", file=sys.stderr)
    sys.stderr.flush()
    if open_first:
        webbrowser.open(pages[0][1])
    return True
