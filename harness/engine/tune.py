"""``python -m harness tune --method M --dataset D --trials N``: seeded Optuna TPE over a
plugin's search space and a few protocol fields, scored on validation, then the best
setting reproduced over the protocol's seeds and scored on the test split.

* Search space: ``Method.search_space(trial)`` (with ``embedding_size=`` where the
  plugin accepts it) plus protocol fields (``--space``, default the head and backbone
  learning rates, log-uniform over [value / 10, value * 10]); protocol fields that
  differ from the protocol are recorded as deviations of the trial's run.
* Objective: the best validation value of the protocol's selection metric (MAP@R by
  default) over the epochs, read from the run's ``val_<metric>`` history. Tuning
  needs ``selection.mode = "validation"``: the test split is never looked at to choose.
* The study lives in an RDB storage (``results/optuna.db`` by default) under a name
  derived from method, dataset, loss and the protocol's hash; re-running counts the
  COMPLETE (and PRUNED) trials and runs only the remainder.
* Pruning: the per-epoch validation values are reported to the trial after the run
  (``trial.report``) so they are in the study. Pruning *during* a run needs a per-epoch
  hook in ``run_training``; when ``RunConfig`` has an ``epoch_callback`` field it is
  used and a ``MedianPruner`` stops poor trials early.
* Every trial and reproduction is an MLflow run tagged ``optuna_study``,
  ``optuna_trial`` and ``tune_role`` (``trial`` or ``reproduction``) from its start.
* Restart after a kill ends where an uninterrupted study ends: a trial whose process died
  (left RUNNING by a SIGKILL on this host, or FAILED by SIGTERM / Ctrl-C) is queued again
  with its parameters, its MLflow run left RUNNING is marked KILLED, and the sampler is
  re-seeded before each trial from ``--sampler-seed`` and the number of trials settled so
  far, so the next suggestion does not depend on how many processes the study took.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import sys
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError

__all__ = ["add_tune_parser", "cmd_tune", "DEFAULT_SPACE", "suggest", "study_name"]

DEFAULT_SPACE = ("optimizer.lr_head", "optimizer.lr_backbone")
TUNABLE_FLOATS = {"optimizer.lr_head", "optimizer.lr_backbone", "optimizer.lr_loss", "optimizer.weight_decay"}


def _log(msg: str) -> None:
    print(f"[tune] {msg}", file=sys.stderr, flush=True)


def _get(protocol, dotted: str) -> Any:
    node: Any = protocol
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def suggest(trial, method: str, protocol, space: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(method options, protocol overrides)`` suggested for ``trial``."""
    from methods import METHODS

    options = METHODS.get(method).cls.search_space(trial, embedding_size=protocol.embedding.size)
    overrides = {}
    for field in space:
        value = _get(protocol, field)
        if not isinstance(value, float) or value <= 0:
            raise HarnessError(f"--space: '{field}' is {value!r}; only positive float fields are tunable "
                               f"({', '.join(sorted(TUNABLE_FLOATS))})")
        overrides[field] = trial.suggest_float(field, value / 10, value * 10, log=True)
    return dict(options), overrides


def study_name(method: str, dataset: str, loss: str, protocol, space: tuple[str, ...]) -> str:
    digest = hashlib.sha256((protocol.canonical_json() + repr(sorted(space))).encode()).hexdigest()[:8]
    return f"tune:{method}:{dataset}:{loss}:{protocol.name}:{digest}"


def _validation_history(run_id: str, metric: str) -> list[tuple[int, float]]:
    import mlflow

    history = mlflow.MlflowClient().get_metric_history(run_id, f"val_{metric}")
    return sorted((m.step, m.value) for m in history)


def _tag(run_id: str, tags: dict[str, Any]) -> None:
    import mlflow

    client = mlflow.MlflowClient()
    for k, v in tags.items():
        client.set_tag(run_id, k, str(v))


def _config(args, protocol, deviations, loss: str, seed: int, options: dict, experiment: str, path,
            tags: dict[str, Any]):
    from harness.engine.training import RunConfig

    return RunConfig(method=args.method, dataset=args.dataset, protocol=protocol, loss=loss,
                     loss_args=protocol.loss_args(loss), seed=seed, deviations=deviations,
                     protocol_path=path, method_options=options, data_root=args.data_root,
                     device=args.device, workers=args.loader_workers, experiment=experiment,
                     tags={k: str(v) for k, v in tags.items()})


def _trial_seed(sampler_seed: int, settled: int) -> int:
    """The sampler's seed for the next trial: a function of the trials settled before it
    (not of the process), so a restarted study suggests what an uninterrupted one would."""
    import numpy as np

    return int(np.random.SeedSequence([sampler_seed, settled]).generate_state(1)[0])


