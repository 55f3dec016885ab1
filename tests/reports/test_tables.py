"""``harness.reports.tables``: layout, bold best, published values and differences, the
deviation mark and refusing mixed protocol fingerprints (the ``table`` command over a
store: ``test_tables_store.py``; intervals and paired tests: ``test_tables_statistics.py``)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
from scipy import stats as scipy_stats

from harness.base.errors import HarnessError
from harness.reports.tables import (
    attach_published,
    load_published,
    render_latex,
    render_markdown,
    summarize,
)
from tests.table_runs import DIABLO_ROWS, PUBLISHED, runs_frame, two_methods


def test_summarize_mean_std_in_percent():
    cells = summarize(two_methods(), ["recall_at_1", "nmi"])
    row = cells[(cells.method == "ngrouping") & (cells.metric == "recall_at_1")].iloc[0]
    assert row["mean"] == pytest.approx(61.0) and row["std"] == pytest.approx(math.sqrt(2.0))
    assert row["half_width"] == pytest.approx(
        scipy_stats.t.ppf(0.975, 1) * math.sqrt(2.0) / math.sqrt(2.0)
    )
    assert row["n"] == 2 and not row["flagged"] and not row["code_flagged"]


def test_mixed_fingerprints_in_one_block_are_refused_naming_both():
    runs = two_methods()
    runs.loc[3, "fingerprint"] = "fpB"
    with pytest.raises(HarnessError) as err:
        summarize(runs)
    text = str(err.value)
    assert "fpA" in text and "fpB" in text and "resnet50 + margin on cub200" in text
    assert "\n" not in text


def test_different_fingerprints_in_different_blocks_are_fine():
    runs = two_methods()
    other = two_methods().assign(dataset="cars196", fingerprint="fpC")
    assert len(summarize(pd.concat([runs, other], ignore_index=True))) == 2 * 2 * 2


def test_markdown_layout_bold_best_published_and_difference():
    cells = summarize(two_methods(), ["recall_at_1", "nmi"])
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
    runs = two_methods()
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
            two_methods(),
            two_methods().assign(dataset="cars196"),
            two_methods().assign(loss="contrastive", fingerprint="fpD"),
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
    runs = two_methods()
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
    cells = attach_published(summarize(runs_frame([]).iloc[0:0], ["recall_at_1"]), pub)
    text = render_markdown(cells, metrics=["recall_at_1", "recall_at_2", "nmi", "f1", "map_at_c"])
    assert text.count("| N-grouping") == 6 and "– / 63.09" in text  # 6 blocks of Table 3
    with pytest.raises(HarnessError, match="no table 9"):
        load_published(PUBLISHED, ["9"])
    with pytest.raises(HarnessError, match="several values for one cell, e.g. .* choose one table"):
        load_published(PUBLISHED.with_name("diml.csv"), ["4"])  # D = 64 and D = 512 rows


def test_diml_table1_layout_baseline_then_diml_per_loss_beside_published():
    pub = load_published(PUBLISHED.with_name("diml.csv"), ["1"])
    runs = runs_frame(
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
    runs = runs_frame(
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


def test_published_metric_sits_beside_the_papers_variant():
    """DIML's published RP is compared with the query-in-R variant, labelled; the harness's
    own RP column has no published value beside it."""
    from harness.reports.tables import variant_notes

    pub = load_published(PUBLISHED.with_name("diml.csv"), ["1"])
    pub = pub[pub.dataset == "cub200"].assign(
        metric=pub["metric"].replace({"r_precision": "r_precision_query_in_r"})
    )
    runs = runs_frame(
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


def test_row_labels_come_from_the_plugins_with_the_runs_recorded_options():
    """A DIABLO row is labelled with the N its runs recorded (``params.method.entries``), not
    the paper's N = 8; runs of one method that recorded different options keep the default."""
    from harness.reports.tables import method_labels, recorded_options

    runs = runs_frame(
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
        p.stem for p in (Path(__file__).resolve().parents[2] / "protocols" / "grids").glob("*.toml")
    ),
)
def test_every_grid_tables_map_at_r(grid):
    """MAP@R (Musgrave et al. 2020) is a column of every shipped grid's table (none of the
    papers forbids it) and of the default metrics."""
    from harness.config.grids import load_grid
    from harness.reports.tables import DEFAULT_METRICS

    loaded = load_grid(Path(__file__).resolve().parents[2] / "protocols" / "grids" / f"{grid}.toml")
    assert "mean_average_precision_at_r" in loaded.metrics
    assert "mean_average_precision_at_r" in DEFAULT_METRICS


def test_a_published_row_without_map_at_r_shows_a_dash_in_that_column():
    runs = runs_frame(
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
    runs = runs_frame(
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
