"""Every output path a command takes (``--json``, ``--out``, figures, checkpoints, an Optuna
``--storage``), checked before any work starts.

An output never replaces the tracking store's database, never lands inside its artifact
folder, and never replaces a device, a FIFO, a folder or any SQLite database
(:mod:`harness.base.paths`). It is written only to a path that does not exist, or over a
file the harness wrote there and that has not changed since: each folder's record of
what the harness wrote, with digests (:mod:`harness.base.written`), tells; the content of
a file does not. An output of the harness changed since is replaced with ``--force``; a
file the harness did not write is never replaced. Nor are one of the command's own input
files, a file inside its input folders (``--dataset``, ``--data-root``), and a file
among the harness's records (a run's checkpoint folder, a dataset's folder:
:func:`harness_record`), ``--force`` or not. A storage (``--storage``) is a
new file or a database that already holds Optuna's tables
(:func:`harness.cli.store.check_own_database`).

Each output flag is declared with :func:`add_output_argument`, which marks it in the
parser: :func:`output_flags` lists them all, so that one test checks every one.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, overload

from harness.base.errors import HarnessError
from harness.base.paths import (
    Replacing,
    writable_file,
    writable_folder,
    writable_stem,
)
from harness.base.written import foreign_files, provenance
from harness.store.location import reserved_paths

__all__ = [
    "output_file",
    "output_folder",
    "output_stem",
    "add_output_argument",
    "add_force_argument",
    "output_flags",
    "option_flags",
    "subcommands",
    "harness_record",
]

#: Files that make their folder a run's checkpoint folder, and a dataset's folder.
_CHECKPOINT_FILES = ("last.pt", "last.pt.sha256.json", "model.pt")
_DATASET_MARKER = "manifest.json"


def harness_record(path: Path) -> str | None:
    """What ``path`` (resolved) is among the harness's records, or None: a file in a run's
    checkpoint folder (``last.pt``, its checksum file or ``model.pt`` beside it) or in a
    generated dataset's folder (``manifest.json`` beside ``images/``)."""
    folder = path.parent
    if path.name in _CHECKPOINT_FILES or any((folder / n).is_file() for n in _CHECKPOINT_FILES):
        return f"in a run's checkpoint folder ({folder})"
    if (folder / _DATASET_MARKER).is_file() and (folder / "images").is_dir():
        return f"in a dataset's folder ({folder})"
    return None


#: The arguments that name outputs: never read as one of the command's inputs.
_OUTPUT_DESTS = ("json", "out", "storage", "checkpoint_root")
#: The arguments whose folder is an input: nothing is written inside it.
_INPUT_FOLDERS = ("dataset", "data_root")


def _inputs(args: argparse.Namespace | None) -> tuple[tuple[str, Path], ...]:
    """The command's inputs: every argument (other than an output) naming an existing file,
    and the folders of ``--dataset`` and ``--data-root``."""
    if args is None:
        return ()
    found = []
    for dest, value in vars(args).items():
        if dest in _OUTPUT_DESTS:
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            if not isinstance(item, str | os.PathLike) or not str(item):
                continue
            path = Path(item)
            try:
                if path.is_file() or (dest in _INPUT_FOLDERS and path.is_dir()):
                    found.append((f"--{dest.replace('_', '-')}", path))
            except (OSError, ValueError):
                continue
    return tuple(found)


def _replacing(args: argparse.Namespace | None) -> Replacing:
    return Replacing(
        provenance=provenance,
        force=bool(getattr(args, "force", False)),
        inputs=_inputs(args),
        record=harness_record,
    )


@overload
def output_file(
    text: str | os.PathLike, flag: str, *, args: argparse.Namespace | None = ...
) -> Path: ...
@overload
def output_file(text: None, flag: str, *, args: argparse.Namespace | None = ...) -> None: ...
def output_file(
    text: str | os.PathLike | None, flag: str, *, args: argparse.Namespace | None = None
) -> Path | None:
    """A file the command will write (None when the flag was not given). ``args``: the
    command's arguments, for ``--force`` and its inputs."""
    return writable_file(text, flag, reserved=reserved_paths(), replacing=_replacing(args))


def output_stem(
    text: str | os.PathLike | None,
    flag: str,
    suffixes: tuple[str, ...],
    *,
    args: argparse.Namespace | None = None,
) -> Path | None:
    """Files ``STEM + suffix`` the command will write."""
    return writable_stem(
        text, flag, suffixes, reserved=reserved_paths(), replacing=_replacing(args)
    )


@overload
def output_folder(text: str | os.PathLike, flag: str, *, files: bool = ...) -> Path: ...
@overload
def output_folder(text: None, flag: str, *, files: bool = ...) -> None: ...
def output_folder(text: str | os.PathLike | None, flag: str, *, files: bool = False) -> Path | None:
    """A folder the command will create files in. ``files``: the command writes its files
    directly in it, under names it chooses as it goes: an existing folder must then hold
    only files the harness wrote."""
    folder = writable_folder(text, flag, reserved=reserved_paths())
    foreign = foreign_files(folder) if files and folder is not None else []
    if foreign:
        raise HarnessError(
            f"{flag} {text} holds files the harness did not write ({foreign[0].name}"
            f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); give a new or "
            f"empty folder, or one the harness wrote"
        )
    return folder


# ------------------------------------------------------------------ the parser's outputs

#: How an output flag's value names what it writes: a file, a stem (``STEM.md`` ...), a
#: folder, or an SQLite URL (``sqlite:///PATH``).
FORMS = ("file", "stem", "folder", "storage")


def add_output_argument(
    parser: argparse.ArgumentParser, flag: str, *, form: str = "file", **options: Any
) -> argparse.Action:
    """``parser.add_argument(flag, **options)``, marked as an output of shape ``form``
    (:data:`FORMS`) for :func:`output_flags`."""
    if form not in FORMS:
        raise ValueError(f"form {form!r} is not one of {FORMS}")
    action = parser.add_argument(flag, **options)
    action.output_form = form  # type: ignore[attr-defined]
    return action


def add_force_argument(parser: argparse.ArgumentParser) -> None:
    """``--force``: replace an output of the harness that changed since it was written."""
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an output the harness wrote even though it changed since (a file the "
        "harness did not write, an input, a checkpoint or dataset file: never)",
    )


def output_flags(parser: argparse.ArgumentParser) -> dict[str, dict[str, str]]:
    """Every subcommand's output flags and their forms: ``{"run": {"--json": "file"}, ...}``
    (a subcommand without outputs maps to an empty dict)."""
    return {
        command: {
            a.option_strings[-1]: form
            for a in sub._actions
            if (form := getattr(a, "output_form", None))
        }
        for command, sub in subcommands(parser).items()
    }


def option_flags(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Every subcommand's option flags (each option by its last spelling)."""
    return {
        command: [a.option_strings[-1] for a in sub._actions if a.option_strings]
        for command, sub in subcommands(parser).items()
    }


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each subcommand of ``parser``, by name."""
    return {
        command: sub
        for action in parser._actions  # argparse lists its subcommands only here
        if isinstance(action, argparse._SubParsersAction)
        for command, sub in action.choices.items()
    }
