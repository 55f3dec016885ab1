"""The recorder of real runs: one run in the tracking store (:class:`harness.store.tracking.Tracker`)
and the run's folder under the checkpoint root (:class:`~harness.engine.run.checkpoints.RunFolder`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.base.device import amp_name
from harness.base.metric_keys import metric_key
from harness.components.data import DatasetSplits
from harness.components.data.base import GIVEN_VALIDATION, VALIDATION_SPLIT_TAG
from harness.components.data.manifest import MANIFEST_ARTIFACT
from harness.components.evaluation import PER_QUERY_ARTIFACT, evaluation_code_digest, save_per_query
from harness.components.losses import miner_for
from harness.config.deviations import TAG_PREFIX, footnote, to_tag
from harness.engine.run.checkpoints import RunFolder
from harness.engine.run.data import adapted_sampling
from harness.engine.run.recorder import FinishedRun, StepFlush
from harness.engine.run.run_config import RunConfig, paper_deviations, run_name
from harness.engine.run.runtime import log_line
from harness.methods import METHODS
from harness.reports.figures import VIEWS_FOLDER
from harness.reports.results import run_note
from harness.store.dead_runs import CHECKPOINT_DIR_TAG, worker_id
from harness.store.location import tracking_uri
from harness.store.provenance import environment_tags, git_commit, uncommitted_changes
from harness.store.tracking import Tracker, flatten
from harness.store.ui import RUN_NOTE_TAG
from harness.store.weights import MODEL_PATH_TAG

CPU = torch.device("cpu")

__all__ = ["MlflowRecorder", "run_params", "run_tags", "dataset_tags", "dataset_source"]


class MlflowRecorder:
    """A :class:`~harness.engine.run.recorder.Recorder` into one MLflow run and the run's folder:
    the run's description, per-step and per-epoch metrics, the test scores and per-query
    values, and the finished run's description; :meth:`record_selected_weights` is the
    end-of-run step that logs where the checkpointer saved its selected weights.
    :meth:`open` makes or continues the MLflow run.

    ``splits``, ``world_size`` and ``device``: what the run trains and evaluates on, and
    where (recorded with it)."""

    def __init__(
        self,
        cfg: RunConfig,
        folder: RunFolder,
        *,
        experiment: str,
        fingerprint: str,
        splits: DatasetSplits,
        world_size: int = 1,
        device: torch.device = CPU,
    ):
        self.cfg, self.folder, self.experiment, self.fingerprint = (
            cfg,
            folder,
            experiment,
            fingerprint,
        )
        self.splits, self.world_size, self.device = splits, world_size, device
        self._tracker: Tracker | None = None

    @property
    def tracker(self) -> Tracker:
        """The run in the tracking store (:meth:`open` makes it)."""
        if self._tracker is None:
            raise RuntimeError("MlflowRecorder: the tracked run is not open (call open() first)")
        return self._tracker

    @property
    def run_id(self) -> str:
        """The tracked run's id ("" until :meth:`open`)."""
        return "" if self._tracker is None else self._tracker.run_id

    def open(self, run_id: str | None = None) -> None:
        """The run in the tracking store: ``run_id`` (a checkpoint's run, or the earlier run
        of an evaluate-only run) when this experiment has it, else a new one."""
        self._tracker = Tracker(self.experiment, run_name(self.cfg), run_id=run_id)

    def start(self, checkpoint: dict[str, Any] | None) -> None:
        """Record the run's metadata (a new run) or which code continued it (a resumed one);
        a checkpoint whose run is not in this store gives its history to the new run."""
        tracker = self.tracker
        if checkpoint is None or not tracker.resumed:
            self._log_metadata()
            tracker.set_tags({"run_key": self.folder.key})
        else:  # the run's git_commit tag is its first segment's; say which code continued it
            tracker.set_tags({"git_commit_at_resume": git_commit()})
        tracker.set_tags(
            {
                "harness_worker": worker_id(),  # the process that owns the run now
                # relative to the checkpoint root, which may move
                CHECKPOINT_DIR_TAG: self.folder.key,
            }
        )
        if checkpoint is not None and not tracker.resumed:
            log_line(
                f"run {checkpoint.get('mlflow_run_id')} of the checkpoint is not in experiment "
                f"'{self.experiment}' of {tracking_uri()}; continuing in a new run {tracker.run_id}"
            )
            for record in checkpoint["history"]:
                tracker.log_metrics(
                    {k: v for k, v in record.items() if k != "epoch"}, step=record["epoch"]
                )

    # ------------------------------------------------------------ Recorder

    def record_flush(self, flush: StepFlush) -> None:
        """``train/loss`` and ``train/lr`` at every step of the flush, against the run's
        global step: the learning rate as a curve that shows the schedule, not one point per
        flush (a flush holds one epoch's steps, and the schedule steps per epoch)."""
        first = flush.global_step - len(flush.step_losses) + 1
        steps = range(first, flush.global_step + 1)
        self.tracker.log_metric_steps(
            {
                metric_key("train", "loss"): list(zip(steps, flush.step_losses, strict=True)),
                metric_key("train", "lr"): [(step, flush.lr) for step in steps],
            }
        )

    def record_epoch(self, record: dict[str, Any]) -> None:
        self.tracker.log_metrics(
            {k: v for k, v in record.items() if k != "epoch"}, step=record["epoch"]
        )

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        """``test/*`` at the selected epoch, the digest of the code that computed them, and
        the per-query values (an artifact) when the scores carry them."""
        self.tracker.log_metrics(
            {metric_key("test", k): v for k, v in scores.items()}, step=selected_epoch
        )
        self.tracker.set_tags({"evaluation_code": evaluation_code_digest()})
        per_query = getattr(scores, "per_query", None)  # a plain dict of scores carries none
        if per_query is not None:
            path = self.folder.file(Path(PER_QUERY_ARTIFACT).name)
            save_per_query(path, per_query)
            self.tracker.log_artifact(path, str(Path(PER_QUERY_ARTIFACT).parent))

    # ------------------------------------------------------- the finished run

    def record_selected_weights(self, finished: FinishedRun) -> None:
        """Where the checkpointer saved the selected weights, with their sha256, and the
        file as the run's ``weights/model.pt`` artifact (an end-of-run step: nothing to
        record where they went nowhere a file names)."""
        saved = finished.weights
        if saved is None:
            return
        # The path under the checkpoint root (which still resolves when the root moves) with
        # the file's sha256, checked by --init-from.
        self.tracker.set_tags(
            {
                "selected_epoch": finished.selected_epoch,
                MODEL_PATH_TAG: saved.relpath,
                "model_sha256": saved.sha256,
            }
        )
        self.tracker.log_artifact(saved.path, "weights")  # listed in the UI as weights/model.pt

    def record_note(self, scores: dict[str, float], selected_epoch: int) -> None:
        """The run's description in the MLflow UI (a Markdown summary; :func:`run_note`),
        naming the model and the figures the run's end-of-run steps logged."""
        cfg = self.cfg
        note = run_note(
            method=cfg.method,
            dataset=cfg.dataset,
            protocol=cfg.protocol.name,
            selection=cfg.protocol.selection.mode,
            metrics=dict(scores),
            selected_epoch=selected_epoch,
            deviations=[str(d) for d in cfg.deviations],
            paper_deviations=[footnote(n, d) for n, d in paper_deviations(cfg).items()],
            init_from=cfg.init_from,
            evaluate_only=cfg.evaluate_only,
            model=run_name(cfg) if self.tracker.model_ids else "",
            figures=[
                p
                for p in self.tracker.logged
                if p.startswith(f"{VIEWS_FOLDER}/") and p.endswith(".png")
            ],
        )
        self.tracker.set_tags({RUN_NOTE_TAG: note})

    def finish(self, result: FinishedRun | None) -> None:
        """The finished run's description (none for a search trial, ``result`` None), then
        the run marked FINISHED."""
        if result is not None:
            self.record_note(result.test, result.selected_epoch)
        self.tracker.finish("FINISHED")

    def fail(self, err: BaseException) -> None:
        """Mark the run KILLED (interrupted) or FAILED with why; a store that fails too is one
        line, so that the error that stopped the run is the one raised."""
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        try:
            self.tracker.set_tags({"failure": f"{type(err).__name__}: {err}"[:4000]})
            self.tracker.finish(status)
        except Exception as secondary:  # the store failing too must not hide why the run stopped
            text = str(secondary).strip().splitlines()[0][:300] if str(secondary).strip() else ""
            log_line(
                f"could not mark run {self.tracker.run_id} {status} in the tracking store "
                f"({type(secondary).__name__}: {text})"
            )

    # ------------------------------------------------------------- metadata

    def _log_metadata(self) -> None:
        """A new run's parameters, tags, dataset input, resolved protocol and deviations,
        protocol file, and the uncommitted changes of the code that runs it."""
        cfg, splits, tracker = self.cfg, self.splits, self.tracker
        tracker.log_params(run_params(cfg, self.world_size))
        classes = len(np.unique(splits.train.labels))
        tags = run_tags(
            cfg,
            self.fingerprint,
            splits,
            sampling_note=adapted_sampling(cfg.protocol, classes)[2],
            world_size=self.world_size,
            device=self.device,
        )
        tracker.set_tags(tags)
        # The dataset and its split digest as an MLflow dataset input (the UI's Datasets column).
        tracker.log_dataset(
            cfg.dataset,
            splits.digest(),
            data_root=cfg.settings.data_root,
            sizes={
                "train": len(splits.train),
                "val": 0 if splits.val is None else len(splits.val),
                "test": len(splits.test),
            },
            extra=dataset_source(splits),
        )
        if splits.files is not None:  # what a resumed grid on changed files compares with
            tracker.log_text(splits.files.to_json(), MANIFEST_ARTIFACT)
        tracker.log_text(
            json.dumps(cfg.protocol.to_dict(), indent=2, sort_keys=True), "protocol/resolved.json"
        )
        tracker.log_text(
            json.dumps([d.__dict__ for d in cfg.deviations], indent=2, default=str),
            "protocol/deviations.json",
        )
        if cfg.protocol_path is not None and Path(cfg.protocol_path).is_file():
            tracker.log_artifact(Path(cfg.protocol_path), "protocol")
        if tags["git_commit"].endswith("-dirty"):
            tracker.log_text(uncommitted_changes(), "source/uncommitted.patch")


