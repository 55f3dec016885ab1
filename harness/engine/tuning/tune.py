"""``python -m harness tune --method M --dataset D --trials N``: seeded Optuna TPE over a
plugin's search space and a few protocol fields, scored on validation, then the best
setting reproduced over the protocol's seeds and scored on the test split.

* Search space: ``Method.search_space(trial)`` (with ``embedding_size=`` where the
  plugin accepts it) plus protocol fields (``--space``, default the head and backbone
  learning rates, log-uniform over [value / 10, value * 10]); protocol fields that
  differ from the protocol are recorded as deviations of the trial's run.
* Objective: the best validation value of the protocol's selection metric (MAP@R by
  default) over the epochs, read from the run's ``val/<metric>`` history. Tuning
  needs ``selection.mode = "validation"``: the test split is never looked at to choose.
* The study lives in an RDB storage (``results/optuna.db`` by default) under a name
  derived from method, dataset, loss and the protocol's hash; re-running counts the
  COMPLETE (and PRUNED) trials and runs only the remainder.
* Pruning: each epoch's validation value is reported to the trial as the run logs it
  (``run_training``'s ``on_epoch``), and a ``MedianPruner`` stops poor trials early.
* Every trial and reproduction is an MLflow run tagged ``optuna_study``,
  ``optuna_trial`` and ``tune_role`` (``trial`` or ``reproduction``) from its start.
* Restart after a kill ends where an uninterrupted study ends: a trial whose process died
  (left RUNNING by a SIGKILL on this host, or FAILED by SIGTERM / Ctrl-C) is queued again
  with its parameters, its MLflow run left RUNNING is marked KILLED, and the sampler is
  re-seeded before each trial from ``--sampler-seed`` and the number of trials settled so
  far, so the next suggestion does not depend on how many processes the study took.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from harness.base.errors import HarnessError, unknown_name
from harness.base.metric_keys import group_metrics, metric_key
from harness.components.data import check_fold_splits, fold_splits, seal_test
from harness.components.data.own import dataset_manifest
from harness.components.losses import LOSSES, loss_search_space
from harness.config.catalog import DEFAULT_PROTOCOL_SPACE, protocol_dir
from harness.config.overrides import flatten_keys
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import default_protocol, load_protocol
from harness.engine.grid.sweep import open_storage
from harness.engine.run import training
from harness.engine.run.data import check_folds_fit, check_training_split, prepare_splits
from harness.engine.run.run_config import RunConfig, RunSettings
from harness.methods import METHODS
from harness.store.dead_runs import mark_dead_runs_killed, process_is_dead, worker_id
from harness.store.queries import metric_history, search_runs, set_run_tags
from harness.store.tracking import filter_value as q

__all__ = [
    "DEFAULT_SPACE",
    "TuneSetup",
    "tune_setup",
    "search",
    "reproduce",
    "suggest",
    "study_name",
    "failed_trials",
    "where_failures_are",
]

#: The protocol fields ``tune`` searches when ``--space`` names none: a grid's defaults.
DEFAULT_SPACE = DEFAULT_PROTOCOL_SPACE
TUNABLE_FLOATS = {
    "optimizer.lr_head",
    "optimizer.lr_backbone",
    "optimizer.lr_loss",
    "optimizer.weight_decay",
}


def _log(msg: str) -> None:
    print(f"[tune] {msg}", file=sys.stderr, flush=True)


def _get(protocol, dotted: str) -> Any:
    node: Any = protocol
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def suggest(
    trial, method: str, protocol, space: tuple[str, ...], loss: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(method options, protocol overrides)`` suggested for ``trial``: the method's
    ``search_space``, the ``space`` fields, and with ``loss`` the loss's arguments
    (:data:`harness.components.losses.LOSS_SEARCH_SPACES`, as protocol fields
    ``loss.args.<loss>.<argument>``)."""

    options = METHODS.get(method).cls.search_space(trial, embedding_size=protocol.embedding.size)
    check_space(protocol, space)
    overrides = {
        field: trial.suggest_float(
            field, _get(protocol, field) / 10, _get(protocol, field) * 10, log=True
        )
        for field in space
    }
    for arg, rng in loss_search_space(loss or "").items():
        name = f"loss.args.{loss}.{arg}"
        overrides[name] = rng.suggest(trial, name)
    return dict(options), overrides


