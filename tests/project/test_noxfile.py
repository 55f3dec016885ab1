"""The nox sessions: the table step (file names, published values and the smoke caption),
the reproduce and docs sessions, and the lock session's uv command."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
@pytest.mark.parametrize(
    "grid, table",
    [
        ("agrouping-table3", "3,4"),
        ("diml-table1", "1"),
        ("diablo-table1", "1"),
        ("avsl-table1", "1"),
        ("sam-table1", "1"),
    ],
)
def test_tables_are_named_after_the_grid_and_carry_the_published_values(
    noxfile, grid, table, smoke
):
    session = RecordingSession()
    noxfile._grid_tables(session, grid, smoke=smoke)
    outs = sorted(_option(call, "--out") for call in session.calls)
    assert outs == [f"results/tables/{grid}.md", f"results/tables/{grid}.tex"]
    for call in session.calls:
        assert _option(call, "--experiment") == grid + ("-smoke" if smoke else "")
        assert _option(call, "--table") == table and _option(call, "--published").startswith(
            "results/published/"
        )
        assert ("not comparable with the published columns" in _option(call, "--caption")) == smoke


def test_every_paper_has_a_reproduce_session(noxfile):
    import nox.registry

    sessions = set(nox.registry.get())
    assert {
        "tests",
        "lint",
        "tables",
        "lock",
        "reproduce-agrouping",
        "reproduce-diml",
        "reproduce-diablo",
        "reproduce-avsl",
        "reproduce-sam",
    } <= sessions


@pytest.mark.parametrize("smoke", [False, True])
def test_diablo_tables_name_the_published_rows_beside_each_method(noxfile, smoke):
    """DIABLO Table 1 prints binomial + DIABLO twice (N = 8, N = 16): the grid's
    [published] rows reach the table command, one --published-row per published row."""
    session = RecordingSession()
    noxfile._grid_tables(session, "diablo-table1", smoke=smoke)
    for call in session.calls:
        rows = [call[i + 1] for i, arg in enumerate(call) if arg == "--published-row"]
        assert rows == [
            "plain=plain@",
            "diablo=diablo@",
            "diablo=diablo@entries=8",
            "diablo_n16=diablo@entries=16",
        ]


def test_reproduce_diablo_sweeps_the_grid_then_writes_its_tables(noxfile):
    session = RecordingSession()
    session.posargs = ["--smoke", "--workers", "2"]
    noxfile.reproduce_diablo(session)
    sweep, *tables = session.calls
    assert sweep[:6] == ("python", "-m", "harness", "sweep", "--grid", "diablo-table1")
    assert "--smoke" in sweep and _option(sweep, "--workers") == "2"
    assert sorted(_option(call, "--out") for call in tables) == [
        "results/tables/diablo-table1.md",
        "results/tables/diablo-table1.tex",
    ]


def test_fair_table_sweeps_every_registered_method_then_writes_its_tables(noxfile):
    from harness.config.grids import load_grid
    from harness.methods import list_methods

    session = RecordingSession()
    session.posargs = ["--smoke"]
    noxfile.fair_table(session)
    sweep, *tables = session.calls
    assert (
        sweep[:6] == ("python", "-m", "harness", "sweep", "--grid", "fair-roth2020")
        and "--smoke" in sweep
    )
    assert sorted(_option(call, "--out") for call in tables) == [
        "results/tables/fair-roth2020.md",
        "results/tables/fair-roth2020.tex",
    ]
    assert all(_option(call, "--baseline") == "plain" for call in tables)
    for smoke in (False, True):  # a row per method of the `--methods all` list, in both versions
        grid = load_grid("fair-roth2020", smoke=smoke)
        assert {c.method for c in grid.cells} == set(list_methods(ablations=False))
        assert len({c.seed for c in grid.cells}) >= 2 and grid.test_time == {"diml": "plain"}


def test_diml_tables_compare_the_published_rp_with_the_query_in_r_variant(noxfile):
    session = RecordingSession()
    noxfile._grid_tables(session, "diml-table1", smoke=False)
    for call in session.calls:
        mapped = [call[i + 1] for i, arg in enumerate(call) if arg == "--published-metric"]
        assert mapped == [
            "r_precision=r_precision_query_in_r",
            "mean_average_precision_at_r=mean_average_precision_at_r_query_in_r",
        ]
        assert "r_precision_query_in_r" in _option(call, "--metrics")


def test_the_fair_table_smoke_caption_names_no_published_columns(noxfile):
    """The harness's own table has no published values: its smoke caption says it is a
    pipeline check without pointing at columns that do not exist."""
    session = RecordingSession()
    noxfile._grid_tables(session, "fair-roth2020", smoke=True)
    for call in session.calls:
        assert "--published" not in call
        caption = _option(call, "--caption")
        assert "a pipeline check" in caption and "published" not in caption


def test_the_docs_session_writes_the_schemas_and_the_roles_table_before_it_builds_the_site(
    noxfile, tmp_path, monkeypatch
):
    written = []

    class SchemaSession(RecordingSession):
        posargs: list[str] = []

        def run(self, *args, **kwargs):
            super().run(*args, **kwargs)
            if "stdout" in kwargs:
                written.append(kwargs["stdout"].name)

    monkeypatch.setattr(noxfile, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    session = SchemaSession()
    noxfile.docs(session)
    *schemas, roles, build = session.calls
    assert roles[:2] == ("python", "-c") and "write_role_table" in roles[2]
    assert str(tmp_path / "docs" / "writing-a-plugin.md") in roles[2]
    assert schemas == [
        ("python", "-m", "harness", "schema", "protocol"),
        ("python", "-m", "harness", "schema", "grid"),
    ]
    assert written == [
        str(tmp_path / "docs" / "protocol.schema.json"),
        str(tmp_path / "docs" / "grid.schema.json"),
    ]
    assert build[:3] == ("mkdocs", "build", "--strict")


def test_the_lock_session_compiles_pyproject_and_the_test_extra_into_the_lock(
    noxfile, monkeypatch, tmp_path
):
    uv = tmp_path / "uv"  # a uv program on PATH
    uv.write_text("#!/bin/sh\n")
    uv.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    session = RecordingSession()
    session.posargs = ["--upgrade-package", "numpy"]
    noxfile.lock(session)
    (call,) = session.calls
    assert call[:3] == ("uv", "pip", "compile") and "pyproject.toml" in call
    assert _option(call, "--extra") == "test"
    assert _option(call, "--output-file") == "requirements/lock.txt"
    assert _option(call, "--custom-compile-command") == "nox -s lock"  # the lock's header
    assert call[-2:] == ("--upgrade-package", "numpy")


def test_the_lock_session_without_uv_says_to_install_it(noxfile, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no uv program
    monkeypatch.setitem(sys.modules, "uv", None)  # and no uv module

    class Refused(Exception):
        pass

    class LockSession(RecordingSession):
        posargs: list[str] = []

        def error(self, message: str):
            raise Refused(message)

    session = LockSession()
    with pytest.raises(Refused, match="uv, which is not installed: pip install uv"):
        noxfile.lock(session)
    assert session.calls == []


class RunWritingSession(RecordingSession):
    """A session whose ``harness run`` writes the ``--json`` records it was asked for."""

    def run(self, *args, **kwargs):
        super().run(*args, **kwargs)
        if args[3] == "run":
            seeds = _option(args, "--seeds").split(",")
            records = [{"mlflow_run_id": f"{m}-{s}"} for s in seeds for m in ("plain", "sam")]
            Path(_option(args, "--json")).write_text(json.dumps(records))


def test_the_explain_benchmark_trains_explains_each_run_with_sanity_then_tabulates(
    noxfile, tmp_path, monkeypatch
):
    from harness.methods import METHODS

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "explain-benchmark").mkdir(parents=True)
    session = RunWritingSession()
    session.posargs = ["--seeds", "1"]
    noxfile.explain_benchmark(session)
    train, *explains, table = session.calls
    assert _option(train, "--protocol") == "explain" and _option(train, "--seeds") == "1"
    assert _option(train, "--dataset") == "synthetic-closeup"
    methods = _option(train, "--methods").split(",")
    assert all(m in METHODS.list() for m in methods) and "plain" in methods
    assert [_option(call, "--run") for call in explains] == ["plain-1", "sam-1"]
    assert all("--sanity" in call for call in explains)
    assert table[3] == "explain-table" and "--strip" in table
    assert _option(table, "--experiment") == _option(train, "--experiment")
