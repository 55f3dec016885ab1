"""Every output path a command takes (``--json``, ``--out``, figures, checkpoints, an Optuna
``--storage``), checked before any work starts.

An output never replaces the tracking store's database, never lands inside its artifact
folder, and never replaces a device, a FIFO, a folder or any SQLite database
(:mod:`harness.base.paths`). It is written only to a path that does not exist, or over a
file the command recognises as its own earlier output of the same kind (a table, a
``--json`` record: :data:`KINDS`); any other existing file is refused in one line unless
the user gives ``--force``. One of the command's own input files, and a file among the
harness's records (a run's checkpoint folder, a dataset's folder:
:func:`harness_record`), are refused even with ``--force``. A storage (``--storage``) is a
new file or a database that already holds Optuna's tables
(:func:`harness.cli.store.check_own_database`).

Each output flag is declared with :func:`add_output_argument`, which marks it in the
parser: :func:`output_flags` lists them all, so that one test checks every one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

from harness.base.paths import (
    OutputKind,
    Replacing,
    writable_file,
    writable_folder,
    writable_stem,
)
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
    "KINDS",
]

#: The largest file read to recognise it as an earlier output (tables and records are small).
_RECOGNISE_LIMIT = 64 << 20


def _head(path: Path, size: int = _RECOGNISE_LIMIT) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(size)
    except OSError:
        return b""


def _json(path: Path) -> Any:
    try:
        return json.loads(_head(path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _record_with(*keys: str) -> Callable[[Path], bool]:
    """A JSON object holding ``keys``."""

    def recognises(path: Path) -> bool:
        data = _json(path)
        return isinstance(data, dict) and all(k in data for k in keys)

    return recognises


def _run_records(path: Path) -> bool:
    """``run --json``: a list of result records, each naming its method and seed."""
    data = _json(path)
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(r, dict) and "method" in r and "seed" in r for r in data)
    )


def _text_with(pattern: str) -> Callable[[Path], bool]:
    regex = re.compile(pattern, re.MULTILINE)

    def recognises(path: Path) -> bool:
        try:
            text = _head(path).decode("utf-8")
        except UnicodeDecodeError:
            return False
        return bool(regex.search(text))

    return recognises


def _starts_with(magic: bytes) -> Callable[[Path], bool]:
    return lambda path: _head(path, len(magic)) == magic


#: What each output writes, by name, and how an earlier output of that kind is recognised.
KINDS: dict[str, OutputKind] = {
    "run-json": OutputKind("a run --json record", _run_records),
    "evaluate-json": OutputKind(
        "an evaluate --json record", _record_with("mode", "metrics", "num_queries")
    ),
    "explain-json": OutputKind(
        "an explain --json record", _record_with("method_name", "pairs", "pair_kind")
    ),
    "constraints": OutputKind("an env constraints file", _text_with(r"\A# run \S+\n# commit ")),
    ".tex": OutputKind("a LaTeX table", _text_with(r"^\\begin\{table\*?\}")),
    ".md": OutputKind("a Markdown table", _text_with(r"^\|\s*:?-{3,}")),
    ".pdf": OutputKind("a PDF figure", _starts_with(b"%PDF-")),
    ".png": OutputKind("a PNG figure", _starts_with(b"\x89PNG\r\n\x1a\n")),
    ".csv": OutputKind(
        "a forest plot's numbers", _text_with(r"\A\ufeff?dataset,block,comparison,")
    ),
}

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


def _inputs(args: argparse.Namespace | None, output: str) -> tuple[tuple[str, Path], ...]:
    """The command's input files: every argument (other than the output ``output``) naming
    an existing file."""
    if args is None:
        return ()
    found = []
    for dest, value in vars(args).items():
        for item in value if isinstance(value, list | tuple) else [value]:
            if dest == output or not isinstance(item, str | os.PathLike) or not str(item):
                continue
            path = Path(item)
            try:
                if path.is_file():
                    found.append((f"--{dest.replace('_', '-')}", path))
            except (OSError, ValueError):
                continue
    return tuple(found)


def _replacing(
    kind: str | None, args: argparse.Namespace | None, dest: str, suffix: str = ""
) -> Replacing:
    return Replacing(
        kind=KINDS.get(kind or suffix),
        force=bool(getattr(args, "force", False)),
        inputs=_inputs(args, dest),
        record=harness_record,
    )


@overload
def output_file(
    text: str | os.PathLike,
    flag: str,
    *,
    kind: str | None = ...,
    args: argparse.Namespace | None = ...,
) -> Path: ...
@overload
def output_file(
    text: None, flag: str, *, kind: str | None = ..., args: argparse.Namespace | None = ...
) -> None: ...
def output_file(
    text: str | os.PathLike | None,
    flag: str,
    *,
    kind: str | None = None,
    args: argparse.Namespace | None = None,
) -> Path | None:
    """A file the command will write (None when the flag was not given). ``kind``: a key of
    :data:`KINDS` (default: by the file's suffix); ``args``: the command's arguments, for
    ``--force`` and its input files."""
    dest = flag.split()[0].removeprefix("--").replace("-", "_")
    suffix = Path(os.fspath(text)).suffix if text is not None else ""
    return writable_file(
        text, flag, reserved=reserved_paths(), replacing=_replacing(kind, args, dest, suffix)
    )


def output_stem(
    text: str | os.PathLike | None,
    flag: str,
    suffixes: tuple[str, ...],
    *,
    args: argparse.Namespace | None = None,
) -> Path | None:
    """Files ``STEM + suffix`` the command will write."""
    dest = flag.removeprefix("--").replace("-", "_")
    return writable_stem(
        text,
        flag,
        suffixes,
        reserved=reserved_paths(),
        replacing=lambda suffix: _replacing(None, args, dest, suffix),
    )


@overload
def output_folder(text: str | os.PathLike, flag: str) -> Path: ...
@overload
def output_folder(text: None, flag: str) -> None: ...
def output_folder(text: str | os.PathLike | None, flag: str) -> Path | None:
    """A folder the command will create files in."""
    return writable_folder(text, flag, reserved=reserved_paths())


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
    """``--force``: replace an existing file that is not the command's own earlier output."""
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output file that this command did not write (never one "
        "of its inputs, nor a checkpoint or dataset file)",
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
