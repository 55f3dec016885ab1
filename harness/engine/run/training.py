"""One run, from its configuration to its tracked result: :func:`train_run` resolves the
configuration once (:func:`~harness.engine.run.assembly.resolve_run`), builds the run's
parts from it (:func:`~harness.engine.run.assembly.assemble_run`) and hands them to
:func:`run_training`, which trains and tests them and returns the run's record; this module
is where ``run``, ``sweep`` and ``tune`` import them from.

Under ``torchrun`` one run trains across processes (:mod:`harness.engine.run.distributed`):
each trains its share of every batch, and process 0 alone evaluates, tracks and
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.components.data import DatasetSplits
from harness.engine.run.assembly import AssembledRun, assemble_run, resolve_run
from harness.engine.run.distributed import barrier
from harness.engine.run.embedding import Evaluator
from harness.engine.run.run_config import RunConfig
from harness.engine.run.trainer import EpochCallback, Trainer

__all__ = [
    "TrainFunction",
    "train_run",
    "run_training",
]

#: What trains one run (:func:`train_run`, or a stand-in handed to ``run``, ``sweep`` and
#: ``tune``): ``(cfg, splits)`` (``tune`` adds ``on_epoch=``) -> the run's record.
TrainFunction = Callable[..., dict[str, Any]]


def train_run(
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
    (:func:`~harness.engine.run.data.training_splits`, or
    :func:`~harness.engine.run.data.check_training_split` on splits shared between runs);
    None: prepared and checked here. ``on_epoch``, ``evaluator`` and ``wrap_parts``: as
    :func:`~harness.engine.run.assembly.assemble_run` takes them.

    The steps, in order: resolve (device, splits, fingerprint, checkpoint), assemble (model
    with the weights it starts from, loss, optimizer, sampler, the tracked run), then
    :func:`run_training`.
    """
    resolved = resolve_run(cfg, splits)
    return run_training(
        assemble_run(resolved, on_epoch=on_epoch, evaluator=evaluator, wrap_parts=wrap_parts)
    )


def run_training(run: AssembledRun) -> dict[str, Any]:
    """Train and test an assembled run: resume its checkpoint's state, train the epochs
    with per-epoch selection, test the selected weights, record; returns the record (empty
    in a process other than 0, which trains its share and waits).

    Model selection follows ``protocol.selection``: the epoch with the best
    validation metric ("validation"), the best test metric ("test-paper", the
    seeds' released-code behaviour, labelled everywhere) or the last epoch.
    """
    resolved, trainer = run.resolved, run.trainer
    if not resolved.procs.is_main:
        return _follow(trainer, resolved.checkpoint)
    selected_epoch, test = _train_and_test(run)
    return {
        **resolved.record,
        "selected_epoch": selected_epoch,
        "mlflow_run_id": run.recorder.run_id,
        "metrics": {k: v for k, v in test.items() if not k.startswith("num_")},
    }


def _train_and_test(run: AssembledRun) -> tuple[int, dict[str, float]]:
    """Process 0's run from its start to its end in the recorder: resume, fit, test the
    selected weights (a search trial: scored on validation, the test split unread),
    finish; on any error the run is marked failed and the error raised."""
    trainer, recorder, resolved = run.trainer, run.recorder, run.resolved
    try:
        recorder.start(resolved.checkpoint)
        if resolved.checkpoint is not None:
            trainer.resume(resolved.checkpoint)
        trainer.fit()
        selected_epoch = trainer.load_selected_weights()
        if resolved.cfg.search_only:
            test: dict[str, float] = {}
            recorder.finish(None)
        else:
            test = trainer.test(selected_epoch)
            recorder.finish(trainer.finish(selected_epoch, test))
        barrier(resolved.procs)
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
