"""Intervals, paired tests, per-query results and DIML's query-in-R metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from harness.components.evaluation import (
    PAPER_VARIANTS,
    evaluate_embeddings,
    load_per_query,
    per_query_values,
    save_per_query,
    with_paper_variants,
)
from harness.components.evaluation.metrics import retrieval_metrics
from harness.reports.stats import (
    paired_bootstrap,
    paired_t_test,
    pool_query_differences,
    t_interval,
)

# ------------------------------------------------------------------ DIML's query in R


def test_perfect_ranking_scores_n_minus_1_over_n_with_the_query_in_r():
    """wl-zhao/DIML evaluation/metrics.py: num_pos counts the query's whole class (n), the
    query itself is pushed to the end of its ranking; a perfect ranking of a class of n
    images lists its n - 1 others first, so RP = MAP@R = (n - 1) / n, not 1."""
    # Two classes, n = 4 and n = 3, same-source; each query's list (self removed) is perfect.
    labels = np.array([0, 0, 0, 0, 1, 1, 1])
    neighbours = []
    for i, y in enumerate(labels):
        same = [j for j in range(len(labels)) if labels[j] == y and j != i]
        other = [j for j in range(len(labels)) if labels[j] != y]
        neighbours.append(labels[same + other])
    r = np.array([3, 3, 3, 3, 2, 2, 2])
    scores = retrieval_metrics(
        np.array(neighbours),
        labels,
        r,
        metrics=list(PAPER_VARIANTS.values()) + ["r_precision", "mean_average_precision_at_r"],
    )
    expected = (4 * 3 / 4 + 3 * 2 / 3) / 7
    assert scores["r_precision_query_in_r"] == pytest.approx(expected)
    assert scores["mean_average_precision_at_r_query_in_r"] == pytest.approx(expected)
    assert scores["r_precision"] == 1.0 and scores["mean_average_precision_at_r"] == 1.0


def test_query_in_r_is_computed_from_the_same_ranking_by_evaluate_embeddings():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(5), 4)
    emb = rng.normal(size=(20, 8)).astype(np.float32) + 3 * np.eye(8, dtype=np.float32)[labels]
    metrics = with_paper_variants(["precision_at_1", "r_precision", "mean_average_precision_at_r"])
    assert metrics[-2:] == ("r_precision_query_in_r", "mean_average_precision_at_r_query_in_r")
    out = evaluate_embeddings(emb, labels, metrics=[*metrics, "map_at_c"])
    # same window and divisor as Roth's mAP@C, a different name for a different paper
    assert out["mean_average_precision_at_r_query_in_r"] == pytest.approx(out["map_at_c"])
    assert out["r_precision_query_in_r"] <= 3 / 4 + 1e-12
    # query/gallery: no self to count, the variants equal the standard metrics
    qg = evaluate_embeddings(emb[::2], labels[::2], emb[1::2], labels[1::2], metrics=metrics)
    assert qg["r_precision_query_in_r"] == pytest.approx(qg["r_precision"])


# ------------------------------------------------------------------ per-query results


def test_per_query_values_reproduce_every_mean_and_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(6), 5)
    labels = np.append(labels, 99)  # a lone query: kept in the arrays, out of every mean
    emb = rng.normal(size=(len(labels), 16)).astype(np.float32)
    out = evaluate_embeddings(
        emb,
        labels,
        recall_k=(1, 4),
        per_query=True,
        metrics=[
            "precision_at_1",
            "recall_at_k",
            "r_precision",
            "mean_average_precision_at_r",
            "r_precision_query_in_r",
        ],
    )
    arrays = out.per_query
    assert arrays["num_relevant"][-1] == 0 and out["num_lone_queries"] == 1
    for metric in (
        "precision_at_1",
        "recall_at_4",
        "r_precision",
        "mean_average_precision_at_r",
        "r_precision_query_in_r",
    ):
        assert per_query_values(arrays, metric).mean() == pytest.approx(out[metric]), metric
    assert per_query_values(arrays, "nmi") is None
    path = tmp_path / "evaluation" / "per_query_test.npz"
    save_per_query(path, arrays)
    back = load_per_query(path)
    assert set(back) == set(arrays) and all(np.array_equal(back[k], arrays[k]) for k in arrays)
    assert list(path.parent.iterdir()) == [path]  # written atomically: no temporary left
    assert out.per_query is not None and evaluate_embeddings(emb, labels).per_query is None


# ---------------------------------------------------------------------- statistics


def test_t_interval_matches_scipy():
    values = [61.2, 63.5, 60.1, 62.8, 64.0]
    mean, half, n = t_interval(values)
    low, high = scipy_stats.t.interval(
        0.95, len(values) - 1, loc=np.mean(values), scale=scipy_stats.sem(values)
    )
    assert (mean, n) == (pytest.approx(np.mean(values)), 5)
    assert mean - half == pytest.approx(low) and mean + half == pytest.approx(high)
    assert math.isnan(t_interval([50.0])[1]) and t_interval([])[2] == 0


def test_paired_t_test_matches_scipy_and_needs_spread():
    a, b = [0.70, 0.72, 0.69], [0.60, 0.65, 0.61]
    diff, p = paired_t_test(a, b)
    assert diff == pytest.approx(np.mean(np.subtract(a, b)))
    assert p == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue)
    assert math.isnan(
        paired_t_test([1.0, 2.0], [0.0, 1.0])[1]
    )  # constant difference: nothing to test
    assert math.isnan(paired_t_test([1.0], [0.0])[1])


def test_paired_bootstrap_is_seeded_and_finds_a_clear_difference():
    rng = np.random.default_rng(0)
    clear = rng.normal(1.0, 1.0, size=400)
    first, again = paired_bootstrap(clear, resamples=2000), paired_bootstrap(clear, resamples=2000)
    assert first == again and first.low > 0 and first.p < 0.01 and first.queries == 400
    null = paired_bootstrap(rng.normal(0.0, 1.0, size=400), resamples=2000)
    assert null.low < 0 < null.high and null.p > 0.05


def test_query_differences_are_averaged_over_seeds_when_the_queries_agree():
    labels = np.array([0, 0, 1])
    diffs, classes, how = pool_query_differences(
        [(np.array([1.0, 0, 1]), np.zeros(3), labels), (np.array([0.0, 0, 1]), np.zeros(3), labels)]
    )
    assert how == "averaged over seeds" and diffs.tolist() == [0.5, 0.0, 1.0]
    assert classes.tolist() == [0, 0, 1]
    diffs, classes, how = pool_query_differences(
        [(np.ones(3), np.zeros(3), labels), (np.ones(2), np.zeros(2), labels[:2])]
    )
    assert how == "pooled over seeds" and len(diffs) == 5 and classes.tolist() == [0, 0, 1, 0, 0]


def test_a_separated_reports_per_query_values_average_to_its_metrics():
    """The separated report is the mean over fold models of each model's metrics; its
    per-query values (what the bootstrap resamples) must average to the same numbers, P@1
    and Recall@K included: a model's first-hit rank is kept, not averaged with another's."""
    from harness.engine.tuning.runs import separated_per_query

    rng = np.random.default_rng(5)
    labels = np.repeat(np.arange(12), 4)
    models = [
        evaluate_embeddings(
            rng.normal(size=(48, 8)) + 2.0 * np.eye(8)[labels % 8] * k,
            labels,
            recall_k=(1, 2),
            metrics=["precision_at_1", "recall_at_k", "mean_average_precision_at_r"],
            per_query=True,
        )
        for k in (0.5, 1.5)
    ]
    arrays = separated_per_query([m.per_query for m in models])
    for metric in ("precision_at_1", "recall_at_2", "mean_average_precision_at_r"):
        expected = np.mean([m[metric] for m in models])
        assert per_query_values(arrays, metric).mean() == pytest.approx(expected), metric
