"""The trained embedder as a model of its own: images in, embeddings out.

:class:`ImageEmbedder` wraps a run's selected weights with the protocol's input
normalisation, so that a user who loads the logged MLflow model
(``mlflow.pytorch.load_model``) or an exported folder (``python -m harness export``) gets
the embeddings the harness evaluated from images prepared by the protocol's evaluation
transform (resize and centre crop), with no harness settings to repeat.
:func:`exportable_embedder` makes the copy that is saved: its padding traced in integer
arithmetic (:func:`~harness.components.exportable.exportable`), on the CPU, so that the
``torch.export`` program takes any batch and any image size the backbone takes, on any
machine. The plain ``model.pt`` checkpoint (state dict only) stays the file
``--init-from`` and ``--resume`` read.

:class:`ExportEmbedder` (the logged model) and :class:`DrawExplanations` (the explanation
figures) are end-of-run steps of a :class:`~harness.engine.run.trainer.Trainer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from harness.base.metric_keys import readable
from harness.components.data import DatasetSplits
from harness.components.data.transforms import normalize_batch
from harness.components.exportable import exportable
from harness.engine.run.recorder import FinishedRun
from harness.engine.run.run_config import RunConfig, run_name
from harness.reports.explanations import log_explanations
from harness.store.environment import LOG_MODEL_ENV, logs_model
from harness.store.tracking import Tracker

__all__ = [
    "ImageEmbedder",
    "exportable_embedder",
    "example_images",
    "ExportEmbedder",
    "DrawExplanations",
]


class ImageEmbedder(nn.Module):
    """uint8 images B x 3 x H x W (the protocol's evaluation crop: S x S) -> B x D float32
    L2-normalised embeddings, the ones retrieval ranks by."""

    def __init__(self, model: nn.Module, image_spec):
        super().__init__()
        self.model = model
        self.image_spec = image_spec

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(normalize_batch(images, self.image_spec)).embedding.float()


def exportable_embedder(model: nn.Module, image_spec) -> ImageEmbedder:
    """A copy of ``model`` (``model`` is left as it is), ready for ``torch.export`` with free
    image sizes (:func:`~harness.components.exportable.exportable`), behind the protocol's
    normalisation, on the CPU, its weights in the default memory format (a trained model's
    are channels-last) and in eval mode: the model a saved program is traced from."""
    embedder = ImageEmbedder(exportable(model), image_spec).cpu()
    return embedder.to(memory_format=torch.contiguous_format).eval()


def example_images(image_size: int, count: int = 2, seed: int = 0) -> np.ndarray:
    """``count`` random uint8 images of ``image_size`` pixels a side (an input example)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, 3, image_size, image_size), dtype=np.uint8)


@dataclass
class ExportEmbedder:
    """An end-of-run step: the selected weights as an MLflow model (images -> embeddings,
    the UI's Models tab) named after the run (:meth:`model_name`), its signature from a
    forward pass on two example images; registered under ``--register``'s name when given.
    The headline test scores go with it as readable percentages
    (:func:`~harness.base.metric_keys.readable`), linked to the model and the run's dataset
    (``split_digest``), so that the Models tab names the data it was tested on. Skipped
    where ``$DML_HARNESS_LOG_MODEL`` is 0 (:func:`~harness.engine.run.run_config.logs_model`)."""

    tracker: Tracker
    cfg: RunConfig
    split_digest: str

    def model_name(self) -> str:
        """The logged model's name: the run's own (:func:`~harness.engine.run.run_config.run_name`)."""
        return run_name(self.cfg)

    def __call__(self, finished: FinishedRun) -> None:
        cfg, model = self.cfg, finished.model
        if not logs_model():
            self.tracker.set_tags({"model_uri": f"none ({LOG_MODEL_ENV}=0)"})
            return
        # Exported on the CPU, so that the logged model loads on a machine without a GPU;
        # traced at the protocol's size, which it then always takes, with the other sizes
        # its graph leaves free (``harness export`` also tries a larger trace).
        embedder = exportable_embedder(model, cfg.protocol.image)
        images = example_images(cfg.protocol.image.size)
        with torch.inference_mode():
            embeddings = embedder(torch.from_numpy(images)).numpy()
        uri = self.tracker.log_pytorch_model(
            embedder,
            images,
            embeddings,
            name=self.model_name(),
            step=finished.selected_epoch,
            registered_name=cfg.registered_model,
            tags={
                "method": cfg.method,
                "dataset": cfg.dataset,
                "loss": cfg.loss,
                "protocol": cfg.protocol.name,
                "seed": str(cfg.seed),
            },
        )
        self.tracker.set_tags({"model_uri": uri})
        self.tracker.log_model_scores(
            uri, readable(finished.test), (cfg.dataset, self.split_digest)
        )


@dataclass
class DrawExplanations:
    """An end-of-run step: the head's explanations of test images, drawn into the run's
    ``folder`` and logged (:func:`~harness.reports.explanations.log_explanations`)."""

    tracker: Tracker
    cfg: RunConfig
    splits: DatasetSplits
    folder: Path
    device: torch.device

    def __call__(self, finished: FinishedRun) -> None:
        cfg = self.cfg
        log_explanations(
            finished.model,
            self.splits,
            cfg.protocol,
            self.device,
            self.folder,
            self.tracker,
            run_label=f"{cfg.method}, {cfg.dataset}, seed {cfg.seed}",
        )
