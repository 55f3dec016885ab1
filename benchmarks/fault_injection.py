"""Fault injection at scale: kill, interrupt, corrupt, lock, move and fill the disk under
``run``, ``sweep`` (3 workers), ``tune`` and ``table``, restart each the normal way, and
print the table (fault, point, recovered, final metrics identical, cells run twice, runs
left RUNNING, half-written results read).

The scenarios are the fault suite's (``tests/faults/injection.py``); ``tests/faults/``
runs a few of them under pytest (slow-marked), this script runs all of them (37 faults)
and writes the Markdown table that docs/faults.md shows. It lives in
``benchmarks/`` beside the other measurement scripts because it measures (minutes of
subprocesses, a table as its output) rather than asserts; it exits 1 if any row fails.

Usage: python benchmarks/fault_injection.py [--seed 0] [--commands run,sweep,tune,table]
       [--out results/fault_injection.md] [--workdir DIR] [--keep] [--start K] [--stop M]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.base.atomic import atomic_write_text  # noqa: E402
from tests.faults.checks import Row  # noqa: E402
from tests.faults.injection import format_table, scenarios  # noqa: E402
from tests.faults.lab import Lab  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seeds the random moments and offsets")
    parser.add_argument("--commands", default="run,sweep,tune,table")
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    parser.add_argument(
        "--workdir", type=Path, help="folder for the scenarios (default: a temporary one)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--start",
        type=int,
        default=0,
        help="run the faults from this index on (the "
        "references always run): split one list over several processes",
    )
    parser.add_argument("--stop", type=int, help="and stop before this index")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dml-faults-"))
    lab = Lab(work / "lab", work / "data", seed=args.seed)
    rows: list[Row] = []
    started = time.monotonic()
    try:
        index = -1
        for step in scenarios(lab, commands=tuple(c.strip() for c in args.commands.split(","))):
            if getattr(step, "__name__", "") != "prepare":
                index += 1
                if index < args.start or (args.stop is not None and index >= args.stop):
                    continue
            row = step()
            if row is None:  # a reference run
                continue
            rows.append(row)
            if args.out:  # as it goes: a partial table survives an interrupted script
                atomic_write_text(args.out, format_table(rows))
            print(
                f"[{time.monotonic() - started:6.0f}s] {'ok  ' if row.ok else 'FAIL'} {row.command}: "
                f"{row.fault} at {row.point} {row.note}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        lab.close()
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    table = format_table(rows)
    summary = (
        f"{len(rows)} faults injected in {time.monotonic() - started:.0f} s (seed {args.seed}); "
        f"{sum(r.ok for r in rows)} recovered with identical results, "
        f"{sum(r.twice for r in rows)} cells run twice, {sum(r.running for r in rows)} runs left RUNNING.\n"
    )
    print(table + "\n" + summary)
    if args.out:
        atomic_write_text(args.out, table + "\n" + summary)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