def _settled(study) -> int:
    """Trials that count towards the next seed: every finished trial but an interrupted one
    (retried with its parameters instead)."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and not t.user_attrs.get("interrupted")))


def _requeue_interrupted(study, experiment: str) -> int:
    """Queue again, with their parameters, the trials a killed process left behind: RUNNING
    ones of a dead process of this host (SIGKILL) and FAILED ones marked ``interrupted``
    (SIGTERM, Ctrl-C); mark their MLflow runs still RUNNING as KILLED. Returns how many."""
    from optuna.trial import TrialState

    from harness.store.tracking import filter_value as q
    from harness.store.tracking import mark_dead_runs_killed, process_is_dead

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    queued = 0
    for t in trials:
        dead = t.state == TrialState.RUNNING and process_is_dead(t.user_attrs.get("worker", ""))
        if dead:
            study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        if not (dead or (t.state == TrialState.FAIL and t.user_attrs.get("interrupted"))) or t.number in retried:
            continue
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
        _log(f"trial {t.number} was interrupted; queued again with its parameters {t.params}")
        queued += 1
    # Runs (trials and reproductions) that a dead process of this host left RUNNING.
    for run_id in mark_dead_runs_killed(experiment, f"tags.optuna_study = {q(study.study_name)}"):
        _log(f"run {run_id} of a dead process marked KILLED")
    return queued


def cmd_tune(args: argparse.Namespace) -> int:
    import mlflow
    import optuna

    from harness.components.data import DATASETS
    from harness.components.losses import LOSSES
    from harness.config.protocol import (
        apply_overrides,
        default_protocol,
        load_protocol,
        protocol_dir,
    )
    from harness.engine import training
    from harness.engine.sweep import open_storage
    from harness.reports.results import format_results
    from harness.store.tracking import filter_value as q
    from harness.store.tracking import tracking_uri, worker_id
    from methods import METHODS

    METHODS.get(args.method)
    DATASETS.get(args.dataset)
    if args.trials < 0:
        raise HarnessError(f"--trials must be >= 0, got {args.trials}")
    protocol_name = args.protocol or default_protocol(args.dataset)
    base, base_deviations = apply_overrides(load_protocol(protocol_name).for_dataset(args.dataset),
                                            list(args.set or []))
    if base.selection.mode != "validation":
        raise HarnessError(f"tune needs selection.mode = 'validation' (protocol '{base.name}' has "
                           f"'{base.selection.mode}'): hyperparameters are never chosen on the test set")
    loss = args.loss or base.loss.name
    LOSSES.get(loss)
    if loss != base.loss.name and loss not in base.loss.args:
        raise HarnessError(f"loss '{loss}' has no arguments in protocol '{base.name}' ([loss.args.{loss}])")
    space = tuple(s.strip() for s in (args.space.split(",") if args.space is not None else DEFAULT_SPACE)
                  if s.strip())
    metric = base.selection.metric
    path = Path(protocol_name) if protocol_name.endswith(".toml") else protocol_dir() / f"{protocol_name}.toml"
    name = study_name(args.method, args.dataset, loss, base, space)
    experiment = args.experiment or f"tune-{args.method}-{args.dataset}-{base.name}"
    seed = args.seed if args.seed is not None else base.seeds[0]
    try:  # checked before the search starts, not after it
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else None
    except ValueError:
        raise HarnessError(f"--seeds expects comma-separated integers like 0,1,2; got '{args.seeds}'") from None
    mlflow.set_tracking_uri(tracking_uri())

    storage = open_storage(args.storage, heartbeat=60, grace=180, retry_stale=False)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=args.sampler_seed), pruner=pruner)
    _requeue_interrupted(study, experiment)
    splits = training.prepare_splits(base, args.dataset, args.data_root, seed=seed)
    has_hook = "epoch_callback" in {f.name for f in dataclasses.fields(training.RunConfig)}

    def objective(trial) -> float:
        trial.set_user_attr("worker", worker_id())
        options, overrides = suggest(trial, args.method, base, space)
        protocol, extra = apply_overrides(base, overrides)
        cfg = _config(args, protocol, base_deviations + extra, loss, seed,
                      {**base.methods.get(args.method, {}), **options}, experiment, path,
                      {"optuna_study": name, "optuna_trial": trial.number, "tune_role": "trial"})
        if has_hook:  # report per epoch while training, so the pruner can stop a run early
            def on_epoch(epoch: int, record: dict) -> None:
                value = record.get(f"val_{metric}")
                if value is not None:
                    trial.report(float(value), epoch)
                    if trial.should_prune():
                        raise optuna.TrialPruned(f"pruned after epoch {epoch}")
            cfg = dataclasses.replace(cfg, epoch_callback=on_epoch)
        _log(f"trial {trial.number}: {options or '{}'} {overrides}")
        try:
            record = training.run_training(cfg, splits)
        except KeyboardInterrupt:  # SIGTERM / Ctrl-C: the next start runs these parameters again
            trial.set_user_attr("interrupted", True)
            raise
        except HarnessError as err:  # e.g. a diverging setting: its trial fails, the study goes on
            _log(f"trial {trial.number} failed: {err}")
            raise
        run_id = record["mlflow_run_id"]
        _tag(run_id, {"optuna_study": name, "optuna_trial": trial.number, "tune_role": "trial"})
        trial.set_user_attr("mlflow_run_id", run_id)
        history = _validation_history(run_id, metric)
        if not history:
            raise HarnessError(f"run {run_id} logged no val_{metric}; cannot score the trial")
        if not has_hook:
            for step, value in history:
                trial.report(value, step)
        return max(v for _, v in history)

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=states))
    remaining = max(args.trials - done, 0)
    _log(f"study '{name}' in {storage.url}: "
         f"{done} trials done, running {remaining} more (target {args.trials})")
    for _ in range(remaining):
        # One trial at a time, the sampler seeded by the trials settled so far (see above).
        study.sampler = optuna.samplers.TPESampler(seed=_trial_seed(args.sampler_seed, _settled(study)))
        # A diverging setting (non-finite loss: HarnessError) fails its trial, not the study.
        # Optuna's own warning for a failed trial carries a traceback (also for Ctrl-C /
        # SIGTERM); the objective says why in one line instead.
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        study.optimize(objective, n_trials=1, catch=(HarnessError,),
                       callbacks=[optuna.study.MaxTrialsCallback(args.trials, states=states)])
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        raise HarnessError(f"study '{name}' has no complete trial; run with --trials >= 1")
    best = study.best_trial
    print(f"best trial {best.number}: validation {metric} {best.value:.4f}; params {best.params}")
    if args.no_reproduce:
        return 0

    # Reproduce the best setting over the protocol's seeds and score on the test split.
    options = {k: v for k, v in best.params.items() if k not in space}
    options = {**base.methods.get(args.method, {}), **options}
    protocol, extra = apply_overrides(base, {k: v for k, v in best.params.items() if k in space})
    seeds = seeds if seeds is not None else list(protocol.seeds)
    exp = mlflow.get_experiment_by_name(experiment)
    done_runs = {}
    if exp is not None:
        for run in mlflow.MlflowClient().search_runs([exp.experiment_id], filter_string=(
                f"attributes.status = 'FINISHED' and tags.tune_role = 'reproduction' and "
                f"tags.optuna_study = {q(name)} and tags.optuna_trial = {q(best.number)}")):
            done_runs.setdefault(int(run.data.tags["seed"]), run)
    records = []
    for s in seeds:
        if s in done_runs:
            run = done_runs[s]
            _log(f"reproduction seed {s} already finished (run {run.info.run_id}); skipped")
            tags = run.data.tags
            records.append({"method": args.method, "dataset": args.dataset, "loss": loss, "seed": s,
                            "protocol": tags.get("protocol", protocol.name),
                            "fingerprint": tags.get("fingerprint", ""),
                            "deviations": [d for d in tags.get("deviations", "none").split("; ") if d != "none"],
                            "selection": tags.get("selection", protocol.selection.mode),
                            "mlflow_run_id": run.info.run_id,
                            "metrics": {k.removeprefix("test_"): v for k, v in run.data.metrics.items()
                                        if k.startswith("test_") and not k.startswith("test_num_")}})
            continue
        cfg = _config(args, protocol, base_deviations + extra, loss, s, options, experiment, path,
                      {"optuna_study": name, "optuna_trial": best.number, "tune_role": "reproduction"})
        # A protocol that carves validation by the run's seed needs each seed's own split.
        record = training.run_training(cfg, None if base.splits.validation_by_run_seed else splits)
        _tag(record["mlflow_run_id"], {"optuna_study": name, "optuna_trial": best.number,
                                       "tune_role": "reproduction"})
        records.append(record)
    print(format_results(records))
    values = [r["metrics"].get(metric) for r in records if r["metrics"].get(metric) is not None]
    if values:
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        print(f"test {metric} of the best setting over seeds {seeds}: {100 * mean:.2f} +- {100 * std:.2f}")
    return 0


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="Optuna TPE over a method's search space (validation), "
                              "then the best setting over the protocol's seeds (test)")
    p.add_argument("--method", required=True)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--trials", type=int, required=True, help="total trials of the study (resumable)")
    p.add_argument("--storage", help="Optuna RDB URL (default sqlite:///results/optuna.db)")
    p.add_argument("--protocol", help="protocol name or .toml path (default as for run)")
    p.add_argument("--loss", help="metric loss (default: the protocol's)")
    p.add_argument("--space", help="comma-separated protocol fields to tune as deviations "
                   f"(default {','.join(DEFAULT_SPACE)}; '' for none)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="fixed protocol override (a deviation)")
    p.add_argument("--seed", type=int, help="training seed of the trials (default: the protocol's first)")
    p.add_argument("--seeds", help="seeds of the reproduction (default: the protocol's)")
    p.add_argument("--sampler-seed", type=int, default=0, help="seed of the TPE sampler")
    p.add_argument("--no-reproduce", action="store_true", help="stop after the search")
    p.add_argument("--experiment", help="MLflow experiment (default tune-<method>-<dataset>-<protocol>)")
    p.add_argument("--data-root", type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--loader-workers", type=int)
    p.set_defaults(func=cmd_tune)
    return p
