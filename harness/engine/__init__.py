"""Training, evaluation of a model, distributed runs, grid sweeps and Optuna tuning.

The engine as a library: a :class:`Trainer` made from its parts (the modules and optimizer,
the training batches, the step, an :class:`Evaluator`, a :class:`Checkpointer` and a
:class:`Recorder`), :meth:`Trainer.from_config` to build them for a :class:`RunConfig`, and
:func:`run_training`, the harness's own run of one configuration (tracked in MLflow,
checkpointed under the checkpoint root)::

    from harness.engine import InMemoryCheckpointer, InMemoryRecorder, RunConfig, Trainer

Each name is imported from its module when first used: ``python -m harness --help``
does not load the training stack (torch, timm, MLflow) for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.engine.checkpoints import (
        Checkpointer,
        FolderCheckpointer,
        InMemoryCheckpointer,
        RunFolder,
    )
    from harness.engine.compiled_step import whole_graph_blocker
    from harness.engine.data import (
        TrainingBatches,
        check_training_split,
        control_deviation,
        prepare_splits,
    )
    from harness.engine.distributed import shutdown
    from harness.engine.embedding import Evaluator, SplitEvaluator, evaluate_split
    from harness.engine.mlflow_recorder import MlflowRecorder
    from harness.engine.model import EmbeddingModel, build_model
    from harness.engine.recorder import (
        FinishedRun,
        InMemoryRecorder,
        NullRecorder,
        Recorder,
        StepFlush,
    )
    from harness.engine.run_config import (
        RunConfig,
        RunSettings,
        default_checkpoint_root,
        logs_model,
        run_key,
    )
    from harness.engine.runtime import default_workers, resolve_device, seed_everything
    from harness.engine.step import TrainingParts, TrainingStep, run_miner
    from harness.engine.trainer import EpochCallback, Progress, Trainer
    from harness.engine.training import TrainFunction, run_training, training_splits

#: Each public name and the module that defines it.
_EXPORTS = {
    # the trainer and its parts
    "Trainer": "trainer",
    "Progress": "trainer",
    "EpochCallback": "trainer",
    "TrainingParts": "step",
    "TrainingStep": "step",
    "TrainingBatches": "data",
    "control_deviation": "data",
    "EmbeddingModel": "model",
    "build_model": "model",
    "Evaluator": "embedding",
    "SplitEvaluator": "embedding",
    "evaluate_split": "embedding",
    # where a run's results and checkpoints go
    "Recorder": "recorder",
    "InMemoryRecorder": "recorder",
    "NullRecorder": "recorder",
    "FinishedRun": "recorder",
    "StepFlush": "recorder",
    "MlflowRecorder": "mlflow_recorder",
    "Checkpointer": "checkpoints",
    "InMemoryCheckpointer": "checkpoints",
    "FolderCheckpointer": "checkpoints",
    "RunFolder": "checkpoints",
    # one run: its configuration, its data, its training
    "RunConfig": "run_config",
    "RunSettings": "run_config",
    "default_checkpoint_root": "run_config",
    "logs_model": "run_config",
    "run_key": "run_config",
    "prepare_splits": "data",
    "check_training_split": "data",
    "training_splits": "training",
    "run_training": "training",
    "TrainFunction": "training",
    # where a run executes
    "resolve_device": "runtime",
    "default_workers": "runtime",
    "seed_everything": "runtime",
    "shutdown": "distributed",
    "run_miner": "step",
    "whole_graph_blocker": "compiled_step",
}

__all__ = [
    "Trainer",
    "Progress",
    "EpochCallback",
    "TrainingParts",
    "TrainingStep",
    "TrainingBatches",
    "control_deviation",
    "EmbeddingModel",
    "build_model",
    "Evaluator",
    "SplitEvaluator",
    "evaluate_split",
    "Recorder",
    "InMemoryRecorder",
    "NullRecorder",
    "FinishedRun",
    "StepFlush",
    "MlflowRecorder",
    "Checkpointer",
    "InMemoryCheckpointer",
    "FolderCheckpointer",
    "RunFolder",
    "RunConfig",
    "RunSettings",
    "default_checkpoint_root",
    "logs_model",
    "run_key",
    "prepare_splits",
    "check_training_split",
    "training_splits",
    "run_training",
    "TrainFunction",
    "resolve_device",
    "default_workers",
    "seed_everything",
    "shutdown",
    "run_miner",
    "whole_graph_blocker",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
