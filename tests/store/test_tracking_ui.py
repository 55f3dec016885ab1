"""What a run leaves for the MLflow UI, read back from a store made by one short
``run --methods plain,diml`` (DIML evaluated on plain's weights): grouped metric names
with the headline metrics first and their readable copies, the source and command, the
description, every method option as a param, the selected epoch of the shared run, the
saved view, artifacts under proxied URIs, and the embedder as an MLflow model named after
its run, with its source and dataset, that loads with ``mlflow.pytorch.load_model`` and
embeds as the harness does."""

from __future__ import annotations

import json
import os

import mlflow
import mlflow.pytorch
import numpy as np
import pytest
import torch

from harness.base.metric_keys import (
    GROUPS,
    HEADLINE,
    READABLE,
    display_copies,
    display_key,
    group_metrics,
    metric_key,
    split_key,
)
from harness.cli.main import main
from harness.components.data.sampling import TransformedImages
from harness.components.data.transforms import build_transform
from harness.config.protocol_files import load_protocol
from harness.engine.run.data import prepare_splits
from harness.engine.run.embedding import embed_images
from harness.engine.run.model import build_model
from harness.methods import METHODS
from harness.store.artifacts import PROXIED_ROOT
from harness.store.runs_view import CURVES_SECTION, HEADLINE_SECTION, VERSION, VERSION_FIELD
from harness.store.ui import EXPERIMENT_KIND_TAG, ML_VIEW_QUERY, RUN_NOTE_TAG, RUNS_VIEW, ui_url
from harness.store.weights import load_finished_weights

REGISTERED = "dml-ui-embedder"


@pytest.fixture(scope="module")
def store(tmp_path_factory, data_root, tracking_dir, tiny_protocol):
    """The records of one ``run --methods plain,diml --register`` and its experiment."""
    folder = tmp_path_factory.mktemp("ui-store")
    before = os.getcwd()
    os.chdir(folder)
    logged = pytest.MonkeyPatch()
    logged.setenv("DML_HARNESS_LOG_MODEL", "1")  # this module reads the logged models
    try:
        out = folder / "records.json"
        assert (
            main(
                [
                    "run",
                    "--methods",
                    "plain,diml",
                    "--protocol",
                    str(tiny_protocol),
                    "--experiment",
                    "ui-store",
                    "--json",
                    str(out),
                    "--register",
                    REGISTERED,
                ]
            )
            == 0
        )
        records = {r["method"]: r for r in json.loads(out.read_text())}
        yield records, folder
    finally:
        logged.undo()
        os.chdir(before)


def _run(records, method):
    return mlflow.MlflowClient().get_run(records[method]["mlflow_run_id"])


def test_metric_keys_round_trip_and_sort_the_headline_first():
    for group in GROUPS:
        for name in (*HEADLINE, "recall_at_8", "loss", "group1_mass_head"):
            assert split_key(metric_key(group, name)) == (group, name)
    keys = sorted(metric_key("test", m) for m in ("r_precision", "f1", *reversed(HEADLINE), "ami"))
    assert [split_key(k)[1] for k in keys[:4]] == list(HEADLINE)
    assert split_key("test_precision_at_1") is None and split_key("other/x") is None
    with pytest.raises(ValueError, match="unknown metric group"):
        metric_key("tests", "nmi")


def test_display_copies_are_the_headline_metrics_of_test_and_validation_in_percent():
    logged = {
        metric_key("test", "precision_at_1"): 0.459027777,
        metric_key("test", "recall_at_8"): 0.9,
        metric_key("val", "mean_average_precision_at_r"): 0.0229,
        metric_key("paper_selection", "nmi"): 0.5,
        metric_key("train", "loss"): 1.0,
    }
    assert display_copies(logged) == {"P at 1": 45.9, "val MAP at R": 2.29}
    assert display_key("test", "nmi") == "NMI" and display_key("val", "recall_at_1") == "val R at 1"
    assert display_key("train", "loss") is None and display_key("test", "recall_at_8") is None


