"""``python -m harness datasets fetch NAME``: a benchmark downloaded (or read from ``--from``
files), verified and unpacked into its official layout by
:func:`harness.components.data.fetch.fetch_dataset`; and ``run --download``'s use of it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.base.errors import HarnessError
from harness.cli.arguments import positive_number

__all__ = ["add_fetch_parser", "cmd_fetch", "ensure_dataset"]


def _show_progress() -> bool:
    """A progress bar only for a person at a terminal: quiet in logs and pipes."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def cmd_fetch(args: argparse.Namespace) -> int:
    from harness.components.data.fetch import fetch_dataset

    data_root = args.fetch_data_root or args.data_root  # after 'fetch', or before it ('datasets --data-root')
    fetch_dataset(args.name, data_root, local_files=args.local_files or (), url=args.url,
                  sha256=args.sha256 or (), timeout=args.timeout, progress=_show_progress(), say=_say)
    return 0


def ensure_dataset(name: str, data_root: Path | None, *, download: bool) -> None:
    """Before ``run`` trains: a missing benchmark is fetched (``download``) or named in an
    error with the exact command that fetches it. Other datasets are left to their loaders."""
    from harness.components.data import DATASETS
    from harness.components.data.fetch import SOURCES, fetch_command, fetch_dataset

    if name not in SOURCES:
        return
    try:
        DATASETS.get(name).locate(data_root)
        return
    except HarnessError as err:
        if not download:
            raise HarnessError(f"{err}; fetch it with: {fetch_command(name, data_root)} "
                               f"(or run with --download)") from None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every process would download the same files
        raise HarnessError(f"--download under torchrun: fetch the dataset first ({fetch_command(name, data_root)})")
    fetch_dataset(name, data_root, progress=_show_progress(), say=_say)


def add_fetch_parser(dataset_commands) -> None:
    fetch = dataset_commands.add_parser(
        "fetch", help="download a benchmark, verify it and unpack it in its official layout",
        description="Download (resumably) or read with --from, verify the checksum, unpack beside the target, "
                    "check the official counts, then move into place. Cars196 and In-Shop need a manual "
                    "download first: the command says what to get.")
    fetch.add_argument("name", help="cub200, cars196, sop or inshop")
    fetch.add_argument("--data-root", dest="fetch_data_root", type=Path, help="default $DML_HARNESS_DATA, else ~/.cache/dml-harness")
    fetch.add_argument("--from", dest="local_files", type=Path, action="append", metavar="FILE",
                       help="a file of the release already downloaded (repeat, in the order the dataset lists)")
    fetch.add_argument("--url", help="download from this mirror instead (one-file datasets)")
    fetch.add_argument("--sha256", action="append", metavar="HEX",
                       help="a checksum to hold each file to, besides any published one (repeat per file)")
    fetch.add_argument("--timeout", type=positive_number, default=60.0,
                       help="seconds a silent connection is waited for (default 60)")
    fetch.set_defaults(func=cmd_fetch)
