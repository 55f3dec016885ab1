"""The selected weights of a FINISHED run, for a run that starts from them (``--init-from``,
``--evaluate-only``) and for explanations: found, checked against the hash the run
recorded, and loaded into a model."""

from __future__ import annotations

import hashlib
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import mlflow
import torch

from harness.base.errors import HarnessError
from harness.store.dead_runs import under_checkpoint_root
from harness.store.location import tracking_uri
from harness.store.tracking import _existing_run_experiment

__all__ = [
    "MODEL_PATH_TAG",
    "FinishedWeights",
    "check_finished_run",
    "find_finished_weights",
    "load_weights",
    "load_finished_weights",
]

#: The tag holding a run's selected weights (``model.pt``), relative to the checkpoint
#: root (an absolute one, as some records hold, is read as it is).
MODEL_PATH_TAG = "model_path"

# MLflow and torch are imported inside the functions that use them: importing them takes
# seconds, which commands that never open the store (--help, schema, methods) should not pay.


def _weights_file(
    run_id: str, tags: dict[str, str], checkpoint_root: Path | None, flag: str
) -> Path:
    """The run's ``model.pt``: ``model_path`` under the checkpoint root (``None``: the
    default one). A run recorded with an absolute ``model_path`` is looked for under the
    root first (its ``model_relpath``, else the path's last two parts), so that a moved
    root still serves, then at that absolute path."""
    recorded = tags.get(MODEL_PATH_TAG, "")
    candidates = []
    if recorded and not Path(recorded).is_absolute():
        candidates.append(under_checkpoint_root(recorded, checkpoint_root))
    elif recorded:
        relative = tags.get("model_relpath") or "/".join(Path(recorded).parts[-2:])
        if not Path(relative).is_absolute():
            candidates.append(under_checkpoint_root(relative, checkpoint_root))
        candidates.append(Path(recorded))
    found = [path for path in candidates if path is not None]
    for path in found:
        if path.is_file():
            return path
    raise HarnessError(
        f"{flag}: run '{run_id}' has no saved model: looked for "
        f"{' and '.join(map(str, found)) or 'a model_path tag'} (a checkpoint root "
        f"where the run's checkpoints are now finds them)"
    )


def check_finished_run(run_id: str, flag: str) -> None:
    """Refuse ``run_id`` unless it is a FINISHED run of the tracking store (one line naming
    ``flag``): checked before a run that starts from its weights does any work."""
    _finished_run(run_id, flag)


def _finished_run(run_id: str, flag: str):
    """The FINISHED run ``run_id`` of the tracking store (an MLflow ``Run``); anything else
    is one line naming ``flag``."""

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    if _existing_run_experiment(client, run_id) is None:
        raise HarnessError(f"{flag}: no run '{run_id}' in the tracking store {tracking_uri()}")
    run = client.get_run(run_id)
    if run.info.status != "FINISHED":
        raise HarnessError(
            f"{flag}: run '{run_id}' is {run.info.status}, not FINISHED, and has no "
            f"selected weights"
        )
    return run


@dataclass(frozen=True)
class FinishedWeights:
    """Where a FINISHED run's selected weights are: the run, the file, the sha256 the run
    recorded for it (empty where it recorded none) and the epoch its tags say it selected."""

    run_id: str
    path: Path
    sha256: str = ""
    selected_epoch: int = 0


def find_finished_weights(
    run_id: str,
    *,
    flag: str,
    expect_fingerprint: str = "",
    checkpoint_root: Path | None = None,
) -> FinishedWeights:
    """The weights file of FINISHED run ``run_id``: under ``checkpoint_root`` (relative tag)
    or at the recorded absolute path. ``flag``: where the caller took ``run_id`` from (an
    option, a setting), named at the start of every refusal. ``expect_fingerprint``
    (evaluate-only runs): the run must have been trained under this same protocol and split."""
    run = _finished_run(run_id, flag)
    path = _weights_file(run_id, run.data.tags, checkpoint_root, flag)
    trained_under = run.data.tags.get("fingerprint", "")
    if expect_fingerprint and trained_under != expect_fingerprint:
        raise HarnessError(
            f"{flag}: run '{run_id}' was trained under protocol fingerprint "
            f"{trained_under or 'unknown'}, this run's is {expect_fingerprint}; evaluating "
            f"without training needs the same protocol, dataset and loss"
        )
    tags = run.data.tags
    return FinishedWeights(
        run_id, path, tags.get("model_sha256", ""), int(tags.get("selected_epoch") or 0)
    )


def load_weights(model, weights: FinishedWeights, *, flag: str, strict: bool = False) -> int:
    """Load ``weights`` into ``model`` (the file must match its recorded sha256: a file
    changed or replaced since is one error line, not silently other weights); returns the
    epoch the run selected them at.

    Keys the new head does not have are an error; keys only the new head has (e.g. a
    re-ranking head's extra parameters) keep their initialisation, unless ``strict`` (a model
    that must be the run's whole: an export), where they are an error."""
    run_id, path = weights.run_id, weights.path
    state, selected = _saved_weights(path, run_id, weights.sha256, flag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise HarnessError(f"{flag}: run '{run_id}' has weights this model lacks: {unexpected[:3]}")
    if strict and missing:
        raise HarnessError(f"{flag}: run '{run_id}' has no weights for {missing[:3]} of this model")
    print(
        f"initialised from run {run_id} ({path}); {len(missing)} new tensors keep their initialisation",
        file=sys.stderr,
        flush=True,
    )
    return int(selected or weights.selected_epoch)


def load_finished_weights(
    model,
    run_id: str,
    *,
    flag: str,
    expect_fingerprint: str = "",
    checkpoint_root: Path | None = None,
    strict: bool = False,
) -> int:
    """Load the selected weights of a FINISHED run into ``model``; returns the epoch that
    run selected them at (:func:`find_finished_weights`, then :func:`load_weights`)."""
    weights = find_finished_weights(
        run_id, flag=flag, expect_fingerprint=expect_fingerprint, checkpoint_root=checkpoint_root
    )
    return load_weights(model, weights, flag=flag, strict=strict)


def _saved_weights(path: Path, run_id: str, expected: str, flag: str) -> tuple[dict, int | None]:
    """The model state and the selected epoch saved at ``path``, its bytes' sha256 checked
    against ``expected`` (the run's ``model_sha256`` tag, when it has one)."""

    data = path.read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if expected and found != expected:
        raise HarnessError(
            f"{flag}: {path} does not match the weights recorded for run '{run_id}' "
            f"(sha256 {found[:12]}..., recorded {expected[:12]}...): the file was changed or replaced"
        )
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return saved["model"], saved.get("selected_epoch")
    except Exception as err:
        raise HarnessError(
            f"{flag}: {path} of run '{run_id}' is unreadable "
            f"({type(err).__name__}: {str(err).strip()[:200]})"
        ) from None