def check_space(protocol, space: tuple[str, ...]) -> None:
    """Every ``--space`` field is a positive float of the protocol (searched over a decade
    either side of its value, on a log scale); checked before the study opens."""

    values = flatten_keys(protocol.to_dict())
    for field in space:
        if field not in values:
            raise HarnessError(
                f"--space: {unknown_name('protocol field', field, sorted(TUNABLE_FLOATS))}"
            )
        if not isinstance(values[field], float) or values[field] <= 0:
            raise HarnessError(
                f"--space: '{field}' = {values[field]!r}; only positive float fields are tunable "
                f"({', '.join(sorted(TUNABLE_FLOATS))})"
            )


def study_name(
    method: str, dataset: str, loss: str, protocol, space: tuple[str, ...], folds: int = 1
) -> str:
    """The study's name: method, dataset, loss, protocol and a digest of the protocol, the
    searched fields and (k > 1) the folds."""
    searched = repr(sorted(space)) + (f"folds={folds}" if folds > 1 else "")
    digest = hashlib.sha256((protocol.canonical_json() + searched).encode()).hexdigest()[:8]
    return f"tune:{method}:{dataset}:{loss}:{protocol.name}:{digest}"


def _trial_seed(sampler_seed: int, settled: int) -> int:
    """The sampler's seed for the next trial: a function of the trials settled before it
    (not of the process), so a restarted study suggests what an uninterrupted one would."""

    return int(np.random.SeedSequence([sampler_seed, settled]).generate_state(1)[0])


def _settled(study) -> int:
    """Trials that count towards the next seed: every finished trial but an interrupted one
    (retried with its parameters instead)."""

    return sum(
        1
        for t in study.get_trials(deepcopy=False)
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and not t.user_attrs.get("interrupted"))
    )


def _requeue_interrupted(study, experiment: str) -> int:
    """Queue again, with their parameters, the trials a killed process left behind: RUNNING
    ones of a dead process of this host (SIGKILL) and FAILED ones marked ``interrupted``
    (SIGTERM, Ctrl-C); mark their MLflow runs still RUNNING as KILLED. Returns how many."""

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    queued = 0
    for t in trials:
        dead = t.state == TrialState.RUNNING and process_is_dead(t.user_attrs.get("worker", ""))
        if dead:
            study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        if (
            not (dead or (t.state == TrialState.FAIL and t.user_attrs.get("interrupted")))
            or t.number in retried
        ):
            continue
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
        _log(f"trial {t.number} was interrupted; queued again with its parameters {t.params}")
        queued += 1
    # Runs (trials and reproductions) that a dead process of this host left RUNNING.
    for run_id in mark_dead_runs_killed(experiment, f"tags.optuna_study = {q(study.study_name)}"):
        _log(f"run {run_id} of a dead process marked KILLED")
    return queued