def test_every_metric_is_in_a_group_with_the_headline_first(store):
    records, _ = store
    for method in ("plain", "diml"):
        metrics = _run(records, method).data.metrics
        copies = display_copies(metrics)
        assert all(split_key(k) is not None or k in copies for k in metrics), sorted(metrics)
        test = sorted(k for k in metrics if k.startswith("test/"))
        assert [split_key(k)[1] for k in test[:4]] == list(HEADLINE)
        assert group_metrics(metrics, "test")["precision_at_1"] == pytest.approx(
            records[method]["metrics"]["precision_at_1"]
        )
    plain = _run(records, "plain").data.metrics
    assert {
        "system/train_images_per_s",
        "system/train_epoch_seconds",
        "system/max_rss_mb",
        "train/epoch_loss",
    } <= set(plain)
    history = mlflow.MlflowClient().get_metric_history(
        records["plain"]["mlflow_run_id"], metric_key("val", "mean_average_precision_at_r")
    )
    assert [m.step for m in history] == [1, 2]  # validation against the epoch
    lr = mlflow.MlflowClient().get_metric_history(records["plain"]["mlflow_run_id"], "train/lr")
    assert [m.step for m in lr] == list(range(1, 7))  # every step of 2 epochs of 3 batches
    client, run_id = mlflow.MlflowClient(), records["plain"]["mlflow_run_id"]
    losses = client.get_metric_history(run_id, "train/loss")
    relative = client.get_metric_history(run_id, "train/relative_loss")
    assert [m.step for m in relative] == [m.step for m in losses]
    assert [r.value for r in relative] == pytest.approx([m.value / losses[0].value for m in losses])


def test_the_headline_is_also_logged_in_percent_and_tables_ignore_it(store):
    """``P at 1`` & co. hold the headline test metrics in %, two decimals, beside the exact
    fractions, which they leave as they were; ``val MAP at R`` & co. the validation curves
    in %, at the same epochs; no group reads them."""
    records, _ = store
    client = mlflow.MlflowClient()
    for method in ("plain", "diml"):
        run_id = records[method]["mlflow_run_id"]
        metrics = client.get_run(run_id).data.metrics
        for name in HEADLINE:
            exact = records[method]["metrics"][name]
            assert metrics[metric_key("test", name)] == pytest.approx(exact)
            assert metrics[READABLE[name]] == round(100 * exact, 2)
        assert set(READABLE) == set(HEADLINE)
        assert not set(READABLE.values()) & set(group_metrics(metrics, "test"))
        for name in HEADLINE:
            fractions = client.get_metric_history(run_id, metric_key("val", name))
            copies = client.get_metric_history(run_id, str(display_key("val", name)))
            assert [(m.step, round(100 * m.value, 2)) for m in fractions] == [
                (m.step, m.value) for m in copies
            ]
    plain = client.get_metric_history(records["plain"]["mlflow_run_id"], "val MAP at R")
    assert [m.step for m in plain] == [1, 2]  # a curve, one point per epoch


def test_source_command_and_version_are_recorded(store):
    records, _ = store
    tags = _run(records, "plain").data.tags
    assert tags["mlflow.source.name"] == "python -m harness run"
    assert tags["command"].startswith("python -m harness run --methods plain,diml --protocol ")
    assert tags["command"].endswith(f"--register {REGISTERED}")
    if tags["git_commit"] != "unknown":
        assert tags["mlflow.source.git.commit"] == tags["git_commit"].removesuffix("-dirty")
    if tags["version.dml-harness"] != "not installed":
        assert tags["harness_version"] == tags["version.dml-harness"]


def test_the_description_summarises_the_run(store):
    """The description opens with plain text (the UI's chart tooltip shows it raw): what ran
    and its headline metrics in % with two decimals; then the deviations, before the fold
    of the run page; then the selection."""
    records, _ = store
    for method in ("plain", "diml"):
        record, tags = records[method], _run(records, method).data.tags
        lines = tags[RUN_NOTE_TAG].splitlines()
        m = record["metrics"]
        assert lines[0] == (
            f"{method} on synthetic, protocol tiny. Test: P@1 = R@1 "
            f"{100 * m['precision_at_1']:.2f} %, MAP@R "
            f"{100 * m['mean_average_precision_at_r']:.2f} %, NMI {100 * m['nmi']:.2f} %."
        )
        assert not set("*|&`#") & set(lines[0] + lines[2])  # no Markdown the tooltip shows
        assert lines[2] == (
            "Deviations from the paper: none. From the protocol (tag deviations): none."
        )
        assert tags["deviations"] == "none"
        assert lines[4].startswith(f"Model selection: validation, epoch {record['selected_epoch']}")
        name = _run(records, method).info.run_name  # its model's name too
        assert lines[6] == (
            f"Look at: the model {name} (Models tab); views/retrieval_examples.png, "
            "views/embedding_map.png (Artifacts tab)."
        )
    diml = _run(records, "diml").data.tags[RUN_NOTE_TAG]
    assert records["plain"]["mlflow_run_id"] in diml.splitlines()[4]


