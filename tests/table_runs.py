"""Runs for the table tests: frames of runs as ``harness.reports.tables`` reads them,
runs written straight into an MLflow store (no training), and the ``table`` command's parser."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from harness.base.metric_keys import metric_key
from harness.cli.table import add_table_parser

PUBLISHED = Path(__file__).resolve().parents[1] / "results" / "published" / "agrouping.csv"


def runs_frame(rows: list[dict]) -> pd.DataFrame:
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


def two_methods() -> pd.DataFrame:
    return runs_frame(
        [
            {"method": "ngrouping", "seed": "0", "test_recall_at_1": 0.60, "test_nmi": 0.70},
            {"method": "ngrouping", "seed": "1", "test_recall_at_1": 0.62, "test_nmi": 0.72},
            {"method": "agrouping", "seed": "0", "test_recall_at_1": 0.65, "test_nmi": 0.69},
            {"method": "agrouping", "seed": "1", "test_recall_at_1": 0.67, "test_nmi": 0.69},
        ]
    )


def table_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_table_parser(parser.add_subparsers(dest="command", required=True))
    return parser


DIABLO_ROWS = {
    "plain": ["plain@"],
    "diablo": ["diablo@", "diablo@entries=8"],
    "diablo_n16": ["diablo@entries=16"],
}


def fake_run(
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
