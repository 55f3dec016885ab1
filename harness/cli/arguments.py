"""Argument types of the command line: each refuses a bad value while the arguments are
parsed, so that the refusal is argparse's one ``error:`` line (``harness.cli.main``) and
comes before any work."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from harness.base.errors import HarnessError

__all__ = [
    "at_least",
    "positive_number",
    "int_list",
    "name_list",
    "model_name",
    "experiment_name",
    "file_name",
    "default_file_name",
    "EXPERIMENT_NAME_MAX",
    "TABLE_NAME_MAX",
    "dataset_label",
    "DATASET_HELP",
    "EMBEDDED_DEFAULT",
    "SEED_LIMIT",
]

#: ``--dataset``'s help, the same for every command that takes it.
DATASET_HELP = (
    "a built-in dataset's name, or your own images by their path: a folder of class "
    "folders or a .csv with open-metric-learning's columns (docs/own-data.md)"
)

#: The dataset ``run`` uses when none is named (generated on first use, CPU-sized).
EMBEDDED_DEFAULT = "synthetic"

#: Seeds are below this: numpy's and torch's generators take 32-bit seeds.
SEED_LIMIT = 2**32


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer >= ``minimum`` (``--workers``: 0; ``--trials``: 1), and <= ``maximum``
    when given (``--epochs``: 100000)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bound = f" and <= {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}{bound}, got '{text}'"
            )
        return value

    return parse


def positive_number(text: str) -> float:
    """A finite number > 0 (a timeout in seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got '{text}'")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated seeds, at least one, each once: integers from 0 to 2**32 - 1
    (``0,1,2``). A seed given twice would train the same run twice and report an interval
    over copies."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 0 like 0,1,2, got '{text}'"
        )
    values = [int(x) for x in parts]
    if max(values) >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(
            f"expected integers >= 0 and < 2**32 ({SEED_LIMIT}), got '{text}'"
        )
    _once(values, text)
    return values


def name_list(text: str) -> list[str]:
    """Comma-separated names, at least one, each once: ``plain,diml``."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected one or more comma-separated names, got '{text}'"
        )
    _once(names, text)
    return names


def _once(values: list, text: str) -> None:
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise argparse.ArgumentTypeError(f"'{twice}' is given twice in '{text}'")


#: The longest experiment name MLflow takes (``mlflow.utils.validation``'s
#: ``MAX_EXPERIMENT_NAME_LENGTH``); a longer one is refused before any work.
EXPERIMENT_NAME_MAX = 500
#: The longest name of a table's file stem, in bytes: room for what is written beside it
#: (``.settings.tex``, ``.forest.pdf``, ``.strip.png``) within a file name's 255 bytes.
TABLE_NAME_MAX = 200


def experiment_name(text: str) -> str:
    """An MLflow experiment name: not empty (an empty one would mean the default
    experiment), at most :data:`EXPERIMENT_NAME_MAX` characters."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected an experiment name, got '{text}'")
    if len(text) > EXPERIMENT_NAME_MAX:
        raise argparse.ArgumentTypeError(
            f"the name '{text[:24]}...' is {len(text):,} characters long; expected at most "
            f"{EXPERIMENT_NAME_MAX} (MLflow's limit)"
        )
    return text


def file_name(text: str) -> str:
    """A name the command makes a file name of (``table --name``): not empty, no path
    separator, not ``.`` or ``..`` (the file would land outside its folder), at most
    :data:`TABLE_NAME_MAX` bytes."""
    name = text.strip()
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise argparse.ArgumentTypeError(
            f"expected a file name without '/', '\\' or '..' alone, got '{text}'"
        )
    size = len(os.fsencode(name))
    if size > TABLE_NAME_MAX:
        raise argparse.ArgumentTypeError(
            f"the name '{name[:24]}...' is {size:,} bytes long; expected at most "
            f"{TABLE_NAME_MAX} (a file name, with room for the files beside it)"
        )
    return name


def default_file_name(experiments: list[str], joiner: str, flag: str = "--name") -> str:
    """The file name a table takes from its experiments when ``--name`` is not given: a
    path separator becomes ``_``; a name too long for a file is refused, asking for
    ``flag``."""
    name = joiner.join(experiments).replace("/", "_").replace("\\", "_")
    if name in (".", ".."):
        name = name.replace(".", "_")
    if len(os.fsencode(name)) > TABLE_NAME_MAX:
        raise HarnessError(
            f"the experiments' names make a file name of {len(os.fsencode(name)):,} bytes, "
            f"more than {TABLE_NAME_MAX}; give {flag} NAME"
        )
    return name


def model_name(text: str) -> str:
    """A name for MLflow's model registry: not empty, without ``/`` or ``:``, which would
    break the ``models:/NAME/VERSION`` URI that loads it."""
    name = text.strip()
    if not name or "/" in name or ":" in name:
        raise argparse.ArgumentTypeError(f"expected a model name without '/' or ':', got '{text}'")
    return name


def dataset_label(text: str) -> str:
    """``--dataset-name``: the short name tables and MLflow give a dataset given by its
    path; not empty and without a path separator (it names the default experiment and
    the run's folders)."""
    name = text.strip()
    if not name or "/" in name or "\\" in name:
        raise argparse.ArgumentTypeError(f"expected a name without '/' or '\\', got '{text}'")
    return name
