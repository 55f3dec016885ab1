"""``python -m harness export RUN_ID DIR``: a FINISHED run's embedder as an MLflow model folder
that loads with MLflow and torch alone.

The run is rebuilt from its record (the resolved protocol it logged, its method's options
as params), its selected weights loaded from the checkpoint root (checked against the
sha256 it recorded), and the network with the protocol's input normalisation in front
(:class:`~harness.engine.run.export.ImageEmbedder`) saved as a ``torch.export`` program
in MLflow's pytorch flavour (:func:`harness.store.model_folder.save_model_folder`): the
image batch, height and width stay free where the network's graph allows. The saved
program is loaded back and checked against the network at the protocol's image size
(which it must take) and at 224 px; the model's metadata holds the run, its protocol
fingerprint, the evaluation preprocessing the harness scored it with and the sizes checked.

The folder is written beside ``DIR`` and renamed into place whole
(:func:`~harness.base.atomic.staged_folder`), with ``harness-export.json`` listing the
sha256 of every file: ``DIR`` may be new, an empty folder, or an earlier export that
still matches its list, which it replaces; anything else is refused before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from harness.base.atomic import sha256_file, staged_folder
from harness.base.errors import HarnessError
from harness.base.paths import writable_folder
from harness.cli.store import open_store
from harness.config.protocol import Protocol, protocol_from_dict
from harness.engine.audit.rerun import method_options
from harness.engine.run.export import example_images, exportable_embedder
from harness.engine.run.model import build_model
from harness.methods import METHODS
from harness.store.location import reserved_paths, tracking_uri
from harness.store.model_folder import add_metadata, checked_sizes, save_model_folder
from harness.store.queries import find_run
from harness.store.records import RunRecord, read_json_artifact, read_record
from harness.store.weights import MODEL_PATH_TAG, load_finished_weights

__all__ = [
    "cmd_export",
    "MANIFEST",
    "TRACE_SIZE",
    "CHECK_SIZE",
    "earlier_export",
    "export_metadata",
]

#: The file of an export that lists the sha256 of every other file in it.
MANIFEST = "harness-export.json"
#: The smallest side of the images an export is traced with: at an output stride of 32,
#: feature maps of 2 x 2 or more, so that no size of the program is fixed at 1.
TRACE_SIZE = 64
#: The image side every export is checked at besides the protocol's.
CHECK_SIZE = 224


def _files(folder: Path) -> dict[str, str]:
    """``{path relative to folder: sha256}`` of every file under ``folder`` but the manifest."""
    return {
        path.relative_to(folder).as_posix(): sha256_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).as_posix() != MANIFEST
    }


def earlier_export(folder: Path) -> bool:
    """Whether ``folder`` is an export of the harness left as it was written: its manifest
    lists exactly the files it holds, each with the sha256 it still has."""
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return listed == _files(folder)


def _check_folder(folder: Path) -> Path:
    """``folder`` as the export's destination: new, empty or an earlier export, outside
    the tracking store, in a folder that can be written; else one line."""
    writable_folder(folder, "export DIR", reserved=reserved_paths())
    if folder.is_dir() and any(folder.iterdir()) and not earlier_export(folder):
        raise HarnessError(
            f"export: {folder} exists and is not an export of the harness left as it was "
            f"(no {MANIFEST}, or files added or changed since); give a new folder"
        )
    return folder


def _record(run_id: str) -> RunRecord:
    """The FINISHED training run ``run_id`` with selected weights; else one line."""
    if find_run(run_id) is None:
        raise HarnessError(f"export: no run '{run_id}' in the tracking store {tracking_uri()}")
    record = read_record(run_id)
    if record.status != "FINISHED":
        raise HarnessError(
            f"export: run '{run_id}' is {record.status}, not FINISHED: it has no selected weights"
        )
    if not record.tag(MODEL_PATH_TAG) or not record.tag("method"):
        raise HarnessError(
            f"export: run '{run_id}' has no selected weights (no {MODEL_PATH_TAG} tag: a "
            f"search trial, or a result derived from other runs); export a run that trained"
        )
    if record.tag("method") not in METHODS:
        raise HarnessError(
            f"export: run '{run_id}' is of method '{record.tag('method')}', which this code "
            f"does not register"
        )
    return record


def _protocol(record: RunRecord) -> Protocol:
    """The protocol the run resolved and logged (``protocol/resolved.json``)."""
    resolved = read_json_artifact(record.run_id, "protocol/resolved.json")
    if resolved is None:
        raise HarnessError(
            f"export: run '{record.run_id}' has no protocol/resolved.json artifact: nothing "
            f"to rebuild its network from"
        )
    return protocol_from_dict(resolved)


def _trained_model(record: RunRecord, protocol: Protocol, checkpoint_root: Path | None):
    """The run's network with its selected weights, every tensor of it loaded. The
    backbone is built without its pretrained weights: the run's replace them all."""
    untrained = dataclasses.replace(
        protocol, backbone=dataclasses.replace(protocol.backbone, pretrained=False, weights="")
    )
    model = build_model(untrained, record.tag("method"), method_options(record))
    load_finished_weights(
        model, record.run_id, flag="export", checkpoint_root=checkpoint_root, strict=True
    )
    return model.eval()


