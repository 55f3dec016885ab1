"""What a table may mark: the multiple-comparison corrections (golden values), the class
bootstrap, the seed and chance rules, and a null simulation of tables of the real shape."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from harness.reports.stats import CORRECTIONS, adjust_p_values, paired_bootstrap
from harness.reports.tables import (
    MIN_SEEDS_FOR_MARK,
    SIGNIFICANCE,
    TEST_COLUMNS,
    attach_published,
    judge,
    paired_tests,
    render_markdown,
    summarize,
)
from tests.table_runs import runs_frame, table_parser

# ------------------------------------------------------------------ corrections


def test_holm_adjusted_p_values_equal_the_step_down_by_hand():
    """Holm (1979): sorted p (0.01, 0.02, 0.03, 0.04) times (4, 3, 2, 1), made monotone:
    0.04, 0.06, 0.06, 0.06; returned in the input order; NaN stays out of the count."""
    p = [0.03, 0.01, math.nan, 0.04, 0.02]
    got = adjust_p_values(p, "holm")
    assert got[[1, 4, 0, 3]] == pytest.approx([0.04, 0.06, 0.06, 0.06])
    assert math.isnan(got[2])
    assert adjust_p_values([0.5, 0.9], "holm").tolist() == [1.0, 1.0]  # capped at 1


def test_benjamini_hochberg_equals_scipys_false_discovery_control():
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 0.2, size=40)
    assert adjust_p_values(p, "bh") == pytest.approx(scipy_stats.false_discovery_control(p))
    # by hand: m = 3, sorted (0.01, 0.02, 0.04) -> (0.03, 0.03, 0.04)
    assert adjust_p_values([0.04, 0.01, 0.02], "bh") == pytest.approx([0.04, 0.03, 0.03])


def test_no_correction_leaves_the_p_values_and_an_unknown_one_is_refused():
    assert adjust_p_values([0.01, 0.2], "none").tolist() == [0.01, 0.2]
    assert set(CORRECTIONS) == {"holm", "bh", "none"}
    with pytest.raises(ValueError, match="unknown correction"):
        adjust_p_values([0.1], "bonferonni")


def test_the_table_command_offers_exactly_the_corrections_the_statistics_know():
    parser = table_parser()
    assert parser.parse_args(["table", "--experiment", "e"]).correction == "holm"
    for name in CORRECTIONS:
        assert (
            parser.parse_args(["table", "--experiment", "e", "--correction", name]).correction
            == name
        )
    with pytest.raises(SystemExit):
        parser.parse_args(["table", "--experiment", "e", "--correction", "bonferroni"])


# ------------------------------------------------------------------ class bootstrap


def test_class_bootstrap_is_wider_than_the_query_bootstrap_when_classes_share_their_luck():
    """Ten classes of 40 queries each: a class's queries all gain or all lose together.
    Resampled query by query, the 400 values look like 400 independent draws and the
    interval is far too narrow; resampled by class, there are only 10 independent units."""
    rng = np.random.default_rng(0)
    classes = np.repeat(np.arange(10), 40)
    shift = rng.normal(0.0, 1.0, size=10)[classes]
    diff = shift + rng.normal(0.0, 0.1, size=400)
    by_query = paired_bootstrap(diff, resamples=4000)
    by_class = paired_bootstrap(diff, classes=classes, resamples=4000)
    assert by_class.classes == 10 and by_query.classes == 0 and by_class.queries == 400
    assert (by_class.high - by_class.low) > 4 * (by_query.high - by_query.low)
    assert by_class.mean == pytest.approx(diff.mean())


def test_class_bootstrap_statistic_is_the_mean_over_the_drawn_queries():
    """Classes of unequal size: each resample's mean weighs a class by its queries, so
    with one class drawn every time its own mean is every resample's value."""
    got = paired_bootstrap([1.0, 1.0, 1.0, 3.0], classes=[7, 7, 7, 9], resamples=2000, seed=1)
    # the mean of the observed data weighs class 7 three times
    assert got.mean == pytest.approx(1.5)
    assert got.low >= 1.0 and got.high <= 3.0 and got.classes == 2


# ------------------------------------------------------------------ marks


def _runs(values: dict[str, list[float]], metric: str = "recall_at_1") -> pd.DataFrame:
    return runs_frame(
        [
            {"method": m, "seed": str(s), "run_id": f"{m}-{s}", f"test_{metric}": v}
            for m, vs in values.items()
            for s, v in enumerate(vs)
        ]
    )


