"""The schema of a grid file (``protocols/grids/<name>.toml``): its keys, their types and
ranges, validated by pydantic and published as ``docs/grid.schema.json``. What relates
its keys (a baseline or a published row naming a method of the grid) is
:func:`harness.config.grids.load_grid`'s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from harness.config.executor import ExecutorTable
from harness.config.schema import SPEC_CONFIG, Bool, Int, Str

__all__ = ["GridFile", "grid_json_schema"]

_Names = Annotated[list[Str], Field(min_length=1)]
#: ``"all"``: every registered method that is not an ablation (less the grid's ``exclude``).
_Methods = _Names | Literal["all"]
_Seeds = Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)]
#: An MLflow experiment's name: MLflow takes at most 500 characters
#: (``mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH``).
_Experiment = Annotated[Str, Field(min_length=1, max_length=500)]
#: ``protocol.key = value`` overrides; their values are the protocol's to check.
_Overrides = dict[Str, Any]


class _SubGrid(BaseModel):
    """An ``[[extra]]`` table: axes that replace the grid's in a sub-grid."""

    model_config = SPEC_CONFIG
    methods: _Methods | None = None
    losses: _Names | None = None
    backbones: _Names | None = None
    datasets: _Names | None = None
    seeds: _Seeds | None = None


class _Smoke(_SubGrid):
    """``[smoke]``: the tiny version's replacements of top-level keys."""

    protocol: Str | None = None
    experiment: _Experiment | None = None
    set: _Overrides | None = None
    tune: _SmokeTune | None = None


class _SmokeTune(BaseModel):
    """``[smoke.tune]``: keys of ``[tune]`` replaced in the smoke version."""

    model_config = SPEC_CONFIG
    trials: Annotated[Int, Field(ge=1)] | None = None
    folds: Annotated[Int, Field(ge=1)] | None = None
    metric: Str | None = None
    sampler_seed: Annotated[Int, Field(ge=0)] | None = None
    round: Annotated[Int, Field(ge=1)] | None = None
    pruner: Literal["median", "none"] | None = None
    defaults: Bool | None = None
    method_spaces: Bool | None = None
    trials_per_dimension: Annotated[Int, Field(ge=1)] | None = None
    space: dict[Str, Any] | None = None


class _Tune(BaseModel):
    """``[tune]``: every study's budget and search space (:mod:`harness.config.tuning`)."""

    model_config = SPEC_CONFIG
    #: Trials per study: the same budget for every method of the grid.
    trials: Annotated[Int, Field(ge=1)] | None = None
    #: Or trials per searched dimension of each study's space (spaces that differ).
    trials_per_dimension: Annotated[Int, Field(ge=1)] | None = None
    #: Class-disjoint folds of the training classes (1: the protocol's validation split).
    folds: Annotated[Int, Field(ge=1)] = 1
    #: The objective (default: the protocol's selection metric), mean over folds.
    metric: Str | None = None
    sampler_seed: Annotated[Int, Field(ge=0)] = 0
    #: Trials suggested together, from the trials of earlier rounds.
    round: Annotated[Int, Field(ge=1)] = 2
    pruner: Literal["median", "none"] = "median"
    #: Search MLRC's default space: the loss's arguments and the loss parameters' rate.
    defaults: Bool = True
    #: Search every method's own ``search_space`` too.
    method_spaces: Bool = False
    #: ``name = [low, high]``, ``{low, high, log}`` or ``{choices = [...]}``.
    space: dict[Str, Any] = {}


class _Published(BaseModel):
    model_config = SPEC_CONFIG
    file: Str = ""
    #: The paper's table numbers (or names) the published CSV rows come from.
    tables: list[Annotated[Int, Field(ge=1)] | Str] = []
    #: ``reproduced method = ["method@setting", ...]``.
    rows: dict[Str, _Names] = {}
    #: ``published metric = "reproduced metric"``.
    metrics: dict[Str, Str] = {}


class _Variant(BaseModel):
    """``[backbone.<name>]``: the settings a paper prescribes for one backbone."""

    model_config = SPEC_CONFIG
    set: _Overrides = {}


class GridFile(BaseModel):
    """The schema of a grid file (``protocols/grids/<name>.toml``); what relates its keys
    (a baseline or published row naming a method of the grid) is :func:`load_grid`'s."""

    model_config = SPEC_CONFIG
    name: Str | None = None
    description: Str = ""
    protocol: Str
    experiment: _Experiment | None = None
    methods: _Methods
    #: Methods left out of ``methods = "all"`` (and of its ``[[extra]]`` and ``[smoke]`` uses).
    exclude: list[Str] = []
    losses: _Names
    backbones: _Names
    datasets: _Names
    seeds: _Seeds
    set: _Overrides = {}
    published: _Published = _Published()
    backbone: dict[Str, _Variant] = {}
    extra: list[_SubGrid] = []
    smoke: _Smoke | None = None
    #: ``method = "base method"``: test-time-only methods and the method they evaluate.
    test_time: dict[Str, Str] = {}
    metrics: _Names | None = None
    baseline: Str | None = None
    #: ``[executor.slurm]``: the resources of ``sweep --executor slurm`` (its options win).
    executor: ExecutorTable = ExecutorTable()
    tune: _Tune | None = None


def grid_json_schema() -> dict[str, Any]:
    """The JSON Schema of a grid file (``docs/grid.schema.json``)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **GridFile.model_json_schema(),
        "title": "dml-harness grid",
    }
