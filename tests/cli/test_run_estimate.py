"""The estimate ``run`` prints before its first run: within a factor 2 of the run's time
on a dataset in an official layout, and on a CPU, over an hour, a refusal of one line
that leaves nothing behind unless ``--yes`` is given."""

from __future__ import annotations

import time
import uuid

import mlflow
import pytest
import torch

from harness.base.errors import HarnessError
from harness.cli.estimates import GATE_SECONDS, refusal
from harness.cli.main import build_parser, main
from harness.cli.run import cmd_run
from harness.config.protocol_files import load_protocol
from harness.engine import RunConfig, training_splits
from harness.engine.run.estimate import CostPart, Estimate, MethodCost, PlannedRun, estimate_runs
from harness.methods import list_methods
from tests.fixtures import make_cub

pytestmark = pytest.mark.usefixtures("estimates")


def _runs(experiment: str) -> list:
    exp = mlflow.MlflowClient().get_experiment_by_name(experiment)
    return [] if exp is None else mlflow.MlflowClient().search_runs([exp.experiment_id])


def _costly(seconds: float = 38 * 3600) -> Estimate:
    """An estimate of ``seconds`` on the CPU, most of it AVSL's exhaustive ranking."""
    parts = (
        CostPart(
            "ranking", "avsl's exhaustive ranking of 60,502 x 60,502 test pairs", seconds - 60
        ),
        CostPart("training", "avsl's training of 1 epochs x 3 batches", 60),
    )
    top_k = "declare a top-K re-ranking deviation with --set methods.avsl.rank=rerank"
    return Estimate("cpu", (MethodCost("avsl", 1, 1, parts, top_k),), 1.5)


def test_the_estimate_is_within_a_factor_two_of_the_runs_time(workdir, tiny_protocol, capsys):
    """``plain`` under the tiny protocol, 4 epochs of 8 batches, on a CUB tree of JPEGs."""
    data = make_cub(workdir / "data")
    made: list[tuple[Estimate, float]] = []

    def recorded(runs, device, **kw):
        found = estimate_runs(runs, device, **kw)
        made.append((found, time.perf_counter()))
        return found

    argv = ["run", "--methods", "plain", "--dataset", "cub200", "--data-root", str(data)]
    argv += ["--protocol", str(tiny_protocol), "--device", "cpu", "--epochs", "4"]
    argv += ["--set", "sampling.batches_per_epoch=8", "--experiment", uuid.uuid4().hex[:8]]
    # One thread: on cores shared with other work a second thread's stalls at each kernel's
    # end multiply a step's time by whatever the other work does at that moment.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cmd_run(build_parser().parse_args(argv), estimate=recorded) == 0
    finally:
        torch.set_num_threads(threads)
    took = time.perf_counter() - made[0][1]
    estimate = made[0][0]
    with capsys.disabled():  # shown with -s
        print(
            f"\nestimate {estimate.seconds:.1f} s, run {took:.1f} s: {took / estimate.seconds:.2f}"
        )
    assert 0.5 <= took / estimate.seconds <= 2.0, (took, estimate)
    err = capsys.readouterr().err
    assert estimate.line() in err and "estimate: about " in estimate.line()
    assert estimate.warm_up_seconds < 10


def test_over_an_hour_on_a_cpu_is_one_line_and_leaves_nothing(workdir, tiny_protocol, capsys):
    experiment, checkpoints = uuid.uuid4().hex[:8], workdir / "checkpoints"
    argv = ["run", "--methods", "plain", "--protocol", str(tiny_protocol), "--device", "cpu"]
    argv += ["--epochs", "100000", "--experiment", experiment]
    argv += ["--checkpoint-root", str(checkpoints), "--json", str(workdir / "out.json")]
    capsys.readouterr()
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: estimated ") and " on cpu for 1 run, most of it " in lines[0]
    assert "pass --yes to run it anyway" in lines[0]
    assert _runs(experiment) == []
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert not (workdir / "out.json").exists()


def test_yes_runs_what_the_estimate_puts_over_an_hour(workdir, tiny_protocol, capsys):
    experiment = uuid.uuid4().hex[:8]
    argv = ["run", "--methods", "plain", "--protocol", str(tiny_protocol), "--device", "cpu"]
    argv += ["--epochs", "0", "--experiment", experiment]
    costly = _costly()
    with pytest.raises(HarnessError, match="pass --yes"):
        cmd_run(build_parser().parse_args(argv), estimate=lambda *a, **k: costly)
    assert _runs(experiment) == []
    assert (
        cmd_run(build_parser().parse_args([*argv, "--yes"]), estimate=lambda *a, **k: costly) == 0
    )
    assert len(_runs(experiment)) == 1
    assert costly.line() in capsys.readouterr().err


def test_the_refusal_names_the_costliest_part_and_the_top_k_deviation():
    line = refusal(_costly())
    assert line.startswith("estimated 38 h on cpu for 1 run, most of it avsl's exhaustive ")
    assert "60,502 x 60,502" in line and "pass --yes to run it anyway" in line
    assert line.endswith(
        "or declare a top-K re-ranking deviation with --set methods.avsl.rank=rerank"
    )
    assert "\n" not in line
    assert refusal(_costly(GATE_SECONDS - 1)).startswith("estimated 59 min 59 s on cpu")


def test_the_warm_up_measures_every_registered_method(workdir, tiny_protocol):
    """Each registered method's warm-up (its trainer built, its steps, its embedding and
    ranking) works on the tiny protocol: every method is counted, none left out. The other
    tests run their commands without the warm-up (``DML_HARNESS_ESTIMATE=0``)."""
    protocol = load_protocol(tiny_protocol).for_dataset("synthetic")
    splits = training_splits(protocol, "synthetic", None, seed=0)
    methods = list_methods()
    runs = [
        PlannedRun(
            RunConfig.build(protocol, method=m, dataset="synthetic", loss="margin", seed=0), splits
        )
        for m in methods
    ]
    found = estimate_runs(runs, torch.device("cpu"), workers=0)
    assert found.unmeasured == ()
    assert [m.method for m in found.methods] == methods
    for cost in found.methods:
        kinds = {part.kind for part in cost.parts}
        assert {"training", "embedding"} <= kinds, (cost.method, kinds)
        assert all(part.seconds > 0 for part in cost.parts), cost


def test_without_the_estimate_a_run_starts_at_once_and_a_bad_setting_is_one_line(
    workdir, tiny_protocol, monkeypatch, capsys
):
    experiment = uuid.uuid4().hex[:8]
    argv = ["run", "--methods", "plain", "--protocol", str(tiny_protocol), "--device", "cpu"]
    argv += ["--epochs", "0", "--experiment", experiment]
    monkeypatch.setenv("DML_HARNESS_ESTIMATE", "no")
    capsys.readouterr()
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [
        "error: DML_HARNESS_ESTIMATE must be 1 (estimate before the first run) or 0, not 'no'"
    ]
    assert _runs(experiment) == []
    monkeypatch.setenv("DML_HARNESS_ESTIMATE", "0")
    assert main(argv) == 0
    assert "estimate:" not in capsys.readouterr().err
    assert len(_runs(experiment)) == 1
