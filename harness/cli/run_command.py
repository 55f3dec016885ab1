"""``python -m harness run``: train and test methods under a fair protocol, seed by seed;
the runs themselves are :func:`harness.engine.run.training.train_run`'s."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.base.device import CUBLAS_WORKSPACE, amp_dtype
from harness.base.errors import HarnessError
from harness.base.written import write_output_json
from harness.cli.estimates import EstimateFunction, estimate_or_refuse, say_estimate
from harness.cli.fetch_command import check_data_root, check_dataset, ensure_dataset
from harness.cli.outputs import (
    output_file,
    output_folder,
)
from harness.cli.store import open_store
from harness.components.data.own import dataset_name
from harness.components.losses import LOSSES, check_loss_args
from harness.config.catalog import protocol_dir
from harness.config.overrides import Deviation
from harness.config.protocol import Protocol, apply_overrides
from harness.config.protocol_files import default_protocol, load_protocol
from harness.engine import (
    RunConfig,
    RunSettings,
    control_deviation,
    default_workers,
    resolve_device,
    run_miner,
    shutdown,
    train_run,
    training_splits,
    whole_graph_blocker,
)
from harness.engine.run.estimate import PlannedRun
from harness.methods import METHODS, check_method_options, list_methods, training_base
from harness.reports.results import format_results
from harness.store.environment import default_checkpoint_root, estimates_commands, logs_model
from harness.store.weights import check_finished_run

if TYPE_CHECKING:
    from harness.engine import RunSettings, TrainFunction

__all__ = [
    "cmd_run",
    "shared_training",
    "check_checkpoint_root",
]


@dataclass(frozen=True)
class _Request:
    """What ``run`` was asked for, checked: methods, the protocol with its deviations, the
    loss, the seeds and where and how the runs execute."""

    methods: list[str]
    #: The registered name of ``--dataset`` (a built-in one, or one given by its path).
    dataset: str
    protocol: Protocol
    protocol_path: Path
    deviations: tuple
    loss: str
    seeds: list[int]
    settings: RunSettings


def _request(args: argparse.Namespace) -> _Request:
    """Check every name and flag before any work starts (one error line each)."""

    settings = _settings(args)  # a device that is not there: refused before the dataset loads
    methods = list_methods(ablations=False) if args.methods == ["all"] else args.methods
    for name in methods:
        METHODS.get(name)
    dataset = dataset_name(args.dataset, name=args.dataset_name)  # a path's files listed
    if args.data_root is not None and not args.data_root.is_dir() and not args.download:
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    check_data_root(dataset, args.data_root)
    protocol_name = args.protocol or default_protocol(dataset)
    protocol, deviations, loss = _protocol(args, protocol_name, dataset)
    for method in methods:  # a bad option value is one line now, not after the dataset loads
        _check_method(args, method, protocol, loss, settings)
    path = (
        Path(protocol_name)
        if protocol_name.endswith(".toml")
        else protocol_dir() / f"{protocol_name}.toml"
    )
    _check_outputs(args)
    seeds = args.seeds or list(protocol.seeds)
    return _Request(methods, dataset, protocol, path, deviations, loss, seeds, settings)


def _settings(args: argparse.Namespace) -> RunSettings:
    """Where and how the runs execute, the device resolved once (``auto``: a GPU if there
    is one) and refused here when it is not there."""

    if args.deterministic and args.fast:
        raise HarnessError("--deterministic and --fast exclude each other")
    device = resolve_device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        raise HarnessError(
            f"--cuda-graphs replays the compiled step as a CUDA graph and needs a GPU; "
            f"--device {args.device} is {device.type} here"
        )
    return RunSettings(
        data_root=args.data_root,
        device=device.type,
        workers=args.workers,
        checkpoint_root=args.checkpoint_root,
        deterministic=args.deterministic,
        fast=args.fast,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
    )


def _protocol(
    args: argparse.Namespace, protocol_name: str, dataset: str
) -> tuple[Protocol, tuple, str]:
    """The protocol as it runs on ``dataset`` (resolved for it once, here, before the
    overrides), the deviations of ``--set``, ``--epochs``, ``--loss``, ``--init-from`` and
    ``--seen-class-control`` / ``--shuffled-labels-control``, and the loss."""

    protocol = load_protocol(protocol_name).for_dataset(dataset)
    overrides = list(args.set or [])
    if args.epochs is not None:
        overrides.append(f"schedule.epochs={args.epochs}")
    protocol, deviations = apply_overrides(protocol, overrides)
    loss = args.loss or protocol.loss.name
    LOSSES.get(loss)
    check_loss_args(loss, protocol.loss_args(loss))  # a bad --set loss.args value: one line
    if loss != protocol.loss.name and loss not in protocol.loss.args:
        deviations += (Deviation("loss.name", protocol.loss.name, loss),)
    _check_init_from(args)
    if args.init_from and not args.evaluate_only:  # trained from another run's weights
        deviations += (Deviation("init_from", "the protocol's pretrained weights", args.init_from),)
    control = run_control(args)
    if control:
        deviations += (Deviation(*control_deviation(control)),)
    return protocol, tuple(deviations), loss


def run_control(args: argparse.Namespace) -> str:
    """The diagnostic control the runs train as (:data:`~harness.engine.run.data.CONTROLS`),
    "" for none; both flags at once are one error line."""
    if args.seen_class_control and args.shuffled_labels_control:
        raise HarnessError(
            "--seen-class-control and --shuffled-labels-control are two controls: give one"
        )
    if args.seen_class_control:
        return "seen-class"
    return "shuffled-labels" if args.shuffled_labels_control else ""


def _check_init_from(args: argparse.Namespace) -> None:
    """``--init-from`` names a finished run of the store (read now, not after the dataset
    loads); ``--evaluate-only`` needs it and trains no epoch."""
    if args.evaluate_only and not args.init_from:
        raise HarnessError(
            "--evaluate-only evaluates the weights of a finished run: give --init-from RUN_ID"
        )
    if args.evaluate_only and args.epochs is not None:
        raise HarnessError("--evaluate-only trains no epoch: drop --epochs")
    if args.init_from:
        check_finished_run(args.init_from, "--init-from")


def _check_method(
    args: argparse.Namespace, method: str, protocol: Protocol, loss: str, settings: RunSettings
) -> None:
    """The method's options of the protocol, and under ``--cuda-graphs`` its step as one
    graph: what stands in the way (the miner, the method's host work, float16's loss
    scaler) is one line before any run starts."""

    head = check_method_options(
        method, protocol.methods.get(method, {}), embedding_size=protocol.embedding.size, loss=loss
    )
    if settings.cuda_graphs:
        dtype = amp_dtype(resolve_device(settings.device), protocol.numerics.precision)
        blocker = whole_graph_blocker(head, run_miner(loss, protocol), dtype)
        if blocker:
            raise HarnessError(f"--cuda-graphs needs {method}'s step as one graph, but {blocker}")


def _check_outputs(args: argparse.Namespace) -> None:
    """``--json`` and the checkpoint root must be writable before the first epoch, not
    after the last one."""
    args.json = output_file(args.json, "--json", args=args)
    check_checkpoint_root(args.checkpoint_root)


def check_checkpoint_root(root: Path | None) -> None:
    """The folder training writes its checkpoints in (``--checkpoint-root``, else the
    default) can be created and written: checked before a run starts, for run, sweep, tune."""

    output_folder(
        root or default_checkpoint_root(),
        "--checkpoint-root"
        if root
        else "the checkpoint root ($DML_HARNESS_CHECKPOINTS, else results/checkpoints)",
    )


def cmd_run(
    args: argparse.Namespace,
    *,
    train: TrainFunction | None = None,
    estimate: EstimateFunction | None = None,
) -> int:
    """Train and test each method with each seed (``train``: what trains one run, default
    :func:`~harness.engine.run.training.train_run`); print the table, write ``--json``.

    Before the first run, the harness's own training (``train`` not given) is estimated
    (``estimate``: default :func:`~harness.engine.run.estimate.estimate_runs`) and the
    estimate printed; on a CPU one over an hour is refused without ``--yes``. With
    ``DML_HARNESS_ESTIMATE=0`` (:func:`~harness.store.environment.estimates_commands`)
    nothing is estimated."""

    if args.deterministic and not args.fast:  # before anything touches CUDA (cuBLAS reads it once)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    # Under torchrun only process 0 reports (every process trains the same runs).
    main_process = os.environ.get("RANK", "0") in ("", "0")
    req = _request(args)
    _check_inputs(args, req, main_process)
    shared = {} if args.init_from else shared_training(req.methods, req.protocol)
    splits = _splits(args, req, req.seeds[0])
    # The harness's own training, in one process (torchrun's processes train together).
    one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    estimated = (
        _estimate(args, req, splits, shared, estimate)
        if train is None and one_process and estimates_commands()
        else None
    )
    if main_process:
        _announce(req, splits, shared)
        if estimated is not None:
            say_estimate(estimated)
    records: list[dict] = []
    try:
        for seed in req.seeds:
            if req.protocol.splits.validation_by_run_seed and seed != req.seeds[0]:
                splits = _splits(args, req, seed)  # each seed its own carve
            records += _run_seed(args, req, seed, splits, shared, train or train_run)
    finally:
        shutdown()  # a process group left open would hang the other processes' exit
    if not main_process:
        return 0
    records.sort(key=lambda r: (req.seeds.index(r["seed"]), req.methods.index(r["method"])))
    print(format_results(records))
    if args.json:
        write_output_json(args.json, records)
    return 0


def _estimate(
    args: argparse.Namespace,
    req: _Request,
    splits,
    shared: dict[str, str],
    estimate: EstimateFunction | None,
):
    """The estimate of every run of the command (each seed's on the first seed's splits),
    refused on a CPU over an hour without ``--yes``."""
    runs = [
        PlannedRun(_config(args, req, seed, method, shared), splits)
        for seed in req.seeds
        for method in _in_order(req.methods, shared)
    ]
    device = resolve_device(req.settings.device)
    workers = default_workers(device) if req.settings.workers is None else req.settings.workers
    chosen = {} if estimate is None else {"estimate": estimate}
    return estimate_or_refuse(runs, device, workers=workers, yes=args.yes, **chosen)


def _check_inputs(args: argparse.Namespace, req: _Request, main_process: bool) -> None:
    """The dataset there (fetched with ``--download``) and readable, the tracking store
    open, and ``--register`` with a logged model: before any training."""

    ensure_dataset(req.dataset, args.data_root, download=args.download)
    if main_process:  # one process reads every image header (torchrun starts several)
        check_dataset(req.dataset, args.data_root)
    open_store()
    if not logs_model() and args.register:  # a bad value is refused here, before any training
        raise HarnessError(
            "--register needs each run's logged model, and DML_HARNESS_LOG_MODEL is 0"
        )


def _splits(args: argparse.Namespace, req: _Request, seed: int):
    """The splits of ``seed``'s runs, the protocol's batch rule checked on them (before
    the summary line: a refusal is one line)."""

    return training_splits(
        req.protocol, req.dataset, args.data_root, control=run_control(args), seed=seed
    )


def _announce(req: _Request, splits, shared: dict[str, str]) -> None:
    """The protocol, the dataset's split sizes and the deviations; the methods that are
    evaluated on another's trained weights."""
    val = 0 if splits.val is None else len(splits.val)
    print(
        f"protocol {req.protocol.name}; dataset {req.dataset}: {len(splits.train)} train / "
        f"{val} val / {len(splits.test)} test images"
        + (f"; deviations: {', '.join(map(str, req.deviations))}" if req.deviations else ""),
        file=sys.stderr,
    )
    if shared:
        print(
            "; ".join(
                f"{m}: evaluated on {b}'s trained weights (it trains as {b})"
                for m, b in shared.items()
            ),
            file=sys.stderr,
        )


