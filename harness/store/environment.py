"""The settings the harness reads from its environment, in one module.

Below the command line, the engine reads no environment variable itself: it asks here.
The variables, each with what it sets:

* ``DML_HARNESS_CHECKPOINTS``: the checkpoint root when ``--checkpoint-root`` is not given
  (default ``results/checkpoints``, relative to the working directory);
* ``DML_HARNESS_LOG_MODEL``: ``1`` (default) logs each finished run's embedder as an MLflow
  model, ``0`` skips it;
* ``DML_HARNESS_ESTIMATE``: ``1`` (default) has ``run`` and ``sweep`` measure a warm-up and
  print their estimate before the first run (a CPU command over an hour stopping without
  ``--yes``), ``0`` starts at once, as ``--yes`` does, with no estimate;
* ``DML_HARNESS_OPTUNA_STORAGE``: the Optuna storage of tuned grids when the command names none;
* ``DML_HARNESS_CACHE``: where the harness keeps what it can recompute (the ``methods`` lines
  of installed packages' plugins); default ``$XDG_CACHE_HOME/dml-harness``, else
  ``~/.cache/dml-harness``;
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: the process group ``torchrun`` starts;
* ``SLURM_JOB_ID``, ``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``: the Slurm job a worker
  runs in, recorded as run tags.

The tracking store's own variable (``MLFLOW_TRACKING_URI``) is read by
:mod:`harness.store.location`; the data root's (``DML_HARNESS_DATA``) by the datasets'
loaders (:func:`harness.components.data.base.default_data_root`), below the store.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.base.errors import HarnessError

__all__ = [
    "CHECKPOINTS_ENV",
    "LOG_MODEL_ENV",
    "ESTIMATE_ENV",
    "OPTUNA_STORAGE_ENV",
    "CACHE_ENV",
    "cache_folder",
    "SLURM_TAGS",
    "carried_environment",
    "default_checkpoint_root",
    "logs_model",
    "estimates_commands",
    "optuna_storage_setting",
    "slurm_ids",
    "torchrun_ranks",
]

CHECKPOINTS_ENV = "DML_HARNESS_CHECKPOINTS"
#: The setting that turns off the logged MLflow model of each run (``0``); the selected
#: weights stay in the run's ``weights/`` artifact and its checkpoint folder either way.
LOG_MODEL_ENV = "DML_HARNESS_LOG_MODEL"
#: The setting that turns off the warm-up and the estimate before ``run`` and ``sweep`` (``0``).
ESTIMATE_ENV = "DML_HARNESS_ESTIMATE"
OPTUNA_STORAGE_ENV = "DML_HARNESS_OPTUNA_STORAGE"
CACHE_ENV = "DML_HARNESS_CACHE"
#: MLflow tag -> the environment variable Slurm sets in a job's processes.
SLURM_TAGS = {
    "slurm_job_id": "SLURM_JOB_ID",
    "slurm_array_job_id": "SLURM_ARRAY_JOB_ID",
    "slurm_array_task_id": "SLURM_ARRAY_TASK_ID",
}


def default_checkpoint_root() -> Path:
    """``$DML_HARNESS_CHECKPOINTS``, else ``results/checkpoints`` (relative to the working directory)."""
    return Path(os.environ.get(CHECKPOINTS_ENV) or "results/checkpoints")


def logs_model() -> bool:
    """Whether finished runs log their embedder as an MLflow model: ``$DML_HARNESS_LOG_MODEL``
    ``1`` (the default) or ``0``. Exporting the model (torch.export) costs seconds per run,
    which a large sweep or a test suite may rather spend training; the run then records
    ``model_uri`` as ``none``. Any other value is one error line."""
    value = os.environ.get(LOG_MODEL_ENV, "1").strip()
    if value not in ("0", "1"):
        raise HarnessError(f"{LOG_MODEL_ENV} must be 1 (log each run's model) or 0, not {value!r}")
    return value == "1"


def estimates_commands() -> bool:
    """Whether ``run`` and ``sweep`` measure a warm-up and print their estimate first:
    ``$DML_HARNESS_ESTIMATE`` ``1`` (the default) or ``0``. The warm-up costs about a second
    per method on 2 CPU cores, which a script of many short runs (a test suite) may rather
    spend on the runs; with ``0`` nothing is estimated and nothing is gated, as under
    ``--yes``. Any other value is one error line."""
    value = os.environ.get(ESTIMATE_ENV, "1").strip()
    if value not in ("0", "1"):
        raise HarnessError(
            f"{ESTIMATE_ENV} must be 1 (estimate before the first run) or 0, not {value!r}"
        )
    return value == "1"


def optuna_storage_setting() -> str | None:
    """``$DML_HARNESS_OPTUNA_STORAGE``, or None where it is unset or empty."""
    return os.environ.get(OPTUNA_STORAGE_ENV) or None


def cache_folder() -> Path:
    """``$DML_HARNESS_CACHE``, else ``dml-harness`` under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "dml-harness"


def slurm_ids() -> dict[str, str]:
    """The Slurm ids of the job this process runs in (none outside Slurm), as run tags."""
    return {tag: os.environ[var] for tag, var in SLURM_TAGS.items() if os.environ.get(var)}


#: What a grid's Slurm or local-executor tasks carry from the submitting shell: the
#: tracking store, the hub's offline switch and every ``DML_HARNESS_*`` setting.
CARRIED = ("MLFLOW_TRACKING_URI", "HF_HUB_OFFLINE")
CARRIED_PREFIX = "DML_HARNESS_"


def carried_environment() -> dict[str, str]:
    """The variables of this process that a grid's tasks carry (:data:`CARRIED`, ``DML_HARNESS_*``)."""
    return {k: v for k, v in os.environ.items() if k in CARRIED or k.startswith(CARRIED_PREFIX)}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise HarnessError(
            f"environment variable {name}={value!r} is not an integer (set by torchrun)"
        ) from None


def torchrun_ranks() -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as ``torchrun`` sets them; ``(0, 1, 0)`` outside it."""
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
