"""User-facing errors: one clear line, non-zero exit (see ``harness.cli.main``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["HarnessError", "NonFiniteLoss", "unknown_name"]


class HarnessError(Exception):
    """An error caused by the user's input; the CLI prints ``str(err)`` and exits 2."""


class NonFiniteLoss(HarnessError):
    """A run's loss became NaN or infinite: the setting diverged (a search's trial ends
    with it; the study goes on)."""


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> HarnessError:
    """``unknown method 'agroup'; did you mean 'agrouping'? valid: ...``."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return HarnessError(f"unknown {kind} '{name}'{hint} valid: {', '.join(valid)}")
