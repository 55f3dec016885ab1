"""``python -m harness``: run, evaluate, sweep, tune, table, explain,
explain-table, datasets, methods, ui.

Every user error is one line on stderr and exit status 2; nothing is written
until a command has its result (``--json`` files are written atomically).

Both entry points, ``python -m harness`` and the ``dml-harness`` console script, call
:func:`run_main`, which installs the SIGTERM handler before running :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.base.atomic import atomic_write_json
from harness.base.errors import HarnessError
from harness.config.protocol import default_protocol

#: The dataset ``run`` uses when none is named (generated on first use, CPU-sized).
EMBEDDED_DEFAULT = "synthetic"

def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HarnessError(f"{flag} expects comma-separated integers like 0,1,2; got '{text}'") from None


# ---------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from harness.components.data import DATASETS
    from harness.components.losses import check_loss_args
    from harness.config.protocol import Deviation, apply_overrides, load_protocol, protocol_dir
    from harness.engine.distributed import shutdown
    from harness.engine.training import RunConfig, prepare_splits, run_training
    from harness.reports.results import format_results
    from methods import METHODS, check_method_options, list_methods

    if args.deterministic:  # before anything touches CUDA (cuBLAS reads its workspace setting once)
        from harness.base.device import CUBLAS_WORKSPACE

        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    # Under torchrun only process 0 reports (every process trains the same runs).
    main_process = os.environ.get("RANK", "0") in ("", "0")
    # Validate every name before any work starts.
    DATASETS.get(args.dataset)
    methods = list_methods(ablations=False) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in methods:
        METHODS.get(name)
    if args.data_root is not None and not args.data_root.is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    protocol_name = args.protocol or default_protocol(args.dataset)
    protocol = load_protocol(protocol_name).for_dataset(args.dataset)
    overrides = list(args.set or [])
    if args.epochs is not None:
        if args.epochs < 0:
            raise HarnessError(f"--epochs must be >= 0, got {args.epochs}")
        overrides.append(f"schedule.epochs={args.epochs}")
    protocol, deviations = apply_overrides(protocol, overrides)
    loss = args.loss or protocol.loss.name
    check_loss_args(loss, protocol.loss_args(loss))  # a bad --set loss.args value: one line, before any work
    if loss != protocol.loss.name and loss not in protocol.loss.args:
        deviations += (Deviation("loss.name", protocol.loss.name, loss),)
    if args.evaluate_only and not args.init_from:
        raise HarnessError("--evaluate-only evaluates the weights of a finished run: give --init-from RUN_ID")
    if args.evaluate_only and args.epochs is not None:
        raise HarnessError("--evaluate-only trains no epoch: drop --epochs")
    if args.init_from and not args.evaluate_only:  # trained from another run's weights
        deviations += (Deviation("init_from", "the protocol's pretrained weights", args.init_from),)
    if args.seen_class_control:
        deviations += (Deviation("splits.train", "training classes", "seen-class control"),)
    seeds = _int_list(args.seeds, "--seeds") if args.seeds else list(protocol.seeds)
    for method in methods:  # a bad option value is one line now, not after the dataset loads
        check_method_options(method, protocol.methods.get(method, {}), embedding_size=protocol.embedding.size,
                             loss=loss)
    path = Path(protocol_name) if protocol_name.endswith(".toml") else protocol_dir() / f"{protocol_name}.toml"

    def splits_for(seed: int):
        return prepare_splits(protocol, args.dataset, args.data_root, control=args.seen_class_control, seed=seed)

    splits = splits_for(seeds[0])
    if main_process:
        print(f"protocol {protocol.name}; dataset {args.dataset}: {len(splits.train)} train / "
          f"{0 if splits.val is None else len(splits.val)} val / {len(splits.test)} test images"
              + (f"; deviations: {', '.join(map(str, deviations))}" if deviations else ""), file=sys.stderr)
    shared = {} if args.init_from else shared_training(methods, protocol)
    if shared and main_process:
        print("; ".join(f"{m}: evaluated on {b}'s trained weights (it trains as {b})" for m, b in shared.items()),
              file=sys.stderr)
    records = []
    for seed in seeds:
        if protocol.splits.validation_by_run_seed and seed != seeds[0]:  # each seed its own carve
            splits = splits_for(seed)
        trained: dict[str, str] = {}  # method -> its run id, this seed
        for method in sorted(methods, key=lambda m: m in shared):  # base methods first
            base = shared.get(method, "")
            cfg = RunConfig(method=method, dataset=args.dataset, protocol=protocol, loss=loss,
                            loss_args=protocol.loss_args(loss), seed=seed, deviations=deviations,
                            protocol_path=path, data_root=args.data_root, device=args.device,
                            workers=args.workers, resume=args.resume, experiment=args.experiment or "",
                            init_from=trained[base] if base else args.init_from or "",
                            evaluate_only=bool(base) or args.evaluate_only,
                            method_options=dict(protocol.methods.get(method, {})),
                            deterministic=args.deterministic,
                            **({"checkpoint_root": args.checkpoint_root} if args.checkpoint_root else {}))
            try:
                records.append(run_training(cfg, splits))
            except BaseException:
                shutdown()  # a process group left open would hang the other processes' exit
                raise
            trained[method] = records[-1].get("mlflow_run_id", "")
    shutdown()
    if not main_process:
        return 0
    records.sort(key=lambda r: (seeds.index(r["seed"]), methods.index(r["method"])))  # as asked
    print(format_results(records))
    if args.json:
        atomic_write_json(args.json, records)
    return 0


def shared_training(methods: list[str], protocol) -> dict[str, str]:
    """Methods of this ``run`` that train as another one in it (:func:`methods.training_base`,
    e.g. training-free DIML and ``plain``), mapped to that method: ``run`` trains it once
    and evaluates them on its weights. Only in one process (under torchrun every process
    trains every run, and only process 0 knows the run ids)."""
    from methods import training_base

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {}
    shared = {m: b for m in methods if (b := training_base(m, protocol.methods)) in methods}
    return {m: b for m, b in shared.items() if b not in shared}  # a base is trained, not shared


# ----------------------------------------------------------------------- listings


def cmd_datasets(args: argparse.Namespace) -> int:
    from harness.components.data import DATASETS
    from harness.components.data.fashion_mnist import fashion_mnist_root
    from harness.components.data.synthetic import synthetic_root

    for name in DATASETS:
        info = DATASETS.get(name)
        if name == "synthetic":
            root = synthetic_root(args.data_root)
            status = "found" if (root / "manifest.json").is_file() else "generated on first use"
            where = str(root)
        else:
            try:
                where = str(fashion_mnist_root(args.data_root) if name == "fashion-mnist" else info.locate(args.data_root))
                status = "found"
            except HarnessError as err:
                status, where = "missing", str(err).split("expected ", 1)[-1]
        print(f"{name:14s} {status:24s} {where}\n{'':14s} {info.description}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from methods import METHODS

    for name in METHODS:
        entry = METHODS.get(name)
        paper = entry.cls.paper
        source = f"{paper.title} ({paper.year})" if paper else "harness baseline"
        print(f"{name:14s} {entry.description}\n{'':14s} {source}; options: "
              f"{', '.join(f'{k}={v!r}' for k, v in entry.options().items()) or 'none'}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from harness.store.tracking import tracking_uri

    uri = tracking_uri()
    print(f"MLflow UI on http://{args.host}:{args.port} over {uri}", file=sys.stderr)
    artifacts = (Path("results") / "mlartifacts").resolve()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
           "--default-artifact-root", artifacts.as_uri(), "--host", args.host, "--port", str(args.port)]
    sys.stderr.flush()
    return serve_process_group(cmd)


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live (not zombie) member. Zombies count
    as members for ``killpg`` until reaped, and a container's PID 1 may never reap them."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def stop_process_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM every process of group ``pgid``, wait up to ``grace`` seconds, SIGKILL the rest."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def serve_process_group(cmd: list[str], grace: float = 10.0) -> int:
    """Run ``cmd`` (a server) in its own session and process group until it exits; on
    SIGTERM or SIGINT stop the whole group, then exit.

    ``mlflow server`` starts worker processes of its own (uvicorn / gunicorn); a signal
    to the server alone, or to a process that exec-ed into it, left those workers
    running and holding the port. Here every process it starts shares its group, and
    ``killpg`` reaches them all. Returns the server's exit status; a signal ends in
    ``KeyboardInterrupt`` (exit 130 through :func:`main`) once the group is gone."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait()
    finally:  # interrupted (or failed): the server and its workers go with us
        signal.signal(signal.SIGTERM, previous)
        stop_process_group(proc.pid, grace)
        proc.wait()


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train and evaluate methods under a fair protocol")
    run.add_argument("--methods", default="all",
                     help="'all' (every registered method but ablation variants) or a comma-separated list")
    run.add_argument("--dataset", default=EMBEDDED_DEFAULT)
    run.add_argument("--protocol", help="protocol name or .toml path (default: smoke on synthetic "
                     "and fashion-mnist, roth2020 on the four benchmarks)")
    run.add_argument("--loss", help="metric loss (default: the protocol's)")
    run.add_argument("--seeds", help="comma-separated seeds (default: the protocol's)")
    run.add_argument("--epochs", type=int, help="override schedule.epochs (recorded as a deviation); "
                     "0 evaluates the initial model")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override any protocol field, e.g. optimizer.lr_head=1e-4 (a deviation)")
    run.add_argument("--data-root", type=Path)
    run.add_argument("--device", default="auto", help="auto, cpu or cuda")
    run.add_argument("--workers", type=int, help="data-loading processes (default 4 on CUDA; on CPU 1, or 0 with under 2 cores per process)")
    run.add_argument("--experiment", help="MLflow experiment (default: <dataset>-<protocol>)")
    run.add_argument("--json", type=Path, help="write the result records to this file")
    run.add_argument("--resume", action="store_true", help="continue interrupted runs from their last checkpoint")
    run.add_argument("--deterministic", action="store_true",
                     help="deterministic kernels on every device (an op without one is an error), cuDNN "
                     "without autotuning, CUBLAS_WORKSPACE_CONFIG=:4096:8; recorded with each run")
    run.add_argument("--checkpoint-root", type=Path, help="checkpoints and selected weights (default "
                     "$DML_HARNESS_CHECKPOINTS, else results/checkpoints); --init-from finds a run's "
                     "weights under it even after the folder moved")
    run.add_argument("--init-from", metavar="RUN_ID",
                     help="start from the selected weights of a finished run (a deviation, unless "
                     "--evaluate-only)")
    run.add_argument("--evaluate-only", action="store_true",
                     help="train no epoch: evaluate the --init-from run's weights, trained under this "
                     "same protocol (e.g. --methods diml: DIML at test time on a trained plain run)")
    run.add_argument("--seen-class-control", action="store_true",
                     help="diagnostic: train on other images of the test classes, not on the training "
                     "classes (a deviation; tells broken training from features that do not transfer)")
    run.set_defaults(func=cmd_run)

    from harness.cli.deviations import add_deviations_parser
    from harness.cli.evaluate import add_evaluate_parser
    from harness.cli.explain import add_explain_parser
    from harness.engine.sweep import add_sweep_parser
    from harness.engine.tune import add_tune_parser
    from harness.reports.explanation_table import add_explain_table_parser
    from harness.reports.tables import add_table_parser

    add_evaluate_parser(sub)
    add_deviations_parser(sub)
    add_sweep_parser(sub)
    add_tune_parser(sub)
    add_table_parser(sub)
    add_explain_parser(sub)
    add_explain_table_parser(sub)

    ds = sub.add_parser("datasets", help="list datasets, whether each is found locally and where")
    ds.add_argument("--data-root", type=Path)
    ds.set_defaults(func=cmd_datasets)

    me = sub.add_parser("methods", help="list registered method plugins")
    me.set_defaults(func=cmd_methods)

    ui = sub.add_parser("ui", help="open the MLflow UI over the tracking store (127.0.0.1)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(func=cmd_ui)
    return parser


def _one_line(err: BaseException) -> str:
    text = str(err)
    # Errors raised in DataLoader workers arrive wrapped with the worker's traceback.
    marker = "HarnessError: "
    if marker in text:
        text = text.rsplit(marker, 1)[-1]
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def _is_store_error(err: BaseException) -> bool:
    """An error raised by the tracking or Optuna store (MLflow, SQLAlchemy, a database driver)."""
    return type(err).__module__.split(".")[0] in ("mlflow", "sqlalchemy", "sqlite3", "psycopg2", "psycopg", "optuna")


def _terminated(signum, frame):
    # SIGTERM (a sweep stopping its workers, a cluster's time limit) unwinds like Ctrl-C,
    # so the current run is marked KILLED instead of left RUNNING in the tracking store.
    raise KeyboardInterrupt


def run_main(argv: list[str] | None = None) -> int:
    """The program entry point (``python -m harness`` and the ``dml-harness`` script):
    :func:`main` with SIGTERM turned into ``KeyboardInterrupt``. Kept out of :func:`main`
    so that calling ``main`` from Python (tests, notebooks) leaves signals alone."""
    signal.signal(signal.SIGTERM, _terminated)
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HarnessError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped (head, less): not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit-time flush quiet
        return 0
    except Exception as err:  # errors from DataLoader workers are re-raised as other types
        if "HarnessError" in str(err):
            print(f"error: {_one_line(err)}", file=sys.stderr)
            return 2
        if _is_store_error(err):  # e.g. a store locked by another writer past MLflow's timeout
            print(f"error: the tracking store failed ({type(err).__name__}: {_one_line(err)[:300]}); "
                  f"run the command again once it answers (run --resume continues from the last checkpoint)", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
