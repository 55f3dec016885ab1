"""Training of one run: (method, dataset, protocol, loss, seed), then its test.

This module trains; it asks :mod:`harness.engine.embedding` to evaluate,
:mod:`harness.components.explanation.maps` to log explanations and :mod:`harness.store.tracking` for the
store (and the weights of finished runs). Seeded everywhere (python, numpy, torch; deterministic
kernels where they exist, required with ``--deterministic``, cuDNN autotuning with ``--fast``),
AMP (bf16 where supported, else fp16 with a loss scaler) and channels-last on CUDA, a step
loop that reads the device once per ``[training] sync_every`` steps, a checkpoint after
every epoch (written atomically), and ``resume`` that continues from the last checkpoint
to exactly the result of an uninterrupted run: every source of randomness is re-derived
from ``(seed, epoch)`` at the start of each epoch (each image's augmentation from ``(seed,
epoch, batch, position)``), so nothing but tensors has to be saved, and the loader's
workers can persist across epochs.

Under ``torchrun`` one run trains across processes (:mod:`harness.engine.distributed`):
each takes a share of every global batch, the metric loss sees the gathered batch,
DDP averages gradients, and process 0 alone evaluates, tracks and checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from harness.base.atomic import atomic_save_torch, atomic_write_json
from harness.base.device import amp_dtype, amp_name, configure_determinism
from harness.base.errors import HarnessError
from harness.base.faults import fault_point
from harness.base.metric_keys import metric_key
from harness.components.backbones import Backbone, create_backbone
from harness.components.data import (
    DATASETS,
    DatasetSplits,
    cap_per_class,
    carve_validation,
    seen_class_control,
)
from harness.components.data.sampling import ClassBalancedBatchSampler, TransformedImages
from harness.components.data.transforms import build_transform, normalize_batch
from harness.components.evaluation import (
    PER_QUERY_ARTIFACT,
    evaluation_code_digest,
    save_per_query,
    with_paper_variants,
)
from harness.components.losses import MetricLoss, create_loss, create_miner, miner_for
from harness.config.deviations import (
    TAG_PREFIX,
    PaperDeviation,
    applicable,
    footnote,
    from_tag,
    to_tag,
)
from harness.config.protocol import Deviation, Protocol, check_batch_fits, fingerprint
from harness.engine.distributed import (
    SINGLE_PROCESS,
    GatheredMetricLoss,
    Processes,
    average_gradients,
    barrier,
    check_replicas_agree,
    processes_from_env,
    wrap_model,
)
from harness.engine.embedding import evaluate_split, loader_worker_init
from harness.engine.export import ImageEmbedder, example_images
from harness.reports.explanations import log_explanations
from harness.reports.results import run_note
from harness.store.tracking import RUN_NOTE_TAG, load_finished_weights
from methods import METHODS, HeadOutput, Method, TrainingBatch, create_method

__all__ = ["RunConfig", "RunSettings", "EmbeddingModel", "prepare_splits", "check_training_split", "build_model", "run_training",
           "seed_everything", "resolve_device"]


@dataclass
class RunConfig:
    method: str
    dataset: str
    protocol: Protocol
    loss: str
    loss_args: dict[str, Any]
    seed: int
    deviations: tuple[Deviation, ...] = ()
    protocol_path: Path | None = None
    method_options: dict[str, Any] = field(default_factory=dict)
    data_root: Path | None = None
    device: str = "auto"
    workers: int | None = None
    resume: bool = False
    #: A finished run (MLflow run id) whose selected weights initialise this one,
    #: e.g. DIML applied at test time to a trained ``plain`` model.
    init_from: str = ""
    #: Train no epoch: evaluate the ``init_from`` weights, which were trained under this
    #: same protocol (a test-time-only method such as DIML on a trained baseline). Unlike
    #: ``--epochs 0`` this is not a deviation: the protocol's training happened in the base run.
    evaluate_only: bool = False
    experiment: str = ""
    #: Where checkpoints and selected weights live (``--checkpoint-root``, else
    #: ``$DML_HARNESS_CHECKPOINTS``, else ``results/checkpoints``). Runs record their
    #: weights relative to it too, so a moved root still serves ``--init-from``.
    checkpoint_root: Path = field(default_factory=lambda: default_checkpoint_root())
    #: Extra MLflow tags set when the run starts (sweep: cell_key, grid; tune: optuna_*).
    tags: dict[str, str] = field(default_factory=dict)
    #: Called after each epoch as ``(epoch, record)``; may raise (e.g. ``optuna.TrialPruned``).
    epoch_callback: Any = None
    #: Deterministic kernels everywhere, cuDNN/cuBLAS made repeatable (:mod:`harness.base.device`).
    deterministic: bool = False
    #: cuDNN autotuning and non-deterministic kernels (:func:`~harness.base.device.configure_determinism`).
    fast: bool = False
    #: Train through ``torch.compile`` of the model (evaluation runs the model as it is).
    compile: bool = False
    #: Register the run's logged embedder under this name in MLflow's model registry (``--register``).
    registered_model: str = ""

    @classmethod
    def build(cls, protocol: Protocol, *, method: str, dataset: str, loss: str, seed: int,
              deviations: tuple[Deviation, ...] = (), settings: RunSettings | None = None,
              method_options: dict[str, Any] | None = None, **run: Any) -> RunConfig:
        """The one way ``run``, ``sweep`` and ``tune`` make a run: the loss's arguments
        come from the protocol (``[loss.args.<loss>]``), the method's options from the
        protocol unless given, the machine-side choices from ``settings``. ``run``: the
        remaining fields (``experiment``, ``resume``, ``init_from``, ``evaluate_only``,
        ``tags``, ``protocol_path``, ``registered_model``)."""
        settings = settings or RunSettings()
        options = protocol.methods.get(method, {}) if method_options is None else method_options
        return cls(method=method, dataset=dataset, protocol=protocol, loss=loss,
                   loss_args=protocol.loss_args(loss), seed=seed, deviations=tuple(deviations),
                   method_options=dict(options), data_root=settings.data_root, device=settings.device,
                   workers=settings.workers, deterministic=settings.deterministic, fast=settings.fast,
                   compile=settings.compile,
                   **({"checkpoint_root": Path(settings.checkpoint_root)} if settings.checkpoint_root else {}),
                   **run)


@dataclass(frozen=True)
class RunSettings:
    """Where and how a run executes, none of which changes its result (``--data-root``,
    ``--device``, data-loading workers, ``--checkpoint-root``, ``--deterministic``, ``--fast``,
    ``--compile``); the last three are recorded with each run."""

    data_root: Path | None = None
    device: str = "auto"
    workers: int | None = None
    checkpoint_root: Path | None = None
    deterministic: bool = False
    fast: bool = False
    compile: bool = False


class EmbeddingModel(nn.Module):
    """Backbone (images -> feature maps) followed by a method head (maps -> HeadOutput)."""

    def __init__(self, backbone: Backbone, head: Method):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor) -> HeadOutput:
        return self.head(self.backbone(images))


# ----------------------------------------------------------------------- utilities


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda requested but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise HarnessError(f"unknown device '{name}'; valid: auto, cpu, cuda")
    return torch.device(name)


def _epoch_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def default_checkpoint_root() -> Path:
    """``$DML_HARNESS_CHECKPOINTS``, else ``results/checkpoints`` (relative to the working directory)."""
    return Path(os.environ.get("DML_HARNESS_CHECKPOINTS") or "results/checkpoints")


# Checkpoints are checked before a resume trusts them: a file cut short (disk full, a
# copy interrupted, a crash on a file system that reorders writes) must restart the run,
# never continue it from garbage. Beside ``last.pt``, ``last.pt.sha256.json`` lists the
# sha256 digests a resume accepts.

#: What a resumable checkpoint holds at least.
_CHECKPOINT_KEYS = ("epoch", "model", "loss", "optimizer", "scheduler", "history", "best")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def _save_checkpoint(obj: dict[str, Any], path: Path, current_digest: str | None) -> str:
    """Save ``obj`` to ``path`` atomically; returns its sha256.

    The sidecar is rewritten (atomically) just before the new file takes the name and
    lists both the new digest and ``current_digest`` (that of the file still under the
    name), so whenever a crash lands, the file under the name is one the sidecar accepts.
    """
    def record(_tmp: Path, digest: str) -> None:
        accepted = [digest] + ([current_digest] if current_digest and current_digest != digest else [])
        atomic_write_json(_sidecar(path), {"file": path.name, "sha256": accepted})

    return atomic_save_torch(obj, path, before_replace=record)


def _load_checkpoint(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(checkpoint, sha256)`` of a resumable ``path``, or ``(None, None)`` after one line
    saying why it is refused (the run then starts from scratch).

    Refused: a digest the sidecar does not list (a sidecar that cannot be read counts as
    such), a file ``torch.load`` cannot read, one without the keys a resume needs. A
    checkpoint without a sidecar (written before the harness kept one) is only loaded and
    checked for its keys."""
    try:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        sidecar = _sidecar(path)
        if sidecar.exists():
            try:
                accepted = json.loads(sidecar.read_text(encoding="utf-8"))["sha256"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"its checksum file {sidecar.name} is unreadable") from None
            if digest not in accepted:
                raise ValueError(f"{len(data)} bytes with sha256 {digest[:12]}..., not a digest "
                                 f"recorded in {sidecar.name}")
        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(checkpoint, dict) or not set(_CHECKPOINT_KEYS) <= set(checkpoint):
            raise ValueError("not a training checkpoint (keys missing)")
    except Exception as err:
        text = str(err).strip()
        reason = f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__
        _log(f"checkpoint {path} is unreadable ({reason}); starting from scratch")
        return None, None
    return checkpoint, digest


