"""The code's form is checked, not only declared: ``ruff format`` has nothing to change,
``ruff check`` (pyproject.toml's ``[tool.ruff]``) finds nothing, and the type checker
(``[tool.mypy]``, at the strictness stated there) passes over ``harness/`` and the plugins.
The same three run before a commit (``.pre-commit-config.yaml``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> list[str]:
    """The tool from this interpreter's environment (``python -m``), as the [test] extra
    installs it."""
    pytest.importorskip(name, reason=f"{name} is in the [test] extra")
    return [sys.executable, "-m", name]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_formatter_has_nothing_to_change():
    done = _run([*_tool("ruff"), "format", "--check", "--diff", "."])
    assert done.returncode == 0, f"run `ruff format .`:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"


def test_the_linter_finds_nothing():
    done = _run([*_tool("ruff"), "check", "--output-format", "concise", "."])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_type_checker_passes(tmp_path):
    cache = tmp_path / "mypy-cache"
    done = _run([*_tool("mypy"), "--cache-dir", str(cache)])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Success" in done.stdout


def test_the_pre_commit_hooks_run_the_same_checks():
    text = (REPO / ".pre-commit-config.yaml").read_text()
    for hook in ("ruff format", "ruff check", "mypy"):
        assert hook in text, f".pre-commit-config.yaml lacks {hook}"
