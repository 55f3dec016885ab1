"""``harness rerun``: a run trained again from its record alone. A recorded package version
that differs is named in the first table and the rerun still gives its verdict; other data
is refused in one line before anything trains; every bad input is one line, exit 2."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import mlflow
import pytest

from harness.cli.main import main
from harness.store.provenance import commit_in_history, git_commit

TINY_PROTOCOL = Path(__file__).parents[1] / "protocols" / "tiny.toml"


def _client(store: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, data_root) -> dict:
    """A store of its own (database and artifacts in one folder) holding one tiny run of
    ``plain``."""
    root = tmp_path_factory.mktemp("rerun")
    store, experiment = root / "store", f"rerun-{uuid.uuid4().hex[:6]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
        argv = ["run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL)]
        out = root / "run.json"
        assert main([*argv, "--experiment", experiment, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    return {
        "root": root,
        "store": store,
        "experiment": experiment,
        "run_id": record["mlflow_run_id"],
    }


@pytest.fixture
def copied(recorded, tmp_path, monkeypatch) -> Path:
    """A copy of the recorded store, the tracking URI pointed at it and the working folder
    in ``tmp_path``; the original is moved away meanwhile, so the copy's artifacts serve."""
    copy = tmp_path / "copy"
    shutil.copytree(recorded["store"], copy)
    away = recorded["root"] / "away"
    recorded["store"].rename(away)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{copy / 'mlflow.db'}")
    yield copy
    away.rename(recorded["store"])


def _runs(store: Path, experiment: str) -> list:
    client = _client(store)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def test_a_changed_package_version_is_named_first_and_the_rerun_still_judged(
    recorded, copied, capsys
):
    run_id = recorded["run_id"]
    _client(copied).set_tag(run_id, "version.torch", "0.0.1")
    assert main(["rerun", run_id]) == 0
    out, err = capsys.readouterr()
    first_table = err.split("\n\n")[0]
    assert "what differs between the record and this machine" in first_table
    assert "| package torch | 0.0.1 |" in first_table
    assert err.index("| package torch |") < err.index("epoch 1/")  # before anything trains
    (row,) = [line for line in out.splitlines() if run_id in line]
    verdict = row.split(" | ")[2]
    assert verdict in ("IDENTICAL", "WITHIN NOISE"), row
    (rerun,) = _runs(copied, recorded["experiment"] + "-reruns")
    assert rerun.data.tags["rerun_of"] == run_id
    original = _client(copied).get_run(run_id).data.tags
    assert json.loads(original["reruns"]) == {verdict: 1} and original["rerun.last"] == verdict
    comparison = _client(copied).download_artifacts(rerun.info.run_id, "rerun/comparison.json")
    saved = json.loads(Path(comparison).read_text())
    assert saved["verdict"] == verdict
    assert {"name": "package torch", "recorded": "0.0.1"}.items() <= saved["differences"][0].items()


def test_other_data_is_refused_in_one_line_before_anything_trains(recorded, copied, capsys):
    run_id = recorded["run_id"]
    _client(copied).set_tag(run_id, "split_digest", "0" * 16)
    assert main(["rerun", run_id]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "split digest" in err[0]
    assert "--allow-data-change" in err[0]
    assert _runs(copied, recorded["experiment"] + "-reruns") == []


def test_a_commit_outside_this_checkout_is_refused_unless_allowed(recorded, copied, capsys):
    if commit_in_history(git_commit().removesuffix("-dirty")) is None:
        pytest.skip("the harness runs from no git checkout here: commits cannot be looked up")
    run_id = recorded["run_id"]
    _client(copied).set_tag(run_id, "git_commit", "f" * 40)
    assert main(["rerun", run_id]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in this checkout's history" in err[0], err
    assert "--allow-code-change" in err[0]
    assert _runs(copied, recorded["experiment"] + "-reruns") == []


def _running_run(store: Path, experiment: str) -> str:
    client = _client(store)
    return client.create_run(client.get_experiment_by_name(experiment).experiment_id).info.run_id


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rerun", "0123456789abcdef"], "no run '0123456789abcdef' in the tracking store"),
        (["rerun"], "give run ids, --experiment NAME or --table EXPERIMENT"),
        (["rerun", "--table", "no-such-table"], "no MLflow experiment 'no-such-table'"),
        (["rerun", "--experiment", "no-such-experiment"], "no experiment 'no-such-experiment'"),
        (["rerun", "--filter", "params.method = 'plain'"], "--filter selects runs of --experiment"),
        (
            ["rerun", "--experiment", "{experiment}", "--filter", "params.method = = 'x'"],
            "MLflow rejects it",
        ),
        (["rerun", "{running}"], "is still RUNNING"),
    ],
)
def test_bad_input_is_one_line(recorded, copied, capsys, argv, message):
    running = _running_run(copied, recorded["experiment"]) if "{running}" in argv else ""
    argv = [a.format(experiment=recorded["experiment"], running=running) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert _runs(copied, recorded["experiment"] + "-reruns") == []


@pytest.mark.slow
def test_a_table_rerun_marks_every_reproduced_cell(recorded, copied, capsys):
    assert main(["rerun", "--table", recorded["experiment"]]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL 1, WITHIN NOISE 0, DIFFERS 0" in out
    table = out.split("IDENTICAL 1, WITHIN NOISE 0, DIFFERS 0")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "(n=" in line]
    # Every run's cell, the chance row aside (random embeddings: nothing to rerun).
    runs = [row for row in rows if not row.startswith("| Chance (random embeddings)")]
    cells = [cell for row in runs for cell in row.split(" | ")[1:]]
    assert cells and all("✓ (n=1)" in cell for cell in cells), table
    assert len(runs) < len(rows)  # the chance row is printed, unmarked
    assert "✓ cells whose every run was trained again from its record" in table


@pytest.mark.slow
def test_a_run_of_three_methods_reruns_identical_float_for_float(
    tmp_path, monkeypatch, capsys, data_root
):
    """``run --methods plain,agrouping,diml`` on the tiny protocol, then ``rerun
    --experiment``: IDENTICAL for every run (DIML evaluated on the rerun of plain)."""
    experiment = f"rerun-three-{uuid.uuid4().hex[:6]}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    methods = "plain,agrouping,diml"
    argv = [
        "run",
        "--methods",
        methods,
        "--protocol",
        str(TINY_PROTOCOL),
        "--experiment",
        experiment,
    ]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["rerun", "--experiment", experiment]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "seed 0" in line]
    assert len(rows) == 3 and all(" | IDENTICAL | " in row for row in rows), out
    assert "IDENTICAL 3, WITHIN NOISE 0, DIFFERS 0" in out


@pytest.mark.slow
def test_a_shared_diml_run_reruns_alone_from_the_original_plain_weights(
    tmp_path, monkeypatch, capsys, data_root
):
    """``rerun`` of DIML's run alone: it starts from the original ``plain`` run's weights,
    looked for under the checkpoint root where that run keeps them (its own checkpoints go
    under ``reruns/``)."""
    experiment = f"rerun-diml-{uuid.uuid4().hex[:6]}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    records = tmp_path / "records.json"
    argv = ["run", "--methods", "plain,diml", "--protocol", str(TINY_PROTOCOL)]
    assert main([*argv, "--experiment", experiment, "--json", str(records)]) == 0
    (diml,) = [r for r in json.loads(records.read_text()) if r["method"] == "diml"]
    capsys.readouterr()
    assert main(["rerun", diml["mlflow_run_id"]]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL 1, WITHIN NOISE 0, DIFFERS 0" in out, out
