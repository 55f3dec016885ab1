"""Experiment grids as data: ``protocols/grids/<name>.toml`` parsed, validated and
expanded into cells (one run each).

A grid names a protocol and the axes ``methods x losses x backbones x datasets x
seeds``; ``methods = "all"`` is every registered method that is not an ablation (the
``--methods all`` list, installed plugins included) less the names in ``exclude``;
``[[extra]]`` tables add sub-grids that override some axes (e.g. the SOP
row of a paper's table), ``[backbone.<name>] set = {...}`` holds the settings a paper
prescribes for one backbone (the grid's protocol *variant*: fingerprinted, not a
deviation), top-level ``set`` and ``[smoke] set`` are protocol overrides recorded as
deviations. ``[smoke]`` replaces any top-level key for the tiny version (``--smoke``).
``[test_time] method = "base"`` makes ``method`` a test-time-only method (DIML): its
cell trains nothing and evaluates the selected weights of the ``base`` cell with the
same backbone, loss, dataset and seed, under the same protocol (so both land in one
comparison). ``metrics`` names the table's metric columns. ``[published] rows`` maps a
reproduced method to the published rows it sits beside, as ``"method@setting"`` (the
CSV's ``method`` and ``setting`` columns; DIABLO Table 1 prints binomial + DIABLO with
N = 8 and N = 16): ``diablo_n16 = ["diablo@entries=16"]``; with it, published rows
no entry names are left out of the tables. ``[published] metrics`` maps a published
metric to the reproduced variant that the paper's definition matches (DIML:
``r_precision = "r_precision_query_in_r"``). ``baseline`` names the method every other
row of a block is tested against in the tables (default ``plain``). A ``datasets`` entry
is a built-in dataset's name or your own dataset's path, relative to the grid file (a
folder of class folders or a CSV: :mod:`harness.components.data.own`). Unknown keys are
errors naming the key. ``[executor.slurm]`` holds the resources each task of ``sweep
--executor slurm`` asks for (:mod:`harness.config.executor`); it enters no cell key.

Each :class:`Cell` has a ``key`` that finds a finished cell in the tracking store
(:mod:`harness.config.grid_cells`, where a loaded grid is expanded into its cells).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harness.base.errors import HarnessError, unknown_name
from harness.base.paths import read_text
from harness.components.data.own import dataset_manifest, dataset_name
from harness.config.catalog import MAX_CELLS, grid_dir, list_grids
from harness.config.executor import check_time
from harness.config.grid_cells import Cell, Grid, expand
from harness.config.grid_file import GridFile, grid_json_schema
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.config.schema import refusal, shown
from harness.config.tuning import TuneSpec, parse_tune
from harness.methods import METHODS, list_methods

__all__ = [
    "Grid",
    "Cell",
    "GridFile",
    "grid_json_schema",
    "load_grid",
    "grid_from_table",
    "expand",
    "cell_count",
]

AXES = ("methods", "losses", "backbones", "datasets", "seeds")


#: A grid's name: it names the sweep's folder (``sweeps/<name>``), its queue's study and
#: its experiment, so it is one plain file name.
GRID_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: The longest grid name: room for the longest file named after it
#: (``results/tables/<grid>-concatenated.settings.tex``) within a file name's 255 bytes.
GRID_NAME_MAX = 200


def cell_count(axes: dict[str, list], extras: list[dict[str, list]]) -> int:
    """The cells the axes and ``[[extra]]`` tables span, before duplicates are merged."""

    def span(sub: dict[str, list]) -> int:
        return math.prod(len(sub[a]) for a in AXES)

    return span(axes) + sum(span({**axes, **extra}) for extra in extras)


def load_grid(
    name_or_path: str | Path,
    *,
    smoke: bool = False,
    max_cells: int | None = MAX_CELLS,
    on_count: Callable[[int], object] | None = None,
) -> Grid:
    """Parse and validate a grid (a name under ``protocols/grids`` or a ``.toml`` path),
    then expand it into cells (``grid.cells``). ``on_count(n)`` hears the number of cells
    before they are expanded; more than ``max_cells`` (None: no cap) is refused."""
    path = _grid_path(name_or_path)
    data, spec = _read_grid_file(path)
    data = _with_dataset_names(_with_method_names(data, path), path)
    return _built(data, spec, path, smoke=smoke, max_cells=max_cells, on_count=on_count)


def grid_from_table(data: dict[str, Any], path: Path, *, max_cells: int | None = MAX_CELLS) -> Grid:
    """A grid from the table a grid file holds, given in memory (``python -m harness tune``
    builds its one-cell tuned grid so): validated and expanded as :func:`load_grid` does a
    file's. ``path`` stands for the file: relative protocol paths are taken from its folder
    and its stem is the default name; nothing reads it. Its ``datasets`` are registered
    names (:func:`~harness.components.data.own.dataset_name`'s), not paths."""
    try:
        spec = GridFile.model_validate(data)
    except ValidationError as err:
        raise refusal(err, GridFile.model_json_schema(), what="grid key") from None
    data = _with_method_names(data, path)
    return _built(data, spec, path, smoke=False, max_cells=max_cells, on_count=None)


def _built(
    data: dict[str, Any],
    spec: GridFile,
    path: Path,
    *,
    smoke: bool,
    max_cells: int | None,
    on_count: Callable[[int], object] | None,
) -> Grid:
    """The grid of a validated table (its methods and datasets already named), expanded."""
    slurm = _checked_slurm(spec.executor.slurm.model_dump(exclude_none=True), "grid")
    top, axes, extras = _smoke_applied(data, smoke, path)
    published = data.get("published", {})
    all_methods = {m for sub in (data, *data.get("extra", [])) for m in sub.get("methods", [])}
    published_rows = _published_rows(published.get("rows", {}), all_methods)
    test_time = data.get("test_time", {})
    baseline = _baseline(data, all_methods)
    protocol = _resolved_protocol(str(top["protocol"]), path)
    tune = _tune_spec(
        data, smoke, protocol, dict(top.get("set", {})), all_methods, axes, extras, test_time
    )
    name = _grid_name(data, path) + ("-smoke" if smoke else "")
    grid = Grid(
        name=name,
        path=path,
        description=str(data.get("description", "")),
        protocol=protocol,
        experiment=str(top.get("experiment") or name),
        axes=axes,
        extras=tuple(extras),
        overrides=dict(top.get("set", {})),
        variants={b: dict(v.get("set", {})) for b, v in data.get("backbone", {}).items()},
        published_file=str(published.get("file", "")),
        published_tables=tuple(str(t) for t in published.get("tables", ())),
        published_rows=published_rows,
        smoke=smoke,
        test_time=dict(test_time),
        metrics=tuple(data.get("metrics", [])),
        baseline=baseline,
        published_metrics=dict(published.get("metrics", {})),
        paper_protocol=_resolved_protocol(str(data["protocol"]), path),
        paper_axes={a: _with_extras(data, a) for a in ("datasets", "backbones")},
        slurm={**_protocol_slurm(protocol), **slurm},  # the grid's own win
        tune=tune,
    )
    _check_count(path, cell_count(axes, extras), max_cells, on_count)
    grid.cells.extend(expand(grid))
    return grid


def _grid_path(name_or_path: str | Path) -> Path:
    """A grid's file: a ``.toml`` path, or a name under :func:`grid_dir`."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = grid_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise unknown_name("grid", str(name_or_path), list_grids())
    if not path.is_file():
        raise HarnessError(f"grid file not found: {path}")
    return path


def _read_grid_file(path: Path) -> tuple[dict[str, Any], GridFile]:
    """The grid file's TOML, and the same validated against :class:`GridFile`."""
    try:
        data = tomllib.loads(read_text(path, "TOML"))
    except tomllib.TOMLDecodeError as err:
        raise HarnessError(f"malformed grid file {path}: {err}") from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise HarnessError(f"malformed grid file {path}: nested too deeply") from None
    try:
        return data, GridFile.model_validate(data)
    except ValidationError as err:
        raise refusal(err, GridFile.model_json_schema(), what="grid key") from None


def _checked_slurm(slurm: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``[executor.slurm]`` table's set keys, its time limit checked."""
    if "time" in slurm:
        check_time(slurm["time"], f"{where} key 'executor.slurm.time' = {shown(slurm['time'])}")
    return slurm


def _protocol_slurm(protocol: str) -> dict[str, Any]:
    """The ``[executor.slurm]`` table of the grid's protocol (its set keys)."""
    return _checked_slurm(
        load_protocol(protocol).executor.slurm.model_dump(exclude_none=True), "protocol"
    )


def _smoke_applied(
    data: dict[str, Any], smoke: bool, path: Path
) -> tuple[dict[str, Any], dict[str, list], list[dict[str, list]]]:
    """The top-level keys, the axes and the ``[[extra]]`` sub-grids of the grid, or of its
    smoke version: ``[smoke]``'s keys replace the top-level ones and its axes the
    sub-grids' too; its ``set`` comes on top of the grid's own."""
    smoke_data = data.get("smoke", {})
    if smoke and not smoke_data:
        raise HarnessError(f"grid {path.stem} has no [smoke] table; --smoke needs one")
    top = {**data, **smoke_data} if smoke else data
    if smoke and "set" in smoke_data:
        top["set"] = {**data.get("set", {}), **smoke_data["set"]}
    axes = {a: list(top[a]) for a in AXES}
    extras = []
    for extra in data.get("extra", []):
        sub = {a: list(v) for a, v in extra.items()}
        if smoke:
            sub.update({a: axes[a] for a in AXES if a in smoke_data})
        extras.append(sub)
    return top, axes, extras


def _baseline(data: dict[str, Any], methods: set[str]) -> str:
    """``baseline``: a method of the grid (default ``plain``)."""
    baseline = data.get("baseline", "plain")
    if "baseline" in data and baseline not in methods:
        raise HarnessError(
            f"grid key 'baseline' = \"{baseline}\": expected a method of the grid (methods: "
            f"{', '.join(sorted(methods))})"
        )
    return baseline


def _resolved_protocol(protocol: str, path: Path) -> str:
    """A protocol's name, or its file's path resolved against the grid's folder."""
    if protocol.endswith(".toml") and not Path(protocol).is_absolute():
        return str((path.parent / protocol).resolve())
    return protocol


def _grid_name(data: dict[str, Any], path: Path) -> str:
    """The grid's ``name`` (default: its file's stem): a name for a sweep's folder, study
    and experiment."""
    name = str(data.get("name", path.stem))
    if not GRID_NAME.fullmatch(name):
        raise HarnessError(
            f"grid key 'name' = {shown(name)}: expected a name of letters, digits, '.', '_' "
            f"and '-' that starts with a letter or digit (it names the sweep's folder under "
            f"sweeps/, its study and its experiment)"
            if "name" in data
            else f"grid file {path}: its name {name!r} cannot name a sweep; expected a file "
            f"name of letters, digits, '.', '_' and '-' (or a 'name' key)"
        )
    if len(name) > GRID_NAME_MAX:
        raise HarnessError(
            f"grid {'key ' + repr('name') if 'name' in data else 'file ' + str(path)}: the name "
            f"'{name[:24]}...' is {len(name)} characters long; expected at most {GRID_NAME_MAX} "
            f"(it names the grid's tables and the sweep's folder)"
        )
    return name


def _check_count(
    path: Path, count: int, max_cells: int | None, on_count: Callable[[int], object] | None
) -> None:
    """``on_count`` hears the number of cells; more than ``max_cells`` is refused."""
    if on_count is not None:
        on_count(count)
    if max_cells is not None and count > max_cells:
        raise HarnessError(
            f"grid {path.stem} has {count:,} cells, more than {max_cells:,} (each a training run); "
            f"check its axes, or give --yes to sweep them all"
        )


def _tune_spec(
    data: dict[str, Any],
    smoke: bool,
    protocol: str,
    overrides: dict[str, Any],
    methods: set[str],
    axes: dict[str, list],
    extras: list[dict[str, list]],
    test_time: dict[str, str],
) -> TuneSpec | None:
    """The grid's ``[tune]`` table (``[smoke.tune]``'s keys on top for the smoke version),
    validated against the protocol, the grid's methods and losses."""
    if "tune" not in data:
        if smoke and data.get("smoke", {}).get("tune"):
            raise HarnessError("grid key 'smoke.tune' needs a [tune] table in the grid")
        return None
    table = dict(data["tune"])
    if smoke:
        table.update(data.get("smoke", {}).get("tune", {}))
    losses = sorted({loss for sub in (axes, *extras) for loss in sub.get("losses", axes["losses"])})
    resolved, _ = apply_overrides(load_protocol(protocol), overrides)
    spec = parse_tune(table, resolved, sorted(methods), losses)
    for name in spec.space:
        head, _, rest = name.partition(".")
        if head == "method" and rest.split(".")[0] in test_time:
            raise HarnessError(
                f"grid key 'tune.space.\"{name}\"': '{rest.split('.')[0]}' is a test-time method "
                f"(test_time), evaluated on its base's tuned weights with the protocol's options; "
                f"its options cannot be searched apart from its base"
            )
    return spec


def _with_method_names(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` with each ``methods = "all"`` (top level, ``[[extra]]``, ``[smoke]``) replaced
    by the names it stands for; ``exclude`` must name registered methods."""

    tables = [data, *data.get("extra", []), data.get("smoke", {})]
    exclude = data.get("exclude", [])
    if exclude and not any(table.get("methods") == "all" for table in tables):
        raise HarnessError(
            f"grid {path.stem}: 'exclude' applies to methods = \"all\", which the grid does not use"
        )
    for name in exclude:
        if name not in METHODS:
            raise HarnessError(
                f"grid {path.stem}: exclude names '{name}', which is not a registered method"
            )
    every = [name for name in list_methods(ablations=False) if name not in exclude]
    if not every:
        raise HarnessError(f'grid {path.stem}: methods = "all" less exclude leaves no method')

    def named(table: dict[str, Any]) -> dict[str, Any]:
        return {**table, "methods": every} if table.get("methods") == "all" else table

    out = named(data)
    if "extra" in data:
        out["extra"] = [named(extra) for extra in data["extra"]]
    if "smoke" in data:
        out["smoke"] = named(data["smoke"])
    return out


def _with_dataset_names(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` with each ``datasets`` entry (top level, ``[[extra]]``, ``[smoke]``) that is
    a path, relative to the grid's folder, replaced by the name it is registered under
    (:func:`~harness.components.data.own.dataset_name`); two paths that would share a name
    are an error."""

    names: dict[str, str] = {}  # entry -> name
    sources: dict[str, str] = {}  # name -> the folder or file it stands for

    def name_of(entry: str) -> str:
        if entry not in names:
            try:
                names[entry] = dataset_name(entry, base=path.parent)
            except HarnessError as err:
                raise HarnessError(f"grid {path.stem}, datasets: {err}") from None
            files = dataset_manifest(names[entry])
            if files is not None and sources.setdefault(names[entry], files.source) != files.source:
                raise HarnessError(
                    f"grid {path.stem}: datasets {sources[names[entry]]} and {files.source} would "
                    f"both be named '{names[entry]}'; rename one of them"
                )
        return names[entry]

    def named(table: dict[str, Any]) -> dict[str, Any]:
        if "datasets" not in table:
            return table
        return {**table, "datasets": [name_of(entry) for entry in table["datasets"]]}

    out = named(data)
    if "extra" in data:
        out["extra"] = [named(extra) for extra in data["extra"]]
    if "smoke" in data:
        out["smoke"] = named(data["smoke"])
    return out


def _with_extras(data: dict[str, Any], axis: str) -> list[str]:
    """The grid file's values of ``axis``, its ``[[extra]]`` sub-grids' included (Table 4's
    SOP row of agrouping-table3 is a paper dataset too)."""
    return list(
        dict.fromkeys(
            [*data[axis], *(v for extra in data.get("extra", []) for v in extra.get(axis, []))]
        )
    )


def _published_rows(rows: dict[str, list[str]], methods: set[str]) -> dict[str, tuple[str, ...]]:
    """``[published] rows``: each key a method of the grid (a misspelt one would silently
    drop its published values)."""
    for method in rows:
        if method not in methods:
            raise HarnessError(
                f"grid key 'published.rows.{method}': '{method}' is not a method of the grid "
                f"(methods: {', '.join(sorted(methods))})"
            )
    return {method: tuple(specs) for method, specs in rows.items()}
