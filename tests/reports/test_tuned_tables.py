"""A tuned grid's tables from its runs in the tracking store (final runs written straight
into it, no training): a one-fold grid's table, the two reports of a k-fold grid, the
fold models' own experiment as a table (a row per fold), and the whole table set of a
sweep written as one (a full disk leaves the previous set as it was)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Metric, Param

from harness.base import atomic
from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.base.written import RECORD_NAME
from harness.cli.faults import fault_train
from harness.cli.main import main
from harness.cli.sweep_tuned import write_tuned_tables
from harness.config.grids import load_grid
from harness.store.location import tracking_uri

TUNED = Path(__file__).resolve().parents[1] / "grids" / "tiny-tuned.toml"
BUDGET = "2 trials (Optuna's TPE, random until 10 are settled) x 2 class-disjoint folds"
SEEDS = (0, 1, 2)
#: Each method's R@1 at seed 0 and its rise per seed (the paired differences vary).
METHODS = {"plain": (0.50, 0.010), "ngrouping": (0.55, 0.013)}


def _final(client, exp_id: str, method: str, seed: int, r1: float, **tags: str) -> None:
    """A tuned grid's final run (or result) of ``method`` and ``seed``, with ``tags``: its
    tags given as it is created, its metrics in one batch (a few store calls per run)."""
    tags = {
        "method": method,
        "loss": "margin",
        "dataset": "cub200",
        "seed": str(seed),
        "fingerprint": "fp-final",
        "deviations": "none",
        "test_set_selection": "False",
        "evaluation_code": "code1",
        "selection": "validation",
        "tune_role": "final",
        "tune_budget": BUDGET,
        "tune_trials": "2",
        "tune_params": json.dumps({"loss.args.margin.margin": 0.2}),
        "tune_history": json.dumps([0.1, 0.2]),
        "tune_study": f"tune:g:resnet50/margin/{method}/cub200:k",
        "tune_protocol": "searched-under",
        **tags,
    }
    run_id = client.create_run(exp_id, tags=tags).info.run_id
    client.log_batch(
        run_id,
        metrics=[
            Metric(metric_key("test", "recall_at_1"), r1, 0, 0),
            Metric(metric_key("test", "nmi"), 0.5 + r1 / 10, 0, 0),
        ],
        params=[Param("protocol.backbone.name", "resnet50")],
    )
    client.set_terminated(run_id, status="FINISHED")


@pytest.fixture(scope="module")
def tuned_store(tracking_dir) -> dict[str, str]:
    """Three experiments of final runs: a one-fold grid's (``single``: no ``tune_report``),
    a two-fold grid's two reports (``grid``) and its fold models (``folds``: fold 0 and 1
    of each seed, their fingerprints apart as their splits are)."""
    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    prefix = f"tuned-tables-{uuid.uuid4().hex[:8]}"
    names = {kind: f"{prefix}-{kind}" for kind in ("single", "grid", "folds")}
    ids = {kind: client.create_experiment(name) for kind, name in names.items()}
    for method, (r1, rise) in METHODS.items():
        for seed in SEEDS:
            value = r1 + seed * rise
            _final(client, ids["single"], method, seed, value, tune_fold="validation")
            for report, shift in (("separated", 0.0), ("concatenated", 0.01)):
                _final(
                    client,
                    ids["grid"],
                    method,
                    seed,
                    value + shift,
                    tune_fold="all",
                    tune_report=report,
                )
            for fold in (0, 1):
                _final(
                    client,
                    ids["folds"],
                    method,
                    seed,
                    value - fold / 50,
                    tune_fold=str(fold),
                    fingerprint=f"fp-fold{fold}",
                )
    return names


@pytest.mark.parametrize("kind", ["single", "folds"])
def test_the_concatenated_report_tables_a_one_fold_grid_and_the_fold_models(
    tuned_store, kind, workdir, capsys
):
    out = workdir / f"{kind}.md"
    argv = ["table", "--experiment", tuned_store[kind], "--report", "concatenated"]
    assert main([*argv, "--format", "markdown", "--out", str(out)]) == 0
    text = out.read_text()
    assert "each cell is the mean over seeds of one model per seed" in text
    if kind == "single":
        assert "| ngrouping [tuned] |" in text and "(n=3)" in text
        return
    # One row per fold, each of one model per seed, each against the baseline's same fold.
    for fold in (0, 1):
        assert f"| plain [tuned, fold {fold}] |" in text
        assert f"ngrouping [tuned, fold {fold}] vs " in text
    assert "(n=3)" in text and "(n=6)" not in text


def _table_set(folder: Path) -> dict[str, bytes]:
    """The set's files (the record of what the harness wrote aside)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != RECORD_NAME}


def test_a_sweeps_tables_are_one_set_that_a_full_disk_leaves_as_it_was(
    tuned_store, workdir, monkeypatch
):
    grid = dataclasses.replace(load_grid(TUNED), experiment=tuned_store["grid"])
    folder = workdir / "tables"
    written = write_tuned_tables(grid, folder)
    before = _table_set(folder)
    assert {p.name for p in written} == set(before)
    for stem in ("tiny-tuned", "tiny-tuned-concatenated"):
        assert {f"{stem}.md", f"{stem}.tex", f"{stem}.settings.md", f"{stem}.search.png"} <= set(
            before
        )
    assert b"(concatenated fold models)" in before["tiny-tuned-concatenated.md"]
    # A full disk at the last file of the set: no file of the set replaced, none left over.
    monkeypatch.setattr(atomic, "sync_to_disk", atomic.sync_to_disk)  # restored afterwards
    fault_train("write:tiny-tuned-concatenated.settings.tex:1:enospc")
    again = dataclasses.replace(grid, description="a second caption")
    with pytest.raises(HarnessError, match="No space left on device"):
        write_tuned_tables(again, folder)
    assert _table_set(folder) == before
    assert not list(folder.glob(".*.tmp"))
    write_tuned_tables(again, folder)
    assert b"a second caption" in (folder / "tiny-tuned.md").read_bytes()


def test_a_one_fold_sweep_writes_its_tables(tuned_store, workdir):
    grid = dataclasses.replace(load_grid(TUNED, smoke=True), experiment=tuned_store["single"])
    assert grid.tune is not None and grid.tune.folds == 1
    written = {p.name for p in write_tuned_tables(grid, workdir / "tables")}
    assert {
        "tiny-tuned-smoke.md",
        "tiny-tuned-smoke.tex",
        "tiny-tuned-smoke.settings.md",
    } <= written
    assert not any("concatenated" in name for name in written)
    text = (workdir / "tables" / "tiny-tuned-smoke.md").read_text()
    assert "one model per seed" in text