def run_params(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """A run's parameters: the resolved protocol, every method option (defaults included,
    so that any two runs' params compare), the loss and the execution settings."""
    return {
        **flatten(cfg.protocol.to_dict(), "protocol."),
        **flatten({**METHODS.get(cfg.method).options(), **cfg.method_options}, "method."),
        "loss.name": cfg.loss,
        **flatten(cfg.loss_args, "loss.args."),
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        "method": cfg.method,
        "world_size": world_size,
        "deterministic": cfg.settings.deterministic,
        "fast": cfg.settings.fast,
        "compile": cfg.settings.compile,
        "cuda_graphs": cfg.settings.cuda_graphs,
    }


def run_tags(
    cfg: RunConfig,
    fingerprint: str,
    splits: DatasetSplits,
    *,
    sampling_note: str,
    world_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """A new run's tags: what it is (fingerprint, method and its revision, data, selection,
    deviations from the protocol and from the paper), how it executes, the environment and
    code (:func:`~harness.store.provenance.environment_tags`), and ``cfg.tags`` last."""
    protocol = cfg.protocol
    tags = {
        "fingerprint": fingerprint,
        "protocol": protocol.name,
        "method": cfg.method,
        "dataset": cfg.dataset,
        "method_revision": METHODS.get(cfg.method).cls.revision,
        "loss": cfg.loss,
        "seed": cfg.seed,
        "split_digest": splits.digest(),
        "selection": protocol.selection.mode,
        "test_set_selection": protocol.selection.mode == "test-paper",
        "deviations": "; ".join(str(d) for d in cfg.deviations) or "none",
        "num_train_images": len(splits.train),
        "num_test_images": len(splits.test),
        "init_from": cfg.init_from or "none",
        "evaluate_only": cfg.evaluate_only,
        "miner": miner_for(cfg.loss, protocol.miner.name, loss_miners=protocol.loss.miners)[0],
        "world_size": world_size,
        "deterministic": cfg.settings.deterministic,
        "fast": cfg.settings.fast,
        "compile": cfg.settings.compile,
        "cuda_graphs": cfg.settings.cuda_graphs,
        "amp": amp_name(device, protocol.numerics.precision),
        **{TAG_PREFIX + n: to_tag(d) for n, d in paper_deviations(cfg).items()},
        **dataset_tags(splits),
        **environment_tags(),
    }
    if splits.val is not None:
        tags["num_val_images"] = len(splits.val)
    if splits.val_given:  # the dataset's own validation split, not the protocol's carve
        tags[VALIDATION_SPLIT_TAG] = GIVEN_VALIDATION
    if sampling_note:
        tags["sampling_adapted"] = sampling_note
    tags.update(cfg.tags)
    return tags


def dataset_tags(splits: DatasetSplits) -> dict[str, str]:
    """A dataset given by its path: where its files are and their fingerprint (paths,
    sizes, labels), so that a run says which files it saw and ``explain`` finds them again;
    nothing for a built-in dataset."""
    if splits.files is None:
        return {}
    return {"dataset_path": splits.files.source, "dataset_fingerprint": splits.files.fingerprint}


def dataset_source(splits: DatasetSplits) -> dict[str, str]:
    """The source fields of the run's MLflow dataset input beyond the built-in ones: for a
    dataset given by its path, the module that reads it, its path and its fingerprint."""
    tags = dataset_tags(splits)
    return {"loader": "harness.components.data.own", **tags} if tags else {}
