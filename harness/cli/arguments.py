"""Argument types of the command line: each refuses a bad value while the arguments are
parsed, so that the refusal is argparse's one ``error:`` line (``harness.cli.main``) and
comes before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least", "positive_number", "int_list", "name_list", "model_name"]


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum`` (``--workers``: 0; ``--trials``: 1)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got '{text}'")
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
    """Comma-separated integers >= 0, at least one: ``0,1,2`` (seeds, K values)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 like 0,1,2, got '{text}'")
    return [int(x) for x in parts]


def name_list(text: str) -> list[str]:
    """Comma-separated names, at least one: ``plain,diml``."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated names, got '{text}'")
    return names


def model_name(text: str) -> str:
    """A name for MLflow's model registry: not empty, without ``/`` or ``:``, which would
    break the ``models:/NAME/VERSION`` URI that loads it."""
    name = text.strip()
    if not name or "/" in name or ":" in name:
        raise argparse.ArgumentTypeError(f"expected a model name without '/' or ':', got '{text}'")
    return name
