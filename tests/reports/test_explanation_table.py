"""``explain-table`` over seeds: one row per method and map source, the newest explained
run of each seed taken, the mean over seeds with its t-interval over seeds, and the sanity
marks failing when one seed fails."""

from __future__ import annotations

import math

import mlflow
import pytest
from scipy import stats

from harness.base.metric_keys import metric_key
from harness.reports.explanation_table import explain_rows, markdown_table


def _explained_run(experiment: str, method: str, seed: int, share: float, **verdicts) -> str:
    """A FINISHED run with the ``explain/*`` metrics ``explain`` logs (the baseline only)."""
    with mlflow.start_run(experiment_id=_experiment_id(experiment)) as run:
        mlflow.set_tags({"method": method, "seed": str(seed)})
        metrics = {
            "pairs": 200.0,
            "curve_pairs": 16.0,
            "baseline_deletion_auc": 0.4,
            "baseline_discriminative_part_share": share,
            "baseline_discriminative_part_share_lo": share - 0.01,
            "baseline_discriminative_part_share_hi": share + 0.01,
            "baseline_chance_part_share": 0.03,
        }
        metrics.update({f"baseline_{k}": float(v) for k, v in verdicts.items()})
        mlflow.log_metrics({metric_key("explain", k): v for k, v in metrics.items()})
    return run.info.run_id


def _experiment_id(name: str) -> str:
    found = mlflow.get_experiment_by_name(name)
    return found.experiment_id if found else mlflow.create_experiment(name)


def test_rows_average_the_newest_run_of_each_seed_with_an_interval_over_seeds(experiment):
    _explained_run(experiment, "plain", 0, 0.90)  # replaced by the newer run of seed 0
    newest = [
        _explained_run(experiment, "plain", seed, share, beats_chance=1)
        for seed, share in ((0, 0.05), (1, 0.07), (2, 0.06))
    ]
    single = _explained_run(experiment, "sam", 0, 0.04, beats_chance=1)
    rows = {(r.method, r.source): r for r in explain_rows([experiment])}

    plain = rows[("plain", "Grad-CAM baseline")]
    assert sorted(plain.run_ids) == sorted(newest) and plain.seeds == ["0", "1", "2"]
    mean, lo, hi = plain.scores["discriminative_part_share"]
    half = stats.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)  # the seeds' means: sd 0.01
    assert mean == pytest.approx(0.06)
    assert (lo, hi) == (pytest.approx(0.06 - half), pytest.approx(0.06 + half))
    assert plain.verdicts["beats_chance"] is True

    sam = rows[("sam", "Grad-CAM baseline")]  # one seed: its own interval over pairs
    assert sam.run_ids == [single]
    assert sam.scores["discriminative_part_share"] == pytest.approx((0.04, 0.03, 0.05))

    table = markdown_table(list(rows.values()))
    assert "| plain | Grad-CAM baseline | 3 | 200 (16) |" in table
    assert "| sam | Grad-CAM baseline | 1 | 200 (16) |" in table


def test_a_row_fails_its_sanity_mark_when_one_seed_fails(experiment):
    _explained_run(experiment, "sam", 0, 0.05, beats_chance=1, changes_under_randomisation=1)
    _explained_run(experiment, "sam", 1, 0.05, beats_chance=0, changes_under_randomisation=1)
    (row,) = explain_rows([experiment])
    assert row.verdicts["beats_chance"] is False
    assert row.verdicts["changes_under_randomisation"] is True
    assert row.verdicts["uses_training"] is None
    assert "| <= chance |" in markdown_table([row])
