"""A run trained again from its record alone, and compared with it (``harness rerun``).

The record is what :class:`~harness.engine.run.mlflow_recorder.MlflowRecorder` wrote when the
run started: the resolved protocol (``protocol/resolved.json``, the run's own snapshot,
whatever the protocol file says now), the deviations (``protocol/deviations.json``), every
method option (``method.*`` params, read back with the types of the options' defaults),
the loss, seed, dataset and execution flags (params), and the code, data and machine it
ran on (tags). Nothing is taken from the current defaults.

Before anything trains, each run is checked (:func:`plan_rerun`, :func:`check_data`): it
must be FINISHED with test metrics; its recorded commit must be in this checkout's history
(unless ``allow_code_change``); the data must have the recorded split digest (unless
``allow_data_change``). What differs between the record and this machine is listed
(:func:`input_differences`). The rerun is a new run of the experiment ``<experiment>-reruns``
tagged ``rerun_of``, with its checkpoints apart from the original's, and its comparison
(:func:`~harness.reports.reruns.compare_metrics`) is an artifact of it and a tag of the
original.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.base.device import amp_name
from harness.base.errors import HarnessError
from harness.components.data import DatasetSplits
from harness.config.deviations import TAG_PREFIX
from harness.config.fingerprint import fingerprint
from harness.config.overrides import Deviation
from harness.config.protocol import protocol_from_dict
from harness.engine.run.data import recorded_control, training_splits
from harness.engine.run.run_config import RunConfig, RunSettings
from harness.engine.run.runtime import resolve_device
from harness.engine.run.training import train_run
from harness.methods import METHODS
from harness.reports.reruns import (
    Comparison,
    InputDifference,
    compare_metrics,
    format_metric_table,
    noise_half_width,
)
from harness.store.provenance import (
    commit_in_history,
    git_commit,
    package_versions,
    uncommitted_changes,
)
from harness.store.queries import log_to_run, search_runs
from harness.store.records import (
    RERUN_OF_TAG,
    RunRecord,
    add_rerun_verdict,
    read_json_artifact,
    read_record,
    read_text_artifact,
)
from harness.store.tracking import filter_value

__all__ = [
    "NUMERIC_PACKAGES",
    "RERUN_EXPERIMENT_SUFFIX",
    "RerunPlan",
    "plan_rerun",
    "method_options",
    "input_differences",
    "check_data",
    "cell_half_widths",
    "rerun",
]

#: The packages whose versions can change a run's numbers (the others are listed, not weighed).
NUMERIC_PACKAGES = (
    "torch",
    "torchvision",
    "timm",
    "pytorch-metric-learning",
    "numpy",
    "faiss-cpu",
    "faiss-gpu",
)
#: Reruns are recorded in ``<the run's experiment><suffix>``, so that tables of the
#: original experiment are not changed by them.
RERUN_EXPERIMENT_SUFFIX = "-reruns"


@dataclass(frozen=True)
class RerunPlan:
    """A run's record and the configuration that trains it again (its experiment and
    checkpoint root set apart from the original's); ``control``: the diagnostic control it
    trained as (:data:`~harness.engine.run.data.CONTROLS`), "" for none."""

    record: RunRecord
    cfg: RunConfig
    control: str

    @property
    def label(self) -> str:
        r = self.record
        return f"{r.tag('method')} {r.tag('loss')} seed {r.tag('seed')} on {r.tag('dataset')}"


def _refuse_unless_rerunnable(record: RunRecord) -> None:
    if record.status != "FINISHED":
        what = "is still RUNNING" if record.status == "RUNNING" else f"ended {record.status}"
        raise HarnessError(
            f"run {record.run_id} {what}: only a FINISHED run has results to reproduce"
        )
    if not any(k.startswith("test/") for k in record.metrics):
        raise HarnessError(
            f"run {record.run_id} has no test metrics (a search trial, or a result derived "
            f"from other runs): nothing of it to reproduce; rerun the runs it came from"
        )
    if not record.tag("method") or not record.tag("split_digest"):
        raise HarnessError(
            f"run {record.run_id} is not a training run of the harness (no method or "
            f"split_digest tag): nothing to rebuild it from"
        )


def _typed(text: str, default: Any) -> Any:
    """A ``method.*`` param (MLflow keeps strings) as the option's value: a string where the
    default is one, JSON for lists and tables, else a Python literal."""
    if isinstance(default, str):
        return text
    if isinstance(default, list | tuple | dict) or text.startswith(("[", "{")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text
        return tuple(value) if isinstance(default, tuple) and isinstance(value, list) else value
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def method_options(record: RunRecord) -> dict[str, Any]:
    """Every option of the run's method as it ran (defaults included), from its params."""
    defaults = METHODS.get(record.tag("method")).options()
    return {
        name: _typed(record.params[f"method.{name}"], default)
        if f"method.{name}" in record.params
        else default
        for name, default in defaults.items()
    }


