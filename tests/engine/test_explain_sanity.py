"""``explain --sanity`` on finished runs: the ceiling, floor, method and randomised rows are
printed and recorded, the ground-truth map wins the pointing game, the random map scores
chance, a map that ignores the model is flagged by the randomisation check while one drawn
by the model is not, and ``explain-table`` marks the rows."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch

from harness.base.metric_keys import metric_key
from harness.cli.main import main
from harness.methods import METHODS, register_method
from harness.methods.plain import PlainHead

#: A feature map of 4 x 4 on the tiny protocol, so that maps have places to choose between.
WIDER = ["--set", "backbone.output_stride=16", "--set", "image.size=64", "--set", "image.resize=72"]


class CentreMapHead(PlainHead):
    """``plain`` with maps that ignore the model: a bump at the centre of every image."""

    def pair_maps(self, query, gallery, same):
        grid = torch.tensor([0.0, 1.0, 1.0, 0.0])
        bump = (grid[:, None] * grid[None, :] + 0.1).expand(len(same), 4, 4)
        return bump.clone(), bump.clone()


@pytest.fixture
def centre_map_method():
    register_method("centre-map-test")(CentreMapHead)
    yield "centre-map-test"
    METHODS.remove("centre-map-test")


def _trained(tiny_protocol, workdir, method: str) -> str:
    out = workdir / f"{method}.json"
    # An experiment of the test's own: the strip loads the weights of every run in it.
    experiment = ["--experiment", f"sanity-{workdir.name}"]
    args = [
        "run",
        "--methods",
        method,
        "--protocol",
        str(tiny_protocol),
        "--epochs",
        "0",
        *experiment,
    ]
    assert main([*args, *WIDER, "--json", str(out)]) == 0
    return json.loads(out.read_text())[0]["mlflow_run_id"]


def _explained(run_id: str, workdir, capsys) -> tuple[dict, str]:
    out = workdir / f"sanity-{run_id}.json"
    capsys.readouterr()
    assert (
        main(
            [
                "explain",
                "--run",
                run_id,
                "--pairs",
                "24",
                "--curve-pairs",
                "2",
                "--sanity",
                "--out",
                str(workdir / run_id),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.mark.slow  # 17 s on 2 cores
def test_sanity_rows_verdicts_and_table_marks(workdir, tiny_protocol, centre_map_method, capsys):
    record, printed = _explained(_trained(tiny_protocol, workdir, "agrouping"), workdir, capsys)
    sanity = record["sanity"]
    for line in ("ceiling  ground_truth:", "floor    uniform:", "floor    random:", "method  "):
        assert line in printed, line
    assert "randomised head (method):" in printed and "sanity   method:" in printed

    # The ceiling points at the part; the floors score chance.
    assert sanity["ground_truth"]["pointing_game"] >= 0.9
    chance = record["baseline"]["chance_part_share"]
    lo, hi = sanity["random"]["discriminative_part_share_ci95"]
    assert lo <= chance <= hi
    assert sanity["uniform"]["pointing_game"] == 0.0

    # The cascade: the head first, then the backbone's points from the last to the first.
    stages = [k.removeprefix("randomised ") for k in sanity if k.startswith("randomised ")]
    assert stages[:2] == ["head (method)", "head (baseline)"]
    assert stages[-1] == "s8 (baseline)"
    verdicts = record["sanity_verdicts"]
    assert verdicts["method"]["changes_under_randomisation"] is True
    assert verdicts["baseline"]["changes_under_randomisation"] is True

    # Maps that ignore the model survive its destruction: flagged.
    centre, printed = _explained(
        _trained(tiny_protocol, workdir, centre_map_method), workdir, capsys
    )
    verdict = centre["sanity_verdicts"]["method"]
    assert verdict["changes_under_randomisation"] is False
    # ... and keep their within-object score once the trained parts are re-drawn.
    assert verdict["uses_training"] is False
    assert verdict["training_drop"][0] == pytest.approx(0.0)
    assert "uses training: NO" in printed
    assert centre["sanity"][verdict["fully_randomised"]]["rank_correlation"] == pytest.approx(1.0)
    assert "changes under randomisation: NO" in printed

    run = mlflow.MlflowClient().get_run(centre["run_id"])
    assert run.data.metrics[metric_key("explain", "method_changes_under_randomisation")] == 0.0
    assert metric_key("explain", "sanity_ground_truth_pointing_game") in run.data.metrics

    experiment = mlflow.MlflowClient().get_experiment(run.info.experiment_id).name
    table = ["explain-table", "--experiment", experiment, "--out", str(workdir / "t")]
    assert main([*table, "--strip"]) == 0
    scores_table, cascade = (workdir / "t.md").read_text().split("Cascading randomisation")
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[-2].strip()
        for line in scores_table.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert rows[("reference", "uniform on the object (chance)")] == ""
    assert "| agrouping | own maps |" in cascade
    assert "unchanged" in rows[(centre_map_method, "own maps")]
    assert "unchanged" not in rows[("agrouping", "own maps")]
    assert " & Sanity \\\\" in (workdir / "t.tex").read_text()

    # The strip: the same pair under every method's maps, one column per run.
    strip = workdir / "t.strip.png"
    assert strip.is_file() and strip.stat().st_size > 10_000
    assert main([*table, "--strip"]) == 0  # the harness's own outputs: written over
    strip.write_bytes(strip.read_bytes() + b"edited")
    assert main([*table, "--strip"]) == 2  # changed since: refused without --force