# ------------------------------------------------------------------------ building


def prepare_splits(protocol: Protocol, dataset: str, data_root: Path | None, *,
                   control: bool = False, seed: int | None = None) -> DatasetSplits:
    """Load the dataset, cap images per class (small protocols) and carve validation classes.

    ``control`` swaps the training images for other images of the test classes
    (:func:`~harness.components.data.seen_class_control`, a diagnostic recorded as a deviation).
    ``seed``: the run's seed, which carves the validation classes when the protocol sets
    ``splits.validation_by_run_seed`` (then it is required; else it is not used).
    """
    protocol = protocol.for_dataset(dataset)
    s = protocol.splits
    if s.validation_by_run_seed and seed is None:
        raise HarnessError(f"protocol '{protocol.name}' carves its validation classes with the run's seed "
                           f"(splits.validation_by_run_seed): its splits need the seed of the run")
    splits = DATASETS.get(dataset).load(data_root)
    test_pool = splits.test
    splits.train = cap_per_class(splits.train, s.max_train_images_per_class, s.seed)
    splits.test = cap_per_class(splits.test, s.max_test_images_per_class, s.seed)
    if protocol.selection.mode == "validation":
        splits = carve_validation(splits, s.validation_classes, seed if s.validation_by_run_seed else s.seed)
    if control:
        splits = seen_class_control(splits, test_pool, s.max_train_images_per_class, s.seed)
    return splits


def check_training_split(protocol: Protocol, dataset: str, splits: DatasetSplits) -> None:
    """The protocol's rules that need the training split (its batch fits in it), checked
    before a run is tracked: a batch larger than the split would be drawn all the same."""
    check_batch_fits(protocol, dataset, images=len(splits.train), classes=len(np.unique(splits.train.labels)))


def build_model(protocol: Protocol, method: str, options: dict[str, Any]) -> EmbeddingModel:
    """The protocol's backbone, the method's head on it (``setup``), and the backbone told
    to stop at the last point the head reads."""
    b = protocol.backbone
    backbone = create_backbone(b.name, pretrained=b.pretrained, weights=b.weights, freeze_bn=b.freeze_bn)
    head = create_method(method, channels=dict(backbone.channels), embedding_size=protocol.embedding.size,
                         **options)
    head.setup(backbone)
    backbone.set_outputs(head.stages)
    return EmbeddingModel(backbone, head)


