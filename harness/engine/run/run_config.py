"""What one run is: its configuration (method, dataset, protocol, loss, seed and the
machine-side settings), the key its checkpoints live under, and its departures from the paper."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config.deviations import TAG_PREFIX, PaperDeviation, applicable, from_tag
from harness.config.overrides import Deviation
from harness.config.protocol import Protocol
from harness.methods import METHODS
from harness.store.environment import default_checkpoint_root

__all__ = [
    "RunConfig",
    "RunSettings",
    "run_key",
    "run_name",
    "paper_deviations",
]

#: Characters MLflow refuses in a logged model's name, which a run's name (the model's
#: too) spells as ``-``.
_UNNAMEABLE = "/:.%'\""


@dataclass(frozen=True)
class RunSettings:
    """Where and how a run executes, none of which changes its result (``--data-root``,
    ``--device``, data-loading workers, ``--checkpoint-root``, ``--deterministic``, ``--fast``,
    ``--compile``, ``--cuda-graphs``); the last four are recorded with each run."""

    data_root: Path | None = None
    #: ``auto``, ``cpu`` or ``cuda`` (:func:`~harness.engine.run.runtime.resolve_device`).
    device: str = "auto"
    #: Data-loading processes; None: :func:`~harness.engine.run.runtime.default_workers`.
    workers: int | None = None
    #: Where checkpoints and selected weights live (``--checkpoint-root``; None given:
    #: ``$DML_HARNESS_CHECKPOINTS``, else ``results/checkpoints``). Runs record their
    #: weights relative to it too, so a moved root still serves ``--init-from``.
    checkpoint_root: Path = field(default_factory=lambda: default_checkpoint_root())
    #: Where the weights of ``init_from`` are looked for, when not under ``checkpoint_root``
    #: (a rerun checkpoints into a folder of its own and starts from runs checkpointed
    #: elsewhere); None: ``checkpoint_root``.
    init_root: Path | None = None
    #: Deterministic kernels everywhere, cuDNN/cuBLAS made repeatable (:mod:`harness.base.device`).
    deterministic: bool = False
    #: cuDNN autotuning and non-deterministic kernels (:func:`~harness.base.device.configure_determinism`).
    fast: bool = False
    #: Train through ``torch.compile``: the whole step in one process
    #: (:mod:`harness.engine.run.compiled_step`), the model inside DDP across processes.
    compile: bool = False
    #: Replay the compiled step as a CUDA graph (``--cuda-graphs``; implies ``compile``).
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        root = Path(self.checkpoint_root) if self.checkpoint_root else default_checkpoint_root()
        object.__setattr__(self, "checkpoint_root", root)
        object.__setattr__(self, "compile", self.compile or self.cuda_graphs)

    @classmethod
    def of_worker(cls, settings: Mapping[str, Any]) -> RunSettings:
        """The settings of a sweep worker's runs, from its ``data_root``, ``device``,
        ``loader_workers`` and ``checkpoint_root``."""
        return cls(
            data_root=settings.get("data_root"),
            device=settings.get("device", "auto"),
            workers=settings.get("loader_workers"),
            checkpoint_root=settings.get("checkpoint_root") or default_checkpoint_root(),
        )


@dataclass
class RunConfig:
    """One run: what it trains (method, dataset, protocol, loss, seed, deviations), where
    and how it executes (:class:`RunSettings`), and how it is tracked."""

    method: str
    dataset: str
    protocol: Protocol
    loss: str
    loss_args: dict[str, Any]
    seed: int
    deviations: tuple[Deviation, ...] = ()
    protocol_path: Path | None = None
    method_options: dict[str, Any] = field(default_factory=dict)
    #: Where and how the run executes (device, workers, checkpoint root, kernels, compile).
    settings: RunSettings = field(default_factory=RunSettings)
    resume: bool = False
    #: A finished run (MLflow run id) whose selected weights initialise this one,
    #: e.g. DIML applied at test time to a trained ``plain`` model.
    init_from: str = ""
    #: Train no epoch: evaluate the ``init_from`` weights, which were trained under this
    #: same protocol (a test-time-only method such as DIML on a trained baseline). Unlike
    #: ``--epochs 0`` this is not a deviation: the protocol's training happened in the base run.
    evaluate_only: bool = False
    experiment: str = ""
    #: Extra MLflow tags set when the run starts (sweep: cell_key, grid; tune: optuna_*).
    tags: dict[str, str] = field(default_factory=dict)
    #: Register the run's logged embedder under this name in MLflow's model registry (``--register``).
    registered_model: str = ""
    #: A trial of a hyperparameter search: trained and selected on validation only; the
    #: test split is never evaluated (its splits come sealed), no model or explanation is
    #: logged and no selected weights are kept.
    search_only: bool = False

    def __post_init__(self) -> None:
        # The protocol as it runs on the dataset: callers resolve it where they load it,
        # before their overrides (then this is a no-op); a protocol that still has
        # per-dataset sections is resolved here.
        if self.protocol.datasets:
            self.protocol = self.protocol.for_dataset(self.dataset)

    @classmethod
    def build(
        cls,
        protocol: Protocol,
        *,
        method: str,
        dataset: str,
        loss: str,
        seed: int,
        deviations: tuple[Deviation, ...] = (),
        settings: RunSettings | None = None,
        method_options: dict[str, Any] | None = None,
        **run: Any,
    ) -> RunConfig:
        """The one way ``run``, ``sweep`` and ``tune`` make a run: the loss's arguments
        come from the protocol (``[loss.args.<loss>]``), the method's options from the
        protocol unless given, the machine-side choices from ``settings``. ``run``: the
        remaining fields (``experiment``, ``resume``, ``init_from``, ``evaluate_only``,
        ``tags``, ``protocol_path``, ``registered_model``, ``search_only``)."""
        options = protocol.methods.get(method, {}) if method_options is None else method_options
        return cls(
            method=method,
            dataset=dataset,
            protocol=protocol,
            loss=loss,
            loss_args=protocol.loss_args(loss),
            seed=seed,
            deviations=tuple(deviations),
            method_options=dict(options),
            settings=settings or RunSettings(),
            **run,
        )


def run_key(cfg: RunConfig, fp: str) -> str:
    """The name of the run's folder under the checkpoint root: what a resume continues
    (fingerprint, method and its options, seed, the run it starts from, method revision)."""
    payload = json.dumps(
        {
            "fp": fp,
            "method": cfg.method,
            "options": cfg.method_options,
            "seed": cfg.seed,
            "init_from": cfg.init_from,
            **({"evaluate_only": True} if cfg.evaluate_only else {}),
            # A search trial's run is its trial's own, even where two trials draw one setting.
            **({"search_trial": _search_trial(cfg.tags)} if cfg.search_only else {}),
            **METHODS.get(cfg.method).key_fields(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def run_name(cfg: RunConfig) -> str:
    """The one name of a run in the tracking store and of the model it logs: its method,
    dataset, loss and seed (``avsl-cub200-margin-seed0``); ``runs:/<run id>/<this name>``
    loads the model. MLflow allows no ``/``, ``:``, ``.``, ``%`` or quote in a model's
    name: those become ``-`` in both."""
    name = f"{cfg.method}-{cfg.dataset}-{cfg.loss}-seed{cfg.seed}"
    return "".join("-" if c in _UNNAMEABLE else c for c in name)


def _search_trial(tags: dict[str, str]) -> str:
    """Which trial of which study a search run belongs to (``tune_*`` or ``optuna_*`` tags)."""
    study = tags.get("tune_study") or tags.get("optuna_study", "")
    trial = tags.get("tune_trial") or tags.get("optuna_trial", "")
    return f"{study}:{trial}:{tags.get('tune_fold', '')}"


def paper_deviations(cfg: RunConfig) -> dict[str, PaperDeviation]:
    """Where the run departs from its paper or the authors' code: a grid cell's, handed in
    as ``deviation.<name>`` tags (its paper protocol's, and a smoke version's settings),
    else those its protocol declares for this method and dataset."""
    handed = {
        k.removeprefix(TAG_PREFIX): from_tag(v)
        for k, v in cfg.tags.items()
        if k.startswith(TAG_PREFIX)
    }
    return handed or applicable(
        cfg.protocol.deviations, cfg.method, cfg.dataset, cfg.protocol.backbone.name, cfg.loss
    )
