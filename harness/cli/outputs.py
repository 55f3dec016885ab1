"""Every output path a command takes (``--json``, ``--out``, figures, checkpoints), checked
before any work starts against the tracking store's own places: an output never replaces
the store's database, never lands inside its artifact folder, and never replaces a device,
a FIFO, a folder or any SQLite database (:mod:`harness.base.paths`). The harness's own
writes into the store go through MLflow, not through these paths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import overload

from harness.base.errors import HarnessError
from harness.base.paths import writable_file, writable_folder, writable_stem
from harness.store.location import reserved_paths

__all__ = ["output_file", "output_folder", "output_stem", "check_study_storage"]


@overload
def output_file(text: str | os.PathLike, flag: str) -> Path: ...
@overload
def output_file(text: None, flag: str) -> None: ...
def output_file(text: str | os.PathLike | None, flag: str) -> Path | None:
    """A file the command will write (None when the flag was not given)."""
    return writable_file(text, flag, reserved=reserved_paths())


def output_stem(
    text: str | os.PathLike | None, flag: str, suffixes: tuple[str, ...]
) -> Path | None:
    """Files ``STEM + suffix`` the command will write."""
    return writable_stem(text, flag, suffixes, reserved=reserved_paths())


@overload
def output_folder(text: str | os.PathLike, flag: str) -> Path: ...
@overload
def output_folder(text: None, flag: str) -> None: ...
def output_folder(text: str | os.PathLike | None, flag: str) -> Path | None:
    """A folder the command will create files in."""
    return writable_folder(text, flag, reserved=reserved_paths())


def check_study_storage(storage: str | None, flag: str = "--storage") -> None:
    """An Optuna or sweep storage that is the tracking store's database would add its
    tables to the store: refused, as are a database URL whose driver is not installed and a
    new SQLite database whose folder cannot be written."""
    from harness.cli.store import check_driver

    if storage:
        check_driver(storage, flag)
    if not storage or not storage.startswith("sqlite:///"):
        return
    database = Path(storage.removeprefix("sqlite:///").split("?", 1)[0]).resolve()
    for place in reserved_paths():
        if not place.folder and place.holds(database):
            raise HarnessError(f"{flag} {storage} is {place.what}; give a database of its own")
    if (
        not database.is_file()
    ):  # created on first use: its folder must take it, checked before the dataset loads
        try:
            writable_folder(database.parent, "its folder")
        except HarnessError as err:
            raise HarnessError(f"cannot open the Optuna storage {storage}: {err}") from None
