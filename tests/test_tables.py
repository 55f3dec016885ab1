"""``harness.tables``: layout, bold best, published values and differences, the
deviation mark, refusing mixed protocol fingerprints, and the ``table`` command over
runs written straight into a temporary MLflow store (no training)."""

from __future__ import annotations

import argparse
import math
import uuid
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from harness.errors import HarnessError
from harness.tables import (
    CELL_COLUMNS,
    add_table_parser,
    attach_published,
    load_published,
    render_latex,
    render_markdown,
    summarize,
)

PUBLISHED = Path(__file__).resolve().parents[1] / "results" / "published" / "agrouping.csv"


def _runs(rows: list[dict]) -> pd.DataFrame:
    base = {"run_id": "r", "experiment": "e", "backbone": "resnet50", "loss": "margin", "dataset": "cub200",
            "seed": "0", "fingerprint": "fpA", "deviations": "none", "test_set_selection": False,
            "evaluation_code": "code1", "setting": ""}
    return pd.DataFrame([{**base, **r} for r in rows])


def _two_methods() -> pd.DataFrame:
    return _runs([
        {"method": "ngrouping", "seed": "0", "test_recall_at_1": 0.60, "test_nmi": 0.70},
        {"method": "ngrouping", "seed": "1", "test_recall_at_1": 0.62, "test_nmi": 0.72},
        {"method": "agrouping", "seed": "0", "test_recall_at_1": 0.65, "test_nmi": 0.69},
        {"method": "agrouping", "seed": "1", "test_recall_at_1": 0.67, "test_nmi": 0.69},
    ])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_table_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_summarize_mean_std_in_percent():
    cells = summarize(_two_methods(), ["recall_at_1", "nmi"])
    row = cells[(cells.method == "ngrouping") & (cells.metric == "recall_at_1")].iloc[0]
    assert row["mean"] == pytest.approx(61.0) and row["std"] == pytest.approx(math.sqrt(2.0))
    assert row["half_width"] == pytest.approx(scipy_stats.t.ppf(0.975, 1) * math.sqrt(2.0) / math.sqrt(2.0))
    assert row["n"] == 2 and not row["flagged"] and not row["code_flagged"]


def test_mixed_fingerprints_in_one_block_are_refused_naming_both():
    runs = _two_methods()
    runs.loc[3, "fingerprint"] = "fpB"
    with pytest.raises(HarnessError) as err:
        summarize(runs)
    text = str(err.value)
    assert "fpA" in text and "fpB" in text and "resnet50 + margin on cub200" in text
    assert "\n" not in text


def test_different_fingerprints_in_different_blocks_are_fine():
    runs = _two_methods()
    other = _two_methods().assign(dataset="cars196", fingerprint="fpC")
    assert len(summarize(pd.concat([runs, other], ignore_index=True))) == 2 * 2 * 2


def test_markdown_layout_bold_best_published_and_difference():
    cells = summarize(_two_methods(), ["recall_at_1", "nmi"])
    published = pd.DataFrame([
        {"backbone": "resnet50", "loss": "margin", "method": "ngrouping", "dataset": "cub200",
         "metric": "recall_at_1", "value": 63.09},
        {"backbone": "resnet50", "loss": "margin", "method": "agrouping", "dataset": "cub200",
         "metric": "recall_at_1", "value": 65.50},
    ])
    text = render_markdown(attach_published(cells, published), metrics=["recall_at_1", "nmi"])
    lines = text.splitlines()
    assert lines[0] == "| Method | CUB-200-2011 R@1 | CUB-200-2011 NMI |"
    assert lines[2].startswith("| *ResNet-50 + Margin* |")
    n_row = next(line for line in lines if line.startswith("| N-grouping"))
    a_row = next(line for line in lines if line.startswith("| A-grouping"))
    # rows in first-appearance order, best per column bold, published beside with difference
    assert lines.index(n_row) < lines.index(a_row)
    # two seeds: 95% t half-width 12.71, every interval overlaps the best one's: tied, none bold
    assert "61.00 ± 12.71≈ (n=2) / 63.09 (-2.09)" in n_row and "71.00 ± 12.71≈ (n=2)" in n_row
    assert "66.00 ± 12.71≈ (n=2) / 65.50 (+0.50)" in a_row and "69.00 ± 0.00≈ (n=2)" in a_row
    assert "**" not in n_row + a_row and "†" not in text and "§" not in text


