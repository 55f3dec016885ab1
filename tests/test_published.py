"""Sanity checks for the transcribed published result tables in ``results/published``.

agrouping.csv: Xu et al., "Towards Improved and Interpretable Deep Metric Learning via
Attentive Grouping", Tables 2-4.  diml.csv: Zhao et al., "Towards Interpretable Deep Metric
Learning with Structural Matching", Tables 1-6.  One row per printed cell ("-" cells omitted).
"""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

PUBLISHED = Path(__file__).resolve().parents[1] / "results" / "published"

BASE_COLUMNS = ["table", "backbone", "loss", "method", "dataset", "metric", "value"]

SPECS = {
    "agrouping.csv": {
        "columns": BASE_COLUMNS,
        # Table 2: 15 method rows x 9 columns minus 9 "-" cells (HDC, BIER, A-BIER NMI);
        # Table 3: 6 configurations x 5 grouping modules x 10 columns; Table 4: 5 x 5.
        "rows_per_table": {"2": 126, "3": 300, "4": 25},
    },
    "diml.csv": {
        "columns": BASE_COLUMNS + ["setting"],
        # T1: 17 baselines x 2 rows x 9; T2: 8 rows x 6; T3: 6 rows x 6; T4: 12 rows x 6;
        # T5: 10 rows x 9; T6: 8 rows x 9.
        "rows_per_table": {"1": 306, "2": 48, "3": 36, "4": 72, "5": 90, "6": 72},
    },
}

DATASETS = {"cub200", "cars196", "sop"}
BACKBONES = {"googlenet", "resnet50"}
GROUPING_METHODS = {"ngrouping", "mgrouping", "ggrouping", "cgrouping", "agrouping"}


def _load(name: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(PUBLISHED / name, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_header(name):
    header, _ = _load(name)
    assert header == SPECS[name]["columns"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_values_are_percentages(name):
    _, rows = _load(name)
    assert rows
    for row in rows:
        value = float(row["value"])
        assert 0.0 <= value <= 100.0, row
        assert row["dataset"] in DATASETS, row
        assert row["backbone"] in BACKBONES, row
        assert row["method"] and row["metric"], row


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_duplicate_keys(name):
    header, rows = _load(name)
    key_columns = [c for c in header if c != "value"]
    keys = Counter(tuple(row[c] for c in key_columns) for row in rows)
    duplicates = [k for k, n in keys.items() if n > 1]
    assert not duplicates, duplicates


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rows_per_table(name):
    _, rows = _load(name)
    counts = Counter(row["table"] for row in rows)
    assert dict(counts) == SPECS[name]["rows_per_table"]


def test_agrouping_tables_3_4_methods_are_grouping_modules():
    _, rows = _load("agrouping.csv")
    methods = {row["method"] for row in rows if row["table"] in {"3", "4"}}
    assert methods <= GROUPING_METHODS, methods - GROUPING_METHODS
    assert methods == GROUPING_METHODS


def test_agrouping_ours_rows_use_margin_loss():
    _, rows = _load("agrouping.csv")
    for row in rows:
        if row["table"] == "2":
            assert row["loss"] == ("margin" if row["method"] == "agrouping" else ""), row


def test_diml_methods():
    """The paper's "Baseline" rows are the harness's ``plain`` method (GAP + linear, the
    model DIML is applied to), so the table joins them to reproduced runs by name."""
    from methods import METHODS

    _, rows = _load("diml.csv")
    assert {row["method"] for row in rows} == {"plain", "diml"}
    assert all(row["method"] in METHODS for row in rows)
    assert all(row["loss"] for row in rows)