def _flag(record: RunRecord, key: str) -> bool:
    return record.params.get(key, record.tag(key, "False")) == "True"


def plan_rerun(
    record: RunRecord,
    settings: RunSettings,
    *,
    allow_code_change: bool = False,
    init_from: str | None = None,
) -> RerunPlan:
    """The configuration that trains ``record``'s run again, checked (one line for a run
    that cannot be re-run meaningfully). ``settings``: where this machine keeps data and
    checkpoints; the run's own kernels and compile flags are taken from its record.
    ``init_from``: the run whose weights replace the recorded ``init_from`` (its rerun)."""
    _refuse_unless_rerunnable(record)
    commit = record.tag("git_commit").removesuffix("-dirty")
    if not allow_code_change and commit_in_history(commit) is False:
        raise HarnessError(
            f"run {record.run_id} was made by commit {commit}, which is not in this "
            f"checkout's history: check it out (git fetch; git checkout {commit[:12]}) or "
            f"pass --allow-code-change"
        )
    resolved = read_json_artifact(record.run_id, "protocol/resolved.json")
    if resolved is None:
        raise HarnessError(
            f"run {record.run_id} has no protocol/resolved.json artifact (was the store's "
            f"artifact folder left behind when it was moved?): its protocol cannot be rebuilt"
        )
    deviations = read_json_artifact(record.run_id, "protocol/deviations.json") or []
    recorded_init = record.tag("init_from", "none")
    cfg = RunConfig.build(
        protocol_from_dict(resolved),
        method=record.tag("method"),
        dataset=record.tag("dataset"),
        loss=record.tag("loss"),
        seed=int(record.tag("seed")),
        deviations=tuple(Deviation(**d) for d in deviations),
        method_options=method_options(record),
        settings=_rerun_settings(record, settings),
        experiment=record.experiment + RERUN_EXPERIMENT_SUFFIX,
        init_from=init_from or ("" if recorded_init == "none" else recorded_init),
        evaluate_only=record.tag("evaluate_only") == "True",
        tags={
            RERUN_OF_TAG: record.run_id,
            **{k: v for k, v in record.tags.items() if k.startswith(TAG_PREFIX)},
        },
    )
    return RerunPlan(record, cfg, control=recorded_control(record.tag("deviations")))


def _rerun_settings(record: RunRecord, settings: RunSettings) -> RunSettings:
    """This machine's data root and device, the run's recorded kernels and compile flags,
    and checkpoints under ``<root>/reruns/<run id>-<random stamp>``: never the original's
    folder. The weights it starts from (``init_from``) are looked for under ``<root>``,
    where the runs it re-runs keep theirs."""
    stamp = uuid.uuid4().hex[:8]
    return replace(
        settings,
        init_root=settings.checkpoint_root,
        deterministic=_flag(record, "deterministic"),
        fast=_flag(record, "fast"),
        compile=_flag(record, "compile"),
        cuda_graphs=_flag(record, "cuda_graphs"),
        checkpoint_root=settings.checkpoint_root / "reruns" / f"{record.run_id}-{stamp}",
    )


def load_splits(plan: RerunPlan) -> DatasetSplits:
    """The run's splits as ``run`` prepared them (the validation carve of its seed)."""
    cfg = plan.cfg
    return training_splits(
        cfg.protocol, cfg.dataset, cfg.settings.data_root, control=plan.control, seed=cfg.seed
    )


def check_data(plan: RerunPlan, splits: DatasetSplits, *, allow_data_change: bool) -> None:
    """Refuse data whose split digest is not the recorded one (unless allowed): the rerun
    would measure other images."""
    recorded, here = plan.record.tag("split_digest"), splits.digest()
    if recorded != here and not allow_data_change:
        raise HarnessError(
            f"run {plan.record.run_id}: the dataset '{plan.cfg.dataset}' here has split digest "
            f"{here}, the run recorded {recorded}: other images, so its numbers cannot be "
            f"reproduced (point --data-root at the run's data, or pass --allow-data-change)"
        )


def _current_environment(plan: RerunPlan) -> dict[str, str]:
    device = resolve_device(plan.cfg.settings.device)
    return {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "amp": amp_name(device, plan.cfg.protocol.numerics.precision),
        "torch_threads": str(torch.get_num_threads()),
    }