def test_a_description_names_the_deviations_from_the_paper_before_listing_them():
    from harness.reports.results import run_note

    note = run_note(
        method="avsl",
        dataset="cub200",
        protocol="avsl",
        selection="validation",
        metrics={"precision_at_1": 0.459, "recall_at_1": 0.46, "nmi": 0.644},
        selected_epoch=3,
        deviations=["optimizer.lr_head: 0.001 -> 0.01"],
        paper_deviations=["backbone: paper X (ref); here Y. Why.", "sampler: paper A; here B. C."],
        model="avsl-cub200-margin-seed0",
        figures=["views/retrieval_examples.png", "views/embedding_map.png"],
    ).splitlines()
    assert note[0] == "avsl on cub200, protocol avsl. Test: P@1 45.90 %, R@1 46.00 %, NMI 64.40 %."
    assert note[2] == (
        "Deviations from the paper: 2 (backbone, sampler; below). From the protocol "
        "(tag deviations): optimizer.lr_head: 0.001 -> 0.01."
    )
    assert note[6] == (
        "Look at: the model avsl-cub200-margin-seed0 (Models tab); views/retrieval_examples.png, "
        "views/embedding_map.png (Artifacts tab)."
    )
    assert note[-2:] == [
        "- backbone: paper X (ref); here Y. Why.",
        "- sampler: paper A; here B. C.",
    ]


def test_the_shared_run_records_the_epoch_its_weights_were_selected_at(store):
    records, _ = store
    plain, diml = _run(records, "plain").data.tags, _run(records, "diml").data.tags
    assert (
        diml["evaluate_only"] == "True" and diml["init_from"] == records["plain"]["mlflow_run_id"]
    )
    assert int(plain["selected_epoch"]) >= 1
    assert (
        diml["selected_epoch"] == plain["selected_epoch"] == str(records["diml"]["selected_epoch"])
    )


def test_every_option_of_the_method_is_a_param(store):
    records, _ = store
    for method in ("plain", "diml"):
        params = _run(records, method).data.params
        options = METHODS.get(method).options()
        assert options, method
        assert {f"method.{name}" for name in options} <= set(params)


def test_the_experiment_is_of_the_model_development_kind(store):
    records, _ = store
    experiment = mlflow.MlflowClient().get_experiment(_run(records, "plain").info.experiment_id)
    key, kind = EXPERIMENT_KIND_TAG
    assert experiment.tags[key] == kind
    view = json.loads(
        experiment.tags[f"mlflow.sharedViewState.{RUNS_VIEW[0]}"]
    )  # the UI's saved-view envelope
    assert view["name"] == RUNS_VIEW[1] and isinstance(view["createdAt"], int)
    state = json.loads(view["state"])
    assert state[VERSION_FIELD] == VERSION
    assert state["selectedColumns"] == [
        *(f"metrics.`{READABLE[m]}`" for m in HEADLINE),
        *(f"tags.`{key}`" for key in ("method", "dataset", "loss", "seed")),
    ]  # the headline first; no Source, Models or Dataset column
    assert state["orderByKey"] == "metrics.`P at 1`" and not state["orderByAsc"]
    assert state["runsHiddenMode"] == "SHOW_ALL" and state["isAccordionReordered"]
    open_sections = [s["name"] for s in state["compareRunSections"] if s["display"]]
    assert open_sections == [HEADLINE_SECTION, CURVES_SECTION]
    shown = [c for c in state["compareRunCharts"] if not c["deleted"]]
    assert [(c["type"], c.get("metricKey") or c["yaxis"]["key"]) for c in shown] == [
        *(("SCATTER", READABLE[m]) for m in HEADLINE),
        ("LINE", "val MAP at R"),
        ("LINE", "train/loss"),
        ("LINE", "train/relative_loss"),
        ("LINE", "train/lr"),
    ]
    assert all(c["xaxis"] == {"key": "method", "type": "PARAM"} for c in shown[:4])
    assert shown[-1]["scaleType"] == "log"
    runs_page = ui_url("http://127.0.0.1:5000", experiment.experiment_id)
    assert runs_page.endswith(f"/#/experiments/{experiment.experiment_id}/runs?{ML_VIEW_QUERY}")
    url = ui_url(
        "http://127.0.0.1:5000", experiment.experiment_id, records["plain"]["mlflow_run_id"]
    )
    assert url == (
        f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs/"
        f"{records['plain']['mlflow_run_id']}?{ML_VIEW_QUERY}"
    )