@dataclass(frozen=True)
class TuneSetup:
    """One study: what it tunes (method, dataset, loss, protocol and its fixed deviations,
    the protocol fields searched), where it records (study name, MLflow experiment), the
    seed of its trials and the run settings every run gets."""

    method: str
    dataset: str
    loss: str
    protocol: Any
    deviations: tuple
    space: tuple[str, ...]
    protocol_path: Path
    name: str
    experiment: str
    seed: int
    settings: Any
    #: Class-disjoint folds of the training classes a trial trains on (1: the protocol's
    #: validation split; k > 1: k runs, the test split sealed, scored by their mean).
    folds: int = 1
    #: What trains a run (default :func:`~harness.engine.run.training.run_training`).
    train: Any = None

    @property
    def metric(self) -> str:
        return self.protocol.selection.metric

    @functools.cached_property
    def splits(self):
        """The trials' splits (their seed's carve), loaded once for every trial; the
        protocol's batch is checked against them here, before the study opens."""

        if self.folds == 1:
            splits = prepare_splits(
                self.protocol, self.dataset, self.settings.data_root, seed=self.seed
            )
            check_training_split(self.protocol, self.dataset, splits)
            return splits
        # k folds: the whole training split, no validation carved (the folds replace it).
        whole, _ = apply_overrides(self.protocol, {"selection.mode": "last"})
        splits = prepare_splits(whole, self.dataset, self.settings.data_root, seed=self.seed)
        try:
            check_fold_splits(splits, self.folds)
        except HarnessError as err:
            raise HarnessError(f"--{err}") from None
        return splits

    def trial_splits(self, fold: int | None):
        """The splits of one run of a trial: the study's (``fold`` None), or fold ``fold``
        of the training classes with the test split sealed."""

        if fold is None:
            return self.splits
        split = fold_splits(self.splits, self.folds, fold, self.protocol.splits.seed)
        return seal_test(split, "the hyperparameter search")

    def config(self, protocol, deviations, seed: int, options: dict, tags: dict[str, Any]):
        """The :class:`~harness.engine.run.run_config.RunConfig` of one trial or reproduction."""

        return RunConfig.build(
            protocol,
            method=self.method,
            dataset=self.dataset,
            loss=self.loss,
            seed=seed,
            deviations=deviations,
            settings=self.settings,
            method_options=options,
            protocol_path=self.protocol_path,
            experiment=self.experiment,
            tags={k: str(v) for k, v in tags.items()},
        )

    def run(self, cfg, splits, on_epoch=None) -> dict[str, Any]:
        """Train one run of the study (``splits`` None: its own), the batch rule of its
        protocol checked on the splits handed to it."""

        if splits is not None:
            check_training_split(cfg.protocol, cfg.dataset, splits)
        return (self.train or training.run_training)(cfg, splits, on_epoch=on_epoch)

    def options(self, params: dict[str, Any]) -> dict[str, Any]:
        """The method's options of a trial: the protocol's, updated by the suggested ones."""
        return {**self.protocol.methods.get(self.method, {}), **params}


def tune_setup(
    method: str,
    dataset: str,
    *,
    protocol: str | None = None,
    loss: str | None = None,
    overrides: Sequence[str] = (),
    space: str | None = None,
    seed: int | None = None,
    experiment: str | None = None,
    settings=None,
    folds: int = 1,
    train: Any = None,
) -> TuneSetup:
    """Check the names and resolve everything a study needs; tuning needs validation
    selection (the test split is never looked at to choose)."""

    METHODS.get(method)
    files = dataset_manifest(dataset)  # a dataset given by its path: a study per file list
    studied = f"{dataset}@{files.fingerprint}" if files is not None else dataset
    protocol_name = protocol or default_protocol(dataset)
    base, deviations = _validation_protocol(protocol_name, dataset, overrides)
    loss = _checked_loss(loss or base.loss.name, base)
    fields = tuple(
        s.strip() for s in (space.split(",") if space is not None else DEFAULT_SPACE) if s.strip()
    )
    check_space(base, fields)
    if folds < 1:
        raise HarnessError(f"--folds {folds}: expected at least 1")
    settings = settings or RunSettings()
    try:  # before the dataset is loaded, or generated (the synthetic set) for nothing
        check_folds_fit(dataset, settings.data_root, folds)
    except HarnessError as err:
        raise HarnessError(f"--{err}") from None
    path = (
        Path(protocol_name)
        if protocol_name.endswith(".toml")
        else protocol_dir() / f"{protocol_name}.toml"
    )
    return TuneSetup(
        method,
        dataset,
        loss,
        base,
        tuple(deviations),
        fields,
        path,
        study_name(method, studied, loss, base, fields, folds),
        experiment or f"tune-{method}-{dataset}-{base.name}",
        seed if seed is not None else base.seeds[0],
        settings,
        folds,
        train,
    )


def _validation_protocol(protocol_name: str, dataset: str, overrides: Sequence[str]):
    """The protocol with ``overrides`` applied and the deviations they make; it must select
    on validation."""

    base, deviations = apply_overrides(
        load_protocol(protocol_name).for_dataset(dataset), list(overrides)
    )
    if base.selection.mode != "validation":
        raise HarnessError(
            f"tune needs selection.mode = 'validation' (protocol '{base.name}' has "
            f"'{base.selection.mode}'): hyperparameters are never chosen on the test set"
        )
    return base, deviations