def input_differences(plan: RerunPlan, splits: DatasetSplits) -> list[InputDifference]:
    """Each recorded input this machine does not reproduce: commit (and uncommitted
    changes), protocol fingerprint, split digest, device, precision, thread count, package
    versions (those that change numbers first)."""
    r, cfg = plan.record, plan.cfg
    found = []
    commit = git_commit()
    if r.tag("git_commit") != commit:
        found.append(InputDifference("commit", r.tag("git_commit"), commit))
    elif commit.endswith("-dirty"):  # the same commit, each with local changes: the same ones?
        recorded = read_text_artifact(r.run_id, "source/uncommitted.patch") or ""
        if recorded != uncommitted_changes():
            found.append(
                InputDifference("uncommitted changes", "source/uncommitted.patch", "other changes")
            )
    fp = fingerprint(cfg.protocol, splits.digest(), loss=cfg.loss, loss_args=cfg.loss_args)
    if r.tag("fingerprint") != fp:
        found.append(InputDifference("protocol fingerprint", r.tag("fingerprint"), fp))
    if r.tag("split_digest") != splits.digest():
        found.append(InputDifference("split digest", r.tag("split_digest"), splits.digest()))
    for key, here in _current_environment(plan).items():
        if r.tag(key) != here:
            found.append(InputDifference(key, r.tag(key), here))
    versions = package_versions()
    for name in sorted(versions, key=lambda n: (n not in NUMERIC_PACKAGES, n)):
        recorded = r.tag(f"version.{name}")
        if recorded and recorded != versions[name] and name != "dml-harness":
            found.append(
                InputDifference(
                    f"package {name}", recorded, versions[name], name in NUMERIC_PACKAGES
                )
            )
    return found


def cell_half_widths(record: RunRecord, tolerance: float) -> tuple[dict[str, float], str]:
    """The noise interval of each ``test/`` metric of ``record``'s cell (the finished runs of
    its experiment with its fingerprint, method, options and loss, one per seed, reruns
    left out), and how it was judged."""
    runs = search_runs(
        record.experiment,
        " and ".join(
            f"tags.{key} = {filter_value(record.tag(key))}"
            for key in ("fingerprint", "method", "loss")
        )
        + " and attributes.status = 'FINISHED'",
    )
    options = {k: v for k, v in record.params.items() if k.startswith("method.")}
    newest: dict[str, Any] = {}
    for run in sorted(runs, key=lambda run: run.info.start_time):
        same = {k: v for k, v in run.data.params.items() if k.startswith("method.")} == options
        if same and RERUN_OF_TAG not in run.data.tags:
            newest[run.data.tags.get("seed", "")] = run  # the newest run of each seed
    keys = [k for k in record.metrics if k.startswith("test/")]
    widths = {
        key: noise_half_width(
            [run.data.metrics[key] for run in newest.values() if key in run.data.metrics],
            tolerance,
        )
        for key in keys
    }
    seeds = len(newest)
    return widths, (f"{seeds} seeds of the cell" if seeds >= 2 else f"tolerance {tolerance:g}")


#: What trains one run: :func:`~harness.engine.run.training.train_run` or a stand-in.
Train = Callable[..., dict[str, Any]]


def rerun(
    plan: RerunPlan,
    splits: DatasetSplits,
    differences: list[InputDifference],
    *,
    tolerance: float,
    train: Train = train_run,
) -> Comparison:
    """Train ``plan``'s run again, compare every metric with the record, and keep the
    comparison with both runs: ``rerun/comparison.json`` and ``rerun/comparison.md`` on the
    new run, the verdict counted on the original (``reruns``, ``rerun.last`` tags)."""
    result = train(plan.cfg, splits)
    rerun_id = result["mlflow_run_id"]
    new = read_record(rerun_id)
    widths, noise = cell_half_widths(plan.record, tolerance)
    verdict, rows = compare_metrics(plan.record.metrics, new.metrics, widths)
    comparison = Comparison(
        plan.record.run_id, rerun_id, plan.label, verdict, rows, noise, tuple(differences)
    )
    log_to_run(
        rerun_id,
        metrics={},
        tags={"rerun.verdict": verdict},
        texts={
            "rerun/comparison.json": json.dumps(comparison.to_dict(), indent=2),
            "rerun/comparison.md": format_metric_table(comparison) + "\n",
        },
        artifacts=(),
    )
    add_rerun_verdict(read_record(plan.record.run_id), verdict)  # counts as stored now
    return comparison