def export_metadata(record: RunRecord, protocol: Protocol, embedding_size: int) -> dict[str, Any]:
    """What the model's ``MLmodel`` says of it: the run, its protocol and fingerprint, and
    the preprocessing its scores were computed with (the images the model takes)."""
    image = protocol.image
    return {
        "run_id": record.run_id,
        "run_name": record.tag("mlflow.runName"),
        "experiment": record.experiment,
        "fingerprint": record.tag("fingerprint"),
        "protocol": protocol.name,
        **{key: record.tag(key) for key in ("method", "dataset", "loss", "seed")},
        "selected_epoch": record.tag("selected_epoch"),
        "weights_sha256": record.tag("model_sha256"),
        "embedding_size": embedding_size,
        "preprocessing": {
            "input": "uint8 RGB images, B x 3 x H x W: any batch, the sizes the program "
            "takes (image_sizes_checked: those it was checked at)",
            "evaluation_transform": image.eval_transform,
            "resize": image.resize,
            "crop": image.size,
            "normalisation": "x / 255, then (x - mean) / std, inside the model",
            "mean": list(image.mean),
            "std": list(image.std),
        },
        "output": "L2-normalised float32 embeddings, B x embedding_size",
    }


def _write(
    embedder: torch.nn.Module, folder: Path, metadata: dict[str, Any], size: int
) -> list[int]:
    """The model folder and its manifest into ``folder`` (empty); returns the image sizes it
    was checked at. Traced at :data:`TRACE_SIZE` where the protocol's images are smaller
    (their feature maps of 1 x 1 would fix the program's sizes), else at the protocol's
    size; traced again at the protocol's size when that first program refuses it."""
    for trace in dict.fromkeys((max(size, TRACE_SIZE), size)):
        shutil.rmtree(folder)  # empty, or what a first trace left
        folder.mkdir()
        images = example_images(trace)
        with torch.inference_mode():
            embeddings = embedder(torch.from_numpy(images)).numpy()
        save_model_folder(embedder, folder, images, embeddings, metadata=metadata)
        checked = checked_sizes(folder, embedder, tuple(dict.fromkeys((size, CHECK_SIZE))))
        if size in checked:
            add_metadata(folder, {"traced_at": trace, "image_sizes_checked": checked})
            manifest = {"run_id": metadata["run_id"], "files": _files(folder)}
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            return checked
    raise HarnessError(
        f"export: the program saved from run '{metadata['run_id']}' does not embed {size} px "
        f"images as its network does; nothing written"
    )


def cmd_export(args: argparse.Namespace) -> int:
    """Write run ``args.run_id``'s model folder at ``args.folder``; prints where and how
    to load it."""
    folder = _check_folder(args.folder)
    open_store(read_only=True)
    record = _record(args.run_id)
    protocol = _protocol(record)
    model = _trained_model(record, protocol, args.checkpoint_root)
    embedder = exportable_embedder(model, protocol.image)
    metadata = export_metadata(record, protocol, protocol.embedding.size)
    with staged_folder(folder) as staged:
        checked = _write(embedder, staged, metadata, protocol.image.size)
        _check_folder(folder)  # another process may have written it meanwhile
    sizes = " and ".join(f"{size} px" for size in checked)
    print(
        f"exported run {record.run_id} ({metadata['run_name']}) to {folder}, checked at "
        f"{sizes}: mlflow.pyfunc.load_model({str(folder)!r}) loads it"
    )
    return 0
