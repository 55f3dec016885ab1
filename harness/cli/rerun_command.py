"""``python -m harness rerun``: train runs again from their records and say whether their
numbers come out again (:mod:`harness.engine.audit.rerun`, verdicts in
:mod:`harness.reports.reruns`).

``rerun RUN_ID [RUN_ID ...]``, ``rerun --experiment NAME [--filter "..."]`` or
``rerun --table EXPERIMENT`` (the runs behind the cells of that experiment's table, which
is printed at the end with its reproduced cells marked). Every run is checked before any
trains; one summary line per run as it ends, then the table of verdicts. Exit status 0
when no run DIFFERS, 1 when one does, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from harness.base.errors import HarnessError
from harness.cli.run_command import check_checkpoint_root
from harness.cli.store import open_store
from harness.engine.audit.rerun import (
    RerunPlan,
    check_data,
    input_differences,
    load_splits,
    plan_rerun,
    rerun,
)
from harness.engine.run.run_config import RunSettings
from harness.engine.run.runtime import resolve_device
from harness.engine.run.training import TrainFunction, train_run
from harness.reports.reruns import (
    DIFFERS,
    format_comparisons,
    format_differences,
    format_metric_table,
    format_summary_line,
)
from harness.reports.tables import TableRequest, make_table
from harness.reports.tables.load import load_runs
from harness.store.records import experiment_runs, read_record

__all__ = ["cmd_rerun"]


def _run_ids(args: argparse.Namespace) -> list[str]:
    """The runs asked for: ids, an experiment's (filtered) runs, or a table's runs."""
    if args.filter and not args.experiment:
        raise HarnessError("rerun: --filter selects runs of --experiment; give --experiment")
    given = [bool(args.run_ids), bool(args.experiment), bool(args.table)]
    if sum(given) != 1:
        raise HarnessError("rerun: give run ids, --experiment NAME or --table EXPERIMENT (one)")
    if args.run_ids:
        return list(dict.fromkeys(args.run_ids))
    if args.experiment:
        ids = experiment_runs(args.experiment, args.filter)
        if not ids:
            raise HarnessError(
                f"rerun: no run of experiment '{args.experiment}'"
                + (f" matches --filter {args.filter!r}" if args.filter else "")
            )
        return ids
    runs = load_runs([args.table])
    if runs.empty:
        raise HarnessError(f"rerun: no table: experiment '{args.table}' has no finished runs")
    return list(runs["run_id"])


def _check_arguments(args: argparse.Namespace) -> None:
    """What the arguments name, before the store opens: the data root, the device, the
    checkpoint root (a folder that can be written, outside the store)."""
    if args.data_root is not None and not args.data_root.is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    resolve_device(args.device)
    check_checkpoint_root(args.checkpoint_root)


def _settings(args: argparse.Namespace) -> RunSettings:
    return RunSettings(
        data_root=args.data_root,
        device=resolve_device(args.device).type,
        workers=args.workers,
        checkpoint_root=args.checkpoint_root,
    )


def _plans(args: argparse.Namespace, ids: list[str]) -> list[RerunPlan]:
    """Every run's plan, checked before any trains; runs that start from another run's
    weights after that run, when it is re-run too."""
    settings = _settings(args)
    plans = [
        plan_rerun(read_record(run_id), settings, allow_code_change=args.allow_code_change)
        for run_id in ids
    ]
    return sorted(plans, key=lambda plan: plan.cfg.init_from in ids)


def _from_rerun(plan: RerunPlan, rerun_id: str, root: Path) -> RerunPlan:
    """``plan`` starting from the weights of the rerun ``rerun_id``, looked for under the
    checkpoint root ``root`` that rerun wrote them in."""
    settings = replace(plan.cfg.settings, init_root=root)
    return replace(plan, cfg=replace(plan.cfg, init_from=rerun_id, settings=settings))


def cmd_rerun(args: argparse.Namespace, *, train: TrainFunction | None = None) -> int:
    """Check every run, print what differs from its record, train each again, compare."""
    _check_arguments(args)
    open_store()
    plans = _plans(args, _run_ids(args))
    prepared = []
    for plan in plans:
        splits = load_splits(plan)
        check_data(plan, splits, allow_data_change=args.allow_data_change)
        prepared.append((plan, splits, input_differences(plan, splits)))
    for plan, _, differences in prepared:
        print(
            format_differences(f"{plan.label} ({plan.record.run_id})", differences), file=sys.stderr
        )
    # original run id -> its rerun's id and the checkpoint root that rerun wrote in
    reruns: dict[str, tuple[str, Path]] = {}
    comparisons = []
    for plan, splits, differences in prepared:
        if plan.cfg.init_from in reruns:  # start from the rerun of the run it started from
            plan = _from_rerun(plan, *reruns[plan.cfg.init_from])
        comparison = rerun(
            plan, splits, differences, tolerance=args.tolerance, train=train or train_run
        )
        reruns[plan.record.run_id] = (comparison.rerun_id, plan.cfg.settings.checkpoint_root)
        comparisons.append(comparison)
        print(format_summary_line(comparison), file=sys.stderr)
        if comparison.verdict == DIFFERS:
            print(format_metric_table(comparison), file=sys.stderr)
    print(format_comparisons(comparisons))
    if args.table:
        print()
        print(make_table(TableRequest(experiments=(args.table,), fmt="markdown")).text)
    return 1 if any(c.verdict == DIFFERS for c in comparisons) else 0
