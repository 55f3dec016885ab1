"""The code stays readable in pieces: no module of the package, its tests or benchmarks over
600 lines. (That tests build on public names only: ``test_public_names.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE_LINES = 600
FOLDERS = ("harness", "tests", "benchmarks")


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_is_longer_than_600_lines(folder):
    long = {
        str(path.relative_to(REPO)): n
        for path in _modules(folder)
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
