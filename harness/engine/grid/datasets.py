"""A grid's own datasets (given by their path) against the files its earlier cells ran on:
the fingerprint of the file list is in every cell key, so a grid resumed on changed files
would otherwise train every cell again beside the old ones."""

from __future__ import annotations

from harness.base.errors import HarnessError
from harness.components.data.manifest import MANIFEST_ARTIFACT, FileManifest
from harness.components.data.own import dataset_manifest
from harness.config.grids import Grid
from harness.store.queries import read_artifact, search_runs
from harness.store.tracking import filter_value as q

__all__ = ["check_datasets_unchanged"]


def check_datasets_unchanged(grid: Grid) -> None:
    """Refuse a grid whose dataset given by its path has other files than when some of its
    cells ran, with one line saying what changed (files added, removed, relabelled). Its
    fingerprint is in the cell keys, so the sweep would otherwise run every cell again
    beside the old ones, and the grid's tables would mix the two file lists."""

    for name in sorted({cell.dataset for cell in grid.cells}):
        files = dataset_manifest(name)
        if files is None:
            continue
        earlier = search_runs(
            grid.experiment,
            f"tags.grid = {q(grid.name)} and tags.dataset = {q(name)} "
            f"and tags.dataset_fingerprint != {q(files.fingerprint)}",
            max_results=1,
        )
        if not earlier:
            continue
        run = earlier[0]
        old = read_artifact(
            run.info.run_id,
            MANIFEST_ARTIFACT,
            lambda path: FileManifest.from_json(path.read_text(encoding="utf-8")),
        )
        what = (
            files.changes_since(old)
            if old is not None
            else f"fingerprint {run.data.tags['dataset_fingerprint']}, now {files.fingerprint}"
        )
        raise HarnessError(
            f"grid {grid.name}: the files of dataset '{name}' changed since run "
            f"{run.info.run_id} of the grid ({what}); sweeping would mix two file lists in "
            f"experiment '{grid.experiment}': restore the files, or give the grid another experiment"
        )
