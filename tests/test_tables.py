"""``harness.reports.tables``: layout, bold best, published values and differences, the
deviation mark, refusing mixed protocol fingerprints, and the ``table`` command over
runs written straight into a temporary MLflow store (no training)."""

from __future__ import annotations

import argparse
import math
import re
import uuid
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.cli.table import add_table_parser
from harness.reports.tables import (
    CELL_COLUMNS,
    attach_published,
    load_published,
    render_latex,
    render_markdown,
    summarize,
)

PUBLISHED = Path(__file__).resolve().parents[1] / "results" / "published" / "agrouping.csv"


def _runs(rows: list[dict]) -> pd.DataFrame:
    base = {
        "run_id": "r",
        "experiment": "e",
        "backbone": "resnet50",
        "loss": "margin",
        "dataset": "cub200",
        "seed": "0",
        "fingerprint": "fpA",
        "deviations": "none",
        "test_set_selection": False,
        "evaluation_code": "code1",
        "setting": "",
    }
    return pd.DataFrame([{**base, **r} for r in rows])


def _two_methods() -> pd.DataFrame:
    return _runs(
        [
            {"method": "ngrouping", "seed": "0", "test_recall_at_1": 0.60, "test_nmi": 0.70},
            {"method": "ngrouping", "seed": "1", "test_recall_at_1": 0.62, "test_nmi": 0.72},
            {"method": "agrouping", "seed": "0", "test_recall_at_1": 0.65, "test_nmi": 0.69},
            {"method": "agrouping", "seed": "1", "test_recall_at_1": 0.67, "test_nmi": 0.69},
        ]
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_table_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_summarize_mean_std_in_percent():
    cells = summarize(_two_methods(), ["recall_at_1", "nmi"])
    row = cells[(cells.method == "ngrouping") & (cells.metric == "recall_at_1")].iloc[0]
    assert row["mean"] == pytest.approx(61.0) and row["std"] == pytest.approx(math.sqrt(2.0))
    assert row["half_width"] == pytest.approx(
        scipy_stats.t.ppf(0.975, 1) * math.sqrt(2.0) / math.sqrt(2.0)
    )
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
    published = pd.DataFrame(
        [
            {
                "backbone": "resnet50",
                "loss": "margin",
                "method": "ngrouping",
                "dataset": "cub200",
                "metric": "recall_at_1",
                "value": 63.09,
            },
            {
                "backbone": "resnet50",
                "loss": "margin",
                "method": "agrouping",
                "dataset": "cub200",
                "metric": "recall_at_1",
                "value": 65.50,
            },
        ]
    )
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
    text = render_markdown(
        cells, deviations=["schedule.epochs: 150 -> 1", "test-set model selection"]
    )
    rows = [
        line for line in text.splitlines() if line.startswith("| N-") or line.startswith("| A-")
    ]
    assert all("†" in r for r in rows)
    assert (
        "† runs with protocol deviations or test-set model selection (schedule.epochs: 150 -> 1"
        in text
    )
    latex = render_latex(
        cells, deviations=["schedule.epochs: 150 -> 1", "loss.args: {'m': 0.1} -> {'m': 1e-3}"]
    )
    assert "$^\\dagger$" in latex
    assert (
        "schedule.epochs: 150 $\\to$ 1; loss.args: \\{'m': 0.1\\} $\\to$ \\{'m': 1e-3\\}" in latex
    )


def test_latex_is_booktabs_one_table_per_dataset_with_blocks():
    runs = pd.concat(
        [
            _two_methods(),
            _two_methods().assign(dataset="cars196"),
            _two_methods().assign(loss="contrastive", fingerprint="fpD"),
        ],
        ignore_index=True,
    )
    cells = attach_published(summarize(runs, ["recall_at_1", "nmi"]), None)
    tex = render_latex(cells, metrics=["recall_at_1", "nmi"], caption="Table 3")
    assert tex.startswith("% Table 3\n% Needs in the preamble: \\usepackage{booktabs}\n")
    cub, cars = tex.split("\\begin{table*}")[1:]
    assert "\\caption{Table 3 (CUB-200-2011)}" in cub and "\\caption{Table 3 (Cars196)}" in cars
    assert "\\multicolumn{2}{c}{CUB-200-2011}" in cub and "\\cmidrule(l){3-4}" in cub
    assert "\\scriptsize" not in tex and tex.count("\\footnotesize") >= 2
    assert (
        cub.count("\\midrule") == 2 and cars.count("\\midrule") == 1
    )  # contrastive has no Cars196 runs
    assert "\\emph{ResNet-50 + Margin}" in cub and "\\emph{ResNet-50 + Contrastive}" in cub
    assert "\\emph{ResNet-50 + Contrastive}" not in cars
    assert "A-grouping & 2 & 66.00$\\pm$12.71$^{\\approx}$ &" in cub
    assert (
        "Cells: mean over seeds" in cars and "Cells: mean over seeds" not in cub
    )  # footnotes under the last


def test_latex_signs_are_minus_signs_and_published_values_sit_beneath():
    runs = _two_methods()
    published = pd.DataFrame(
        [
            {
                "backbone": "resnet50",
                "loss": "margin",
                "method": "agrouping",
                "dataset": "cub200",
                "metric": "recall_at_1",
                "value": 70.0,
                "note": "",
            }
        ]
    )
    tex = render_latex(
        attach_published(summarize(runs, ["recall_at_1"]), published), metrics=["recall_at_1"]
    )
    assert "\\quad published &  & 70.00 ($-$4.00) \\\\" in tex
    assert "(-4.00)" not in tex


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
    runs = _runs(
        [
            {"method": m, "dataset": d, "loss": "margin", "test_precision_at_1": v}
            for m, d, v in (("plain", "cub200", 0.60), ("diml", "cub200", 0.63))
        ]
    )
    cells = attach_published(summarize(runs, ["precision_at_1"]), pub)
    text = render_markdown(
        cells, metrics=["precision_at_1", "r_precision", "mean_average_precision_at_r"]
    )
    lines = text.splitlines()
    margin = lines.index(next(line for line in lines if line.startswith("| *ResNet-50 + Margin*")))
    # Paper's Table 1: per loss a Baseline row, then DIML; ours beside theirs with the difference.
    assert lines[margin + 1].startswith("| Baseline | 60.00 (n=1) / 62.47 (-2.47) |")
    assert lines[margin + 2].startswith("| DIML | 63.00 (n=1) / 65.16 (-2.16) |")
    assert text.count("| Baseline |") == 17 and "| *ResNet-50 + Triplet (semihard)* |" in text


DIABLO_ROWS = {
    "plain": ["plain@"],
    "diablo": ["diablo@", "diablo@entries=8"],
    "diablo_n16": ["diablo@entries=16"],
}


def test_published_rows_told_apart_by_setting_sit_beside_their_method():
    """DIABLO Table 1 prints binomial + DIABLO for N = 8 and N = 16 (the CSV's `setting`):
    without a mapping that is two values for one cell; with the grid's [published] rows,
    each reproduced method gets its own row (the contrastive and triplet + DIABLO rows,
    which print no N, have the empty setting), and other papers' rows are left out."""
    csv = PUBLISHED.with_name("diablo.csv")
    with pytest.raises(
        HarnessError, match="several values for one cell, e.g. diablo \\+ binomial_deviance"
    ):
        load_published(csv, ["1"])
    pub = load_published(csv, ["1"], DIABLO_ROWS)
    r1 = pub[(pub.dataset == "cub200") & (pub.metric == "recall_at_1")].set_index(
        ["loss", "method"]
    )["value"]
    assert r1.to_dict() == {
        ("contrastive", "plain"): 58.7,
        ("contrastive", "diablo"): 62.3,
        ("triplet", "plain"): 55.9,
        ("triplet", "diablo"): 59.6,
        ("binomial_deviance", "plain"): 59.6,
        ("binomial_deviance", "diablo"): 62.8,
        ("binomial_deviance", "diablo_n16"): 63.9,
    }
    assert len(pub) == 7 * 2 * 6  # seven rows x two datasets x R@1..32
    runs = _runs(
        [
            {
                "backbone": "googlenet",
                "loss": "binomial_deviance",
                "method": m,
                "test_recall_at_1": v,
            }
            for m, v in (("plain", 0.60), ("diablo", 0.62), ("diablo_n16", 0.64))
        ]
    )
    text = render_markdown(
        attach_published(summarize(runs, ["recall_at_1"]), pub), metrics=["recall_at_1"]
    )
    lines = text.splitlines()
    block = lines.index(
        next(line for line in lines if line.startswith("| *GoogLeNet + Binomial deviance*"))
    )
    assert lines[block + 1].startswith("| Baseline | 60.00 (n=1) / 59.60 (+0.40) |")
    assert lines[block + 2].startswith("| + DIABLO (N = 8) | 62.00 (n=1) / 62.80 (-0.80) |")
    assert lines[block + 3].startswith("| + DIABLO (N = 16) | 64.00 (n=1) / 63.90 (+0.10) |")
    # A grid without rows keeps the CSV's own method names (the setting column is not read).
    assert set(load_published(PUBLISHED.with_name("diml.csv"), ["1"])["method"]) == {
        "plain",
        "diml",
    }
    with pytest.raises(
        HarnessError, match="no row 'diablo@entries=32'.*rows there: .*diablo@entries=16"
    ):
        load_published(csv, ["1"], {"diablo": ["diablo@entries=32"]})


# ------------------------------------------------------------- over the MLflow store


def _fake_run(
    client,
    exp_id: str,
    *,
    method: str,
    seed: int,
    r1: float,
    fp: str = "fp1",
    deviations: str = "none",
    status: str = "FINISHED",
    start_time: int | None = None,
    revision: int = 1,
) -> str:
    run = client.create_run(exp_id, start_time=start_time)
    rid = run.info.run_id
    client.log_param(rid, "protocol.backbone.name", "resnet50")
    for k, v in {
        "method": method,
        "loss": "margin",
        "dataset": "cub200",
        "seed": seed,
        "fingerprint": fp,
        "deviations": deviations,
        "test_set_selection": "False",
        "method_revision": revision,
        "evaluation_code": "code1",
        "selection": "validation",
    }.items():
        client.set_tag(rid, k, str(v))
    client.log_metric(rid, metric_key("test", "recall_at_1"), r1)
    client.log_metric(rid, metric_key("test", "nmi"), 0.5)
    client.set_terminated(rid, status=status)
    return rid


@pytest.fixture
def experiment(workdir) -> str:
    from harness.store.location import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    return f"tables-{uuid.uuid4().hex[:8]}"


def test_table_command_reads_finished_runs_and_writes_atomically(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    _fake_run(client, exp_id, method="agrouping", seed=0, r1=0.70, start_time=2_000)
    _fake_run(
        client, exp_id, method="agrouping", seed=0, r1=0.10, start_time=1_000
    )  # superseded by the rerun
    _fake_run(client, exp_id, method="agrouping", seed=1, r1=0.72)
    _fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.60)
    _fake_run(client, exp_id, method="ngrouping", seed=1, r1=0.10, status="FAILED")  # ignored
    args = _parser().parse_args(
        [
            "table",
            "--experiment",
            experiment,
            "--format",
            "markdown",
            "--published",
            str(PUBLISHED),
            "--table",
            "3",
        ]
    )
    assert args.func(args) == 0
    out = workdir / "results" / "tables" / f"{experiment}.md"
    text = out.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    a_row = next(
        line
        for line in text.splitlines()
        if line.startswith("| A-grouping") and "71.00 ± 12.71 (n=2)" in line
    )
    assert (
        "71.00 ± 12.71 (n=2) / 68.62 (+2.38)" in a_row
    )  # Table 3: ResNet-50 + margin, A-grouping, CUB R@1
    assert (
        "60.00 (n=1) / 63.09 (-3.09)" in text
    )  # one finished seed of two: no interval, the count shown
    assert "half-width of the 95% Student t-interval" in text
    assert "Model selection of the reproduced numbers: the epoch with the best validation" in text
    assert not list(out.parent.glob(".*tmp"))


def test_runs_of_an_older_method_revision_are_superseded(experiment, workdir, capsys):
    from harness.reports.tables import load_runs

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
    assert CELL_COLUMNS == [
        "backbone",
        "loss",
        "method",
        "setting",
        "dataset",
        "metric",
        "mean",
        "half_width",
        "std",
        "n",
        "flagged",
        "code_flagged",
        "published",
    ]


def test_table_command_takes_published_rows(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    _fake_run(client, exp_id, method="plain", seed=0, r1=0.70)
    rows = [f"--published-row={m}={spec}" for m, specs in DIABLO_ROWS.items() for spec in specs]
    args = _parser().parse_args(
        [
            "table",
            "--experiment",
            experiment,
            "--format",
            "markdown",
            "--published",
            str(PUBLISHED.with_name("diablo.csv")),
            "--table",
            "1",
            *rows,
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "| + DIABLO (N = 16) |" in text and "63.90" in text and "| rml |" not in text
    args = _parser().parse_args(["table", "--experiment", experiment, "--published-row", "diablo"])
    with pytest.raises(HarnessError, match="must look like METHOD=PUBLISHED_METHOD@SETTING"):
        args.func(args)


def test_a_mislabelled_published_column_is_never_compared(experiment, capsys):
    """A-grouping Table 2 heads its ResNet-50 SOP column R@2 but prints R@10 values there
    (Ours-R 91.8 against Table 4's R@2 83.11): the rows stay in the CSV, flagged, and the
    table leaves them out with a footnote and one line on stderr."""
    from harness.reports.tables import build_table

    pub = load_published(PUBLISHED, ["2"])
    assert not (
        (pub.dataset == "sop") & (pub.metric == "recall_at_2") & (pub.backbone == "resnet50")
    ).any()
    assert (
        (pub.dataset == "sop") & (pub.metric == "recall_at_10")
    ).sum() == 5  # Inception rows: R@10 as printed
    assert "agrouping sop recall_at_2 (table 2): column_mislabelled" in capsys.readouterr().err
    client = mlflow.MlflowClient()
    _fake_run(client, client.create_experiment(experiment), method="agrouping", seed=0, r1=0.70)
    text = build_table([experiment], fmt="markdown", published=PUBLISHED, tables=["2"])
    assert "91.80" not in text and "79.20" in text  # Ours-R SOP: R@1 compared, the "R@2" not
    assert "Published values not compared: " in text and "never compared as R@2" in text
    latex = build_table([experiment], fmt="latex", published=PUBLISHED, tables=["2"])
    assert "Published values not compared" in latex and latex.rstrip().endswith("\\end{table*}")


def test_diml_k_sweep_rows_carry_their_note_into_the_table(experiment):
    """DIML Table 3's test-only rows and Tables 5-6 come from the released code's K-sweep
    evaluation: compared, with the note as a footnote."""
    from harness.reports.tables import build_table

    diml = PUBLISHED.with_name("diml.csv")
    rows = {"plain": ["plain@diml_stage=none"], "diml": ["diml@diml_stage=test"]}
    pub = load_published(diml, ["3"], rows)
    assert set(pub.loc[pub.method == "diml", "note"].str.split(":").str[0]) == {"ksweep"}
    assert set(pub.loc[pub.method == "plain", "note"]) == {""}
    assert set(load_published(diml, ["1"])["note"]) == {""}
    client = mlflow.MlflowClient()
    _fake_run(client, client.create_experiment(experiment), method="diml", seed=0, r1=0.70)
    text = build_table(
        [experiment], fmt="markdown", published=diml, tables=["3"], published_rows=rows
    )
    assert "Published values marked ksweep: from the released code's K-sweep evaluation" in text


# ------------------------------------------------- intervals, paired tests, settings


def _planted() -> pd.DataFrame:
    """Three seeds of plain and of a method clearly above it, and one tied with it."""
    values = {
        "plain": [0.600, 0.610, 0.605],
        "agrouping": [0.700, 0.712, 0.703],
        "mgrouping": [0.601, 0.615, 0.603],
    }
    return _runs(
        [
            {"method": m, "seed": str(s), "run_id": f"{m}-{s}", "test_recall_at_1": v}
            for m, vs in values.items()
            for s, v in enumerate(vs)
        ]
    )


def test_planted_runs_give_scipys_interval_and_paired_p_value():
    from harness.reports.tables import paired_tests

    runs = _planted()
    cells = summarize(runs, ["recall_at_1"]).set_index("method")
    for method, group in runs.groupby("method"):
        values = group["test_recall_at_1"] * 100
        low, high = scipy_stats.t.interval(
            0.95, len(values) - 1, loc=values.mean(), scale=scipy_stats.sem(values)
        )
        cell = cells.loc[method]
        assert cell["n"] == 3 and cell["mean"] - cell["half_width"] == pytest.approx(low)
        assert cell["mean"] + cell["half_width"] == pytest.approx(high)
    tests = paired_tests(runs, ["recall_at_1"], baseline="plain").set_index("method")
    assert set(tests.index) == {
        "agrouping",
        "mgrouping",
    }  # the baseline is not tested against itself
    ours = runs[runs.method == "agrouping"].sort_values("seed")["test_recall_at_1"] * 100
    base = runs[runs.method == "plain"].sort_values("seed")["test_recall_at_1"] * 100
    assert tests.loc["agrouping", "p_t"] == pytest.approx(
        scipy_stats.ttest_rel(ours.values, base.values).pvalue
    )
    assert tests.loc["agrouping", "difference"] == pytest.approx((ours.values - base.values).mean())
    assert (
        tests.loc["agrouping", "pairs"] == 3 and tests.loc["agrouping", "boot_queries"] == 0
    )  # no per-query data
    text = render_markdown(
        attach_published(summarize(runs, ["recall_at_1"]), None),
        tests=paired_tests(runs, ["recall_at_1"]),
    )
    rows = {
        line.split(" | ")[0].lstrip("| "): line
        for line in text.splitlines()
        if line.startswith("| ")
    }
    # A-grouping's interval lies above every other: bold, and above plain in the paired t-test
    assert "**70.50** ± " in rows["A-grouping"] and "↑ (n=3)" in rows["A-grouping"]
    assert "**" not in rows["M-grouping"] + rows["Baseline"] and "↑" not in rows["M-grouping"]
    assert "paired t-test over seeds" in text and "| Resnet" not in text
    assert "**Paired tests against the baseline row**" in text
    assert f"| {_p(tests.loc['agrouping', 'p_t'])} |" in text


def _p(value):
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def test_ties_are_marked_not_bold():
    runs = _planted()
    runs = runs[runs.method != "agrouping"]
    text = render_markdown(attach_published(summarize(runs, ["recall_at_1"]), None))
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| Baseline") or line.startswith("| M-grouping")
    ]
    assert all("≈" in r for r in rows) and not any("**" in r for r in rows)
    assert "tied for best" in text


def test_rows_computed_by_different_evaluation_code_are_flagged():
    runs = _planted()
    runs.loc[runs.method == "agrouping", "evaluation_code"] = "code2"
    cells = summarize(runs, ["recall_at_1"])
    assert cells["code_flagged"].all()
    assert "§" in render_markdown(attach_published(cells, None))
    runs.loc[:, "evaluation_code"] = "code1"
    other_block = _planted().assign(
        dataset="cars196", evaluation_code=""
    )  # lacking the tag: flagged too
    cells = summarize(pd.concat([runs, other_block], ignore_index=True), ["recall_at_1"])
    assert not cells[cells.dataset == "cub200"]["code_flagged"].any()
    assert cells[cells.dataset == "cars196"]["code_flagged"].all()


def test_published_metric_sits_beside_the_papers_variant():
    """DIML's published RP is compared with the query-in-R variant, labelled; the harness's
    own RP column has no published value beside it."""
    from harness.reports.tables import variant_notes

    pub = load_published(PUBLISHED.with_name("diml.csv"), ["1"])
    pub = pub[pub.dataset == "cub200"].assign(
        metric=pub["metric"].replace({"r_precision": "r_precision_query_in_r"})
    )
    runs = _runs(
        [
            {
                "method": "plain",
                "seed": str(s),
                "test_r_precision": v,
                "test_r_precision_query_in_r": v - 0.01,
            }
            for s, v in enumerate([0.30, 0.31])
        ]
    )
    metrics = ["r_precision", "r_precision_query_in_r"]
    text = render_markdown(
        attach_published(summarize(runs, metrics), pub[pub.metric.isin(metrics)]),
        metrics=metrics,
        notes=variant_notes(metrics, {"r_precision": "r_precision_query_in_r"}),
    )
    header = text.splitlines()[0]
    assert header == "| Method | CUB-200-2011 RP | CUB-200-2011 RP (query in R) |"
    margin = text.splitlines().index("| *ResNet-50 + Margin* |  |  |")
    baseline = text.splitlines()[margin + 1]
    assert baseline.startswith("| Baseline | 30.50 ± 6.35 (n=2) | 29.50 ± 6.35 (n=2) / ")
    assert "query itself counted" in text and "(n-1)/n" in text


def _option_run(client, exp_id, *, seed, entries, r1, tuned=False, init_from="none"):
    rid = _fake_run(client, exp_id, method="diablo", seed=seed, r1=r1)
    client.log_param(rid, "method.entries", str(entries))
    client.log_param(rid, "method.selection", "dimension")
    if tuned:
        client.set_tag(rid, "tune_role", "reproduction")
    client.set_tag(rid, "init_from", init_from)
    return rid


def test_runs_differing_only_in_a_method_option_are_two_rows(experiment, workdir, capsys):
    from harness.reports.tables import load_runs

    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    for seed in (0, 1):  # same fingerprint, same seeds: only the option tells them apart
        _option_run(client, exp_id, seed=seed, entries=8, r1=0.60 + seed / 100)
        _option_run(client, exp_id, seed=seed, entries=16, r1=0.70 + seed / 100)
    _option_run(client, exp_id, seed=0, entries=8, r1=0.65, tuned=True)
    runs = load_runs([experiment])
    assert len(runs) == 5 and "superseded" not in capsys.readouterr().err
    cells = summarize(runs, ["recall_at_1"]).set_index("setting")
    assert cells.loc["entries=8", "mean"] == pytest.approx(60.5)
    assert cells.loc["entries=16", "mean"] == pytest.approx(70.5)
    assert cells.loc["entries=8, tuned", "n"] == 1
    text = render_markdown(attach_published(summarize(runs, ["recall_at_1"]), None))
    assert "| diablo [entries=8] |" in text and "| diablo [entries=16] |" in text
    assert "| diablo [entries=8, tuned] |" in text


def test_paired_bootstrap_reads_the_runs_per_query_artifacts(experiment, workdir, tmp_path):
    from harness.components.evaluation import PER_QUERY_ARTIFACT, save_per_query
    from harness.reports.tables import artifact_per_query, build_table

    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(50), 4)
    stored = {}
    for method, shift in (("plain", 0), ("agrouping", 2)):
        for seed in (0, 1):
            ranks = np.maximum(
                rng.integers(-1, 3, size=len(labels)) - shift, 0
            )  # agrouping ranks better
            rid = _fake_run(client, exp_id, method=method, seed=seed, r1=float((ranks == 0).mean()))
            arrays = {
                "query_index": np.arange(len(labels)),
                "label": labels,
                "num_relevant": np.full(len(labels), 3),
                "first_hit_rank": ranks,
            }
            path = tmp_path / rid / "per_query_test.npz"
            save_per_query(path, arrays)
            client.log_artifact(rid, str(path), PER_QUERY_ARTIFACT.rsplit("/", 1)[0])
            stored[rid] = arrays
    for rid, arrays in stored.items():  # round trip through the store
        back = artifact_per_query(rid)
        assert all(np.array_equal(back[k], arrays[k]) for k in arrays)
    text = build_table(
        [experiment], fmt="markdown", metrics=["recall_at_1"], baseline="plain", resamples=500
    )
    a_row = next(line for line in text.splitlines() if line.startswith("| A-grouping"))
    assert "⇑" in a_row  # the bootstrap over 200 queries sees the better first ranks
    assert "paired bootstrap over test queries (per-query differences averaged over seeds" in text
    assert "(Q=200)" in text


def test_row_labels_come_from_the_plugins_with_the_runs_recorded_options():
    """A DIABLO row is labelled with the N its runs recorded (``params.method.entries``), not
    the paper's N = 8; runs of one method that recorded different options keep the default."""
    from harness.reports.tables import method_labels, recorded_options

    runs = _runs(
        [
            {"method": "plain", "options": "{}", "test_recall_at_1": 0.60},
            {"method": "diablo", "options": '{"entries": "2"}', "test_recall_at_1": 0.62},
            {
                "method": "diablo_n16",
                "options": '{"entries": "4"}',
                "seed": "0",
                "test_recall_at_1": 0.6,
            },
            {
                "method": "diablo_n16",
                "options": '{"entries": "8"}',
                "seed": "1",
                "test_recall_at_1": 0.6,
            },
        ]
    )
    assert recorded_options(runs) == {"plain": {}, "diablo": {"entries": "2"}}
    labels = method_labels(["plain", "diablo", "diablo_n16", "rml"], recorded_options(runs))
    assert labels == {
        "plain": "Baseline",
        "diablo": "+ DIABLO (N = 2)",
        "diablo_n16": "+ DIABLO (N = 16)",
        "rml": "rml",
    }
    text = render_markdown(
        attach_published(summarize(runs[:2], ["recall_at_1"]), None),
        metrics=["recall_at_1"],
        labels=labels,
    )
    assert "| + DIABLO (N = 2) | 62.00 (n=1) |" in text and "N = 8" not in text


@pytest.mark.parametrize(
    "grid",
    sorted(
        p.stem for p in (Path(__file__).resolve().parents[1] / "protocols" / "grids").glob("*.toml")
    ),
)
def test_every_grid_tables_map_at_r(grid):
    """MAP@R (Musgrave et al. 2020) is a column of every shipped grid's table (none of the
    papers forbids it) and of the default metrics."""
    from harness.config.grids import load_grid
    from harness.reports.tables import DEFAULT_METRICS

    loaded = load_grid(Path(__file__).resolve().parents[1] / "protocols" / "grids" / f"{grid}.toml")
    assert "mean_average_precision_at_r" in loaded.metrics
    assert "mean_average_precision_at_r" in DEFAULT_METRICS


def test_a_published_row_without_map_at_r_shows_a_dash_in_that_column():
    runs = _runs(
        [
            {
                "method": "agrouping",
                "seed": "0",
                "test_recall_at_1": 0.70,
                "test_mean_average_precision_at_r": 0.3,
            },
            {
                "method": "agrouping",
                "seed": "1",
                "test_recall_at_1": 0.72,
                "test_mean_average_precision_at_r": 0.32,
            },
        ]
    )
    metrics = ["recall_at_1", "mean_average_precision_at_r"]
    published = load_published(PUBLISHED, ["3"])
    cells = attach_published(summarize(runs, metrics), published[published["metric"].isin(metrics)])
    text = render_markdown(cells, metrics=metrics)
    header = next(line for line in text.splitlines() if line.startswith("| Method"))
    assert "CUB-200-2011 MAP@R" in header
    column = header.split(" | ").index("CUB-200-2011 MAP@R")
    a_row = next(
        line for line in text.splitlines() if line.startswith("| A-grouping") and "71.00" in line
    )
    assert a_row.split(" | ")[column].startswith(
        "31.00"
    )  # reproduced, no published value beside it
    published_only = next(line for line in text.splitlines() if line.startswith("| N-grouping"))
    assert published_only.split(" | ")[column] == "–"


def test_paired_tests_rows_follow_the_main_tables_order():
    """Runs listed in another order than the table's (a later method first, the second
    dataset first) give paired-tests rows in the main table's order, in both formats."""
    from harness.reports.tables import paired_tests

    rows = []
    for dataset in ("cars196", "cub200"):
        for method, shift in (("agrouping", 0.05), ("plain", 0.0), ("ngrouping", 0.02)):
            rows += [
                {
                    "method": method,
                    "dataset": dataset,
                    "seed": str(s),
                    "run_id": f"{method}-{dataset}-{s}",
                    "test_recall_at_1": 0.5 + shift + 0.01 * s,
                    "test_nmi": 0.4 + shift,
                }
                for s in (0, 1)
            ]
    runs = _runs(rows)
    cells = attach_published(summarize(runs, ["recall_at_1", "nmi"]), None)
    tests = paired_tests(runs, ["nmi", "recall_at_1"], baseline="plain")
    text = render_markdown(cells, metrics=["recall_at_1", "nmi"], tests=tests)
    main_order = [
        line.split(" | ")[0].removeprefix("| ")
        for line in text.split("**Paired tests")[0].splitlines()
        if line.startswith("| ") and "-grouping" in line
    ]
    paired = [
        line.split(" | ") for line in text.split("**Paired tests")[1].splitlines() if " vs " in line
    ]
    assert [(p[1], p[2]) for p in paired] == [
        (d, m) for d in ("CUB-200-2011", "Cars196") for _ in main_order for m in ("R@1", "NMI")
    ]
    assert [p[3].split(" vs ")[0] for p in paired[::2]] == main_order * 2
    tex = render_latex(cells, metrics=["recall_at_1", "nmi"], tests=tests)
    latex_paired = [
        line.split(" vs ")[0].rsplit(": ", 1)[1]
        for line in tex.split("Paired tests", 1)[1].splitlines()
        if " vs " in line
    ]
    assert latex_paired == main_order * 2


def test_a_dataset_with_more_metrics_than_fit_is_split_into_even_parts():
    metrics = [
        "recall_at_1",
        "recall_at_2",
        "recall_at_4",
        "recall_at_8",
        "recall_at_16",
        "recall_at_32",
        "mean_average_precision_at_r",
    ]
    runs = _runs(
        [
            {
                "method": m,
                "seed": str(s),
                **{f"test_{k}": 0.5 + 0.01 * s + (m == "agrouping") * 0.02 for k in metrics},
            }
            for m in ("ngrouping", "agrouping")
            for s in (0, 1)
        ]
    )
    tex = render_latex(
        attach_published(summarize(runs, metrics), None), metrics=metrics, caption="Wide"
    )
    parts = re.findall(r"\\caption\{Wide \(CUB-200-2011, part (\d) of (\d)\)\}", tex)
    assert len(parts) >= 2 and {total for _, total in parts} == {str(len(parts))}
    heads = [line for line in tex.splitlines() if line.startswith("Method & $n$ & ")]
    sizes = [line.count("&") - 1 for line in heads]
    assert (
        sum(sizes) == len(metrics) and max(sizes) - min(sizes) <= 1
    )  # every metric once, parts even
