"""Checkpoints: the :class:`Checkpointer` a :class:`~harness.engine.run.trainer.Trainer` saves
each epoch's resumable state and the run's selected weights through and a resume loads the
state from, kept in memory
(:class:`InMemoryCheckpointer`) or in a run's folder under the checkpoint root
(:class:`FolderCheckpointer`: ``last.pt``, guarded by a checksum file, beside the
selected weights).

Checkpoints are checked before a resume trusts them: a file cut short (disk full, a copy
interrupted, a crash on a file system that reorders writes) must restart the run, never
continue it from garbage. Beside ``last.pt``, ``last.pt.sha256.json`` lists the sha256
digests a resume accepts.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from harness.base.atomic import atomic_save_torch, atomic_write_json
from harness.engine.run.runtime import log_line

__all__ = [
    "CHECKPOINT_KEYS",
    "Checkpointer",
    "SavedWeights",
    "InMemoryCheckpointer",
    "FolderCheckpointer",
    "CheckpointFile",
    "RunFolder",
]

#: What a resumable checkpoint holds at least.
CHECKPOINT_KEYS = ("epoch", "model", "loss", "optimizer", "scheduler", "history", "best")


class CheckpointFile:
    """One resumable checkpoint and its checksum file; ``digest`` is the sha256 of the
    file now under ``path`` as this object last wrote or read it (None: none known)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.digest: str | None = None

    @property
    def checksum_path(self) -> Path:
        """The checksum file beside the checkpoint: the digests a resume accepts."""
        return self.path.with_name(self.path.name + ".sha256.json")

    def save(self, checkpoint: dict[str, Any]) -> str:
        """Write ``checkpoint`` atomically; returns its sha256.

        The checksum file is rewritten (atomically) just before the new file takes the name
        and lists both the new digest and that of the file still under the name, so that
        whenever a crash lands, the file under the name is one the checksum file accepts."""
        current = self.digest

        def record(_tmp: Path, digest: str) -> None:
            accepted = [digest] + ([current] if current and current != digest else [])
            atomic_write_json(self.checksum_path, {"file": self.path.name, "sha256": accepted})

        self.digest = atomic_save_torch(checkpoint, self.path, before_replace=record)
        return self.digest

    def load(self) -> dict[str, Any] | None:
        """The checkpoint, or None after one line saying why it is refused (the run then
        starts from scratch).

        Refused: a digest the checksum file does not list (a checksum file that cannot be
        read counts as such), a file ``torch.load`` cannot read, one without the keys a
        resume needs. A checkpoint without a checksum file (written before the harness kept
        one) is only loaded and checked for its keys."""
        try:
            data = self.path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            self._check_listed(digest, len(data))
            checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(checkpoint, dict) or not set(CHECKPOINT_KEYS) <= set(checkpoint):
                raise ValueError("not a training checkpoint (keys missing)")
        except Exception as err:
            text = str(err).strip()
            reason = (
                f"{type(err).__name__}: {text.splitlines()[0][:200]}"
                if text
                else type(err).__name__
            )
            log_line(f"checkpoint {self.path} is unreadable ({reason}); starting from scratch")
            self.digest = None
            return None
        self.digest = digest
        return checkpoint

    def _check_listed(self, digest: str, size: int) -> None:
        if not self.checksum_path.exists():
            return
        try:
            accepted = json.loads(self.checksum_path.read_text(encoding="utf-8"))["sha256"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"its checksum file {self.checksum_path.name} is unreadable") from None
        if digest not in accepted:
            raise ValueError(
                f"{size} bytes with sha256 {digest[:12]}..., not a digest "
                f"recorded in {self.checksum_path.name}"
            )


class RunFolder:
    """A run's folder under the checkpoint root, named by its run key
    (:func:`~harness.engine.run.run_config.run_key`): ``last.pt`` (the last epoch's
    checkpoint), ``model.pt`` (the selected weights) and the files a run logs beside them."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.last = CheckpointFile(self.path / "last.pt")

    @property
    def key(self) -> str:
        return self.path.name

    def load_last(self) -> dict[str, Any] | None:
        """The last epoch's checkpoint when one is there and passes its checks, else None."""
        return self.last.load() if self.last.path.is_file() else None

    def save_last(self, checkpoint: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.last.save(checkpoint)

    def save_selected(self, weights: dict[str, Any]) -> tuple[Path, str]:
        """``weights`` (the selected model's state and what it is) as ``model.pt``; returns
        the file and its sha256."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.path / "model.pt"
        return path, atomic_save_torch(weights, path)

    def file(self, name: str) -> Path:
        """Where the run writes a file of ``name`` (the folder made first)."""
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path / name


@dataclass(frozen=True)
class SavedWeights:
    """Where a checkpointer saved a run's selected weights: the file, its sha256, and its
    path under the checkpoint root (which still resolves when the root moves)."""

    path: Path
    sha256: str
    relpath: str


@runtime_checkable
class Checkpointer(Protocol):
    """Where a run's resumable state goes after each epoch, and where a resume finds it;
    where the run's selected weights go once it is tested."""

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Keep ``checkpoint`` (live tensors: a checkpointer that holds it copies them) as
        the one a resume continues from."""

    def load(self) -> dict[str, Any] | None:
        """The checkpoint a resume continues from, or None (none kept, or one refused)."""
        ...

    def save_selected(self, weights: dict[str, Any]) -> SavedWeights | None:
        """Keep the selected ``weights`` (the model's state and what it is); where they went
        (None: nowhere a file names)."""
        ...


@dataclass
class InMemoryCheckpointer:
    """A :class:`Checkpointer` that keeps a copy of every checkpoint it is given (tests,
    notebooks); :meth:`load` returns the last."""

    saved: list[dict[str, Any]] = field(default_factory=list)
    selected: dict[str, Any] | None = None

    def save(self, checkpoint: dict[str, Any]) -> None:
        # A copy: the checkpoint holds the live tensors of the model and optimizer.
        self.saved.append(copy.deepcopy(checkpoint))

    def load(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.saved[-1]) if self.saved else None

    def save_selected(self, weights: dict[str, Any]) -> SavedWeights | None:
        self.selected = copy.deepcopy(weights)
        return None


@dataclass
class FolderCheckpointer:
    """A :class:`Checkpointer` into a run's folder: ``last.pt`` and its checksum file
    (:meth:`RunFolder.save_last`), and the selected weights as ``model.pt``; ``stamp`` is
    saved with every checkpoint (the run's fingerprint, and its tracked run, which a resume
    continues), its fingerprint with the selected weights."""

    folder: RunFolder
    stamp: dict[str, Any] = field(default_factory=dict)

    def save(self, checkpoint: dict[str, Any]) -> None:
        self.folder.save_last({**checkpoint, **self.stamp})

    def load(self) -> dict[str, Any] | None:
        return self.folder.load_last()

    def save_selected(self, weights: dict[str, Any]) -> SavedWeights | None:
        path, sha256 = self.folder.save_selected(
            {**weights, "fingerprint": self.stamp.get("fingerprint", "")}
        )
        return SavedWeights(path, sha256, f"{self.folder.key}/{path.name}")
