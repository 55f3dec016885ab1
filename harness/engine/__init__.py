"""Training and evaluation of a run, grid sweeps, tuning, explanations and audits: one
package per subsystem.

- :mod:`harness.engine.run`: one run, from its configuration to tracked metrics (the
  :class:`Trainer` and its parts);
- :mod:`harness.engine.grid`: a grid's cells as tasks of one queue, here or on Slurm;
- :mod:`harness.engine.tuning`: Optuna studies, the same budget for every method;
- :mod:`harness.engine.explain`: a finished run's attribution maps and their checks;
- :mod:`harness.engine.audit`: re-runs, the run as built against the ledgers, and the
  measured effect of each deviation.

``grid`` and ``tuning`` use ``run``; ``tuning`` uses ``grid``; nothing in the engine uses
``explain`` or ``audit`` (the import contracts in ``pyproject.toml``). The run's library
surface is re-exported here::

    from harness.engine import InMemoryCheckpointer, InMemoryRecorder, RunConfig, Trainer
"""

from harness.engine.run import (
    Checkpointer,
    EmbeddingModel,
    EpochCallback,
    Evaluator,
    FinishedRun,
    FolderCheckpointer,
    InMemoryCheckpointer,
    InMemoryRecorder,
    MlflowRecorder,
    NullRecorder,
    Progress,
    Recorder,
    RunConfig,
    RunFolder,
    RunSettings,
    SplitEvaluator,
    StepFlush,
    Trainer,
    TrainFunction,
    TrainingBatches,
    TrainingParts,
    TrainingStep,
    build_model,
    check_training_split,
    control_deviation,
    default_workers,
    evaluate_split,
    prepare_splits,
    resolve_device,
    run_key,
    run_miner,
    run_training,
    seed_everything,
    shutdown,
    train_run,
    training_splits,
    whole_graph_blocker,
)

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
    "run_key",
    "prepare_splits",
    "check_training_split",
    "training_splits",
    "train_run",
    "run_training",
    "TrainFunction",
    "resolve_device",
    "default_workers",
    "seed_everything",
    "shutdown",
    "run_miner",
    "whole_graph_blocker",
]
