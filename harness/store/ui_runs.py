"""What ``python -m harness ui`` gives an experiment's runs before it serves them
(:func:`prepare_runs`): the display copies of their headline metrics where a run was
recorded without them, a colour of its own to each run, the saved view fitted to the
metrics the runs log, and each run's description on its logged model.

MLflow draws each run in a colour its UI derives from the run's id, so that 11 runs share
7 or 8 colours; a run's ``mlflow.runColor`` tag, which the UI's colour picker also writes,
overrides it. A run that has the tag keeps it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import mlflow
from mlflow.entities import Metric

from harness.base.metric_keys import display_copies, display_key, split_key
from harness.store.location import tracking_uri
from harness.store.runs_view import TAG_PREFIX, VIEW_KEY, outdated, view_state, view_tag

__all__ = ["COLOUR_TAG", "PALETTE", "prepare_runs", "run_colours"]

#: The run tag whose colour the MLflow UI draws a run in.
COLOUR_TAG = "mlflow.runColor"
#: Twenty colours of maximum contrast (K. L. Kelly, "Twenty-two colors of maximum
#: contrast", Color Engineering 3(26), 1965; white and black left out), in an order that
#: keeps the first eleven (a run of every method) apart in hue.
PALETTE = (
    "#0067a5",  # blue
    "#f38400",  # orange
    "#008856",  # green
    "#be0032",  # red
    "#875692",  # purple
    "#f3c300",  # yellow
    "#a1caf1",  # light blue
    "#848482",  # grey
    "#e68fac",  # purplish pink
    "#8db600",  # yellow green
    "#882d17",  # reddish brown
    "#c2b280",  # buff
    "#f99379",  # yellowish pink
    "#b3446c",  # purplish red
    "#dcd300",  # greenish yellow
    "#604e97",  # violet
    "#654522",  # yellowish brown
    "#e25822",  # reddish orange
    "#2b3d26",  # olive green
    "#f6a600",  # orange yellow
)
#: The params that say how a run selects its weights.
_SELECTION_PARAM = "protocol.selection.metric"
_NOTE_TAG = "mlflow.note.content"


def prepare_runs(experiment: str) -> dict[str, int]:
    """Prepare experiment id ``experiment``'s runs for the UI; returns how many runs got
    display copies, colours and model descriptions (``copies``, ``colours``, ``notes``)."""

    client = mlflow.MlflowClient(tracking_uri())
    runs = client.search_runs([experiment], max_results=50000)
    finished = [run for run in runs if run.info.status == "FINISHED"]
    done = {
        "copies": sum(_add_display_copies(client, run) for run in finished),
        "colours": _colour(client, runs),
        "notes": _describe_models(client, experiment, finished),
    }
    _fit_view(client, experiment, runs)
    return done


def _add_display_copies(client, run) -> bool:
    """Log the display copies (:func:`~harness.base.metric_keys.display_copies`) a finished
    run lacks, at the steps and times of the metrics they copy; whether any was missing."""

    missing = [
        key
        for key in run.data.metrics
        if (parts := split_key(key)) is not None
        and (copy := display_key(*parts)) is not None
        and copy not in run.data.metrics
    ]
    items = [
        Metric(copy, value, point.timestamp, point.step)
        for key in missing
        for point in client.get_metric_history(run.info.run_id, key)
        for copy, value in display_copies({key: point.value}).items()
    ]
    for start in range(0, len(items), 1000):
        client.log_batch(run.info.run_id, metrics=items[start : start + 1000])
    return bool(items)


def run_colours(runs: Iterable, palette: tuple[str, ...] = PALETTE) -> dict[str, str]:
    """A colour for each run of ``runs`` (MLflow ``Run`` objects) without one, by run id:
    the palette's colours no run has yet, in the order of the runs' method, loss, dataset,
    seed and start; the palette again from its start when it runs out."""
    runs = list(runs)
    taken = {run.data.tags[COLOUR_TAG] for run in runs if COLOUR_TAG in run.data.tags}
    free = [colour for colour in palette if colour not in taken] or list(palette)

    def order(run) -> tuple:
        tags = run.data.tags
        seed = tags.get("seed", "")
        return (
            tags.get("method", ""),
            tags.get("loss", ""),
            tags.get("dataset", ""),
            int(seed) if seed.isdigit() else -1,
            run.info.start_time or 0,
        )

    bare = sorted((run for run in runs if COLOUR_TAG not in run.data.tags), key=order)
    return {run.info.run_id: free[i % len(free)] for i, run in enumerate(bare)}


def _colour(client, runs: list) -> int:
    colours = run_colours(runs)
    for run_id, colour in colours.items():
        client.set_tag(run_id, COLOUR_TAG, colour)
    return len(colours)


def _describe_models(client, experiment: str, runs: list) -> int:
    """Give each logged model of ``runs`` without a description its run's."""
    notes = {
        run.info.run_id: run.data.tags[_NOTE_TAG] for run in runs if _NOTE_TAG in run.data.tags
    }
    done = 0
    for model in client.search_logged_models(experiment_ids=[experiment], max_results=50000):
        note = notes.get(model.source_run_id or "")
        if note and _NOTE_TAG not in model.tags:
            client.set_logged_model_tags(model.model_id, {_NOTE_TAG: note})
            done += 1
    return done


def _fit_view(client, experiment: str, runs: list) -> None:
    """Write the harness's view of the metrics the runs log and the validation metric most
    of them select on, unless the experiment holds a view a user saved over it."""
    keys = {key for run in runs for key in run.data.metrics}
    selections = Counter(run.data.params.get(_SELECTION_PARAM) for run in runs)
    selections.pop(None, None)
    wanted = view_state(keys, *(selections.most_common(1)[0][:1] if selections else ()))
    value = client.get_experiment(experiment).tags.get(TAG_PREFIX + VIEW_KEY)
    if outdated(value, wanted):
        client.set_experiment_tag(experiment, *view_tag(wanted))
