"""One run, from its configuration to its tracked result: :func:`run_training` prepares
the run once (device, processes, splits, fingerprint, the checkpoint it continues, the
weights it starts from) and composes the pieces of :mod:`harness.engine` (a
:class:`~harness.engine.run.trainer.Trainer` recording into an
:class:`~harness.engine.run.mlflow_recorder.MlflowRecorder` and checkpointing into the run's
folder); this module is where ``run``, ``sweep`` and ``tune`` import them from.

Under ``torchrun`` one run trains across processes (:mod:`harness.engine.run.distributed`):
each trains its share of every batch, and process 0 alone evaluates, tracks and
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.base.device import configure_determinism
from harness.base.errors import HarnessError
from harness.components.data import DatasetSplits
from harness.config.deviations import footnote
from harness.config.fingerprint import fingerprint
from harness.config.protocol import Protocol
from harness.engine.run.checkpoints import FolderCheckpointer, RunFolder
from harness.engine.run.data import check_training_split, prepare_splits
from harness.engine.run.distributed import Processes, barrier, processes_from_env
from harness.engine.run.embedding import Evaluator
from harness.engine.run.export import DrawExplanations, ExportEmbedder
from harness.engine.run.mlflow_recorder import MlflowRecorder
from harness.engine.run.model import EmbeddingModel, build_model, on_device
from harness.engine.run.recorder import NullRecorder, Recorder
from harness.engine.run.run_config import (
    RunConfig,
    paper_deviations,
    run_key,
)
from harness.engine.run.runtime import default_workers, log_line, resolve_device, seed_everything
from harness.engine.run.trainer import EndOfRunStep, EpochCallback, Trainer
from harness.engine.run.views import DrawRetrievalViews
from harness.methods import METHODS, ProcessBound
from harness.store.dead_runs import mark_dead_runs_killed
from harness.store.tracking import filter_value, newest_run
from harness.store.weights import load_finished_weights

__all__ = [
    "TrainFunction",
    "training_splits",
    "run_training",
]


def training_splits(
    protocol: Protocol,
    dataset: str,
    data_root: Path | None,
    *,
    control: str = "",
    seed: int | None = None,
) -> DatasetSplits:
    """The splits a run trains and is evaluated on (:func:`~harness.engine.run.data.prepare_splits`),
    the protocol's rules that need them checked (its batch fits in the training split):
    what ``run``, ``sweep`` and ``tune`` hand :func:`run_training`."""
    splits = prepare_splits(protocol, dataset, data_root, control=control, seed=seed)
    check_training_split(protocol, dataset, splits)
    return splits


@dataclass
class _RunPlan:
    """What one run works from, fixed before it starts: the configuration, the device and
    processes, the splits and their fingerprint, its folder and experiment, and the
    checkpoint (or, evaluate-only, the earlier run) it continues."""

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


#: What trains one run (:func:`run_training`, or a stand-in handed to ``run``, ``sweep`` and
#: ``tune``): ``(cfg, splits)`` (``tune`` adds ``on_epoch=``) -> the run's record.
TrainFunction = Callable[..., dict[str, Any]]


def run_training(
    cfg: RunConfig,
    splits: DatasetSplits | None = None,
    *,
    on_epoch: EpochCallback | None = None,
    evaluator: Evaluator | None = None,
    wrap_parts: Callable[[Trainer], Trainer] | None = None,
) -> dict[str, Any]:
    """Train and test one run; returns the record written by ``run --json`` (empty in the
    processes other than 0 of a distributed run, which train their share and wait).

    ``splits``: the run's, with the protocol's batch rule checked on them
    (:func:`training_splits`, or :func:`~harness.engine.run.data.check_training_split` on splits
    shared between runs); None: prepared and checked here. ``on_epoch``: called after each
    epoch with ``(epoch, record)`` (may raise, e.g. ``optuna.TrialPruned``). ``evaluator``:
    what scores the model on validation and test (default:
    :class:`~harness.engine.run.embedding.SplitEvaluator` of the splits). ``wrap_parts``:
    given the trainer as built, the one that trains (the fault-injection suite wraps its
    checkpointer, evaluator or step there).

    Model selection follows ``protocol.selection``: the epoch with the best
    validation metric ("validation"), the best test metric ("test-paper", the
    seeds' released-code behaviour, labelled everywhere) or the last epoch.

    The steps, in order: prepare (device, splits, fingerprint, checkpoint), build (model
    with the weights it starts from, loss, optimizer, sampler), open the tracked run and
    resume the checkpoint's state, train the epochs with per-epoch selection, test the
    selected weights, record.
    """
    plan = _prepare(cfg, splits)
    wrap = wrap_parts or (lambda trainer: trainer)
    stamp = {"fingerprint": plan.fp}
    if not plan.procs.is_main:
        follower = _trainer(plan, NullRecorder(), on_epoch, evaluator)
        follower.checkpointer = FolderCheckpointer(plan.folder, stamp)
        return _follow(wrap(follower), plan.checkpoint)
    recorder = MlflowRecorder(
        cfg,
        plan.folder,
        experiment=plan.experiment,
        fingerprint=plan.fp,
        splits=plan.splits,
        world_size=plan.procs.world_size,
        device=plan.device,
    )
    trainer = _trainer(plan, recorder, on_epoch, evaluator)
    recorder.open(plan.checkpoint.get("mlflow_run_id") if plan.checkpoint else plan.previous)
    # The parts that need the tracked run, given it: a resume continues the run its
    # checkpoint names, and the end-of-run steps log into it.
    trainer.checkpointer = FolderCheckpointer(
        plan.folder, {**stamp, "mlflow_run_id": recorder.run_id}
    )
    trainer.end_of_run = _end_of_run(plan, recorder)
    selected_epoch, test = _train_and_test(wrap(trainer), recorder, plan)
    return _run_record(plan, recorder.run_id, selected_epoch, test)


def _end_of_run(plan: _RunPlan, recorder: MlflowRecorder) -> list[EndOfRunStep]:
    """What follows a tested run: its selected weights logged, the model exported, the
    explanations, the retrieval examples and the embedding map drawn (none of them for a
    search trial)."""
    if plan.cfg.search_only:
        return []
    tracker = recorder.tracker
    return [
        recorder.record_selected_weights,
        ExportEmbedder(tracker, plan.cfg, plan.splits.digest()),
        DrawExplanations(tracker, plan.cfg, plan.splits, plan.folder.path, plan.device),
        DrawRetrievalViews(
            tracker, plan.cfg, plan.splits, plan.folder.path, plan.device, plan.workers
        ),
    ]


def _trainer(
    plan: _RunPlan,
    recorder: Recorder,
    on_epoch: EpochCallback | None,
    evaluator: Evaluator | None,
) -> Trainer:
    """The run's trainer, its model built (seeded) with the weights it starts from."""
    model, init_selected_epoch = _initial_model(plan)
    return Trainer.from_config(
        plan.cfg,
        plan.splits,
        recorder=recorder,
        evaluator=evaluator,
        model=model,
        init_selected_epoch=init_selected_epoch,
        device=plan.device,
        workers=plan.workers,
        procs=plan.procs,
        on_epoch=on_epoch,
    )


def _initial_model(plan: _RunPlan) -> tuple[EmbeddingModel, int]:
    """Seed, then the run's model on its device and the epoch its weights come from (0:
    fresh ones; else the selected epoch of ``init_from``, read from the tracking store and
    the checkpoint root; an evaluate-only run's must carry the run's fingerprint)."""
    cfg = plan.cfg
    seed_everything(cfg.seed)
    model = build_model(cfg.protocol, cfg.method, cfg.method_options)
    init_selected_epoch = 0
    if cfg.init_from:
        init_selected_epoch = load_finished_weights(
            model,
            cfg.init_from,
            flag="--init-from",
            checkpoint_root=cfg.settings.init_root or cfg.settings.checkpoint_root,
            expect_fingerprint=plan.fp if cfg.evaluate_only else "",
        )
    return on_device(model, plan.device), init_selected_epoch


def _train_and_test(
    trainer: Trainer, recorder: Recorder, plan: _RunPlan
) -> tuple[int, dict[str, float]]:
    """Process 0's run from its start to its end in the recorder: resume, fit, test the
    selected weights (a search trial: scored on validation, the test split unread),
    finish; on any error the run is marked failed and the error raised."""
    try:
        recorder.start(plan.checkpoint)
        if plan.checkpoint is not None:
            trainer.resume(plan.checkpoint)
        trainer.fit()
        selected_epoch = trainer.load_selected_weights()
        if plan.cfg.search_only:
            test: dict[str, float] = {}
            recorder.finish(None)
        else:
            test = trainer.test(selected_epoch)
            recorder.finish(trainer.finish(selected_epoch, test))
        barrier(plan.procs)
    except BaseException as err:
        recorder.fail(err)
        raise
    return selected_epoch, test


def _follow(trainer: Trainer, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """A process other than 0: train its share of every epoch, then wait while process 0
    tests and records (returns no record; process 0 reports the run)."""
    if checkpoint is not None:
        trainer.resume(checkpoint)
    trainer.fit()
    barrier(trainer.procs)  # process 0 tests and saves the selected weights
    return {}


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
        "deterministic": cfg.settings.deterministic,
        "fast": cfg.settings.fast,
        "compile": cfg.settings.compile,
        "cuda_graphs": cfg.settings.cuda_graphs,
        "metrics": {k: v for k, v in test.items() if not k.startswith("num_")},
    }


def _prepare(cfg: RunConfig, splits: DatasetSplits | None) -> _RunPlan:
    """Resolve the device and processes; load the splits (unless given); fingerprint the
    run; find the checkpoint (or, evaluate-only, the earlier run) a resume continues."""
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
    plan = _RunPlan(
        cfg,
        device,
        procs,
        workers,
        splits,
        fp,
        RunFolder(settings.checkpoint_root / run_key(cfg, fp)),
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
    cls, options = entry.cls, {**entry.options(), **cfg.method_options}
    reason = cls.cross_process_refusal(options) if issubclass(cls, ProcessBound) else ""
    if reason:
        raise HarnessError(
            f"method '{cfg.method}' cannot train across {procs.world_size} processes: {reason}"
        )
