"""The verdict of a rerun: equal metrics are IDENTICAL, differences within the cell's seed
noise WITHIN NOISE, and a test metric outside it, a changed count of the test set or a
missing metric DIFFERS; the noise interval is t(0.975, n-1) s sqrt(2)."""

from __future__ import annotations

import math

import pytest

from harness.reports.reruns import (
    DIFFERS,
    IDENTICAL,
    WITHIN_NOISE,
    Comparison,
    InputDifference,
    compare_metrics,
    compared_keys,
    format_comparisons,
    format_differences,
    format_metric_table,
    noise_half_width,
)

RECORDED = {
    "test/1_precision_at_1": 0.25,
    "test/num_queries": 240.0,
    "train/loss": 0.5,
    "val/mean_average_precision_at_r": 0.1,
    "system/train_images_per_s": 80.0,
    "P at 1": 25.0,
}


def test_the_noise_interval_is_the_t_interval_of_a_difference_of_two_seeds():
    values = [0.20, 0.24, 0.22]  # s = 0.02, t(0.975, 2) = 4.302653
    assert noise_half_width(values, tolerance=0.5) == pytest.approx(4.302653 * 0.02 * math.sqrt(2))
    assert noise_half_width([0.2], tolerance=0.5) == 0.5
    assert noise_half_width([0.2, math.nan], tolerance=0.5) == 0.5


def test_machine_metrics_and_display_copies_are_not_compared():
    assert compared_keys(RECORDED) == [
        "test/1_precision_at_1",
        "test/num_queries",
        "train/loss",
        "val/mean_average_precision_at_r",
    ]


def test_equal_metrics_are_identical_whatever_the_machine_metrics_say():
    new = {**RECORDED, "system/train_images_per_s": 10.0, "P at 1": 99.0}
    verdict, rows = compare_metrics(RECORDED, new, {"test/1_precision_at_1": 0.01})
    assert verdict == IDENTICAL and all(row.equal for row in rows) and len(rows) == 4


def test_a_test_metric_within_its_interval_is_within_noise_and_outside_differs():
    new = {**RECORDED, "test/1_precision_at_1": 0.255, "train/loss": 0.49}
    assert compare_metrics(RECORDED, new, {"test/1_precision_at_1": 0.01})[0] == WITHIN_NOISE
    assert compare_metrics(RECORDED, new, {"test/1_precision_at_1": 0.001})[0] == DIFFERS


def test_another_test_set_size_or_a_missing_metric_differs():
    more_queries = {**RECORDED, "test/num_queries": 241.0, "train/loss": 0.49}
    assert compare_metrics(RECORDED, more_queries, {"test/num_queries": 10.0})[0] == DIFFERS
    missing = {k: v for k, v in RECORDED.items() if k != "val/mean_average_precision_at_r"}
    verdict, rows = compare_metrics(RECORDED, missing, {})
    assert verdict == DIFFERS
    assert [row.key for row in rows if row.new is None] == ["val/mean_average_precision_at_r"]


def test_the_tables_name_the_differences_and_the_verdicts():
    difference = InputDifference("package torch", "0.0.1", "2.5.1")
    text = format_differences("plain seed 0", [difference])
    assert "| package torch | 0.0.1 | 2.5.1 | yes |" in text
    assert "agree on every input" in format_differences("plain seed 0", [])
    new = {**RECORDED, "test/1_precision_at_1": 0.3}
    verdict, rows = compare_metrics(RECORDED, new, {"test/1_precision_at_1": 0.01})
    comparison = Comparison("a1", "b2", "plain seed 0", verdict, rows, "tolerance 0.01")
    table = format_comparisons([comparison])
    assert "| plain seed 0 (a1) | b2 | DIFFERS | 3/4 | test/1_precision_at_1 +0.05 |" in table
    assert table.endswith("IDENTICAL 0, WITHIN NOISE 0, DIFFERS 1")
    detail = format_metric_table(comparison)
    assert "| test/1_precision_at_1 | 0.25 | 0.3 | +0.05 | ±0.01 | OUTSIDE |" in detail
    assert comparison.to_dict()["metrics"][0]["difference"] == pytest.approx(0.05)
