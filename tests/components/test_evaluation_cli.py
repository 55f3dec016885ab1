"""``python -m harness evaluate``: metrics of saved embeddings, self and query/gallery,
and each bad file refused with one line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.base.errors import HarnessError
from harness.cli.evaluate import add_evaluate_parser
from harness.components.evaluation import (
    evaluate_embeddings,
    gpu_available,
)
from tests.evaluation_data import (
    continuous_data,
)

REPO = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """The evaluate command under a parser like harness.cli.main's (HarnessError -> 'error: ...', exit 2)."""
    parser = argparse.ArgumentParser(prog="python -m harness")
    add_evaluate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def saved(tmp_path):
    x, y = continuous_data(1)
    np.save(tmp_path / "emb.npy", x)
    np.save(tmp_path / "lab.npy", y)
    return tmp_path, x, y


def test_cli_self_and_query_gallery(saved, capsys):
    tmp, x, y = saved
    out_json = tmp / "out" / "m.json"
    code, out, _ = run_cli(
        [
            "evaluate",
            "--embeddings",
            str(tmp / "emb.npy"),
            "--labels",
            str(tmp / "lab.npy"),
            "--recall-k",
            "1,10",
            "--json",
            str(out_json),
        ],
        capsys,
    )
    assert code == 0 and "precision_at_1" in out
    record = json.loads(out_json.read_text())
    expected = evaluate_embeddings(x, y, recall_k=(1, 10))
    assert record["mode"] == "self" and record["num_lone_queries"] == expected["num_lone_queries"]
    assert record["metrics"] == pytest.approx(
        {k: v for k, v in expected.items() if not k.startswith("num_")}
    )
    assert not list(out_json.parent.glob(".*tmp"))

    np.save(tmp / "q.npy", x[:50])
    np.save(tmp / "ql.npy", y[:50])
    code, _, _ = run_cli(
        [
            "evaluate",
            "--embeddings",
            str(tmp / "emb.npy"),
            "--labels",
            str(tmp / "lab.npy"),
            "--query-embeddings",
            str(tmp / "q.npy"),
            "--query-labels",
            str(tmp / "ql.npy"),
            "--metrics",
            "precision_at_1,recall_at_5",
            "--json",
            str(out_json),
        ],
        capsys,
    )
    record = json.loads(out_json.read_text())
    assert code == 0 and record["mode"] == "query-gallery"
    assert set(record["metrics"]) == {"precision_at_1", "recall_at_5"}
    assert record["metrics"]["precision_at_1"] == pytest.approx(
        evaluate_embeddings(x[:50], y[:50], x, y, metrics=["precision_at_1"])["precision_at_1"]
    )


def _bad_files(tmp: Path, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[list[str], str]]:
    """name -> (extra argv replacing the good files, expected words in the message)."""
    nan = x.copy()
    nan[2, 1] = np.nan
    cases = {
        "missing.npy": None,
        "flat.npy": x[:, 0],
        "nan.npy": nan,
        "short_labels.npy": y[:-2],
        "labels_2d.npy": np.stack([y, y], 1),
        "zero_dim.npy": np.zeros((len(y), 0), np.float32),
        "objects.npy": None,
        "narrow.npy": x[:10, :5],
        "float_labels.npy": y + 0.5,
    }
    for name, array in cases.items():
        if array is not None:
            np.save(tmp / name, array)
    (tmp / "text.txt").write_text("1 2 3\n")
    (tmp / "garbage.npy").write_bytes(b"definitely not numpy")
    np.save(tmp / "objects.npy", np.array([{"a": 1}] * len(y), dtype=object), allow_pickle=True)
    emb, lab = str(tmp / "emb.npy"), str(tmp / "lab.npy")
    return {
        "missing": (["--embeddings", str(tmp / "missing.npy"), "--labels", lab], "no such file"),
        "not npy suffix": (["--embeddings", str(tmp / "text.txt"), "--labels", lab], ".npy"),
        "not npy content": (
            ["--embeddings", str(tmp / "garbage.npy"), "--labels", lab],
            "not a readable",
        ),
        "pickled objects": (
            ["--embeddings", emb, "--labels", str(tmp / "objects.npy")],
            "objects.npy",
        ),
        "1-D embeddings": (["--embeddings", str(tmp / "flat.npy"), "--labels", lab], "shape"),
        "no columns": (["--embeddings", str(tmp / "zero_dim.npy"), "--labels", lab], "shape"),
        "NaN": (["--embeddings", str(tmp / "nan.npy"), "--labels", lab], "NaN"),
        "label count": (
            ["--embeddings", emb, "--labels", str(tmp / "short_labels.npy")],
            "labels but",
        ),
        "2-D labels": (["--embeddings", emb, "--labels", str(tmp / "labels_2d.npy")], "1-D"),
        "fractional labels": (
            ["--embeddings", emb, "--labels", str(tmp / "float_labels.npy")],
            "whole",
        ),
        "query dims": (
            [
                "--embeddings",
                emb,
                "--labels",
                lab,
                "--query-embeddings",
                str(tmp / "narrow.npy"),
                "--query-labels",
                str(tmp / "short_labels.npy"),
            ],
            "labels but",
        ),
        "query without labels": (
            ["--embeddings", emb, "--labels", lab, "--query-embeddings", emb],
            "both",
        ),
        "metric name": (
            ["--embeddings", emb, "--labels", lab, "--metrics", "nmi,recal_at_k"],
            "unknown metric",
        ),
        "recall k": (["--embeddings", emb, "--labels", lab, "--recall-k", "1,x"], "--recall-k"),
        **(
            {}
            if gpu_available()
            else {"no GPU": (["--embeddings", emb, "--labels", lab, "--device", "cuda"], "GPU")}
        ),
    }


def test_cli_rejects_each_bad_file_with_one_line(saved, capsys):
    tmp, x, y = saved
    out_json = tmp / "never.json"
    for case, (argv, words) in _bad_files(tmp, x, y).items():
        code, out, err = run_cli(["evaluate", *argv, "--json", str(out_json)], capsys)
        assert code == 2, case
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (case, err)
        assert not out_json.exists(), case
        assert not list(tmp.glob(".never.json*")), case


def _evaluate_is_wired() -> bool:
    from harness.cli.main import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return any("evaluate" in a.choices for a in actions)


@pytest.mark.skipif(
    not _evaluate_is_wired(), reason="harness.cli.main does not wire `evaluate` yet"
)
def test_python_m_harness_evaluate(saved):
    tmp, x, y = saved
    base = [sys.executable, "-m", "harness", "evaluate", "--labels", str(tmp / "lab.npy")]
    ok = subprocess.run(
        [
            *base,
            "--embeddings",
            str(tmp / "emb.npy"),
            "--metrics",
            "precision_at_1",
            "--json",
            str(tmp / "m.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    expected = evaluate_embeddings(x, y, metrics=["precision_at_1"])["precision_at_1"]
    assert json.loads((tmp / "m.json").read_text())["metrics"]["precision_at_1"] == pytest.approx(
        expected
    )
    bad = subprocess.run(
        [*base, "--embeddings", str(tmp / "missing.npy")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.strip().count("\n") == 0
        and bad.stderr.startswith("error: ")
    )
