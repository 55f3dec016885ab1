"""``python -m harness datasets``, ``methods`` and ``ui``: what is registered, what is
found locally (``datasets fetch`` is :mod:`harness.cli.fetch`), and the MLflow UI over
the tracking store."""

from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.request
import webbrowser
from pathlib import Path

from harness.base.errors import HarnessError
from harness.cli.fetch import add_fetch_parser, add_verify_parser
from harness.cli.processes import serve_process_group
from harness.cli.store import open_store
from harness.components.data import DATASETS
from harness.components.data.base import data_root_folder
from harness.components.data.fashion_mnist import fashion_mnist_root
from harness.components.data.fetch import SOURCES, fetch_command, fetch_record
from harness.components.data.synthetic import synthetic_root
from harness.methods import METHODS
from harness.store.location import tracking_uri
from harness.store.queries import experiments_by_activity
from harness.store.ui import prepare_for_ui, ui_url
from harness.store.ui_runs import prepare_runs
from harness.store.ui_server import server_command, server_environment

__all__ = ["add_listing_parsers", "cmd_datasets", "cmd_methods", "cmd_ui", "announce_when_up"]


def cmd_datasets(args: argparse.Namespace) -> int:
    """Per dataset: found or not, where, verified or not, and its image count."""

    if args.data_root is not None and not args.data_root.is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    data_root_folder(args.data_root)  # the default root ($DML_HARNESS_DATA) a file: refused
    for name in DATASETS:
        info = DATASETS.get(name)
        where, status, images = _dataset_state(name, info, args.data_root)
        print(f"{name:14s} {status:38s} {images:>9s}  {where}\n{'':14s} {info.description}")
    return 0


def _dataset_state(name: str, info, data_root: Path | None) -> tuple[str, str, str]:
    """(where, status, image count) of one dataset; a tree its loader refuses is 'damaged'."""

    if name == "synthetic":
        root = synthetic_root(data_root)
        if not (root / "manifest.json").is_file():
            return str(root), "generated on first use", "-"
    else:
        try:
            root = (
                fashion_mnist_root(data_root) if name == "fashion-mnist" else info.locate(data_root)
            )
        except HarnessError as err:
            hint = f"; {fetch_command(name, data_root)}" if name in SOURCES else ""
            return str(err).split("expected ", 1)[-1] + hint, "missing", "-"
    record = fetch_record(root) if name in SOURCES else None
    if record is not None:
        status = (
            "found, verified"
            if record.get("verified")
            else "found, fetched (no published checksum)"
        )
        return str(root), status, f"{record.get('images', 0):,}"
    try:
        splits = info.loader(data_root if info.embedded else root)
    except HarnessError as err:
        return f"{root} ({err})", "damaged", "-"
    count = sum(len(s) for s in (splits.train, splits.test, splits.gallery) if s is not None)
    return (
        str(root),
        "found" + (", not verified (not fetched)" if name in SOURCES else ""),
        f"{count:,}",
    )


def cmd_methods(args: argparse.Namespace) -> int:

    for name in METHODS:
        entry = METHODS.get(name)
        paper = entry.cls.paper
        source = f"{paper.title} ({paper.year})" if paper else "harness baseline"
        print(
            f"{name:14s} {entry.description}\n{'':14s} {source}; options: "
            f"{', '.join(f'{k}={v!r}' for k, v in entry.options().items()) or 'none'}"
        )
    return 0


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


def add_listing_parsers(subparsers) -> None:
    ds = subparsers.add_parser(
        "datasets",
        help="list datasets: found or not, where, verified or not, images; "
        "'datasets fetch NAME' downloads one, 'datasets verify NAME' decodes every image",
    )
    ds.add_argument("--data-root", type=Path)
    ds.set_defaults(func=cmd_datasets)
    commands = ds.add_subparsers(dest="datasets_command", metavar="{fetch,verify}")
    add_fetch_parser(commands)
    add_verify_parser(commands)

    me = subparsers.add_parser("methods", help="list registered method plugins")
    me.set_defaults(func=cmd_methods)

    ui = subparsers.add_parser("ui", help="open the MLflow UI over the tracking store (127.0.0.1)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument(
        "--experiment",
        help="the experiment whose runs page is printed (and opened) first "
        "(default: the most recently active)",
    )
    ui.add_argument(
        "--open", action="store_true", help="open the first runs page in the default web browser"
    )
    ui.set_defaults(func=cmd_ui)
