"""A run put together before it trains: :func:`resolve_run` turns its configuration into
what it works from (device, processes, splits, fingerprint, folder, the checkpoint it
continues) once, and :func:`assemble_run` builds the parts from that (the model with the
weights it starts from, the trainer with its loss, optimizer, batches and step, the
recorder and the checkpointer). :func:`~harness.engine.run.training.run_training` then runs
the assembled parts and reads no configuration itself.

Under ``torchrun`` each process assembles its own run (:mod:`harness.engine.run.distributed`):
process 0 records and checkpoints into the tracked run; the others train their share into a
recorder that records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.base.device import configure_determinism
from harness.base.errors import HarnessError
from harness.components.data import DatasetSplits
from harness.config.deviations import footnote
from harness.config.fingerprint import fingerprint
from harness.engine.run.checkpoints import FolderCheckpointer, RunFolder
from harness.engine.run.data import training_splits
from harness.engine.run.distributed import Processes, processes_from_env
from harness.engine.run.embedding import Evaluator
from harness.engine.run.export import DrawExplanations, ExportEmbedder
from harness.engine.run.mlflow_recorder import MlflowRecorder
from harness.engine.run.model import EmbeddingModel, build_model, on_device
from harness.engine.run.recorder import NullRecorder, Recorder
from harness.engine.run.run_config import RunConfig, paper_deviations, run_key
from harness.engine.run.runtime import default_workers, log_line, resolve_device, seed_everything
from harness.engine.run.trainer import EndOfRunStep, EpochCallback, Trainer
from harness.engine.run.views import DrawRetrievalViews
from harness.methods import METHODS, ProcessBound
from harness.store.dead_runs import mark_dead_runs_killed
from harness.store.tracking import filter_value, newest_run
from harness.store.weights import FinishedWeights, find_finished_weights, load_weights

__all__ = [
    "ResolvedRun",
    "resolve_run",
    "AssembledRun",
    "assemble_run",
]


@dataclass
class ResolvedRun:
    """What one run works from, fixed before it starts: the configuration, the device and
    processes, the splits and their fingerprint, its folder and experiment, the checkpoint
    (or, evaluate-only, the earlier run) it continues, and what its record says of it."""

    cfg: RunConfig
    device: torch.device
    procs: Processes
    workers: int
    splits: DatasetSplits
    fingerprint: str
    folder: RunFolder
    experiment: str
    checkpoint: dict[str, Any] | None = None
    #: An evaluate-only run trains nothing and keeps no last.pt: it resumes into its run.
    previous: str | None = None
    #: The weights the model starts from (``init_from``'s), found and checked; None: fresh.
    init_weights: FinishedWeights | None = None
    #: The run's record without its outcome (method, protocol, deviations, settings).
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class AssembledRun:
    """A run's built parts: the trainer (its checkpointer and end-of-run steps set) and the
    recorder it records into (a :class:`~harness.engine.run.recorder.NullRecorder` in the
    processes other than 0), with the resolved run they were built from."""

    resolved: ResolvedRun
    trainer: Trainer
    recorder: Recorder


def resolve_run(cfg: RunConfig, splits: DatasetSplits | None = None) -> ResolvedRun:
    """Resolve the device and processes; load the splits (unless given, with the protocol's
    batch rule checked on them); fingerprint the run; find the checkpoint (or,
    evaluate-only, the earlier run) a resume continues, and the weights of ``init_from``
    (an evaluate-only run's must carry the run's fingerprint)."""
    if cfg.evaluate_only and not cfg.init_from:
        raise HarnessError(
            "an evaluate-only run needs init_from (the run whose weights it evaluates)"
        )
    settings = cfg.settings
    device = resolve_device(settings.device)
    configure_determinism(settings.deterministic, fast=settings.fast)
    procs, device = processes_from_env(device)
    if procs.distributed:
        _check_distributable(cfg, procs)
    workers = (
        settings.workers
        if settings.workers is not None
        else default_workers(device, procs.world_size)
    )
    if device.type == "cpu":
        # Denormal floats (near-zero activations on flat backgrounds) slow CPU kernels many-fold.
        torch.set_flush_denormal(True)
    if splits is None:
        splits = training_splits(cfg.protocol, cfg.dataset, settings.data_root, seed=cfg.seed)
    fp = fingerprint(
        cfg.protocol,
        splits.digest(),
        loss=cfg.loss,
        loss_args=cfg.loss_args,
        world_size=procs.world_size,
    )
    resolved = ResolvedRun(
        cfg,
        device,
        procs,
        workers,
        splits,
        fp,
        RunFolder(settings.checkpoint_root / run_key(cfg, fp)),
        cfg.experiment or f"{cfg.dataset}-{cfg.protocol.name}",
        record=_run_record(cfg, fp, procs),
    )
    if cfg.init_from:  # a refusal comes before _find_resume changes anything in the store
        resolved.init_weights = find_finished_weights(
            cfg.init_from,
            flag="--init-from",
            checkpoint_root=settings.init_root or settings.checkpoint_root,
            expect_fingerprint=fp if cfg.evaluate_only else "",
        )
    _find_resume(resolved)
    return resolved


def _run_record(cfg: RunConfig, fp: str, procs: Processes) -> dict[str, Any]:
    """What ``run --json`` says of a run before it ran."""
    return {
        "method": cfg.method,
        "dataset": cfg.dataset,
        "loss": cfg.loss,
        "seed": cfg.seed,
        "protocol": cfg.protocol.name,
        "fingerprint": fp,
        "deviations": [str(d) for d in cfg.deviations],
        "selection": cfg.protocol.selection.mode,
        "paper_deviations": [footnote(n, d) for n, d in paper_deviations(cfg).items()],
        "world_size": procs.world_size,
        "deterministic": cfg.settings.deterministic,
        "fast": cfg.settings.fast,
        "compile": cfg.settings.compile,
        "cuda_graphs": cfg.settings.cuda_graphs,
    }


def _find_resume(resolved: ResolvedRun) -> None:
    """Under ``resume``: runs of this key left RUNNING by a dead process marked KILLED, and
    what the run continues: the checkpoint of its folder (when it passes its checks) or,
    evaluate-only, its earlier run."""
    cfg = resolved.cfg
    if cfg.resume and resolved.procs.is_main:
        same_key = f"tags.run_key = {filter_value(resolved.folder.key)}"
        # A run of this key whose process was SIGKILLed stays RUNNING: mark it KILLED.
        for run_id in mark_dead_runs_killed(resolved.experiment, same_key):
            log_line(f"run {run_id} of a process that died was left RUNNING; marked KILLED")
        if cfg.evaluate_only and (previous := newest_run(resolved.experiment, same_key)):
            resolved.previous = previous
            log_line(f"evaluating {cfg.method} seed {cfg.seed} again into its run {previous}")
    if cfg.resume:
        resolved.checkpoint = resolved.folder.load_last()  # None (and one line) if unusable
    if resolved.checkpoint is not None:
        log_line(
            f"resuming {cfg.method} seed {cfg.seed} after epoch "
            f"{resolved.checkpoint['epoch']} from {resolved.folder.last.path}"
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
    cls, options = entry.cls, {**entry.options(), **cfg.method_options}
    reason = cls.cross_process_refusal(options) if issubclass(cls, ProcessBound) else ""
    if reason:
        raise HarnessError(
            f"method '{cfg.method}' cannot train across {procs.world_size} processes: {reason}"
        )


def assemble_run(
    resolved: ResolvedRun,
    *,
    on_epoch: EpochCallback | None = None,
    evaluator: Evaluator | None = None,
    wrap_parts: Callable[[Trainer], Trainer] | None = None,
) -> AssembledRun:
    """The run's parts, built from ``resolved``. In process 0 this opens the tracked run (a
    resume continues the run its checkpoint names) and gives the checkpointer its id.

    ``on_epoch``: called after each epoch with ``(epoch, record)`` (may raise, e.g.
    ``optuna.TrialPruned``). ``evaluator``: what scores the model on validation and test
    (default: :class:`~harness.engine.run.embedding.SplitEvaluator` of the splits).
    ``wrap_parts``: given the trainer as built, the one that trains (the fault-injection
    suite wraps its checkpointer, evaluator or step there)."""
    wrap = wrap_parts or (lambda trainer: trainer)
    stamp = {"fingerprint": resolved.fingerprint}
    if not resolved.procs.is_main:
        follower = _trainer(resolved, NullRecorder(), on_epoch, evaluator)
        follower.checkpointer = FolderCheckpointer(resolved.folder, stamp)
        return AssembledRun(resolved, wrap(follower), follower.recorder)
    recorder = MlflowRecorder(
        resolved.cfg,
        resolved.folder,
        experiment=resolved.experiment,
        fingerprint=resolved.fingerprint,
        splits=resolved.splits,
        world_size=resolved.procs.world_size,
        device=resolved.device,
    )
    trainer = _trainer(resolved, recorder, on_epoch, evaluator)
    checkpoint = resolved.checkpoint
    recorder.open(checkpoint.get("mlflow_run_id") if checkpoint else resolved.previous)
    # The parts that need the tracked run, given it: a resume continues the run its
    # checkpoint names, and the end-of-run steps log into it.
    trainer.checkpointer = FolderCheckpointer(
        resolved.folder, {**stamp, "mlflow_run_id": recorder.run_id}
    )
    trainer.end_of_run = _end_of_run(resolved, recorder)
    return AssembledRun(resolved, wrap(trainer), recorder)


def _end_of_run(resolved: ResolvedRun, recorder: MlflowRecorder) -> list[EndOfRunStep]:
    """What follows a tested run: its selected weights logged, the model exported, the
    explanations, the retrieval examples and the embedding map drawn (none of them for a
    search trial)."""
    if resolved.cfg.search_only:
        return []
    tracker, cfg, splits = recorder.tracker, resolved.cfg, resolved.splits
    folder, device = resolved.folder.path, resolved.device
    return [
        recorder.record_selected_weights,
        ExportEmbedder(tracker, cfg, splits.digest()),
        DrawExplanations(tracker, cfg, splits, folder, device),
        DrawRetrievalViews(tracker, cfg, splits, folder, device, resolved.workers),
    ]


def _trainer(
    resolved: ResolvedRun,
    recorder: Recorder,
    on_epoch: EpochCallback | None,
    evaluator: Evaluator | None,
) -> Trainer:
    """The run's trainer, its model built (seeded) with the weights it starts from."""
    model, init_selected_epoch = _initial_model(resolved)
    return Trainer.from_config(
        resolved.cfg,
        resolved.splits,
        recorder=recorder,
        evaluator=evaluator,
        model=model,
        init_selected_epoch=init_selected_epoch,
        device=resolved.device,
        workers=resolved.workers,
        procs=resolved.procs,
        on_epoch=on_epoch,
    )


def _initial_model(resolved: ResolvedRun) -> tuple[EmbeddingModel, int]:
    """Seed, then the run's model on its device and the epoch its weights come from (0:
    fresh ones; else the selected epoch of ``init_from``, whose weights the resolution
    found)."""
    cfg = resolved.cfg
    seed_everything(cfg.seed)
    model = build_model(cfg.protocol, cfg.method, cfg.method_options)
    init_selected_epoch = 0
    if resolved.init_weights is not None:
        init_selected_epoch = load_weights(model, resolved.init_weights, flag="--init-from")
    return on_device(model, resolved.device), init_selected_epoch
