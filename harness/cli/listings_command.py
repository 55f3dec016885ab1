"""``python -m harness datasets``: what is found locally (``datasets fetch`` is
:mod:`harness.cli.fetch_command`; the MLflow UI, :mod:`harness.cli.ui_command`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.base.errors import HarnessError
from harness.components.data import DATASETS
from harness.components.data.base import data_root_folder
from harness.components.data.fashion_mnist import fashion_mnist_root
from harness.components.data.fetch import SOURCES, fetch_command, fetch_record
from harness.components.data.synthetic import synthetic_root

__all__ = ["cmd_datasets"]


def cmd_datasets(args: argparse.Namespace) -> int:
    """Per dataset: found or not, where, verified or not, and its image count."""

    if args.data_root is not None and not args.data_root.is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    data_root_folder(args.data_root)  # the default root ($DML_HARNESS_DATA) a file: refused
    width = max(len(name) for name in DATASETS)
    for name in DATASETS:
        info = DATASETS.get(name)
        where, status, images = _dataset_state(name, info, args.data_root)
        print(
            f"{name:{width}s} {status:38s} {images:>9s}  {where}\n{'':{width}s} {info.description}"
        )
    return 0


def _dataset_state(name: str, info, data_root: Path | None) -> tuple[str, str, str]:
    """(where, status, image count) of one dataset; a tree its loader refuses is 'damaged'."""

    if name in ("synthetic", "synthetic-closeup"):
        root = synthetic_root(data_root, framing="wide" if name == "synthetic" else "closeup")
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
