"""The retrieval examples and the embedding map of a finished run
(:mod:`harness.reports.figures.views`), drawn from its test embeddings and logged with it:
:class:`DrawRetrievalViews` is an end-of-run step of a
:class:`~harness.engine.run.trainer.Trainer`, as the logged model and the explanations are
(:mod:`harness.engine.run.export`).

The embeddings are the test evaluation's own (:class:`~harness.engine.run.embedding.EmbeddedScores`;
an evaluator that keeps none has the test images embedded again). The neighbours drawn
are the cosine ranking of those embeddings, and each query's AP@R is that ranking's: the
test's per-query values where the run ranks by cosine, else
:func:`~harness.components.evaluation.evaluate_embeddings` on the same embeddings, so that
a method that re-ranks (its ``global_`` metrics are the cosine ranking's) is drawn with
numbers that match its picture.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness.components.data import DatasetSplits
from harness.components.data.transforms import build_transform
from harness.components.evaluation import evaluate_embeddings
from harness.engine.run.embedding import embed_images
from harness.engine.run.model import EmbeddingModel
from harness.engine.run.recorder import FinishedRun
from harness.engine.run.run_config import RunConfig
from harness.reports.figures import VIEWS_FOLDER, ViewData, write_views
from harness.store.tracking import Tracker

__all__ = ["DrawRetrievalViews", "VIEW_METRIC", "cosine_values"]

#: The per-query score that chooses the examples and is printed above each row.
VIEW_METRIC = "mean_average_precision_at_r"


@dataclass
class DrawRetrievalViews:
    """An end-of-run step: the run's retrieval examples and embedding map, drawn into the
    run's ``folder`` (under ``views/``) and logged under :data:`VIEWS_FOLDER`; nothing where
    the protocol's ``evaluation.examples`` is 0."""

    tracker: Tracker
    cfg: RunConfig
    splits: DatasetSplits
    folder: Path
    device: torch.device
    workers: int = 0

    def __call__(self, finished: FinishedRun) -> None:
        cfg = self.cfg
        count = cfg.protocol.evaluation.examples
        if count == 0:
            return
        queries, gallery = self.test_embeddings(finished)
        views = ViewData(
            embeddings=queries,
            images=self.splits.test,
            values=cosine_values(finished.test, queries, self.splits, gallery),
            image_spec=cfg.protocol.image,
            count=count,
            seed=cfg.seed,
            caption=f"{cfg.method}, {cfg.dataset}, seed {cfg.seed}",
            gallery=gallery,
            gallery_images=self.splits.gallery,
            map_points=cfg.protocol.evaluation.map_points,
        )
        for path in write_views(views, self.folder / VIEWS_FOLDER):
            self.tracker.log_artifact(path, VIEWS_FOLDER)

    def test_embeddings(self, finished: FinishedRun) -> tuple[np.ndarray, np.ndarray | None]:
        """The test queries' and gallery's embeddings: the test evaluation's where its
        scores carry them, else the selected weights' embeddings of the test images."""
        kept = getattr(finished.test, "embeddings", None)
        if kept is not None:
            return kept
        protocol = self.cfg.protocol
        transform = build_transform(protocol.image, train=False)

        def embed(images) -> np.ndarray:
            return embed_images(
                typing.cast(EmbeddingModel, finished.model),
                images,
                transform,
                protocol.image,
                batch_size=protocol.evaluation.batch_size,
                device=self.device,
                workers=self.workers,
                precision=protocol.numerics.precision,
            )[0]

        gallery = self.splits.gallery
        return embed(self.splits.test), None if gallery is None else embed(gallery)


def cosine_values(
    test: dict[str, float],
    queries: np.ndarray,
    splits: DatasetSplits,
    gallery: np.ndarray | None = None,
) -> np.ndarray:
    """Each test query's :data:`VIEW_METRIC` under the cosine ranking of ``queries``
    (against ``gallery`` where the split has one), NaN for a query with no other item of
    its class: the test's per-query values when the run ranked by cosine (its scores name
    no ``num_ranked_candidates``) and kept them, else computed on the embeddings."""
    per_query = getattr(test, "per_query", None)
    if per_query is None or "num_ranked_candidates" in test or VIEW_METRIC not in per_query:
        per_query = evaluate_embeddings(
            queries,
            splits.test.labels,
            gallery,
            None if splits.gallery is None else splits.gallery.labels,
            recall_k=(1,),
            metrics=(VIEW_METRIC,),
            per_query=True,
        ).per_query
    assert per_query is not None  # asked for
    values = np.asarray(per_query[VIEW_METRIC], dtype=np.float64)
    return np.where(per_query["num_relevant"] > 0, values, np.nan)
