"""The ``table`` command over runs written straight into a temporary MLflow store (no
training): finished runs, superseded revisions, mixed fingerprints, published rows,
method options as rows and the paired bootstrap over the runs' per-query artifacts."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest

from harness.base.errors import HarnessError
from harness.reports.tables import (
    CELL_COLUMNS,
    TableRequest,
    attach_published,
    load_published,
    make_table,
    render_markdown,
    summarize,
)
from tests.table_runs import DIABLO_ROWS, PUBLISHED, fake_run, table_parser


def _table_text(experiments: list[str], **options) -> str:
    """The text of the table of ``experiments`` (``options``: :class:`TableRequest`'s)."""
    return make_table(TableRequest(experiments=tuple(experiments), **options)).text


def test_table_command_reads_finished_runs_and_writes_atomically(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    fake_run(client, exp_id, method="agrouping", seed=0, r1=0.70, start_time=2_000)
    fake_run(
        client, exp_id, method="agrouping", seed=0, r1=0.10, start_time=1_000
    )  # superseded by the rerun
    fake_run(client, exp_id, method="agrouping", seed=1, r1=0.72)
    fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.60)
    fake_run(client, exp_id, method="ngrouping", seed=1, r1=0.10, status="FAILED")  # ignored
    args = table_parser().parse_args(
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
    fake_run(client, exp_id, method="agrouping", seed=0, r1=0.10, revision=1)
    fake_run(client, exp_id, method="agrouping", seed=1, r1=0.20, revision=1)
    fake_run(client, exp_id, method="agrouping", seed=0, r1=0.60, revision=2)
    fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.50)
    cells = summarize(load_runs([experiment]), ["recall_at_1"])
    a = cells[cells.method == "agrouping"].iloc[0]
    assert (a["mean"], a["n"]) == (pytest.approx(60.0), 1)  # revision 2 only: one seed so far
    assert cells[cells.method == "ngrouping"].iloc[0]["n"] == 1
    assert "2 run(s) superseded" in capsys.readouterr().err


def test_table_command_refuses_mixed_fingerprints(experiment, workdir):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    fake_run(client, exp_id, method="agrouping", seed=0, r1=0.70, fp="aaaa1111")
    fake_run(client, exp_id, method="ngrouping", seed=0, r1=0.60, fp="bbbb2222")
    args = table_parser().parse_args(["table", "--experiment", experiment])
    with pytest.raises(HarnessError, match="aaaa1111.*bbbb2222"):
        args.func(args)
    assert not (workdir / "results" / "tables").exists()


def test_table_command_names_unknown_experiments(workdir):
    args = table_parser().parse_args(["table", "--experiment", "no-such-experiment"])
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
        "reproduced",
        "published",
    ]


def test_table_command_takes_published_rows(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    fake_run(client, exp_id, method="plain", seed=0, r1=0.70)
    rows = [f"--published-row={m}={spec}" for m, specs in DIABLO_ROWS.items() for spec in specs]
    args = table_parser().parse_args(
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
    args = table_parser().parse_args(
        ["table", "--experiment", experiment, "--published-row", "diablo"]
    )
    with pytest.raises(HarnessError, match="must look like METHOD=PUBLISHED_METHOD@SETTING"):
        args.func(args)


def test_a_mislabelled_published_column_is_never_compared(experiment, capsys):
    """A-grouping Table 2 heads its ResNet-50 SOP column R@2 but prints R@10 values there
    (Ours-R 91.8 against Table 4's R@2 83.11): the rows stay in the CSV, flagged, and the
    table leaves them out with a footnote and one line on stderr."""
    pub = load_published(PUBLISHED, ["2"])
    assert not (
        (pub.dataset == "sop") & (pub.metric == "recall_at_2") & (pub.backbone == "resnet50")
    ).any()
    assert (
        (pub.dataset == "sop") & (pub.metric == "recall_at_10")
    ).sum() == 5  # Inception rows: R@10 as printed
    assert "agrouping sop recall_at_2 (table 2): column_mislabelled" in capsys.readouterr().err
    client = mlflow.MlflowClient()
    fake_run(client, client.create_experiment(experiment), method="agrouping", seed=0, r1=0.70)
    text = _table_text([experiment], fmt="markdown", published=PUBLISHED, tables=("2",))
    assert "91.80" not in text and "79.20" in text  # Ours-R SOP: R@1 compared, the "R@2" not
    assert "Published values not compared: " in text and "never compared as R@2" in text
    latex = _table_text([experiment], fmt="latex", published=PUBLISHED, tables=("2",))
    assert "Published values not compared" in latex and latex.rstrip().endswith("\\end{table*}")


def test_diml_k_sweep_rows_carry_their_note_into_the_table(experiment):
    """DIML Table 3's test-only rows and Tables 5-6 come from the released code's K-sweep
    evaluation: compared, with the note as a footnote."""
    diml = PUBLISHED.with_name("diml.csv")
    rows = {"plain": ["plain@diml_stage=none"], "diml": ["diml@diml_stage=test"]}
    pub = load_published(diml, ["3"], rows)
    assert set(pub.loc[pub.method == "diml", "note"].str.split(":").str[0]) == {"ksweep"}
    assert set(pub.loc[pub.method == "plain", "note"]) == {""}
    assert set(load_published(diml, ["1"])["note"]) == {""}
    client = mlflow.MlflowClient()
    fake_run(client, client.create_experiment(experiment), method="diml", seed=0, r1=0.70)
    text = _table_text(
        [experiment], fmt="markdown", published=diml, tables=("3",), published_rows=rows
    )
    assert "Published values marked ksweep: from the released code's K-sweep evaluation" in text


def _option_run(client, exp_id, *, seed, entries, r1, tuned=False, init_from="none"):
    rid = fake_run(client, exp_id, method="diablo", seed=seed, r1=r1)
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
    from harness.reports.tables import artifact_per_query

    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(50), 4)
    stored = {}
    for method, shift in (("plain", 0), ("agrouping", 2)):
        for seed in (0, 1, 2):
            ranks = np.maximum(
                rng.integers(-1, 3, size=len(labels)) - shift, 0
            )  # agrouping ranks better
            rid = fake_run(client, exp_id, method=method, seed=seed, r1=float((ranks == 0).mean()))
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
    text = _table_text(
        [experiment], fmt="markdown", metrics=("recall_at_1",), baseline="plain", resamples=500
    )
    a_row = next(line for line in text.splitlines() if line.startswith("| A-grouping"))
    assert "⇑" in a_row  # the bootstrap over 50 classes sees the better first ranks
    assert (
        "paired bootstrap over the test set's classes (each drawn class brings all its queries"
        in text
    )
    assert "(Q=200, 50 classes)" in text
    # the chance row: random embeddings of the same 200 queries, P@1 about 3 / 199
    chance = next(line for line in text.splitlines() if line.startswith("| Chance (random"))
    assert float(chance.split(" | ")[1].split(" ")[0]) < 5.0 and "(n=5)" in chance
