"""The code stays readable in pieces: no module of the package, its tests or benchmarks over
600 lines, and no test reaching into the engine's private names (the engine's public
pieces, ``Trainer`` and the recorders, are what tests and plugins build on)."""

from __future__ import annotations

import ast
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


def _private_engine_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.engine"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if "._" in a.name and "harness.engine" in a.name]
    return found


def test_no_test_imports_a_private_name_of_the_engine():
    offenders = {
        str(path.relative_to(REPO)): names
        for path in _modules("tests")
        if (names := _private_engine_imports(path))
    }
    assert not offenders


def test_the_private_import_check_finds_one(tmp_path):
    """The check above can fail: a module importing a private engine name is reported."""
    sample = tmp_path / "test_sample.py"
    sample.write_text("from harness.engine.trainer import _step, Trainer\n")
    assert _private_engine_imports(sample) == ["harness.engine.trainer._step"]
