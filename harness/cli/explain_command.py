"""``python -m harness explain --run RUN_ID``: the arguments, the notes and the scores
printed; the explanation is :mod:`harness.engine.explain.explain_run`'s (what it computes and
writes is described there)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.base.written import write_output_json
from harness.cli.outputs import (
    output_file,
    output_folder,
)
from harness.cli.store import open_store
from harness.engine.explain.explain_run import SCORE_KEYS, explain_run, record_to_run
from harness.engine.explain.maps import load_run
from harness.engine.explain.sanity import SANITY_SCORES
from harness.engine.run.runtime import resolve_device

__all__ = ["cmd_explain", "format_record"]


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def cmd_explain(args: argparse.Namespace) -> int:
    if args.data_root is not None and not args.data_root.is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    if args.dataset is not None and not args.dataset.exists():
        raise HarnessError(f"--dataset {args.dataset} does not exist")
    if args.checkpoint_root is not None and not args.checkpoint_root.is_dir():
        raise HarnessError(
            f"--checkpoint-root {args.checkpoint_root} does not exist or is not a folder"
        )
    resolve_device(args.device)
    # Both checked before the explanations are computed and logged to the run, not after.
    args.json = output_file(args.json, "--json", args=args)
    out_dir = output_folder(args.out or Path("results") / "explain" / args.run, "--out", files=True)
    open_store(read_only=True)  # the run must be there: a missing store is not created
    ctx = load_run(
        args.run,
        data_root=args.data_root,
        checkpoint_root=args.checkpoint_root,
        device=args.device,
        dataset_path=args.dataset,
    )
    record = explain_run(
        ctx,
        pairs=args.pairs,
        curve_pairs=args.curve_pairs,
        seed=args.seed,
        out_dir=out_dir,
        sanity=args.sanity,
        canvas=args.insertion_canvas,
    )
    for note in record["notes"]:
        _note(note)
    record_to_run(ctx, record)
    print(format_record(record))
    if args.json:
        write_output_json(args.json, record)
    return 0


def _cells(scores: dict[str, Any], keys: tuple[str, ...]) -> str:
    return "; ".join(
        f"{k} {scores[k]:.3f} [{scores[k + '_ci95'][0]:.3f}, {scores[k + '_ci95'][1]:.3f}]"
        for k in keys
        if k in scores and scores[k] == scores[k]
    )


#: What each sanity row is, as printed before its name.
_SANITY_ROLE = {
    "ground_truth": "ceiling",
    "uniform_on_object": "chance",
    "uniform": "floor",
    "random": "floor",
}


def format_record(record: dict[str, Any]) -> str:
    """A few lines: each source's scores with their intervals; with the sanity checks, the
    ceiling and floors before them, the randomised rows and the verdicts after."""
    lines = [
        f"{record['method_name']} on {record['dataset']} ({record['protocol']}): {record['pairs']} "
        f"{record['pair_kind']} pairs, {record['seconds']:.0f} s"
    ]
    sanity = record.get("sanity") or {}
    for name, scores in sanity.items():
        if name in _SANITY_ROLE:
            lines.append(f"  {_SANITY_ROLE[name]:8s} {name}: {_cells(scores, SANITY_SCORES)}")
    for source in ("method", "baseline"):
        if record.get(source):
            lines.append(f"  {source:8s} {_cells(record[source], SCORE_KEYS)}")
    for name, scores in sanity.items():
        if name not in _SANITY_ROLE:
            lines.append(f"  {name}: {_cells(scores, SANITY_SCORES)}")
    for source, verdict in (record.get("sanity_verdicts") or {}).items():
        lines.append(f"  sanity   {source}: {_verdict_line(verdict)}")
    return "\n".join(lines)


def _verdict_line(verdict: dict[str, Any]) -> str:
    def word(value):
        return "not checked" if value is None else ("yes" if value else "NO")

    def interval(values) -> str:
        mean, lo, hi = values
        return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]" if mean == mean else ""

    difference = interval(verdict["beats_chance_difference"])
    drop = interval(verdict["training_drop"])
    return (
        f"beats chance: {word(verdict['beats_chance'])}"
        + (f" ({verdict['beats_chance_by']}, paired {difference})" if difference else "")
        + f"; changes under randomisation: {word(verdict['changes_under_randomisation'])}"
        + (f" ({verdict['fully_randomised']})" if verdict["fully_randomised"] else "")
        + f"; uses training: {word(verdict['uses_training'])}"
        + (f" (drop {drop} at {verdict['trained_parts_randomised']})" if drop else "")
    )
