"""A finished run logs its retrieval examples and embedding map (``views/``), drawn from
the test evaluation's own embeddings and per-query values; ``evaluation.examples = 0``
logs neither and leaves the run's fingerprint alone."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from harness.components.evaluation import (
    PER_QUERY_ARTIFACT,
    load_per_query,
    with_paper_variants,
)
from harness.config.fingerprint import fingerprint
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.engine.run import (
    VIEW_METRIC,
    DrawRetrievalViews,
    EmbeddedScores,
    FinishedRun,
    RunConfig,
    SplitEvaluator,
    build_model,
    cosine_values,
    train_run,
    training_splits,
)
from harness.reports.figures import EXAMPLES_DATA, MAP_DATA, VIEWS_FOLDER
from harness.store.queries import read_artifact

VIEW_FILES = {"retrieval_examples.png", EXAMPLES_DATA, "embedding_map.png", MAP_DATA}


def _run(protocol) -> dict:
    cfg = RunConfig.build(
        protocol,
        method="plain",
        dataset="synthetic",
        loss="margin",
        seed=0,
        experiment=f"views-{uuid.uuid4().hex[:8]}",
    )
    return train_run(cfg)


def _logged(run_id: str) -> set[str]:
    return {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, VIEWS_FOLDER)}


def test_a_tiny_run_logs_its_retrieval_examples_and_embedding_map(workdir, tiny_protocol):
    record = _run(load_protocol(tiny_protocol))
    run_id = record["mlflow_run_id"]
    assert _logged(run_id) == {f"{VIEWS_FOLDER}/{name}" for name in VIEW_FILES}
    rows = read_artifact(
        run_id, f"{VIEWS_FOLDER}/{EXAMPLES_DATA}", lambda p: json.loads(p.read_text())
    )
    per_query = read_artifact(run_id, PER_QUERY_ARTIFACT, load_per_query)
    assert rows is not None and per_query is not None
    assert [r["group"] for r in rows] == ["worst", "worst", "best", "best", "random", "random"]
    assert len({r["query"] for r in rows}) == 6
    scored = per_query["num_relevant"] > 0
    values = per_query[VIEW_METRIC]
    for row in rows:  # plain ranks by cosine: the printed AP@R is the run's own per-query value
        assert scored[row["query"]] and row["ap_at_r"] == pytest.approx(values[row["query"]])
    worst = min(values[scored])
    assert rows[0]["ap_at_r"] == pytest.approx(worst)
    assert rows[2]["ap_at_r"] == pytest.approx(max(values[scored]))


def test_no_examples_logs_neither_figure_and_keeps_the_fingerprint(workdir, tiny_protocol):
    protocol = load_protocol(tiny_protocol)
    off, _ = apply_overrides(protocol, {"evaluation.examples": 0})
    record = _run(off)
    assert _logged(record["mlflow_run_id"]) == set()
    splits = training_splits(protocol, "synthetic", None, seed=0)
    expected = fingerprint(
        protocol, splits.digest(), loss="margin", loss_args=protocol.loss_args("margin")
    )
    assert record["fingerprint"] == expected
    assert not list(workdir.rglob(f"{VIEWS_FOLDER}/*"))  # nothing drawn into the run's folder


class _Artifacts:
    """A tracker that keeps what is logged to it."""

    def __init__(self):
        self.logged: list[tuple[Path, str | None]] = []

    def log_artifact(self, path: Path, folder: str | None = None) -> None:
        self.logged.append((Path(path), folder))


def test_an_evaluator_that_keeps_no_embeddings_has_the_test_images_embedded_again(
    workdir, tiny_protocol, tmp_path
):
    protocol = load_protocol(tiny_protocol)
    splits = training_splits(protocol, "synthetic", None, seed=0)
    model = build_model(protocol, "plain", {})
    metrics = with_paper_variants(protocol.evaluation.metrics)
    scores = SplitEvaluator(splits, protocol, "synthetic")(
        model, "test", metrics=metrics, per_query=True
    )
    assert isinstance(scores, EmbeddedScores) and scores.embeddings is not None
    kept, gallery = scores.embeddings
    assert gallery is None and kept.shape == (len(splits.test), protocol.embedding.size)
    cfg = RunConfig.build(protocol, method="plain", dataset="synthetic", loss="margin", seed=0)
    tracker = _Artifacts()
    step = DrawRetrievalViews(tracker, cfg, splits, tmp_path, torch.device("cpu"))
    plain = FinishedRun(model, 0, dict(scores))  # a plain dict: no embeddings, no per-query values
    again, _ = step.test_embeddings(plain)
    np.testing.assert_allclose(again, kept, atol=1e-6)
    # The run's own per-query values and those computed on the embeddings agree for a
    # cosine ranking; a re-ranking run's are computed.
    own = cosine_values(scores, kept, splits)
    np.testing.assert_allclose(cosine_values(dict(scores), kept, splits), own, atol=1e-6)
    reranked = EmbeddedScores({**scores, "num_ranked_candidates": 10})
    reranked.per_query = {k: np.zeros_like(v) for k, v in scores.per_query.items()}
    np.testing.assert_allclose(cosine_values(reranked, kept, splits), own, atol=1e-6)
    step(plain)
    assert {(p.name, folder) for p, folder in tracker.logged} == {
        (name, VIEWS_FOLDER) for name in VIEW_FILES
    }
    assert all(p.parent == tmp_path / VIEWS_FOLDER and p.is_file() for p, _ in tracker.logged)
