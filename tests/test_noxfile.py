"""The nox sessions' table step: file names, published values and the smoke caption."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def noxfile():
    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("harness_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordingSession:
    def __init__(self):
        self.calls: list[tuple[str, ...]] = []

    def run(self, *args, **kwargs):
        self.calls.append(args)


def _option(call: tuple[str, ...], flag: str) -> str:
    return call[call.index(flag) + 1]


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("grid, table", [("agrouping-table3", "3,4"), ("diml-table1", "1")])
def test_tables_are_named_after_the_grid_and_carry_the_published_values(noxfile, grid, table, smoke):
    session = RecordingSession()
    noxfile._grid_tables(session, grid, smoke=smoke)
    outs = sorted(_option(call, "--out") for call in session.calls)
    assert outs == [f"results/tables/{grid}.md", f"results/tables/{grid}.tex"]
    for call in session.calls:
        assert _option(call, "--experiment") == grid + ("-smoke" if smoke else "")
        assert _option(call, "--table") == table and _option(call, "--published").startswith("results/published/")
        assert ("not comparable with the published columns" in _option(call, "--caption")) == smoke


def test_every_paper_has_a_reproduce_session(noxfile):
    import nox.registry

    sessions = set(nox.registry.get())
    assert {"tests", "lint", "tables", "reproduce-agrouping", "reproduce-diml"} <= sessions