def _run_seed(
    args: argparse.Namespace,
    req: _Request,
    seed: int,
    splits,
    shared: dict[str, str],
    train: TrainFunction,
) -> list[dict]:
    """Every method's run with ``seed``: the methods that train first, then those that
    evaluate a trained one's weights (``shared``)."""

    records: list[dict] = []
    trained: dict[str, str] = {}  # method -> its run id, this seed
    for method in _in_order(req.methods, shared):
        records.append(train(_config(args, req, seed, method, shared, trained), splits))
        trained[method] = records[-1].get("mlflow_run_id", "")
    return records


def _in_order(methods: list[str], shared: dict[str, str]) -> list[str]:
    """The methods in the order they run: those that train first, then those evaluated on
    another's trained weights."""
    return sorted(methods, key=lambda m: m in shared)


def _config(
    args: argparse.Namespace,
    req: _Request,
    seed: int,
    method: str,
    shared: dict[str, str],
    trained: dict[str, str] | None = None,
) -> RunConfig:
    """The run of ``method`` with ``seed``; one evaluated on another's weights starts from
    that method's run of this seed (its id in ``trained``; none yet for the estimate)."""
    base = shared.get(method, "")
    return RunConfig.build(
        req.protocol,
        method=method,
        dataset=req.dataset,
        loss=req.loss,
        seed=seed,
        deviations=req.deviations,
        settings=req.settings,
        protocol_path=req.protocol_path,
        resume=args.resume,
        experiment=args.experiment or "",
        init_from=(trained or {}).get(base, "") if base else args.init_from or "",
        evaluate_only=bool(base) or args.evaluate_only,
        registered_model=args.register or "",
    )


def shared_training(methods: list[str], protocol) -> dict[str, str]:
    """Methods of this ``run`` that train as another one in it (:func:`harness.methods.training_base`,
    e.g. training-free DIML and ``plain``), mapped to that method: ``run`` trains it once
    and evaluates them on its weights. Only in one process (under torchrun every process
    trains every run, and only process 0 knows the run ids)."""

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {}
    shared = {m: b for m in methods if (b := training_base(m, protocol.methods)) in methods}
    return {m: b for m, b in shared.items() if b not in shared}  # a base is trained, not shared
