"""One run, from its configuration to its tracked result: :func:`run_training` composes
the pieces of :mod:`harness.engine` (a :class:`~harness.engine.trainer.Trainer` recording
into an :class:`~harness.engine.mlflow_recorder.MlflowRecorder`), and this module is where
``run``, ``sweep`` and ``tune`` import them from.

Under ``torchrun`` one run trains across processes (:mod:`harness.engine.distributed`):
each trains its share of every batch, and process 0 alone evaluates, tracks and
checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from harness.base.device import configure_determinism
from harness.base.errors import HarnessError
from harness.components.data import DatasetSplits
from harness.config.deviations import footnote
from harness.config.fingerprint import fingerprint
from harness.engine.checkpoints import RunFolder
from harness.engine.data import check_training_split, prepare_splits
from harness.engine.distributed import Processes, barrier, processes_from_env
from harness.engine.mlflow_recorder import MlflowRecorder
from harness.engine.model import EmbeddingModel, build_model
from harness.engine.recorder import NullRecorder, StepFlush
from harness.engine.run_config import (
    RunConfig,
    RunSettings,
    default_checkpoint_root,
    paper_deviations,
    run_key,
)
from harness.engine.runtime import default_workers, log_line, resolve_device, seed_everything
from harness.engine.trainer import Trainer
from harness.methods import METHODS
from harness.store.dead_runs import mark_dead_runs_killed
from harness.store.tracking import filter_value, newest_run

__all__ = [
    "RunConfig",
    "RunSettings",
    "EmbeddingModel",
    "StepFlush",
    "prepare_splits",
    "check_training_split",
    "build_model",
    "run_training",
    "run_key",
    "paper_deviations",
    "default_checkpoint_root",
    "default_workers",
    "seed_everything",
    "resolve_device",
]


@dataclass
class _RunPlan:
    """What one run works from, fixed before it starts: the resolved configuration, the
    device and processes, the splits and their fingerprint, its folder and experiment,
    and the checkpoint (or, evaluate-only, the earlier run) it continues."""

    cfg: RunConfig
    device: torch.device
    procs: Processes
    workers: int
    splits: DatasetSplits
    fp: str
    folder: RunFolder
    experiment: str
    checkpoint: dict[str, Any] | None = None
    #: An evaluate-only run trains nothing and keeps no last.pt: it resumes into its run.
    previous: str | None = None


def run_training(cfg: RunConfig, splits: DatasetSplits | None = None) -> dict[str, Any]:
    """Train and test one run; returns the record written by ``run --json`` (empty in the
    processes other than 0 of a distributed run, which train their share and wait).

    Model selection follows ``protocol.selection``: the epoch with the best
    validation metric ("validation"), the best test metric ("test-paper", the
    seeds' released-code behaviour, labelled everywhere) or the last epoch.

    The steps, in order: prepare (device, splits, fingerprint, checkpoint), build (model,
    loss, optimizer, sampler), open the tracked run and resume the checkpoint's state,
    train the epochs with per-epoch selection, test the selected weights, record.
    """
    plan = _prepare(cfg, splits)
    cfg = plan.cfg
    recorder = MlflowRecorder(cfg, plan.folder, experiment=plan.experiment, fingerprint=plan.fp)
    trainer = Trainer.build(
        cfg,
        plan.splits,
        recorder=recorder if plan.procs.is_main else NullRecorder(),
        device=plan.device,
        workers=plan.workers,
        procs=plan.procs,
        fingerprint=plan.fp,
    )
    if not plan.procs.is_main:
        return _follow(trainer, plan.checkpoint)
    recorder.open(plan.checkpoint.get("mlflow_run_id") if plan.checkpoint else plan.previous)
    try:
        recorder.start(trainer, plan.checkpoint)
        if plan.checkpoint is not None:
            trainer.resume(plan.checkpoint)
        trainer.fit()
        selected_epoch = trainer.load_selected_weights()
        if cfg.search_only:  # a search trial: scored on validation, the test split unread
            test: dict[str, float] = {}
            recorder.finish()
        else:
            test = trainer.test(selected_epoch)
            _record_finished(recorder, trainer, test, selected_epoch)
        barrier(plan.procs)
    except BaseException as err:
        recorder.fail(err)
        raise
    return _run_record(plan, recorder.run_id, selected_epoch, test)


def _follow(trainer: Trainer, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """A process other than 0: train its share of every epoch, then wait while process 0
    tests and records (returns no record; process 0 reports the run)."""
    if checkpoint is not None:
        trainer.resume(checkpoint)
    trainer.fit()
    barrier(trainer.procs)  # process 0 tests and saves the selected weights
    return {}


def _record_finished(
    recorder: MlflowRecorder, trainer: Trainer, test: dict[str, float], selected_epoch: int
) -> None:
    """The finished run: its selected weights, the logged embedder, its description and
    explanations, then the run marked finished."""
    recorder.record_selected_weights(trainer.model, selected_epoch)
    recorder.record_embedder(trainer, selected_epoch, test)
    recorder.record_note(test, selected_epoch)
    recorder.record_explanations(trainer.model, trainer.splits, trainer.device)
    recorder.finish()


def _run_record(
    plan: _RunPlan, run_id: str, selected_epoch: int, test: dict[str, float]
) -> dict[str, Any]:
    cfg = plan.cfg
    return {
        "method": cfg.method,
        "dataset": cfg.dataset,
        "loss": cfg.loss,
        "seed": cfg.seed,
        "protocol": cfg.protocol.name,
        "fingerprint": plan.fp,
        "deviations": [str(d) for d in cfg.deviations],
        "selection": cfg.protocol.selection.mode,
        "paper_deviations": [footnote(n, d) for n, d in paper_deviations(cfg).items()],
        "selected_epoch": selected_epoch,
        "mlflow_run_id": run_id,
        "world_size": plan.procs.world_size,
        "deterministic": cfg.deterministic,
        "fast": cfg.fast,
        "compile": cfg.compile,
        "cuda_graphs": cfg.cuda_graphs,
        "metrics": {k: v for k, v in test.items() if not k.startswith("num_")},
    }


def _prepare(cfg: RunConfig, splits: DatasetSplits | None) -> _RunPlan:
    """Resolve the protocol, device and processes; load the splits; fingerprint the run;
    find the checkpoint (or, evaluate-only, the earlier run) a resume continues."""
    # Callers resolve the protocol for the dataset before applying overrides; this is a
    # no-op then, and resolves a protocol that still has per-dataset sections.
    cfg = replace(cfg, protocol=cfg.protocol.for_dataset(cfg.dataset))
    if cfg.evaluate_only and not cfg.init_from:
        raise HarnessError(
            "an evaluate-only run needs init_from (the run whose weights it evaluates)"
        )
    device = resolve_device(cfg.device)
    configure_determinism(cfg.deterministic, fast=cfg.fast)
    procs, device = processes_from_env(device)
    if procs.distributed:
        _check_distributable(cfg, procs)
    workers = cfg.workers if cfg.workers is not None else default_workers(device, procs.world_size)
    if device.type == "cpu":
        # Denormal floats (near-zero activations on flat backgrounds) slow CPU kernels many-fold.
        torch.set_flush_denormal(True)
    splits = splits or prepare_splits(cfg.protocol, cfg.dataset, cfg.data_root, seed=cfg.seed)
    check_training_split(cfg.protocol, cfg.dataset, splits)
    fp = fingerprint(
        cfg.protocol,
        splits.digest(),
        loss=cfg.loss,
        loss_args=cfg.loss_args,
        world_size=procs.world_size,
    )
    plan = _RunPlan(
        cfg,
        device,
        procs,
        workers,
        splits,
        fp,
        RunFolder(Path(cfg.checkpoint_root) / run_key(cfg, fp)),
        cfg.experiment or f"{cfg.dataset}-{cfg.protocol.name}",
    )
    _find_resume(plan)
    return plan


def _find_resume(plan: _RunPlan) -> None:
    """Under ``resume``: runs of this key left RUNNING by a dead process marked KILLED, and
    what the run continues: the checkpoint of its folder (when it passes its checks) or,
    evaluate-only, its earlier run."""
    cfg = plan.cfg
    if cfg.resume and plan.procs.is_main:
        same_key = f"tags.run_key = {filter_value(plan.folder.key)}"
        # A run of this key whose process was SIGKILLed stays RUNNING: mark it KILLED.
        for run_id in mark_dead_runs_killed(plan.experiment, same_key):
            log_line(f"run {run_id} of a process that died was left RUNNING; marked KILLED")
        if cfg.evaluate_only and (previous := newest_run(plan.experiment, same_key)):
            plan.previous = previous
            log_line(f"evaluating {cfg.method} seed {cfg.seed} again into its run {previous}")
    if cfg.resume:
        plan.checkpoint = plan.folder.load_last()  # None (and one line) if unusable
    if plan.checkpoint is not None:
        log_line(
            f"resuming {cfg.method} seed {cfg.seed} after epoch {plan.checkpoint['epoch']} "
            f"from {plan.folder.last.path}"
        )


def _check_distributable(cfg: RunConfig, procs: Processes) -> None:
    """One line, before anything is built, for a run that cannot train across processes."""
    if not cfg.protocol.backbone.freeze_bn:
        raise HarnessError(
            f"training across {procs.world_size} processes needs frozen BatchNorm "
            f"(backbone.freeze_bn = true): trained BatchNorm would normalise by each "
            f"process's share, not by the protocol's batch"
        )
    entry = METHODS.get(cfg.method)
    reason = entry.cls.cross_process_refusal({**entry.options(), **cfg.method_options})
    if reason:
        raise HarnessError(
            f"method '{cfg.method}' cannot train across {procs.world_size} processes: {reason}"
        )