def _row(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {label}"))


def test_a_two_seed_cell_carries_no_mark_and_says_why():
    """Two seeds, a difference the uncorrected t-test calls significant (p < 0.05): the
    interval is printed, the mark is not, the tests table says why."""
    runs = _runs({"plain": [0.600, 0.610], "agrouping": [0.700, 0.7101]})
    tests = paired_tests(runs, ["recall_at_1"])
    assert tests.loc[0, "p_t"] < SIGNIFICANCE and tests.loc[0, "pairs"] == 2
    text = render_markdown(attach_published(summarize(runs, ["recall_at_1"]), None), tests=tests)
    row = _row(text, "A-grouping")
    assert "↑" not in row and "±" in row and "(n=2)" in row
    assert f"fewer than {MIN_SEEDS_FOR_MARK} seeds" in text
    # the same difference over three seeds is marked
    runs3 = _runs({"plain": [0.600, 0.610, 0.605], "agrouping": [0.700, 0.7101, 0.704]})
    text3 = render_markdown(
        attach_published(summarize(runs3, ["recall_at_1"]), None),
        tests=paired_tests(runs3, ["recall_at_1"]),
    )
    assert "↑ (n=3)" in _row(text3, "A-grouping")


def test_a_cell_inside_the_chance_interval_carries_no_mark():
    """Both rows at or below the chance interval's upper end: no mark, however small p."""
    runs = _runs({"plain": [0.010, 0.011, 0.012], "agrouping": [0.020, 0.0212, 0.0221]})
    cells = attach_published(summarize(runs, ["recall_at_1"]), None)
    tests = paired_tests(runs, ["recall_at_1"])
    assert tests.loc[0, "p_t"] < 0.01
    chance = pd.DataFrame(
        [{"dataset": "cub200", "metric": "recall_at_1", "mean": 1.5, "half_width": 1.0, "draws": 5}]
    )
    judged = judge(tests, chance=chance)
    assert judged.loc[0, "unmarked"] == "both rows at chance"
    text = render_markdown(cells, tests=tests, chance=chance)
    assert "↑" not in _row(text, "A-grouping") and "both rows at chance" in text
    # above the chance interval, the same evidence is marked
    lower = chance.assign(half_width=0.1)
    assert "↑" in _row(render_markdown(cells, tests=tests, chance=lower), "A-grouping")


def test_the_notes_name_the_correction_and_the_size_of_its_family():
    runs = _runs({"plain": [0.60, 0.61, 0.605], "agrouping": [0.70, 0.712, 0.703]})
    runs = pd.concat([runs, runs.assign(dataset="cars196")], ignore_index=True)
    cells = attach_published(summarize(runs, ["recall_at_1"]), None)
    tests = paired_tests(runs, ["recall_at_1"])
    holm = render_markdown(cells, tests=tests)
    assert "Holm's step-down correction (family-wise error) over the table's 2 p-values" in holm
    bh = render_markdown(cells, tests=tests, correction="bh")
    assert "Benjamini-Hochberg" in bh and "adj." in bh


def test_holm_takes_away_a_mark_the_uncorrected_test_would_print():
    """Twenty comparisons; one has p between 0.05/20 and 0.05: marked without correction,
    not after Holm's."""
    rng = np.random.default_rng(4)
    rows = {"plain": [0.5, 0.51, 0.52]}
    for k in range(19):
        rows[f"m{k}"] = list(np.array(rows["plain"]) + rng.normal(0, 0.01, 3))
    tests = paired_tests(_runs(rows), ["recall_at_1"])
    tests.loc[0, "p_t"] = 0.02
    tests.loc[0, "difference"] = 1.0
    assert judge(tests, correction="none").loc[0, "p_t_adjusted"] == pytest.approx(0.02)
    assert judge(tests).loc[0, "p_t_adjusted"] > SIGNIFICANCE


# ------------------------------------------------------------------ null simulation

METHODS, LOSSES, DATASETS, METRICS, SEEDS = 8, 3, 4, 5, 3


def _null_tables(n_tables: int, rng: np.random.Generator) -> list[pd.DataFrame]:
    """Paired tests of tables of the real shape where every method equals the baseline:
    per table, (methods - 1) rows x losses x datasets x metrics compared with the shared
    baseline over 3 seeds (t-test p from the simulated seed values; a bootstrap p beside
    each, uniform as a valid null p is)."""
    shape = (n_tables, LOSSES, DATASETS, METRICS, SEEDS)
    seed_effect = rng.normal(0, 1.0, size=shape)  # a seed moves every method alike
    baseline = seed_effect + rng.normal(0, 1.0, size=shape)
    methods = seed_effect[:, None] + rng.normal(0, 1.0, size=(n_tables, METHODS - 1, *shape[1:]))
    p_t = scipy_stats.ttest_rel(methods, baseline[:, None], axis=-1).pvalue
    diff = (methods - baseline[:, None]).mean(-1)
    per_table = p_t[0].size
    p_boot = rng.uniform(size=(n_tables, per_table))
    tables = []
    for k in range(n_tables):
        frame = pd.DataFrame(
            {c: "" for c in TEST_COLUMNS} | {"pairs": SEEDS}, index=range(per_table)
        )
        frame["p_t"], frame["difference"] = p_t[k].ravel(), diff[k].ravel()
        frame["p_boot"], frame["boot_difference"] = p_boot[k], diff[k].ravel()
        frame["row_mean"] = frame["baseline_mean"] = 50.0
        tables.append(frame)
    return tables


def _marked(judged: pd.DataFrame) -> bool:
    free = judged["unmarked"] == ""
    return bool(
        (
            free
            & ((judged["p_t_adjusted"] < SIGNIFICANCE) | (judged["p_boot_adjusted"] < SIGNIFICANCE))
        ).any()
    )


def test_null_tables_are_marked_at_most_five_percent_of_the_time_after_holm():
    """1,000 simulated null tables (7 rows x 3 losses x 4 datasets x 5 metrics = 420
    comparisons, two tests each): Holm's correction marks at most 5% of them anywhere;
    read one p at a time, nearly every table would carry a mark."""
    rng = np.random.default_rng(2026)
    tables = _null_tables(1000, rng)
    corrected = sum(_marked(judge(t)) for t in tables)
    uncorrected = sum(_marked(judge(t, correction="none")) for t in tables[:100])
    assert corrected <= 50, corrected
    assert uncorrected >= 95, uncorrected
    assert judge(tables[0])["family"].iloc[0] == 2 * 7 * LOSSES * DATASETS * METRICS
