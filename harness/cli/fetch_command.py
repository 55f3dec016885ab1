"""``python -m harness datasets fetch NAME``: a benchmark downloaded (or read from ``--from``
files), verified and unpacked into its official layout by
:func:`harness.components.data.fetch.fetch_dataset`; and ``run --download``'s use of it.
``datasets verify NAME``: every image decoded once and the tree stamped as verified
(:mod:`harness.components.data.verify`), which ``run`` checks before training."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.base.errors import HarnessError
from harness.cli.outputs import output_folder
from harness.components.data import DATASETS
from harness.components.data.base import DATA_ROOT_SETTING, data_root_folder
from harness.components.data.fetch import SOURCES, fetch_command, fetch_dataset
from harness.components.data.own import dataset_name
from harness.components.data.verify import check_images, verify_dataset

__all__ = [
    "cmd_fetch",
    "cmd_verify",
    "ensure_dataset",
    "check_dataset",
    "check_data_root",
]


def _show_progress() -> bool:
    """A progress bar only for a person at a terminal: quiet in logs and pipes."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def cmd_fetch(args: argparse.Namespace) -> int:

    data_root = (
        args.fetch_data_root or args.data_root
    )  # after 'fetch', or before it ('datasets --data-root')
    fetch_dataset(
        args.name,
        data_root,
        local_files=args.local_files or (),
        url=args.url,
        sha256=args.sha256 or (),
        timeout=args.timeout,
        progress=_show_progress(),
        say=_say,
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:

    if args.threads < 1:
        raise HarnessError(f"--threads must be >= 1, got {args.threads}")
    name = dataset_name(args.name)
    data_root = _existing_data_root(args.verify_data_root or args.data_root)
    verify_dataset(name, data_root, threads=args.threads, progress=_show_progress(), say=_say)
    return 0


def _existing_data_root(data_root: Path | None) -> Path | None:
    if data_root is not None and not data_root.is_dir():
        raise HarnessError(f"--data-root {data_root} does not exist or is not a folder")
    return data_root


def check_dataset(name: str, data_root: Path | None) -> None:
    """Before training: the data root checked (:func:`check_data_root`), the dataset's index
    files read and its images checked (their headers, or nothing more when ``datasets
    verify`` stamped this very tree)."""

    check_data_root(name, data_root)
    check_images(name, data_root, say=_say)


def check_data_root(name: str, data_root: Path | None) -> None:
    """The data root (``--data-root``, else ``$DML_HARNESS_DATA``, else the cache folder)
    is a folder, and one a dataset the harness generates (synthetic) can be written into
    when it is not there yet."""

    root = data_root_folder(data_root)
    flag = "--data-root" if data_root is not None else DATA_ROOT_SETTING
    info = DATASETS.get(name)
    if info.embedded and not (root / info.folder).is_dir():  # generated on first use
        output_folder(root / info.folder, flag)


def ensure_dataset(name: str, data_root: Path | None, *, download: bool) -> None:
    """Before ``run`` trains: a missing benchmark is fetched (``download``) or named in an
    error with the exact command that fetches it. Other datasets are left to their loaders."""

    if name not in SOURCES:
        return
    try:
        DATASETS.get(name).locate(data_root)
        return
    except HarnessError as err:
        if not download:
            raise HarnessError(
                f"{err}; fetch it with: {fetch_command(name, data_root)} (or run with --download)"
            ) from None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every process would download the same files
        raise HarnessError(
            f"--download under torchrun: fetch the dataset first ({fetch_command(name, data_root)})"
        )
    fetch_dataset(name, data_root, progress=_show_progress(), say=_say)
