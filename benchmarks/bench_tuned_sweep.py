"""How busy a tuned sweep kept its workers, read from its queue after the sweep.

Reads the tasks of a tuned grid's queue (study ``sweep:<grid>`` in the sweep's Optuna
storage): each task's start and end, whether it was a search trial or a final cell.
Reports, for the search phase (first trial started to last trial ended) and for the whole
sweep: the wall time, the fraction of it with at least N tasks running at once (N = 1 ..
the most seen), and the task counts; the budget (trials x folds per study) from the grid.

Usage::

    python -m harness sweep --grid fair-tuned-roth2020 --smoke --workers 2 --storage sqlite:///s.db
    python benchmarks/bench_tuned_sweep.py --grid fair-tuned-roth2020 --smoke --storage sqlite:///s.db
"""

from __future__ import annotations

import argparse
import json

import optuna


def busy_fractions(spans: list[tuple[float, float]]) -> tuple[float, dict[int, float]]:
    """``(wall seconds, {n: fraction of the wall time with at least n spans open})``."""
    if not spans:
        return 0.0, {}
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    start, end = events[0][0], events[-1][0]
    at_least: dict[int, float] = {}
    open_now, last = 0, start
    for time, step in events:
        for n in range(1, open_now + 1):
            at_least[n] = at_least.get(n, 0.0) + (time - last)
        open_now, last = open_now + step, time
    wall = end - start
    return wall, {n: seconds / wall for n, seconds in sorted(at_least.items())} if wall else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--storage", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    from harness.config.grids import load_grid

    grid = load_grid(args.grid, smoke=args.smoke)
    queue = optuna.load_study(study_name=f"sweep:{grid.name}", storage=args.storage)
    tasks = [
        (
            t.user_attrs.get("tune_task"),
            t.datetime_start.timestamp(),
            t.datetime_complete.timestamp(),
        )
        for t in queue.get_trials(deepcopy=False)
        if t.state.name == "COMPLETE" and t.datetime_start and t.datetime_complete
    ]
    out = {}
    for phase, kinds in (("search", {"trial"}), ("whole sweep", {"trial", "final"})):
        spans = [(s, e) for kind, s, e in tasks if kind in kinds]
        wall, fractions = busy_fractions(spans)
        out[phase] = {"tasks": len(spans), "wall_s": round(wall, 1), "at_least": fractions}
        shares = ", ".join(f">= {n} running: {f:.1%}" for n, f in fractions.items())
        print(f"{phase}: {len(spans)} tasks in {wall / 60:.1f} min; {shares}")
    assert grid.tune is not None
    print(
        f"budget: {grid.tune.trials} trials x {grid.tune.folds} folds per study; "
        f"{len(grid.cells)} final cells"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