def test_deviation_and_test_selection_are_marked_with_a_footnote():
    runs = _two_methods()
    runs.loc[0, "deviations"] = "schedule.epochs: 150 -> 1"
    runs.loc[[2, 3], "test_set_selection"] = True
    cells = attach_published(summarize(runs, ["recall_at_1"]), None)
    text = render_markdown(cells, deviations=["schedule.epochs: 150 -> 1", "test-set model selection"])
    rows = [line for line in text.splitlines() if line.startswith("| N-") or line.startswith("| A-")]
    assert all("†" in r for r in rows)
    assert "† runs with protocol deviations or test-set model selection (schedule.epochs: 150 -> 1" in text
    latex = render_latex(cells, deviations=["schedule.epochs: 150 -> 1", "loss.args: {'m': 0.1} -> {'m': 1e-3}"])
    assert "$^\\dagger$" in latex
    assert "schedule.epochs: 150 $\\to$ 1; loss.args: \\{'m': 0.1\\} $\\to$ \\{'m': 1e-3\\}" in latex


def test_latex_is_booktabs_with_blocks_and_spanning_dataset_headers():
    runs = pd.concat([_two_methods(), _two_methods().assign(dataset="cars196"),
                      _two_methods().assign(loss="contrastive", fingerprint="fpD")], ignore_index=True)
    cells = attach_published(summarize(runs, ["recall_at_1", "nmi"]), None)
    tex = render_latex(cells, metrics=["recall_at_1", "nmi"], caption="Table 3")
    assert "\\toprule" in tex and "\\bottomrule" in tex and tex.count("\\midrule") == 2
    assert "\\multicolumn{2}{c}{CUB-200-2011} & \\multicolumn{2}{c}{Cars196}" in tex
    assert "\\cmidrule(lr){2-3} \\cmidrule(lr){4-5}" in tex
    assert "\\emph{ResNet-50 + Margin}" in tex and "\\emph{ResNet-50 + Contrastive}" in tex
    assert "66.00$\\pm$12.71$^{\\approx}$$_{n=2}$" in tex
    # contrastive has no cars196 runs: an empty cell, not a crash
    contrastive = tex.split("Contrastive}}")[1]
    assert "--" in contrastive.splitlines()[1]


def test_published_rows_without_runs_still_appear():
    pub = load_published(PUBLISHED, ["3"])
    assert set(pub["metric"]) == {"recall_at_1", "recall_at_2", "nmi", "f1", "map_at_c"}
    cells = attach_published(summarize(_runs([]).iloc[0:0], ["recall_at_1"]), pub)
    text = render_markdown(cells, metrics=["recall_at_1", "recall_at_2", "nmi", "f1", "map_at_c"])
    assert text.count("| N-grouping") == 6 and "– / 63.09" in text  # 6 blocks of Table 3
    with pytest.raises(HarnessError, match="no table 9"):
        load_published(PUBLISHED, ["9"])
    with pytest.raises(HarnessError, match="several values for one cell, e.g. .* choose one table"):
        load_published(PUBLISHED.with_name("diml.csv"), ["4"])  # D = 64 and D = 512 rows


def test_diml_table1_layout_baseline_then_diml_per_loss_beside_published():
    pub = load_published(PUBLISHED.with_name("diml.csv"), ["1"])
    runs = _runs([{"method": m, "dataset": d, "loss": "margin", "test_precision_at_1": v}
                  for m, d, v in (("plain", "cub200", 0.60), ("diml", "cub200", 0.63))])
    cells = attach_published(summarize(runs, ["precision_at_1"]), pub)
    text = render_markdown(cells, metrics=["precision_at_1", "r_precision", "mean_average_precision_at_r"])
    lines = text.splitlines()
    margin = lines.index(next(line for line in lines if line.startswith("| *ResNet-50 + Margin*")))
    # Paper's Table 1: per loss a Baseline row, then DIML; ours beside theirs with the difference.
    assert lines[margin + 1].startswith("| Baseline | 60.00 (n=1) / 62.47 (-2.47) |")
    assert lines[margin + 2].startswith("| DIML | 63.00 (n=1) / 65.16 (-2.16) |")
    assert text.count("| Baseline |") == 17 and "| *ResNet-50 + Triplet (semihard)* |" in text