def _optimizer(protocol: Protocol, model: EmbeddingModel, loss_fn: nn.Module) -> torch.optim.Optimizer:
    o = protocol.optimizer
    # Pretrained copies of backbone segments that a head keeps (DIABLO's phi) train like
    # the backbone they came from.
    pretrained = [p for p in (*model.backbone.parameters(), *model.head.pretrained.parameters()) if p.requires_grad]
    groups = [{"params": pretrained, "lr": o.lr_backbone, "weight_decay": o.weight_decay, "name": "backbone"}]
    groups += model.head.optimizer_groups(o.lr_head, o.weight_decay)
    loss_params = [p for p in loss_fn.parameters() if p.requires_grad]
    if loss_params:
        groups.append({"params": loss_params, "lr": o.lr_loss, "weight_decay": 0.0, "name": "loss"})
    # Fused Adam: one kernel for all parameters instead of a Python loop over ~200 tensors.
    if o.name == "adam":
        return torch.optim.Adam(groups, fused=True)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, fused=True)
    if o.name == "rmsprop":
        return torch.optim.RMSprop(groups, momentum=o.momentum)
    if o.name == "sgd":
        return torch.optim.SGD(groups, momentum=o.momentum)
    raise HarnessError(f"unknown optimizer '{o.name}'; valid: adam, adamw, rmsprop, sgd")


def _scheduler(protocol: Protocol, optimizer):
    s = protocol.schedule
    if s.name == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if s.name == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, list(s.milestones), gamma=s.gamma)
    if s.name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, s.epochs))
    raise HarnessError(f"unknown schedule '{s.name}'; valid: constant, multistep, cosine")


# ------------------------------------------------------------------------- the run


