"""``python -m harness datasets``, ``methods`` and ``ui``: what is registered, what is
found locally, and the MLflow UI over the tracking store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.base.errors import HarnessError
from harness.cli.processes import serve_process_group

__all__ = ["add_listing_parsers", "cmd_datasets", "cmd_methods", "cmd_ui"]


def cmd_datasets(args: argparse.Namespace) -> int:
    from harness.components.data import DATASETS
    from harness.components.data.fashion_mnist import fashion_mnist_root
    from harness.components.data.synthetic import synthetic_root

    for name in DATASETS:
        info = DATASETS.get(name)
        if name == "synthetic":
            root = synthetic_root(args.data_root)
            status = "found" if (root / "manifest.json").is_file() else "generated on first use"
            where = str(root)
        else:
            try:
                where = str(fashion_mnist_root(args.data_root) if name == "fashion-mnist" else info.locate(args.data_root))
                status = "found"
            except HarnessError as err:
                status, where = "missing", str(err).split("expected ", 1)[-1]
        print(f"{name:14s} {status:24s} {where}\n{'':14s} {info.description}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from methods import METHODS

    for name in METHODS:
        entry = METHODS.get(name)
        paper = entry.cls.paper
        source = f"{paper.title} ({paper.year})" if paper else "harness baseline"
        print(f"{name:14s} {entry.description}\n{'':14s} {source}; options: "
              f"{', '.join(f'{k}={v!r}' for k, v in entry.options().items()) or 'none'}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from harness.store.tracking import tracking_uri, ui_server_command

    print(f"MLflow UI on http://{args.host}:{args.port} over {tracking_uri()}", file=sys.stderr)
    sys.stderr.flush()
    return serve_process_group(ui_server_command(args.host, args.port))


def add_listing_parsers(subparsers) -> None:
    ds = subparsers.add_parser("datasets", help="list datasets, whether each is found locally and where")
    ds.add_argument("--data-root", type=Path)
    ds.set_defaults(func=cmd_datasets)

    me = subparsers.add_parser("methods", help="list registered method plugins")
    me.set_defaults(func=cmd_methods)

    ui = subparsers.add_parser("ui", help="open the MLflow UI over the tracking store (127.0.0.1)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(func=cmd_ui)