DIABLO_ROWS = {"plain": ["plain@"], "diablo": ["diablo@", "diablo@entries=8"], "diablo_n16": ["diablo@entries=16"]}


def test_published_rows_told_apart_by_setting_sit_beside_their_method():
    """DIABLO Table 1 prints binomial + DIABLO for N = 8 and N = 16 (the CSV's `setting`):
    without a mapping that is two values for one cell; with the grid's [published] rows,
    each reproduced method gets its own row (the contrastive and triplet + DIABLO rows,
    which print no N, have the empty setting), and other papers' rows are left out."""
    csv = PUBLISHED.with_name("diablo.csv")
    with pytest.raises(HarnessError, match="several values for one cell, e.g. diablo \\+ binomial_deviance"):
        load_published(csv, ["1"])
    pub = load_published(csv, ["1"], DIABLO_ROWS)
    r1 = pub[(pub.dataset == "cub200") & (pub.metric == "recall_at_1")].set_index(["loss", "method"])["value"]
    assert r1.to_dict() == {("contrastive", "plain"): 58.7, ("contrastive", "diablo"): 62.3,
                            ("triplet", "plain"): 55.9, ("triplet", "diablo"): 59.6,
                            ("binomial_deviance", "plain"): 59.6, ("binomial_deviance", "diablo"): 62.8,
                            ("binomial_deviance", "diablo_n16"): 63.9}
    assert len(pub) == 7 * 2 * 6  # seven rows x two datasets x R@1..32
    runs = _runs([{"backbone": "googlenet", "loss": "binomial_deviance", "method": m, "test_recall_at_1": v}
                  for m, v in (("plain", 0.60), ("diablo", 0.62), ("diablo_n16", 0.64))])
    text = render_markdown(attach_published(summarize(runs, ["recall_at_1"]), pub), metrics=["recall_at_1"])
    lines = text.splitlines()
    block = lines.index(next(line for line in lines if line.startswith("| *GoogLeNet + Binomial deviance*")))
    assert lines[block + 1].startswith("| Baseline | 60.00 (n=1) / 59.60 (+0.40) |")
    assert lines[block + 2].startswith("| + DIABLO (N = 8) | 62.00 (n=1) / 62.80 (-0.80) |")
    assert lines[block + 3].startswith("| + DIABLO (N = 16) | 64.00 (n=1) / 63.90 (+0.10) |")
    # A grid without rows keeps the CSV's own method names (the setting column is not read).
    assert set(load_published(PUBLISHED.with_name("diml.csv"), ["1"])["method"]) == {"plain", "diml"}
    with pytest.raises(HarnessError, match="no row 'diablo@entries=32'.*rows there: .*diablo@entries=16"):
        load_published(csv, ["1"], {"diablo": ["diablo@entries=32"]})


# ------------------------------------------------------------- over the MLflow store


def _fake_run(client, exp_id: str, *, method: str, seed: int, r1: float, fp: str = "fp1",
              deviations: str = "none", status: str = "FINISHED", start_time: int | None = None,
              revision: int = 1) -> str:
    run = client.create_run(exp_id, start_time=start_time)
    rid = run.info.run_id
    client.log_param(rid, "protocol.backbone.name", "resnet50")
    for k, v in {"method": method, "loss": "margin", "dataset": "cub200", "seed": seed, "fingerprint": fp,
                 "deviations": deviations, "test_set_selection": "False", "method_revision": revision,
                 "evaluation_code": "code1", "selection": "validation"}.items():
        client.set_tag(rid, k, str(v))
    client.log_metric(rid, "test_recall_at_1", r1)
    client.log_metric(rid, "test_nmi", 0.5)
    client.set_terminated(rid, status=status)
    return rid