def run_key(cfg: RunConfig, fp: str) -> str:
    payload = json.dumps({"fp": fp, "method": cfg.method, "options": cfg.method_options,
                          "seed": cfg.seed, "init_from": cfg.init_from,
                          **({"evaluate_only": True} if cfg.evaluate_only else {}),
                          **METHODS.get(cfg.method).key_fields()},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _adapted_sampling(protocol: Protocol, num_classes: int) -> tuple[int, int, str]:
    """When a split has fewer classes than a batch asks for, every batch takes all of them,
    with more images each: as many as keep the batch within the protocol's size, and at
    least the protocol's samples per class."""
    s = protocol.sampling
    if num_classes >= s.classes_per_batch:
        return s.classes_per_batch, s.samples_per_class, ""
    per_class = max(s.samples_per_class, s.batch_size // num_classes)
    note = (f"{num_classes} classes x {per_class} per batch (protocol asks "
            f"{s.classes_per_batch} x {s.samples_per_class}; the split has {num_classes} classes)")
    return num_classes, per_class, note


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class _Training:
    """Everything one run trains with (built once, restored from a checkpoint on resume)."""

    model: EmbeddingModel
    loss_fn: nn.Module
    miner: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    sampler: ClassBalancedBatchSampler
    train_data: TransformedImages
    sampling_note: str
    #: Built once: with workers, they persist across epochs (each image's augmentation
    #: seed comes with its index from the sampler, so persistence changes no crop).
    loader: DataLoader
    #: The module the training step calls: ``model``, or DDP around it across processes.
    train_model: nn.Module
    metric_loss: MetricLoss
    procs: Processes = SINGLE_PROCESS
    #: The selected epoch of the ``init_from`` run whose weights the model starts from.
    init_selected_epoch: int = 0

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "loss": self.loss_fn.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict()}  # AMP's loss scale: a resume continues it

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.loss_fn.load_state_dict(checkpoint["loss"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if checkpoint.get("scaler"):  # absent in older checkpoints; empty when AMP is off
            self.scaler.load_state_dict(checkpoint["scaler"])


def default_workers(device: torch.device, world_size: int = 1) -> int:
    """Data-loading processes when ``--workers`` is not given: 4 on CUDA; on CPU one, so that
    decoding and augmenting the next batch overlaps the step (measured on 2 cores, smoke
    protocol, ``plain``, 1 epoch: 5-6% less wall time, identical loss and metrics, since every
    sample's augmentation is seeded by its position), and none when the processes already
    have fewer than two cores each (torchrun on a small machine)."""
    if device.type == "cuda":
        return 4
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cores // max(1, world_size) >= 2 else 0


def _build_training(cfg: RunConfig, splits: DatasetSplits, device: torch.device, fp: str = "", *,
                    workers: int = 0, procs: Processes = SINGLE_PROCESS) -> _Training:
    protocol = cfg.protocol
    seed_everything(cfg.seed)
    model = build_model(protocol, cfg.method, cfg.method_options)
    init_selected_epoch = 0
    if cfg.init_from:
        init_selected_epoch = load_finished_weights(model, cfg.init_from, checkpoint_root=cfg.checkpoint_root,
                                                    expect_fingerprint=fp if cfg.evaluate_only else "")
    # Channels-last on every device: cuDNN's tensor-core kernels want it, and oneDNN's CPU
    # convolutions (depthwise ones above all) run 10-15% faster with it on the smoke protocol.
    model = model.to(device, memory_format=torch.channels_last)
    label_ids = np.unique(splits.train.labels)
    copies = model.head.metric_loss_copies
    losses = [create_loss(cfg.loss, cfg.loss_args, num_classes=len(label_ids),
                          embedding_size=model.head.metric_loss_dim) for _ in range(copies)]
    # One instance keeps its state-dict keys; several (one per group) are a ModuleList.
    loss_fn = (losses[0] if copies == 1 else nn.ModuleList(losses)).to(device)
    optimizer = _optimizer(protocol, model, loss_fn)
    classes_per_batch, per_class, note = _adapted_sampling(protocol, len(label_ids))
    sampler = ClassBalancedBatchSampler(splits.train.labels, classes_per_batch=classes_per_batch,
                                        samples_per_class=per_class,
                                        batches_per_epoch=protocol.sampling.batches_per_epoch, seed=cfg.seed,
                                        rank=procs.rank, world_size=procs.world_size, sample_seeds=True)
    # Losses with per-class parameters (proxies, margin beta) need labels 0..C-1.
    label_map = {int(c): i for i, c in enumerate(label_ids)}
    train_data = TransformedImages(splits.train, build_transform(protocol.image, train=True), label_map)
    # Pinned host memory (asynchronous copies to the GPU), workers kept across epochs, and
    # four batches prepared ahead per worker, so that a step never waits for its data.
    loader = DataLoader(train_data, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
                        pin_memory=device.type == "cuda", prefetch_factor=4 if workers > 0 else None,
                        worker_init_fn=loader_worker_init)
    miner = create_miner(*miner_for(cfg.loss, protocol.miner.name, protocol.miner.args,
                                    loss_miners=protocol.loss.miners))
    train_model: nn.Module = model
    metric_loss = MetricLoss(loss_fn, miner)
    if procs.distributed:
        train_model = wrap_model(model, device)
        metric_loss = GatheredMetricLoss(loss_fn, miner, procs)
    if cfg.compile:  # the step's forward and backward compiled; the weights are the model's own
        train_model = torch.compile(train_model)
    # A loss scaler only for float16 autocast (bfloat16 has float32's range).
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype(device) == torch.float16)
    return _Training(model, loss_fn, miner, optimizer, _scheduler(protocol, optimizer), scaler,
                     sampler, train_data, note, loader, train_model, metric_loss, procs, init_selected_epoch)


def _selection_metrics(protocol: Protocol) -> tuple[str, ...]:
    """Per-epoch selection needs the retrieval metrics only (no k-means every epoch)."""
    from harness.components.evaluation import RETRIEVAL_METRICS

    wanted = [m for m in protocol.evaluation.metrics if m in RETRIEVAL_METRICS or m == "recall_at_k"]
    return tuple(dict.fromkeys([*wanted, protocol.selection.metric]))


@dataclass
class _RunPlan:
    """What one run works from, fixed before it starts: the resolved configuration, the
    device and processes, the splits and their fingerprint, where it checkpoints, and
    the checkpoint (or earlier run) it continues."""

    cfg: RunConfig
    device: torch.device
    procs: Processes
    workers: int
    splits: DatasetSplits
    fp: str
    ckpt_dir: Path
    experiment: str
    epochs: int
    checkpoint: dict[str, Any] | None = None
    ckpt_digest: str | None = None
    #: An evaluate-only run trains nothing and keeps no last.pt: it resumes into its run.
    previous: str | None = None

    @property
    def ckpt_path(self) -> Path:
        return self.ckpt_dir / "last.pt"


@dataclass
class _Progress:
    """Where the epochs stand: the next epoch, the per-epoch records, the best epoch so
    far (its score and weights) and the digest of the checkpoint on disk."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=lambda: {"epoch": 0, "score": -math.inf, "state": None})
    ckpt_digest: str | None = None


def run_training(cfg: RunConfig, splits: DatasetSplits | None = None) -> dict[str, Any]:
    """Train and test one run; returns the record written by ``run --json``.

    Model selection follows ``protocol.selection``: the epoch with the best
    validation metric ("validation"), the best test metric ("test-paper", the
    seeds' released-code behaviour, labelled everywhere) or the last epoch.

    The steps, in order: prepare (device, splits, fingerprint, checkpoint), build (model,
    loss, optimizer, sampler), resume (the tracked run and the checkpoint's state), train
    the epochs with per-epoch selection, test the selected weights, record.
    """
    plan = _prepare(cfg, splits)
    cfg = plan.cfg
    t = _build_training(cfg, plan.splits, plan.device, plan.fp, workers=plan.workers, procs=plan.procs)
    if not plan.procs.is_main:
        return _follow(cfg, t, plan.device, plan.checkpoint, plan.epochs)
    tracker = _open_tracker(plan)
    try:
        progress = _resume(plan, t, tracker)
        for epoch in range(progress.start_epoch, plan.epochs):
            _train_and_select(plan, t, tracker, progress, epoch)
        selected_epoch = _load_selected(plan, t, progress)
        test = _test(plan, t, tracker, selected_epoch)
        _save_selected(plan, t, tracker, selected_epoch)
        _log_embedder(plan, t, tracker, selected_epoch)
        _describe(plan, tracker, test, selected_epoch)
        log_explanations(t.model, plan.splits, cfg.protocol, plan.device, plan.ckpt_dir, tracker,
                         run_label=f"{cfg.method}, {cfg.dataset}, seed {cfg.seed}")
        tracker.finish("FINISHED")
        barrier(plan.procs)
    except BaseException as err:
        _mark_stopped(tracker, err)
        raise
    return {"method": cfg.method, "dataset": cfg.dataset, "loss": cfg.loss, "seed": cfg.seed,
            "protocol": cfg.protocol.name, "fingerprint": plan.fp,
            "deviations": [str(d) for d in cfg.deviations], "selection": cfg.protocol.selection.mode,
            "paper_deviations": [footnote(n, d) for n, d in paper_deviations(cfg).items()],
            "selected_epoch": selected_epoch, "mlflow_run_id": tracker.run_id,
            "world_size": plan.procs.world_size, "deterministic": cfg.deterministic, "fast": cfg.fast,
            "compile": cfg.compile, "metrics": {k: v for k, v in test.items() if not k.startswith("num_")}}


def _prepare(cfg: RunConfig, splits: DatasetSplits | None) -> _RunPlan:
    """Resolve the protocol, device and processes; load the splits; fingerprint the run;
    find the checkpoint (or, evaluate-only, the earlier run) a resume continues."""
    # Callers resolve the protocol for the dataset before applying overrides; this is a
    # no-op then, and resolves a protocol that still has per-dataset sections.
    cfg = replace(cfg, protocol=cfg.protocol.for_dataset(cfg.dataset))
    protocol = cfg.protocol
    if cfg.evaluate_only and not cfg.init_from:
        raise HarnessError("an evaluate-only run needs init_from (the run whose weights it evaluates)")
    device = resolve_device(cfg.device)
    configure_determinism(cfg.deterministic, fast=cfg.fast)
    procs, device = processes_from_env(device)
    if procs.distributed:
        _check_distributable(cfg, procs)
    workers = cfg.workers if cfg.workers is not None else default_workers(device, procs.world_size)
    if device.type == "cpu":
        # Denormal floats (near-zero activations on flat backgrounds) slow CPU kernels many-fold.
        torch.set_flush_denormal(True)
    splits = splits or prepare_splits(protocol, cfg.dataset, cfg.data_root, seed=cfg.seed)
    check_training_split(protocol, cfg.dataset, splits)
    fp = fingerprint(protocol, splits.digest(), loss=cfg.loss, loss_args=cfg.loss_args,
                     world_size=procs.world_size)
    plan = _RunPlan(cfg, device, procs, workers, splits, fp, Path(cfg.checkpoint_root) / run_key(cfg, fp),
                    cfg.experiment or f"{cfg.dataset}-{protocol.name}",
                    0 if cfg.evaluate_only else protocol.schedule.epochs)
    if cfg.resume and procs.is_main:
        from harness.store.tracking import filter_value, mark_dead_runs_killed, newest_run

        same_key = f"tags.run_key = {filter_value(plan.ckpt_dir.name)}"
        # A run of this key whose process was SIGKILLed stays RUNNING: mark it KILLED.
        for run_id in mark_dead_runs_killed(plan.experiment, same_key):
            _log(f"run {run_id} of a process that died was left RUNNING; marked KILLED")
        if cfg.evaluate_only and (previous := newest_run(plan.experiment, same_key)):
            plan.previous = previous
            _log(f"evaluating {cfg.method} seed {cfg.seed} again into its run {previous}")
    if cfg.resume and plan.ckpt_path.is_file():
        plan.checkpoint, plan.ckpt_digest = _load_checkpoint(plan.ckpt_path)  # None (and one line) if unusable
    if plan.checkpoint is not None:
        _log(f"resuming {cfg.method} seed {cfg.seed} after epoch {plan.checkpoint['epoch']} from {plan.ckpt_path}")
    return plan


def _open_tracker(plan: _RunPlan):
    """The run in the tracking store: the checkpoint's (or the earlier evaluate-only run),
    else a new one."""
    from harness.store.tracking import Tracker

    cfg = plan.cfg
    return Tracker(plan.experiment, f"{cfg.method}-{cfg.loss}-seed{cfg.seed}",
                   run_id=plan.checkpoint.get("mlflow_run_id") if plan.checkpoint else plan.previous)


def _resume(plan: _RunPlan, t: _Training, tracker) -> _Progress:
    """Record the run's metadata (a new run) or which code continued it (a resumed one),
    and restore the checkpoint's state and progress."""
    from harness.store.tracking import CHECKPOINT_DIR_TAG, git_commit, tracking_uri, worker_id

    cfg, checkpoint = plan.cfg, plan.checkpoint
    if checkpoint is None or not tracker.resumed:
        _log_run_metadata(tracker, cfg, plan.fp, plan.splits, t.sampling_note, plan.procs, plan.device)
        tracker.set_tags({"run_key": plan.ckpt_dir.name})
    else:  # the run's git_commit tag is its first segment's; say which code continued it
        tracker.set_tags({"git_commit_at_resume": git_commit()})
    tracker.set_tags({"harness_worker": worker_id(),  # the process that owns the run now
                      CHECKPOINT_DIR_TAG: str(plan.ckpt_dir.resolve())})
    if checkpoint is None:
        return _Progress(ckpt_digest=plan.ckpt_digest)
    t.restore(checkpoint)
    progress = _Progress(checkpoint["epoch"], checkpoint["history"], checkpoint["best"], plan.ckpt_digest)
    if not tracker.resumed:  # the checkpoint's run is not in this store: a new run gets it all
        _log(f"run {checkpoint.get('mlflow_run_id')} of the checkpoint is not in experiment "
             f"'{plan.experiment}' of {tracking_uri()}; continuing in a new run {tracker.run_id}")
        for record in progress.history:
            tracker.log_metrics({k: v for k, v in record.items() if k != "epoch"}, step=record["epoch"])
    return progress


def _train_and_select(plan: _RunPlan, t: _Training, tracker, progress: _Progress, epoch: int) -> None:
    """One epoch: train, step the schedule, evaluate on the selection split when due (and
    keep the best weights), log, checkpoint."""
    cfg, protocol = plan.cfg, plan.cfg.protocol
    selection = protocol.selection
    summary = _train_epoch(cfg, t, plan.device, epoch, plan.epochs,
                           on_flush=lambda flush: _log_flush(tracker, flush))
    record = {"epoch": epoch + 1, **_epoch_summary(summary, plan.device)}
    t.scheduler.step()
    check_replicas_agree(t.model, plan.procs, f"after epoch {epoch + 1}")
    select_on = {"validation": (plan.splits.val, None), "test-paper": (plan.splits.test, plan.splits.gallery)}
    due = (epoch + 1) % selection.evaluate_every == 0 or epoch + 1 == plan.epochs
    if selection.mode in select_on and due:
        q, g = select_on[selection.mode]
        scores = evaluate_split(t.model, q, g, protocol, cfg.dataset, device=plan.device, workers=plan.workers,
                                metrics=_selection_metrics(protocol))
        group = "val" if selection.mode == "validation" else "paper_selection"
        record.update({metric_key(group, k): v for k, v in scores.items()})
        if scores[selection.metric] > progress.best["score"]:
            progress.best = {"epoch": epoch + 1, "score": float(scores[selection.metric]),
                             "state": {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}}
    progress.history.append(record)
    tracker.log_metrics({k: v for k, v in record.items() if k != "epoch"}, step=epoch + 1)
    _log(_epoch_line(cfg, record, plan.epochs, selection.metric))
    plan.ckpt_dir.mkdir(parents=True, exist_ok=True)
    progress.ckpt_digest = _save_checkpoint(
        {"epoch": epoch + 1, **t.state(), "history": progress.history, "best": progress.best,
         "mlflow_run_id": tracker.run_id, "fingerprint": plan.fp}, plan.ckpt_path, progress.ckpt_digest)
    barrier(plan.procs)  # the other processes wait for this epoch's evaluation and checkpoint
    if cfg.epoch_callback is not None:
        cfg.epoch_callback(epoch + 1, record)


def _load_selected(plan: _RunPlan, t: _Training, progress: _Progress) -> int:
    """Load the selected epoch's weights into the model; returns that epoch (for an
    evaluate-only run, the epoch its base run selected: those are the weights it has)."""
    selection = plan.cfg.protocol.selection
    if plan.cfg.evaluate_only:
        return t.init_selected_epoch
    if selection.mode == "last":
        return plan.epochs
    best = progress.best
    if best["state"] is None and plan.epochs > progress.start_epoch:
        raise HarnessError(
            f"the selection metric {selection.metric} was NaN at every evaluation "
            f"(selection mode '{selection.mode}'), so no epoch could be selected; "
            f"does every validation class have at least two images?")
    if best["state"] is not None:
        t.model.load_state_dict(best["state"])
    return best["epoch"]


def _test(plan: _RunPlan, t: _Training, tracker, selected_epoch: int) -> dict[str, float]:
    """The selected weights on the test split, logged as ``test/*`` at the selected epoch."""
    protocol = plan.cfg.protocol
    # The papers' metric variants ride along (not protocol settings), and the per-query
    # values behind every retrieval mean are kept for intervals and paired tests.
    test = evaluate_split(t.model, plan.splits.test, plan.splits.gallery, protocol, plan.cfg.dataset,
                          device=plan.device, workers=plan.workers,
                          metrics=with_paper_variants(protocol.evaluation.metrics), per_query=True)
    tracker.log_metrics({metric_key("test", k): v for k, v in test.items()}, step=selected_epoch)
    tracker.set_tags({"evaluation_code": evaluation_code_digest()})  # the code that computed test/*
    plan.ckpt_dir.mkdir(parents=True, exist_ok=True)
    per_query = getattr(test, "per_query", None)  # a plain dict of scores carries none
    if per_query is not None:
        per_query_path = plan.ckpt_dir / Path(PER_QUERY_ARTIFACT).name
        save_per_query(per_query_path, per_query)
        tracker.log_artifact(per_query_path, str(Path(PER_QUERY_ARTIFACT).parent))
    return test


def _save_selected(plan: _RunPlan, t: _Training, tracker, selected_epoch: int) -> None:
    """Save the selected weights as ``model.pt`` and record where they are, with their sha256."""
    model_path = plan.ckpt_dir / "model.pt"
    model_sha256 = atomic_save_torch({"model": t.model.state_dict(), "method": plan.cfg.method,
                                      "fingerprint": plan.fp, "selected_epoch": selected_epoch}, model_path)
    # The absolute path, and the path under the checkpoint root (which still resolves
    # when the root moves) with the file's sha256, checked by --init-from.
    tracker.set_tags({"selected_epoch": selected_epoch, "model_path": str(model_path.resolve()),
                      "model_relpath": f"{plan.ckpt_dir.name}/{model_path.name}", "model_sha256": model_sha256})
    tracker.log_artifact(model_path, "weights")  # listed in the UI as weights/model.pt


def _log_embedder(plan: _RunPlan, t: _Training, tracker, selected_epoch: int) -> None:
    """The selected weights as an MLflow model (``embedder``: images -> embeddings, the
    UI's Models tab), its signature from a forward pass on two example images; registered
    under ``--register``'s name when given."""
    embedder = ImageEmbedder(t.model, plan.cfg.protocol.image).to(plan.device).eval()
    images = example_images(plan.cfg.protocol.image.size)
    with torch.inference_mode():
        embeddings = embedder(torch.from_numpy(images).to(plan.device)).cpu().numpy()
    # Exported on the CPU, so that the logged model loads on a machine without a GPU.
    embedder = embedder.cpu()
    try:
        uri = tracker.log_pytorch_model(embedder, images, embeddings, step=selected_epoch,
                                        registered_name=plan.cfg.registered_model,
                                        tags={"method": plan.cfg.method, "dataset": plan.cfg.dataset,
                                              "protocol": plan.cfg.protocol.name, "seed": str(plan.cfg.seed)})
    finally:
        t.model.to(plan.device)
    tracker.set_tags({"model_uri": uri})


def _describe(plan: _RunPlan, tracker, test: dict[str, float], selected_epoch: int) -> None:
    """The run's description in the MLflow UI (a Markdown summary; :func:`run_note`)."""
    cfg = plan.cfg
    note = run_note(method=cfg.method, dataset=cfg.dataset, protocol=cfg.protocol.name,
                    selection=cfg.protocol.selection.mode, metrics=dict(test), selected_epoch=selected_epoch,
                    deviations=[str(d) for d in cfg.deviations],
                    paper_deviations=[footnote(n, d) for n, d in paper_deviations(cfg).items()],
                    init_from=cfg.init_from, evaluate_only=cfg.evaluate_only)
    tracker.set_tags({RUN_NOTE_TAG: note})


def _mark_stopped(tracker, err: BaseException) -> None:
    """Mark the run KILLED (interrupted) or FAILED with why; a store that fails too is one
    line, so that the error that stopped the run is the one raised."""
    status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
    try:
        tracker.set_tags({"failure": f"{type(err).__name__}: {err}"[:4000]})
        tracker.finish(status)
    except Exception as secondary:  # the store failing too must not hide why the run stopped
        text = str(secondary).strip().splitlines()[0][:300] if str(secondary).strip() else ""
        _log(f"could not mark run {tracker.run_id} {status} in the tracking store "
             f"({type(secondary).__name__}: {text})")


def _check_distributable(cfg: RunConfig, procs: Processes) -> None:
    """One line, before anything is built, for a run that cannot train across processes."""
    if not cfg.protocol.backbone.freeze_bn:
        raise HarnessError(f"training across {procs.world_size} processes needs frozen BatchNorm "
                           f"(backbone.freeze_bn = true): trained BatchNorm would normalise by each "
                           f"process's share, not by the protocol's batch")
    entry = METHODS.get(cfg.method)
    reason = entry.cls.cross_process_refusal({**entry.options(), **cfg.method_options})
    if reason:
        raise HarnessError(f"method '{cfg.method}' cannot train across {procs.world_size} processes: {reason}")


def _follow(cfg: RunConfig, t: _Training, device: torch.device, checkpoint: dict[str, Any] | None,
            epochs: int) -> dict[str, Any]:
    """A process other than 0: train its share of every epoch, then wait while process 0
    evaluates, tracks and checkpoints (returns no record; process 0 reports the run)."""
    start_epoch = 0
    if checkpoint is not None:
        t.restore(checkpoint)
        start_epoch = checkpoint["epoch"]
    for epoch in range(start_epoch, epochs):
        _train_epoch(cfg, t, device, epoch, epochs)
        t.scheduler.step()
        check_replicas_agree(t.model, t.procs, f"after epoch {epoch + 1}")
        barrier(t.procs)
    barrier(t.procs)  # process 0 tests and saves the selected weights
    return {}


def paper_deviations(cfg: RunConfig) -> dict[str, PaperDeviation]:
    """Where the run departs from its paper or the authors' code: a grid cell's, handed in
    as ``deviation.<name>`` tags (its paper protocol's, and a smoke version's settings),
    else those its protocol declares for this method and dataset."""
    handed = {k.removeprefix(TAG_PREFIX): from_tag(v) for k, v in cfg.tags.items() if k.startswith(TAG_PREFIX)}
    return handed or applicable(cfg.protocol.deviations, cfg.method, cfg.dataset)


def _log_run_metadata(tracker, cfg: RunConfig, fp: str, splits: DatasetSplits, sampling_note: str,
                      procs: Processes, device: torch.device) -> None:
    from harness.store.tracking import environment_tags, flatten, uncommitted_changes

    protocol = cfg.protocol
    tracker.log_params({**flatten(protocol.to_dict(), "protocol."),
                        # every option, defaults included, so that any two runs' params compare
                        **flatten({**METHODS.get(cfg.method).options(), **cfg.method_options}, "method."),
                        "loss.name": cfg.loss, **flatten(cfg.loss_args, "loss.args."),
                        "seed": cfg.seed, "dataset": cfg.dataset, "method": cfg.method,
                        "world_size": procs.world_size, "deterministic": cfg.deterministic,
                        "fast": cfg.fast, "compile": cfg.compile})
    tags = {"fingerprint": fp, "protocol": protocol.name, "method": cfg.method, "dataset": cfg.dataset,
            "method_revision": METHODS.get(cfg.method).cls.revision,
            "loss": cfg.loss, "seed": cfg.seed, "split_digest": splits.digest(),
            "selection": protocol.selection.mode,
            "test_set_selection": protocol.selection.mode == "test-paper",
            "deviations": "; ".join(str(d) for d in cfg.deviations) or "none",
            "num_train_images": len(splits.train), "num_test_images": len(splits.test),
            "init_from": cfg.init_from or "none", "evaluate_only": cfg.evaluate_only,
            "miner": miner_for(cfg.loss, protocol.miner.name, loss_miners=protocol.loss.miners)[0],
            "world_size": procs.world_size, "deterministic": cfg.deterministic,
            "fast": cfg.fast, "compile": cfg.compile, "amp": amp_name(device),
            **{TAG_PREFIX + n: to_tag(d) for n, d in paper_deviations(cfg).items()},
            **environment_tags()}
    if splits.val is not None:
        tags["num_val_images"] = len(splits.val)
    if sampling_note:
        tags["sampling_adapted"] = sampling_note
    tags.update(cfg.tags)
    tracker.set_tags(tags)
    # The dataset and its split digest as an MLflow dataset input (the UI's Datasets column).
    tracker.log_dataset(cfg.dataset, splits.digest(), data_root=cfg.data_root,
                        sizes={"train": len(splits.train), "val": 0 if splits.val is None else len(splits.val),
                               "test": len(splits.test)})
    tracker.log_text(json.dumps(protocol.to_dict(), indent=2, sort_keys=True), "protocol/resolved.json")
    tracker.log_text(json.dumps([d.__dict__ for d in cfg.deviations], indent=2, default=str),
                     "protocol/deviations.json")
    if cfg.protocol_path is not None and Path(cfg.protocol_path).is_file():
        tracker.log_artifact(Path(cfg.protocol_path), "protocol")
    if tags["git_commit"].endswith("-dirty"):
        tracker.log_text(uncommitted_changes(), "source/uncommitted.patch")


@dataclass(frozen=True)
class StepFlush:
    """What the training loop reads from the device at one flush: every
    ``[training] sync_every`` steps (:class:`~harness.config.protocol.TrainingSpec`) and at
    the end of an epoch, in one transfer. Between two flushes the loop only queues work.

    ``global_step``: steps trained by the run so far (the last step read, counted from 1);
    ``step_losses``: the loss of each step since the previous flush, the last one at
    ``global_step``; ``lr``: the learning rate of the first parameter group (the backbone's;
    the schedules scale every group alike); ``loss_sums``: the epoch's running sums of each
    loss term times its batch size (``""``: the total); ``images``: the epoch's images so far."""

    epoch: int
    global_step: int
    step_losses: tuple[float, ...]
    lr: float
    loss_sums: dict[str, float]
    images: int


class _StepTally:
    """The loop's running values, kept on the device: each step's loss in a window of
    ``sync_every`` slots, and the epoch's sums of every loss term times its batch size.
    Writing them queues device work only; :meth:`read` is the one transfer to the host."""

    def __init__(self, sync_every: int, device: torch.device):
        self.window = torch.zeros(sync_every, device=device)
        self.filled = 0
        self.sums: dict[str, torch.Tensor] = {}  # "" is the total

    def add(self, loss: torch.Tensor, terms: dict[str, torch.Tensor], batch_size: int) -> None:
        self.window[self.filled] = loss.detach().float()  # an indexed copy: no sync
        self.filled += 1
        for name, value in (("", loss), *terms.items()):
            value = value.detach().float() * batch_size
            self.sums[name] = self.sums[name] + value if name in self.sums else value

    def read(self) -> tuple[list[float], dict[str, float]]:
        """The window's losses and the sums, in one device-to-host transfer; the window empties."""
        names = list(self.sums)
        values = torch.cat([self.window[:self.filled], *(self.sums[n].reshape(1) for n in names)]).tolist()
        losses, sums = values[:self.filled], dict(zip(names, values[self.filled:], strict=True))
        self.filled = 0
        return losses, sums


def _train_epoch(cfg: RunConfig, t: _Training, device: torch.device, epoch: int, epochs: int,
                 on_flush: Callable[[StepFlush], None] | None = None) -> dict[str, float]:
    """One epoch of the training step, queued without waiting on the device: each step's
    loss and the epoch's sums stay on the device (:class:`_StepTally`) and are read every
    ``[training] sync_every`` steps and at the end (:class:`StepFlush`, handed to
    ``on_flush``), where a non-finite loss stops the run and names its first batch."""
    model = t.train_model
    seed = _epoch_seed(cfg.seed, epoch)
    torch.manual_seed(seed)  # dropout (miners: per step, augmentation: per image)
    t.sampler.set_epoch(epoch)
    model.train()
    dtype = amp_dtype(device)
    gathered = isinstance(t.metric_loss, GatheredMetricLoss)
    sync_every = cfg.protocol.training.sync_every
    steps_before = epoch * len(t.sampler)

    seen, started = 0, time.perf_counter()
    tally = _StepTally(sync_every, device)
    sums: dict[str, float] = {}
    bar = tqdm(t.loader, desc=f"{cfg.method} epoch {epoch + 1}/{epochs}", unit="batch", leave=False,
               disable=None, file=sys.stderr)

    def flush(step: int) -> None:
        """The one host sync: read steps ``step - filled + 1 .. step``, raise on a non-finite loss."""
        nonlocal sums
        first = step - tally.filled + 1
        losses, sums = tally.read()
        bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
        if bad is not None:
            raise HarnessError(
                f"loss is {losses[bad]} at epoch {epoch + 1}, batch {first + bad + 1} "
                f"(method '{cfg.method}', loss '{cfg.loss}'); run stopped and marked FAILED")
        bar.set_postfix(loss=f"{sums.get('', 0.0) / max(seen, 1):.4f}",
                        img_s=f"{seen / (time.perf_counter() - started):.0f}")
        if on_flush is not None:
            on_flush(StepFlush(epoch + 1, steps_before + step + 1, tuple(losses),
                               float(t.optimizer.param_groups[0]["lr"]), dict(sums), seen))

    step = -1
    for step, (images, labels, _) in enumerate(bar):
        try:
            loss, terms = _train_step(cfg, t, model, images, labels, device, dtype, epoch, step, gathered)
        except Exception:
            # Weights a non-finite loss has reached can make a later step fail another way
            # (a miner on NaN distances): the first non-finite batch is the error to report.
            if tally.filled:
                flush(step - 1)
            raise
        fault_point("train_batch")  # test-only hook (harness.base.faults); nothing when unset
        tally.add(loss, terms, len(images))
        seen += len(images)
        if tally.filled == sync_every:
            flush(step)
    if tally.filled:
        flush(step)
    elapsed = time.perf_counter() - started
    totals = {k: v / max(seen, 1) for k, v in sums.items()}
    return {"train_loss": totals.pop("", 0.0), "train_images_per_s": seen / max(elapsed, 1e-9),
            "train_seconds": elapsed, **{f"train_loss_{k}": v for k, v in totals.items()}}


def _log_flush(tracker, flush: StepFlush) -> None:
    """``train/loss`` at every step of the flush and ``train/lr`` at its last, against the
    run's global step."""
    first = flush.global_step - len(flush.step_losses) + 1
    tracker.log_metric_steps({metric_key("train", "loss"): [(first + i, v) for i, v in enumerate(flush.step_losses)],
                              metric_key("train", "lr"): [(flush.global_step, flush.lr)]})


def _train_step(cfg: RunConfig, t: _Training, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                device: torch.device, dtype: torch.dtype | None, epoch: int, step: int,
                gathered: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, the head's loss terms, backward and the optimizer step of one batch."""
    images = normalize_batch(images.to(device, non_blocking=True), cfg.protocol.image)
    labels = labels.to(device, non_blocking=True)
    images = images.contiguous(memory_format=torch.channels_last)  # as the model (every device)
    t.metric_loss.set_step(cfg.seed, epoch, step)  # random mining seeded per step (losses.MetricLoss)
    with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
        out = model(images)
        terms = t.model.head.loss_terms(out, TrainingBatch(labels, t.metric_loss, images, t.model))
        loss = sum(terms.values())
    t.optimizer.zero_grad(set_to_none=True)
    t.scaler.scale(loss).backward()
    if gathered:
        average_gradients(t.loss_fn.parameters(), t.procs)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    return loss, terms


def _epoch_summary(summary: dict[str, float], device: torch.device) -> dict[str, float]:
    """An epoch's training summary under its logged keys: the mean loss and its terms as
    ``train/epoch_loss*`` (``train/loss`` is the per-step curve), throughput, time and
    peak memory as ``system/*``."""
    system = {"train_images_per_s": "train_images_per_s", "train_seconds": "train_epoch_seconds"}
    record = {}
    for name, value in summary.items():  # train_loss, train_loss_<term>, throughput, seconds
        key = metric_key("system", system[name]) if name in system else \
            metric_key("train", "epoch_" + name.removeprefix("train_"))
        record[key] = value
    # ru_maxrss is in KiB on Linux: the process's peak resident memory so far.
    record[metric_key("system", "max_rss_mb")] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        record[metric_key("system", "cuda_max_allocated_mb")] = torch.cuda.max_memory_allocated(device) / 2**20
    return record


def _epoch_line(cfg: RunConfig, record: dict, epochs: int, metric: str) -> str:
    parts = [f"{cfg.method:>12s} seed {cfg.seed} epoch {record['epoch']}/{epochs}",
             f"loss {record[metric_key('train', 'epoch_loss')]:.4f}",
             f"{record[metric_key('system', 'train_images_per_s')]:.0f} img/s"]
    for group in ("val", "paper_selection"):
        if metric_key(group, metric) in record:
            parts.append(f"{group} {metric} {record[metric_key(group, metric)]:.4f}")
    return "  ".join(parts)
