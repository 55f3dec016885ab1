"""``python -m harness datasets``, ``methods`` and ``ui``: what is registered, what is
found locally (``datasets fetch`` is :mod:`harness.cli.fetch`), and the MLflow UI over
the tracking store."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from harness.base.errors import HarnessError
from harness.cli.fetch import add_fetch_parser, add_verify_parser
from harness.cli.processes import serve_process_group
from harness.cli.store import open_store

__all__ = ["add_listing_parsers", "cmd_datasets", "cmd_methods", "cmd_ui"]


def cmd_datasets(args: argparse.Namespace) -> int:
    """Per dataset: found or not, where, verified or not, and its image count."""
    from harness.components.data import DATASETS

    if args.data_root is not None and not args.data_root.is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    for name in DATASETS:
        info = DATASETS.get(name)
        where, status, images = _dataset_state(name, info, args.data_root)
        print(f"{name:14s} {status:38s} {images:>9s}  {where}\n{'':14s} {info.description}")
    return 0


def _dataset_state(name: str, info, data_root: Path | None) -> tuple[str, str, str]:
    """(where, status, image count) of one dataset; a tree its loader refuses is 'damaged'."""
    from harness.components.data.fashion_mnist import fashion_mnist_root
    from harness.components.data.fetch import SOURCES, fetch_command, fetch_record
    from harness.components.data.synthetic import synthetic_root

    if name == "synthetic":
        root = synthetic_root(data_root)
        if not (root / "manifest.json").is_file():
            return str(root), "generated on first use", "-"
    else:
        try:
            root = fashion_mnist_root(data_root) if name == "fashion-mnist" else info.locate(data_root)
        except HarnessError as err:
            hint = f"; {fetch_command(name, data_root)}" if name in SOURCES else ""
            return str(err).split("expected ", 1)[-1] + hint, "missing", "-"
    record = fetch_record(root) if name in SOURCES else None
    if record is not None:
        status = "found, verified" if record.get("verified") else "found, fetched (no published checksum)"
        return str(root), status, f"{record.get('images', 0):,}"
    try:
        splits = info.loader(data_root if info.embedded else root)
    except HarnessError as err:
        return f"{root} ({err})", "damaged", "-"
    count = sum(len(s) for s in (splits.train, splits.test, splits.gallery) if s is not None)
    return str(root), "found" + (", not verified (not fetched)" if name in SOURCES else ""), f"{count:,}"


def cmd_methods(args: argparse.Namespace) -> int:
    from methods import METHODS

    for name in METHODS:
        entry = METHODS.get(name)
        paper = entry.cls.paper
        source = f"{paper.title} ({paper.year})" if paper else "harness baseline"
        print(f"{name:14s} {entry.description}\n{'':14s} {source}; options: "
              f"{', '.join(f'{k}={v!r}' for k, v in entry.options().items()) or 'none'}")
    return 0


def check_port_free(host: str, port: int) -> None:
    """Refuse a port outside 1-65535, or one that cannot be bound on ``host`` (in use,
    privileged), before the server starts: the server would fail after printing its URL."""
    if not 1 <= port <= 65535:
        raise HarnessError(f"--port {port} is out of range; give a port from 1 to 65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise HarnessError(f"--host {host} is not an address of this machine ({err.strerror})") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            if sys.platform != "win32":  # as the server will: a port in TIME_WAIT is free, a listened one not
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise HarnessError(f"--port {port}: cannot listen on {host}:{port} ({err.strerror or err}); "
                           f"give a free port with --port") from None


def cmd_ui(args: argparse.Namespace) -> int:
    from harness.store.tracking import tracking_uri, ui_server_command

    check_port_free(args.host, args.port)
    open_store()
    print(f"MLflow UI on http://{args.host}:{args.port} over {tracking_uri()}", file=sys.stderr)
    sys.stderr.flush()
    return serve_process_group(ui_server_command(args.host, args.port))


def add_listing_parsers(subparsers) -> None:
    ds = subparsers.add_parser("datasets", help="list datasets: found or not, where, verified or not, images; "
                               "'datasets fetch NAME' downloads one, 'datasets verify NAME' decodes every image")
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
    ui.set_defaults(func=cmd_ui)
