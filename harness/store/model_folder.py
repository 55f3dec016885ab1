"""A trained embedder as an MLflow model folder of its own: what ``python -m harness export``
writes, and the signature the models that runs log share.

The folder is MLflow's pytorch flavour with the network saved as a ``torch.export`` program
(``data/model.pt2``): graph and weights, no pickled Python code. So
``mlflow.pyfunc.load_model(folder)`` and ``mlflow.pytorch.load_model(folder)`` load it in a
Python that has MLflow and torch and nothing of the harness (no class of it is needed to
rebuild the network, and no tracking store is read). Its ``MLmodel`` holds the signature
(uint8 images ``B x 3 x H x W`` in, float32 embeddings ``B x D`` out, the batch, height
and width free), an input example, and the caller's metadata (the run, its protocol
fingerprint, the preprocessing it was evaluated with).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pytorch
import numpy as np
import torch
import torch.fx.experimental._config as symbolic_shapes
from mlflow.models import Model, ModelSignature
from mlflow.models.model import MLMODEL_FILE_NAME
from mlflow.types import Schema, TensorSpec
from torch import nn

__all__ = [
    "embedder_signature",
    "model_requirements",
    "free_sizes",
    "save_model_folder",
    "checked_sizes",
    "add_metadata",
]


def embedder_signature(images: np.ndarray, embeddings: np.ndarray) -> ModelSignature:
    """The signature of an embedder: images of ``images``' dtype and channels, any batch,
    height and width (``-1``), to embeddings of ``embeddings``' dtype and width, any batch.
    MLflow's ``pt2`` export makes every ``-1`` a dynamic dimension of the program."""
    return ModelSignature(
        inputs=Schema([TensorSpec(images.dtype, (-1, images.shape[1], -1, -1))]),
        outputs=Schema([TensorSpec(embeddings.dtype, (-1, embeddings.shape[1]))]),
    )


@contextlib.contextmanager
def free_sizes() -> Iterator[None]:
    """``torch.export`` (MLflow's ``pt2`` format) inside the block keeps every dynamic
    dimension free, also at 0 and 1: by default a size traced at 2 or more is assumed never
    to be 1, and a program traced with feature maps of 2 x 2 refuses the images whose maps
    are 1 x 1 (32 px at an output stride of 32). Traced without the assumption, the
    program embeds those images as the network does (``tests/cli/test_export.py`` checks
    the protocol's 32 px and 224 px). The exporter also keeps quiet about parameters that
    share storage without one tensor spanning it (views): it stores them correctly."""
    oblivious = symbolic_shapes.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]  # torch makes the config module's patch() at import
    with warnings.catch_warnings(), oblivious:
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        yield


def model_requirements(*extra: str) -> list[str]:
    """The pip requirements a model names (MLflow would otherwise load the model in a
    subprocess to infer them): torch and mlflow at their versions, then ``extra``."""
    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"mlflow=={mlflow.__version__}",
        *extra,
    ]


def save_model_folder(
    embedder: nn.Module,
    folder: Path,
    images: np.ndarray,
    embeddings: np.ndarray,
    *,
    metadata: dict[str, Any],
) -> None:
    """``embedder`` (on the CPU, in eval mode) as an MLflow model in ``folder`` (absent or
    empty): a ``torch.export`` program whose input example is ``images`` and whose signature
    is :func:`embedder_signature` of ``images`` -> ``embeddings``, with ``metadata`` in its
    ``MLmodel``. Nothing of the harness is a requirement: the program needs torch only."""
    with free_sizes():
        mlflow.pytorch.save_model(
            embedder,
            str(folder),
            signature=embedder_signature(images, embeddings),
            input_example=images,
            pip_requirements=model_requirements(),
            metadata=metadata,
            serialization_format="pt2",
        )


def checked_sizes(
    folder: Path, embedder: nn.Module, sizes: tuple[int, ...], *, atol: float = 1e-4
) -> list[int]:
    """The image sizes among ``sizes`` at which the program saved in ``folder`` embeds three
    random images as ``embedder`` does (within ``atol``); a size its graph refuses (a
    guard on the input's shape fails) or embeds otherwise is left out."""
    program = mlflow.pytorch.load_model(str(folder))
    passed = []
    for size in sizes:
        images = torch.from_numpy(
            np.random.default_rng(size).integers(0, 256, (3, 3, size, size), dtype=np.uint8)
        )
        try:
            with torch.inference_mode():
                got, expected = program(images), embedder(images)
        except (AssertionError, RuntimeError):  # a guard of the program, or a shape it cannot take
            continue
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=0, atol=atol):
            passed.append(size)
    return passed


def add_metadata(folder: Path, metadata: dict[str, Any]) -> None:
    """``metadata`` added to the ``MLmodel`` of the model saved in ``folder``."""
    model = Model.load(str(folder))
    model.metadata = {**(model.metadata or {}), **metadata}
    model.save(str(folder / MLMODEL_FILE_NAME))