def _checked_loss(loss: str, base) -> str:
    """``loss``, once it is a registered loss that is the protocol's own or has arguments
    in it."""

    LOSSES.get(loss)
    if loss != base.loss.name and loss not in base.loss.args:
        raise HarnessError(
            f"loss '{loss}' has no arguments in protocol '{base.name}' ([loss.args.{loss}])"
        )
    return loss


def search(setup: TuneSetup, *, trials: int, storage: str | None, sampler_seed: int = 0):
    """Run the study's trials up to ``trials`` in all (a restarted study runs the rest,
    interrupted trials again first); returns the study."""

    splits = setup.splits  # a protocol the split refuses is refused before the study is stored
    rdb = open_storage(storage, heartbeat=60, grace=180, retry_stale=False)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    study = optuna.create_study(
        study_name=setup.name,
        storage=rdb,
        direction="maximize",
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=sampler_seed),
        pruner=pruner,
    )
    _requeue_interrupted(study, setup.experiment)
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=states))
    remaining = max(trials - done, 0)
    _log(
        f"study '{setup.name}' in {rdb.url}: {done} trials done, running {remaining} more (target {trials})"
    )
    for _ in range(remaining):
        # One trial at a time, the sampler seeded by the trials settled so far (see above).
        study.sampler = optuna.samplers.TPESampler(seed=_trial_seed(sampler_seed, _settled(study)))
        # A diverging setting (non-finite loss: HarnessError) fails its trial, not the study.
        # Optuna's own warning for a failed trial carries a traceback (also for Ctrl-C /
        # SIGTERM); the objective says why in one line instead.
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        study.optimize(
            lambda trial: _objective(setup, splits, trial),
            n_trials=1,
            catch=(HarnessError,),
            callbacks=[optuna.study.MaxTrialsCallback(trials, states=states)],
        )
    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        failed = failed_trials(study)
        if failed:
            raise HarnessError(
                f"all {len(failed)} trial(s) of study '{setup.name}' failed; "
                f"{where_failures_are(setup)}"
            )
        raise HarnessError(f"study '{setup.name}' has no complete trial; run with --trials >= 1")
    return study


def failed_trials(study) -> list:
    """The study's trials that failed for good: not those a killed or interrupted process
    left (queued again with their parameters on the next start)."""

    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if not t.user_attrs.get("interrupted")
    ]


def where_failures_are(setup: TuneSetup) -> str:
    """Where a failed trial's reason is recorded (besides its line on stderr)."""
    return (
        f"each trial's reason is its MLflow run's 'failure' tag in experiment '{setup.experiment}' "
        f"(status FAILED, tag optuna_study = {setup.name})"
    )


def _objective(setup: TuneSetup, splits, trial) -> float:
    """One trial: a run with the suggested setting (with ``folds`` k > 1, one run per fold,
    the test split sealed), scored by its best validation value of the selection metric,
    the mean over folds. Each epoch's value goes to the pruner as it is logged (with
    folds, each fold's running mean after the fold)."""

    trial.set_user_attr("worker", worker_id())
    options, overrides = suggest(trial, setup.method, setup.protocol, setup.space, setup.loss)
    protocol, extra = apply_overrides(setup.protocol, overrides)
    _log(f"trial {trial.number}: {options or '{}'} {overrides}")
    folds: list[int | None] = [None] if setup.folds == 1 else list(range(setup.folds))
    values = []
    for fold in folds:
        tags = {"optuna_study": setup.name, "optuna_trial": trial.number, "tune_role": "trial"}
        if fold is not None:
            tags["tune_fold"] = fold
        cfg = setup.config(
            protocol, setup.deviations + extra, setup.seed, setup.options(options), tags
        )
        values.append(_trial_run(setup, trial, cfg, setup.trial_splits(fold), fold))
        if fold is not None and fold < setup.folds - 1:
            _report_fold(trial, fold, sum(values) / len(values))
    return sum(values) / len(values)


def _report_fold(trial, fold: int, mean: float) -> None:

    trial.report(mean, fold)
    if trial.should_prune():
        raise optuna.TrialPruned(f"pruned after fold {fold}")


