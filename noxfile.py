"""nox sessions: tests, lint (reproduction sessions arrive with the grids)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The test suite in the current environment (fast tests; pass -m slow for the rest)."""
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", "harness", "methods", "tests", "benchmarks", "noxfile.py")