def test_artifacts_are_recorded_relative_to_the_store(store):
    """Runs and models record ``mlflow-artifacts:`` URIs, which a SQLite store resolves to
    the folder beside its database (a moved store keeps them)."""
    records, _ = store
    client = mlflow.MlflowClient()
    run = _run(records, "plain")
    assert client.get_experiment(run.info.experiment_id).artifact_location == PROXIED_ROOT
    assert run.info.artifact_uri == f"{PROXIED_ROOT}{run.info.run_id}/artifacts"
    model = client.get_logged_model(run.data.tags["model_uri"].split("/")[-1])
    assert model.artifact_location.startswith(f"{PROXIED_ROOT}models/")
    assert "weights/model.pt" in {a.path for a in client.list_artifacts(run.info.run_id, "weights")}


def test_the_embedder_loads_as_an_mlflow_model_and_embeds_as_the_harness(
    store, tiny_protocol, monkeypatch
):
    records, folder = store
    run = _run(records, "plain")
    loaded = mlflow.pytorch.load_model(run.data.tags["model_uri"])
    protocol = load_protocol(str(tiny_protocol)).for_dataset("synthetic")
    splits = prepare_splits(protocol, "synthetic", None, seed=0)
    test = splits.test.subset(np.arange(6))
    model = build_model(protocol, "plain", {})
    monkeypatch.chdir(folder)  # the run's checkpoint root is relative to where it ran
    load_finished_weights(model, run.info.run_id, flag="--init-from")
    expected, _ = embed_images(
        model,
        test,
        build_transform(protocol.image, train=False),
        protocol.image,
        batch_size=8,
        device=torch.device("cpu"),
    )
    images = TransformedImages(test, build_transform(protocol.image, train=False))
    batch = torch.stack([images[i][0] for i in range(len(images))])
    with torch.inference_mode():
        got = loaded(batch).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    model = mlflow.MlflowClient().get_logged_model(run.data.tags["model_uri"].split("/")[-1])
    assert model.name == "plain-synthetic-margin-seed0"
    assert model.tags["mlflow.source.name"] == "python -m harness run"
    assert model.tags["command"] == run.data.tags["command"]
    assert model.tags["loss"] == "margin" and model.tags["dataset"] == "synthetic"
    linked = {m.key: m for m in model.metrics if m.dataset_name}
    assert set(linked) == set(READABLE.values())
    assert {(m.dataset_name, m.dataset_digest) for m in linked.values()} == {
        ("synthetic", run.data.tags["split_digest"])
    }
    assert model.tags["selected_epoch"] == run.data.tags["selected_epoch"]
    assert model.tags[RUN_NOTE_TAG] == run.data.tags[RUN_NOTE_TAG]  # its page's description
    versions = mlflow.MlflowClient().search_model_versions(f"name = '{REGISTERED}'")
    assert {v.run_id for v in versions} >= {
        records["plain"]["mlflow_run_id"],
        records["diml"]["mlflow_run_id"],
    }


def test_the_logged_model_shows_the_runs_final_metrics(store):
    """The model's page lists each metric the run had when the model was logged with the
    run's final value: ``train/loss`` at the last step, not at the step numbered as the
    selected epoch; the headline ones in % with the dataset."""
    records, _ = store
    client = mlflow.MlflowClient()
    for method in ("plain", "diml"):
        run = _run(records, method)
        model = client.get_logged_model(run.data.tags["model_uri"].split("/")[-1])
        shown: dict[str, list[float]] = {}
        for metric in model.metrics:
            shown.setdefault(metric.key, []).append(metric.value)
        final = {k: v for k, v in run.data.metrics.items() if not k.startswith("explain/")}
        assert {k: v[0] for k, v in shown.items()} == final
        assert all(len(values) == 1 for values in shown.values())  # one value each
    plain = _run(records, "plain")
    loss = client.get_metric_history(plain.info.run_id, "train/loss")
    assert len(loss) == 6 and loss[0].value != loss[-1].value
    model = client.get_logged_model(plain.data.tags["model_uri"].split("/")[-1])
    assert [m.value for m in model.metrics if m.key == "train/loss"] == [loss[-1].value]


def test_a_run_without_maps_of_its_own_says_why_in_its_artifacts(store):
    from harness.reports.explanations import NO_MAPS_ARTIFACT

    records, folder = store
    client = mlflow.MlflowClient()
    plain = records["plain"]["mlflow_run_id"]
    note = client.download_artifacts(plain, NO_MAPS_ARTIFACT, str(folder))
    text = open(note).read()
    assert text.startswith("# No maps of its own\n\nplain computes no explanation maps")
    assert "python -m harness explain --run RUN_ID" in text and "Grad-CAM" in text
    diml = records["diml"]["mlflow_run_id"]
    assert NO_MAPS_ARTIFACT not in {a.path for a in client.list_artifacts(diml, "explanations")}