def _trial_run(setup: TuneSetup, trial, cfg, splits, fold: int | None) -> float:
    """One run of a trial, its best validation value (a fold's run never opens the test
    split: ``search_only``)."""

    def on_epoch(epoch: int, record: dict) -> None:  # so the pruner can stop a run early
        value = record.get(metric_key("val", setup.metric))
        if value is not None:
            trial.report(float(value), epoch)
            if trial.should_prune():
                raise optuna.TrialPruned(f"pruned after epoch {epoch}")

    cfg = dataclasses.replace(cfg, search_only=fold is not None)
    try:
        record = setup.run(cfg, splits, on_epoch if fold is None else None)
    except KeyboardInterrupt:  # SIGTERM / Ctrl-C: the next start runs these parameters again
        trial.set_user_attr("interrupted", True)
        raise
    except HarnessError as err:  # e.g. a diverging setting: its trial fails, the study goes on
        _log(f"trial {trial.number} failed: {err}")
        raise
    run_id = record["mlflow_run_id"]
    set_run_tags(run_id, cfg.tags)
    trial.set_user_attr("mlflow_run_id" if fold is None else f"mlflow_run_id_fold{fold}", run_id)
    history = metric_history(run_id, metric_key("val", setup.metric))
    if not history:
        raise HarnessError(
            f"run {run_id} logged no {metric_key('val', setup.metric)}; cannot score the trial"
        )
    return max(v for _, v in history)


def _split_params(setup: TuneSetup, params: dict[str, Any]) -> tuple[dict, dict]:
    """A trial's parameters as ``(method options, protocol overrides)``: the searched
    protocol fields and loss arguments are overrides, the rest the method's options."""
    is_field = {k for k in params if k in setup.space or k.startswith("loss.args.")}
    return (
        {k: v for k, v in params.items() if k not in is_field},
        {k: v for k, v in params.items() if k in is_field},
    )


def reproduce(setup: TuneSetup, best, seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """The best trial's setting trained with each of ``seeds`` (default the protocol's) and
    scored on the test split; a seed with a finished reproduction is read, not run again."""

    chosen, fields = _split_params(setup, best.params)
    options = setup.options(chosen)
    protocol, extra = apply_overrides(setup.protocol, fields)
    seeds = seeds if seeds is not None else list(protocol.seeds)
    tags = {"optuna_study": setup.name, "optuna_trial": best.number, "tune_role": "reproduction"}
    done: dict[int, Any] = {}
    for run in search_runs(
        setup.experiment,
        f"attributes.status = 'FINISHED' and tags.tune_role = 'reproduction' "
        f"and tags.optuna_study = {q(setup.name)} and tags.optuna_trial = {q(best.number)}",
    ):
        done.setdefault(int(run.data.tags["seed"]), run)
    # A protocol that carves validation by the run's seed needs each seed's own split; with
    # folds, the reproduction trains on the protocol's own split (one model per seed).
    splits = None if protocol.splits.validation_by_run_seed or setup.folds > 1 else setup.splits
    records = []
    for seed in seeds:
        if seed in done:
            _log(
                f"reproduction seed {seed} already finished (run {done[seed].info.run_id}); skipped"
            )
            records.append(_record_of(done[seed], setup, protocol, seed))
            continue
        cfg = setup.config(protocol, setup.deviations + extra, seed, options, tags)
        record = setup.run(cfg, splits)
        set_run_tags(record["mlflow_run_id"], tags)
        records.append(record)
    return records


def _record_of(run, setup: TuneSetup, protocol, seed: int) -> dict[str, Any]:
    """The ``run --json`` record of a finished reproduction, read back from its run."""
    tags = run.data.tags
    return {
        "method": setup.method,
        "dataset": setup.dataset,
        "loss": setup.loss,
        "seed": seed,
        "protocol": tags.get("protocol", protocol.name),
        "fingerprint": tags.get("fingerprint", ""),
        "deviations": [d for d in tags.get("deviations", "none").split("; ") if d != "none"],
        "selection": tags.get("selection", protocol.selection.mode),
        "mlflow_run_id": run.info.run_id,
        "metrics": {
            k: v
            for k, v in group_metrics(run.data.metrics, "test").items()
            if not k.startswith("num_")
        },
    }
