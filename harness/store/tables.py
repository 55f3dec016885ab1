"""A table set inside the tracking store, where a researcher browsing an experiment finds it.

The files ``harness table`` and a tuned ``sweep`` write (the table in Markdown or LaTeX,
its forest plot, a tuned grid's appendix of chosen settings) are logged to one run of each
experiment the table draws from: the *table run*, named after the table (a grid's tables
are named after the grid) and tagged :data:`~harness.store.tracking.TABLE_SET_TAG`. The
experiment's description links it. The table run trains nothing: every search for an
experiment's results leaves it out (:func:`~harness.store.tracking.training_runs_only`).

Each reproduced run whose cell has a published value gets ``delta/<metric>`` metrics:
its test value minus the published one, in percentage points (the papers' unit)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from harness.base.errors import HarnessError
from harness.store.queries import client, log_to_run
from harness.store.tracking import TABLE_SET_TAG, filter_value
from harness.store.ui import RUN_NOTE_TAG

__all__ = ["TABLES_FOLDER", "DELTA_PREFIX", "record_table_set", "table_run", "linked_description"]

#: The artifact folder of a table run that holds the table set.
TABLES_FOLDER = "tables"
#: The prefix of a run's distance to its published value (``delta/recall_at_1``).
DELTA_PREFIX = "delta/"
# The experiment description's block of table links, between these two lines (the rest of
# the description is the user's, and stays as it is).
_LINKS_START = "<!-- harness: tables -->"
_LINKS_END = "<!-- harness: end of tables -->"
_LINKS = re.compile(re.escape(_LINKS_START) + r".*?" + re.escape(_LINKS_END), re.DOTALL)
_LINK = re.compile(r"\[([^\]]+)\]\(#/experiments/[^/]+/runs/(\w+)/")


def record_table_set(
    experiments: Iterable[str],
    name: str,
    files: Iterable[Path],
    deltas: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, str]:
    """Log ``files`` (written already) to the table run ``name`` of each of ``experiments``,
    link it from the experiment's description, and log each run's ``deltas``
    (``{run id: {metric: points}}``) as ``delta/<metric>``. Returns ``{experiment: table
    run id}``."""
    paths = [Path(f) for f in files]
    runs = {}
    for experiment in experiments:
        run_id = table_run(experiment, name)
        log_to_run(
            run_id,
            metrics={},
            tags={},
            texts={},
            artifacts=[(path, TABLES_FOLDER) for path in paths],
        )
        _link_from_description(experiment, name, run_id)
        runs[experiment] = run_id
    for run_id, values in (deltas or {}).items():
        log_to_run(
            run_id,
            metrics={DELTA_PREFIX + metric: value for metric, value in values.items()},
            tags={},
            texts={},
            artifacts=(),
        )
    return runs


def table_run(experiment: str, name: str) -> str:
    """The id of the table run ``name`` of ``experiment``: the one logged before, else a
    FINISHED run made for it."""
    c = client()
    found = c.get_experiment_by_name(experiment)
    if found is None:
        raise HarnessError(f"no experiment '{experiment}' in the tracking store")
    earlier = c.search_runs(
        [found.experiment_id],
        filter_string=f"tags.{TABLE_SET_TAG} = {filter_value(name)}",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if earlier:
        return earlier[0].info.run_id
    run = c.create_run(
        found.experiment_id,
        run_name=name,
        tags={
            TABLE_SET_TAG: name,
            RUN_NOTE_TAG: f"The table set **{name}**: open *Artifacts* > `{TABLES_FOLDER}/`.",
        },
    )
    c.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def linked_description(description: str, experiment_id: str, links: Mapping[str, str]) -> str:
    """``description`` with its line of table links written anew, first: the links already
    there and ``links`` (``{table name: run id}``); the rest is kept as it was."""
    block = _LINKS.search(description)
    known = dict(_LINK.findall(block.group(0))) if block else {}
    rest = _LINKS.sub("", description).strip()
    shown = [
        f"[{name}](#/experiments/{experiment_id}/runs/{run_id}/artifacts/{TABLES_FOLDER})"
        for name, run_id in sorted({**known, **links}.items())
    ]
    # One line, first: the UI shows a description's first line and folds the rest.
    text = f"{_LINKS_START}\n**Tables**: {' · '.join(shown)}\n{_LINKS_END}"
    return f"{text}\n\n{rest}" if rest else text


def _link_from_description(experiment: str, name: str, run_id: str) -> None:
    """Add ``name``'s table run to the experiment's block of table links."""
    c = client()
    found = c.get_experiment_by_name(experiment)
    description = found.tags.get(RUN_NOTE_TAG, "")
    text = linked_description(description, found.experiment_id, {name: run_id})
    c.set_experiment_tag(found.experiment_id, RUN_NOTE_TAG, text)
