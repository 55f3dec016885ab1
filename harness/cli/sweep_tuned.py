"""``sweep --grid G`` for a grid with a ``[tune]`` table: what the start queues, the
report at the end (each study's trials, the unfinished cells) and the tables it writes:
``results/tables/<grid>.md`` and ``.tex`` (and ``-concatenated`` ones with k > 1 folds),
the appendix of chosen settings ``<grid>.settings.md`` / ``.tex`` and the best-so-far
figure ``<grid>.search.png`` / ``.pdf``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from harness.base.written import write_outputs
from harness.cli.outputs import output_file
from harness.config.grids import Grid
from harness.engine.grid.queue import pop_lock
from harness.engine.tuning.studies import record_storage, tuned_studies
from harness.engine.tuning.sweep import plan_tasks, study_progress, unfinished_tuned_cells
from harness.reports.figures import forest_files, forest_paths
from harness.reports.tables.compose import TableRequest, make_table
from harness.reports.tables.load import load_runs, select_report
from harness.reports.tuning import tuned_table_files, tuned_table_paths
from harness.store.tables import record_table_set

__all__ = [
    "queue_tuned_grid",
    "tuned_final_report",
    "progress_lines",
    "write_tuned_tables",
    "check_tuned_tables",
    "tuned_table_stems",
]

TABLES = Path("results/tables")


def queue_tuned_grid(grid: Grid, queue, storage: str, *, finals: bool = True) -> dict[str, Any]:
    """Queue what can run now (without ``finals``: the search's trials alone); the counts
    ``sweep --executor`` sizes its array by."""

    records = record_storage(storage)  # opened before the lock, which opening may take
    with pop_lock(storage):
        counts = plan_tasks(grid, queue, records, finals=finals)
    spec = grid.tune
    assert spec is not None
    trials = sum(s.trials for s in tuned_studies(grid))
    print(
        f"[sweep] tuned grid {grid.name}: {counts['studies']} studies, {trials} trials in all x "
        f"{spec.folds} fold(s), then {len(grid.cells)} final cells x {spec.folds} fold(s); "
        f"{counts['complete']} studies complete, {counts['trials_queued']} trials and "
        f"{counts['finals_queued']} final cells queued, {counts['pending']} already queued or "
        f"running; storage {storage}",
        file=sys.stderr,
        flush=True,
    )
    to_run = counts["trials_queued"] + counts["finals_queued"]
    # Trials of later rounds and the final cells are queued as the earlier ones settle.
    later = trials + len(grid.cells)
    return {"queued": to_run, "pending": counts["pending"], "waiting": [None] * later}


def progress_lines(grid: Grid, storage: str) -> list[str]:
    """One line per study: finished / pruned / running trials of its budget, best value."""
    lines = []
    for row in study_progress(grid, record_storage(storage)):
        best = "-" if row["best"] is None else f"{100 * row['best']:.2f}"
        lines.append(
            f"  {row['study']}: {row['finished']} finished, {row['pruned']} pruned, "
            f"{row['running']} running of {row['budget']}; best {best}"
        )
    return lines


def tuned_final_report(grid: Grid, storage: str) -> int:
    """The studies' progress and the unfinished final cells; the tables once every cell
    is final. Exit status 1 while a cell is unfinished."""
    print(f"grid {grid.name}: studies (trials of the budget, best validation value %)")
    print("\n".join(progress_lines(grid, storage)))
    missing = unfinished_tuned_cells(grid)
    print(
        f"grid {grid.name}: {len(grid.cells) - len(missing)}/{len(grid.cells)} final cells "
        f"finished (MLflow experiment '{grid.experiment}')"
    )
    for cell in missing:
        print(f"  not finished: {cell.label} (queued again on the next start)")
    if missing:
        return 1
    for path in write_tuned_tables(grid, TABLES):
        print(f"wrote {path}")
    return 0


def tuned_table_stems(grid: Grid, folder: Path) -> dict[str, Path]:
    """Each report of the grid's tables and the stem of its files under ``folder``."""
    assert grid.tune is not None
    reports = ["separated", "concatenated"] if grid.tune.folds > 1 else ["separated"]
    return {r: folder / (grid.name if r == "separated" else f"{grid.name}-{r}") for r in reports}


def check_tuned_tables(grid: Grid, folder: Path = TABLES) -> None:
    """Every file the grid's tables may be written to, checked before any work (each may
    replace only the harness's own earlier output)."""
    for stem in tuned_table_stems(grid, folder).values():
        for fmt, ext in (("markdown", ".md"), ("latex", ".tex")):
            for path in (
                stem.with_suffix(ext),
                *forest_paths(stem),
                *tuned_table_paths(stem, fmt),
            ):
                output_file(path, f"grid {grid.name}'s table set")


def write_tuned_tables(grid: Grid, folder: Path) -> list[Path]:
    """The grid's tables (each report, Markdown and LaTeX) under ``folder``, each with its
    forest plot, its appendix of chosen settings and its best-so-far figure: all of them
    one set, written together or not at all (a full disk leaves the previous set), then
    logged to the grid's table run in its experiment (:mod:`harness.store.tables`)."""

    assert grid.tune is not None
    caption = grid.description or f"Tuned grid {grid.name}"
    if grid.smoke:
        caption += " -- smoke run: a pipeline check"
    options: dict[str, Any] = {"baseline": grid.baseline}
    if grid.metrics:
        options["metrics"] = tuple(grid.metrics)
    runs = load_runs([grid.experiment])
    files: dict[Path, bytes | str] = {}
    for report, stem in tuned_table_stems(grid, folder).items():
        title = caption + (f" ({report} fold models)" if grid.tune.folds > 1 else "")
        for fmt, ext in (("markdown", ".md"), ("latex", ".tex")):
            table = make_table(
                TableRequest(
                    experiments=(grid.experiment,), fmt=fmt, caption=title, report=report, **options
                )
            )
            files.update(
                {
                    stem.with_suffix(ext): table.text,
                    **forest_files(stem, table.tests, table.labels, metrics=table.metrics),
                    **tuned_table_files(select_report(runs, report), stem, fmt),
                }
            )
    write_outputs(files)
    record_table_set([grid.experiment], grid.name, files)
    return list(files)
