"""``harness.reports.tables``: confidence intervals, paired tests against the baseline,
ties, and rows computed by different evaluation code."""

from __future__ import annotations

import pandas as pd
import pytest
from scipy import stats as scipy_stats

from harness.reports.tables import (
    attach_published,
    render_latex,
    render_markdown,
    summarize,
)
from tests.table_runs import runs_frame


def _planted() -> pd.DataFrame:
    """Three seeds of plain and of a method clearly above it, and one tied with it."""
    values = {
        "plain": [0.600, 0.610, 0.605],
        "agrouping": [0.700, 0.712, 0.703],
        "mgrouping": [0.601, 0.615, 0.603],
    }
    return runs_frame(
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
    assert f"| {_p(tests.loc['agrouping', 'p_t'])} (adj. " in text


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
    runs = runs_frame(rows)
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