@pytest.fixture
def experiment(workdir) -> str:
    from harness.tracking import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    return f"tables-{uuid.uuid4().hex[:8]}"


def test_table_command_reads_finished_runs_and_writes_atomically(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    _fake_run(client, exp_id, method="agrouping", seed=0, r1=0.70, start_time=2_000)
    _fake_run(client, exp_id, method="agrouping", seed=0, r1=0.10, start_time=1_000)  # superseded by the rerun
    _fake_run(client, exp_id, method="agrouping", seed=1, r1=0.72)
    _fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.60)
    _fake_run(client, exp_id, method="ngrouping", seed=1, r1=0.10, status="FAILED")  # ignored
    args = _parser().parse_args(["table", "--experiment", experiment, "--format", "markdown",
                                 "--published", str(PUBLISHED), "--table", "3"])
    assert args.func(args) == 0
    out = workdir / "results" / "tables" / f"{experiment}.md"
    text = out.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    a_row = next(line for line in text.splitlines()
                 if line.startswith("| A-grouping") and "71.00 ± 12.71 (n=2)" in line)
    assert "71.00 ± 12.71 (n=2) / 68.62 (+2.38)" in a_row  # Table 3: ResNet-50 + margin, A-grouping, CUB R@1
    assert "60.00 (n=1) / 63.09 (-3.09)" in text  # one finished seed of two: no interval, the count shown
    assert "half-width of the 95% Student t-interval" in text
    assert "Model selection of the reproduced numbers: the epoch with the best validation" in text
    assert not list(out.parent.glob(".*tmp"))


def test_runs_of_an_older_method_revision_are_superseded(experiment, workdir, capsys):
    from harness.tables import load_runs

    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    _fake_run(client, exp_id, method="agrouping", seed=0, r1=0.10, revision=1)
    _fake_run(client, exp_id, method="agrouping", seed=1, r1=0.20, revision=1)
    _fake_run(client, exp_id, method="agrouping", seed=0, r1=0.60, revision=2)
    _fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.50)
    cells = summarize(load_runs([experiment]), ["recall_at_1"])
    a = cells[cells.method == "agrouping"].iloc[0]
    assert (a["mean"], a["n"]) == (pytest.approx(60.0), 1)  # revision 2 only: one seed so far
    assert cells[cells.method == "ngrouping"].iloc[0]["n"] == 1
    assert "2 run(s) superseded" in capsys.readouterr().err


def test_table_command_refuses_mixed_fingerprints(experiment, workdir):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    _fake_run(client, exp_id, method="agrouping", seed=0, r1=0.70, fp="aaaa1111")
    _fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.60, fp="bbbb2222")
    args = _parser().parse_args(["table", "--experiment", experiment])
    with pytest.raises(HarnessError, match="aaaa1111.*bbbb2222"):
        args.func(args)
    assert not (workdir / "results" / "tables").exists()


def test_table_command_names_unknown_experiments(workdir):
    args = _parser().parse_args(["table", "--experiment", "no-such-experiment"])
    with pytest.raises(HarnessError, match="no MLflow experiment 'no-such-experiment'"):
        args.func(args)


def test_cell_columns_are_stable():
    assert CELL_COLUMNS == ["backbone", "loss", "method", "setting", "dataset", "metric", "mean", "half_width",
                            "std", "n", "flagged", "code_flagged", "published"]


def test_table_command_takes_published_rows(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    _fake_run(client, exp_id, method="plain", seed=0, r1=0.70)
    rows = [f"--published-row={m}={spec}" for m, specs in DIABLO_ROWS.items() for spec in specs]
    args = _parser().parse_args(["table", "--experiment", experiment, "--format", "markdown",
                                 "--published", str(PUBLISHED.with_name("diablo.csv")), "--table", "1", *rows])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "| + DIABLO (N = 16) |" in text and "63.90" in text and "| rml |" not in text
    args = _parser().parse_args(["table", "--experiment", experiment, "--published-row", "diablo"])
    with pytest.raises(HarnessError, match="must look like METHOD=PUBLISHED_METHOD@SETTING"):
        args.func(args)
