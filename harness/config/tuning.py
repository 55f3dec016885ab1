"""A grid's ``[tune]`` table: every method of the grid given the same budget of
hyperparameter-search trials before it is compared.

The protocol follows Musgrave et al., "A Metric Learning Reality Check" (MLRC, ECCV 2020),
Sec. 4.2 and its code (powerful-benchmarker): for each (method, loss, dataset, backbone)
one study of ``trials`` Bayesian-optimisation trials (Optuna's TPE, seeded); a trial
trains one model per class-disjoint fold of the training classes and scores the mean of
their validation values (``metric``, MAP@R by default; MLRC: "mean validation accuracy
over folds"); the best setting is then trained again with each of the grid's seeds, one
model per fold, and scored on the test classes.

Keys::

    [tune]
    trials = 50          # the budget, the same for every study of the grid
    folds = 4            # class-disjoint folds of the training classes (1: the protocol's validation split)
    metric = "mean_average_precision_at_r"
    sampler_seed = 0
    round = 2            # trials suggested together, from the trials of earlier rounds
    pruner = "median"    # or "none": stop a trial between folds
    defaults = true      # the method's, the loss's and the learning rates' spaces

    [tune.space]         # added to (or replacing) the defaults, by name
    "optimizer.lr_head" = { low = 1e-6, high = 1e-3, log = true }   # a protocol field
    "loss.margin.margin" = [0.0, 0.5]                                # a loss argument
    "method.agrouping.groups" = { choices = [2, 4, 8] }               # a method option

Determinism: a trial's setting depends only on the trials of earlier rounds, in trial
order, and on (``sampler_seed``, trial number); the pruner compares only with them. So a
study ends with the same trials however many workers share it, and after any restart.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from harness.base.errors import HarnessError, unknown_name
from harness.components.evaluation import RETRIEVAL_METRICS
from harness.components.losses import (
    LOSS_PARAMETER_RATE,
    LOSSES,
    loss_search_space,
    miner_for,
    miner_search_space,
)
from harness.config.overrides import flatten_keys
from harness.methods import METHODS, Tunable

if TYPE_CHECKING:
    from optuna.trial import Trial

__all__ = [
    "TuneSpec",
    "SpaceEntry",
    "parse_tune",
    "TUNABLE_FIELDS",
    "decade_space",
    "TPE_STARTUP_TRIALS",
    "study_space",
    "suggest_setting",
]

#: The positive float fields ``tune --space`` is most often given (named in its refusals).
TUNABLE_FIELDS = (
    "optimizer.lr_backbone",
    "optimizer.lr_head",
    "optimizer.lr_loss",
    "optimizer.weight_decay",
)
#: The loss parameters' learning rate (a margin loss's per-class beta, a proxy loss's
#: proxies), searched by default where the loss has parameters: MLRC searched it and kept
#: the trunk's and the embedder's rates fixed (Musgrave et al. 2020, Sec. 4.2 and
#: supplementary; powerful-benchmarker's ``metric-learning`` configuration, cited in
#: :data:`harness.components.losses.LOSS_PARAMETER_RATE`'s source). The trunk and head rates stay at the
#: protocol's unless the grid's ``[tune.space]`` names them, for every method alike.
LOSS_PARAMETER_RATE_NAME = "optimizer.lr_loss"
#: The search name of an argument of the miner a loss brings:
#: ``loss.miners.<loss>.args.<argument>`` (it becomes the protocol's ``[loss.miners.<loss>]``).
MINER_ARGUMENT_PREFIX = "loss.miners."
#: Settled trials TPE needs before it models the space (Optuna's ``n_startup_trials``,
#: counting finished and pruned trials); before that it samples at random.
TPE_STARTUP_TRIALS = 10
PRUNERS = ("median", "none")
_KEYS = {
    "trials",
    "folds",
    "metric",
    "sampler_seed",
    "round",
    "pruner",
    "defaults",
    "method_spaces",
    "trials_per_dimension",
    "space",
}


@dataclass(frozen=True)
class SpaceEntry:
    """One searched name: a float range (``log``: log-uniform) or a list of ``choices``."""

    low: float = 0.0
    high: float = 0.0
    log: bool = False
    choices: tuple[Any, ...] = ()
    source: str = ""
    #: Integers in ``[low, high]`` (an integer target: a group count, a batch layout).
    integer: bool = False

    def suggest(self, trial, name: str) -> Any:
        if self.choices:
            return trial.suggest_categorical(name, list(self.choices))
        if self.integer:
            return int(trial.suggest_int(name, int(self.low), int(self.high), log=self.log))
        return float(trial.suggest_float(name, self.low, self.high, log=self.log))

    def describe(self) -> str:
        if self.choices:
            return "{" + ", ".join(str(c) for c in self.choices) + "}"
        return f"[{self.low:g}, {self.high:g}]" + (" log" if self.log else "")


@dataclass(frozen=True)
class TuneSpec:
    """A validated ``[tune]`` table."""

    trials: int
    folds: int = 1
    metric: str = "mean_average_precision_at_r"
    sampler_seed: int = 0
    round: int = 2
    pruner: str = "median"
    defaults: bool = True
    #: Whether every method's own ``search_space`` is searched too (off: a method's options
    #: stay at its paper's values unless ``[tune.space]`` names them).
    method_spaces: bool = False
    #: The budget rule where the spaces differ: each study's trials are this many per
    #: searched dimension (0: every study gets ``trials``).
    trials_per_dimension: int = 0
    #: ``{name: SpaceEntry}``: ``optimizer.*`` (protocol fields), ``loss.<loss>.<arg>``,
    #: ``method.<method>.<option>``.
    space: dict[str, SpaceEntry] = field(default_factory=dict)

    def canonical(self) -> dict[str, Any]:
        """What enters the cells' keys and the studies' names."""
        return {
            "trials": self.trials,
            "folds": self.folds,
            "metric": self.metric,
            "sampler_seed": self.sampler_seed,
            "round": self.round,
            "pruner": self.pruner,
            "defaults": self.defaults,
            "method_spaces": self.method_spaces,
            "trials_per_dimension": self.trials_per_dimension,
            "space": {k: vars(v) for k, v in sorted(self.space.items())},
        }

    def digest(self) -> str:
        payload = json.dumps(self.canonical(), sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:8]

    def trials_for(self, dimensions: int) -> int:
        """A study's number of trials: ``trials``, or ``trials_per_dimension`` times the
        dimensions of its space."""
        return self.trials_per_dimension * dimensions if self.trials_per_dimension else self.trials

    @property
    def budget(self) -> str:
        """The budget as a table's note says it."""
        folds = f"{self.folds} class-disjoint folds" if self.folds > 1 else "the validation split"
        trials = (
            f"{self.trials_per_dimension} trials per searched dimension"
            if self.trials_per_dimension
            else f"{self.trials} trials"
        )
        return (
            f"{trials} (Optuna's TPE, random until {TPE_STARTUP_TRIALS} are settled) x "
            f"{folds} (sampler seed {self.sampler_seed}, {self.round} per round, pruner "
            f"{self.pruner}), objective {self.metric}"
        )


def _entry(name: str, value: Any) -> SpaceEntry:
    where = f"grid key 'tune.space.\"{name}\"'"
    if isinstance(value, list):
        if len(value) != 2 or not all(_is_number(v) for v in value):
            raise HarnessError(f"{where} = {value!r}: expected [low, high] (two numbers)")
        value = {"low": value[0], "high": value[1]}
    if not isinstance(value, dict):
        raise HarnessError(
            f"{where} = {value!r}: expected [low, high], {{low, high, log}} or {{choices = [...]}}"
        )
    unknown = set(value) - {"low", "high", "log", "choices"}
    if unknown:
        raise HarnessError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    if "choices" in value:
        if set(value) != {"choices"}:
            raise HarnessError(
                f"{where}: choices take no {', '.join(sorted(set(value) - {'choices'}))} "
                f"(a range is {{low, high, log}})"
            )
        return _choices_entry(where, value["choices"])
    log = value.get("log", False)
    if not isinstance(log, bool):
        raise HarnessError(f"{where}: log = {log!r}: expected true or false")
    return _range_entry(where, value.get("low"), value.get("high"), log)


def _is_number(value: Any) -> bool:
    """An integer or a float, not a boolean (which Python counts as an integer)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _choices_entry(where: str, choices: Any) -> SpaceEntry:
    """``{choices = [...]}``: a non-empty list of numbers, booleans or strings, each number
    finite."""
    if not isinstance(choices, list) or not choices:
        raise HarnessError(f"{where}: choices must be a non-empty list")
    if not all(isinstance(c, bool | int | float | str) for c in choices):
        raise HarnessError(f"{where}: choices must be numbers, booleans or strings")
    if any(isinstance(c, float) and not math.isfinite(c) for c in choices):
        raise HarnessError(f"{where}: choices {choices!r}: expected finite numbers")
    return SpaceEntry(choices=tuple(choices))


def _range_entry(where: str, low: Any, high: Any, log: bool) -> SpaceEntry:
    """``[low, high]`` or ``{low, high, log}``: a non-empty range of finite numbers (its
    width finite too), positive when ``log``."""
    for key, bound in (("low", low), ("high", high)):
        if bound is None:  # TOML has no null: the key is missing
            raise HarnessError(f"{where}: {key} is missing: expected numbers low and high")
        if not _is_number(bound):
            raise HarnessError(f"{where}: {key} = {bound!r}: expected a number")
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(high - low)):
        raise HarnessError(
            f"{where}: the range [{low}, {high}]: expected finite bounds a finite distance apart"
        )
    if not low < high:
        raise HarnessError(
            f"{where}: an empty or inverted range [{low}, {high}] (expected low < high)"
        )
    if log and low <= 0:
        raise HarnessError(f"{where}: a log range needs low > 0 (got {low})")
    return SpaceEntry(float(low), float(high), log)


def parse_tune(table: dict[str, Any], protocol, methods: list[str], losses: list[str]) -> TuneSpec:
    """Validate a grid's ``[tune]`` table against its protocol (``protocol``: resolved),
    methods and losses: one line naming the key for any mistake."""
    if not isinstance(table, dict):
        raise HarnessError("grid key 'tune': expected a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise HarnessError(
            f"grid key 'tune.{sorted(unknown)[0]}': unknown (expected one of {', '.join(sorted(_KEYS))})"
        )
    ints = {}
    per_dimension = "trials_per_dimension" in table
    defaults = {"trials": 1 if per_dimension else None, "folds": 1, "round": 2, "sampler_seed": 0}
    defaults["trials_per_dimension"] = 0
    for key, low in (
        ("trials", 1),
        ("folds", 1),
        ("round", 1),
        ("sampler_seed", 0),
        ("trials_per_dimension", 1 if per_dimension else 0),
    ):
        value = table.get(key, defaults[key])
        if value is None:
            raise HarnessError(
                "grid key 'tune.trials' is missing: the budget of every study (or "
                "'tune.trials_per_dimension', trials per searched dimension)"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HarnessError(f"grid key 'tune.{key}' = {value!r}: expected an integer >= {low}")
        ints[key] = value
    pruner = table.get("pruner", "median")
    if pruner not in PRUNERS:
        raise HarnessError(f"grid key 'tune.pruner' = {pruner!r}: expected one of {PRUNERS}")
    metric = table.get("metric", protocol.selection.metric)
    logged = _validation_metrics(protocol)
    if metric not in logged:
        raise HarnessError(
            f"grid key 'tune.metric' = {metric!r}: expected a metric the validation logs "
            f"({', '.join(logged)})"
        )
    if protocol.selection.mode != "validation":
        raise HarnessError(
            f"a tuned grid needs selection.mode = 'validation' (protocol '{protocol.name}' has "
            f"'{protocol.selection.mode}'): hyperparameters are never chosen on the test set"
        )
    space = {name: _entry(name, value) for name, value in dict(table.get("space", {})).items()}
    for name, entry in space.items():
        space[name] = _typed(name, entry, _check_space_name(name, protocol, methods, losses))
    return TuneSpec(
        trials=ints["trials"],
        folds=ints["folds"],
        metric=metric,
        sampler_seed=ints["sampler_seed"],
        round=ints["round"],
        pruner=pruner,
        defaults=bool(table.get("defaults", True)),
        method_spaces=bool(table.get("method_spaces", False)),
        trials_per_dimension=ints["trials_per_dimension"],
        space=space,
    )


def _validation_metrics(protocol) -> list[str]:
    """The metrics each epoch's validation logs: the protocol's retrieval metrics and its
    selection metric."""

    wanted = [m for m in protocol.evaluation.metrics if m in RETRIEVAL_METRICS]
    return list(dict.fromkeys([*wanted, protocol.selection.metric]))


def _check_space_name(name: str, protocol, methods: list[str], losses: list[str]) -> Any:
    """A space name is a numeric protocol field, ``loss.<loss>.<arg>`` of a grid's loss,
    or ``method.<method>.<option>`` of a grid's method; returns its current value (None
    where it has none), whose type the searched values keep."""

    where = f"grid key 'tune.space.\"{name}\"'"
    head, _, rest = name.partition(".")
    if head == "loss" and rest.count(".") == 1:
        loss, arg = rest.split(".")
        if loss not in losses:
            raise HarnessError(f"{where}: '{loss}' is not a loss of the grid ({', '.join(losses)})")

        accepted = set(inspect.signature(LOSSES.get(loss).cls).parameters)
        if arg not in accepted | set(LOSSES.get(loss).defaults):
            raise HarnessError(f"{where}: the {loss} loss has no argument '{arg}'")
        return protocol.loss_args(loss).get(arg, LOSSES.get(loss).defaults.get(arg))
    if head == "method" and rest.count(".") == 1:
        method, option = rest.split(".")
        if method not in methods:
            raise HarnessError(
                f"{where}: '{method}' is not a method of the grid ({', '.join(methods)})"
            )
        if option not in METHODS.get(method).options():
            raise HarnessError(
                f"{where}: method '{method}' has no option '{option}' "
                f"(options: {', '.join(sorted(METHODS.get(method).options())) or 'none'})"
            )
        return {**METHODS.get(method).options(), **protocol.methods.get(method, {})}.get(option)
    fields = flatten_keys(protocol.to_dict())
    if name not in fields:
        raise HarnessError(
            f"{where}: not a protocol field, 'loss.<loss>.<argument>' or 'method.<method>.<option>'"
        )
    if isinstance(fields[name], bool) or not isinstance(fields[name], int | float):
        raise HarnessError(
            f"{where}: protocol field = {fields[name]!r} is not a number; only numbers are searched"
        )
    return fields[name]


def _typed(name: str, entry: SpaceEntry, current: Any) -> SpaceEntry:
    """``entry`` searched in its target's type: an integer target (a batch layout, a group
    count) gets integers, so a range on it needs integer bounds."""
    where = f"grid key 'tune.space.\"{name}\"'"
    if entry.choices:
        return entry
    if isinstance(current, int) and not isinstance(current, bool):
        if entry.low != int(entry.low) or entry.high != int(entry.high):
            raise HarnessError(
                f"{where}: '{name}' is an integer ({current}); expected integer bounds, got "
                f"[{entry.low:g}, {entry.high:g}]"
            )
        return SpaceEntry(entry.low, entry.high, entry.log, integer=True)
    return entry


def study_space(spec: TuneSpec, method: str, loss: str, protocol) -> dict[str, SpaceEntry]:
    """The named entries a study of (``method``, ``loss``) searches besides the method's
    own ``search_space`` (with ``method_spaces``): MLRC's default space (when ``defaults``:
    the loss's arguments and, for a loss with parameters, their learning rate), then the
    grid's ``[tune.space]`` entries that concern it. Names are
    those of Optuna's parameters: protocol fields as dotted keys (``loss.args.<loss>.<arg>``
    for a loss argument), method options by the option's name."""

    out: dict[str, SpaceEntry] = {}
    if spec.defaults:
        for arg, rng in loss_search_space(loss).items():
            out[f"loss.args.{loss}.{arg}"] = SpaceEntry(
                rng.low, rng.high, rng.log, source=rng.source
            )
        for arg, rng in miner_search_space(loss).items():
            out[f"{MINER_ARGUMENT_PREFIX}{loss}.args.{arg}"] = SpaceEntry(
                rng.low, rng.high, rng.log, source=rng.source
            )
        if LOSSES.get(loss).needs_classes:  # the loss has parameters of its own
            rate = LOSS_PARAMETER_RATE
            out[LOSS_PARAMETER_RATE_NAME] = SpaceEntry(
                rate.low, rate.high, rate.log, source=rate.source
            )
    for name, entry in spec.space.items():
        head, _, rest = name.partition(".")
        if head == "loss" and rest.count(".") == 1:
            if rest.split(".")[0] == loss:
                out[f"loss.args.{rest}"] = entry
        elif head == "method" and rest.count(".") == 1:
            if rest.split(".")[0] == method:
                out[rest.split(".")[1]] = entry
        else:
            out[name] = entry
    return out


class _Overriding:
    """A trial whose ``suggest_*`` calls for names in ``entries`` use those entries: the
    grid's entry for a method option replaces the plugin's own range for it. It answers
    every other attribute as the Optuna trial it wraps, so a plugin's ``search_space``
    takes it as that trial."""

    def __init__(self, trial, entries: dict[str, SpaceEntry]):
        self.trial, self.entries = trial, entries

    def __getattr__(self, attr: str):
        real = getattr(self.trial, attr)
        if not attr.startswith("suggest_"):
            return real

        def suggest(name, *args, **kwargs):
            if name in self.entries:
                return self.entries[name].suggest(self.trial, name)
            return real(name, *args, **kwargs)

        return suggest


def _miner_overrides(overrides: dict[str, Any], loss: str, protocol) -> dict[str, Any]:
    """Searched miner arguments (``loss.miners.<loss>.args.<argument>``) folded into one
    ``loss.miners`` override: the loss's miner as the protocol runs it, with them set."""
    searched = {k: v for k, v in overrides.items() if k.startswith(MINER_ARGUMENT_PREFIX)}
    if not searched:
        return overrides
    name, args = miner_for(
        loss, protocol.miner.name, protocol.miner.args, loss_miners=protocol.loss.miners
    )
    args = {**args, **{k.rsplit(".", 1)[1]: v for k, v in searched.items()}}
    rest = {k: v for k, v in overrides.items() if k not in searched}
    return {**rest, "loss.miners": {**protocol.loss.miners, loss: {"name": name, "args": args}}}


def suggest_setting(
    trial, spec: TuneSpec, method: str, loss: str, protocol
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(method options, protocol overrides)`` that ``trial`` suggests for a study of
    (``method``, ``loss``) under ``protocol``: every entry of :func:`study_space` first, the
    dimensions every method of the grid shares (the loss's arguments, the learning rates)
    before the method's own options, each group in name order; then the method's own
    ``search_space`` (when ``defaults``). The order is the random stream's: a sampler
    draws in suggestion order, so trial n of two methods' studies (seeded alike) draws the
    same values for their shared dimensions while its samples are random (common random
    numbers, a paired design); the method's own draws come after and shift nothing. The
    method's ``search_space`` is searched only with ``method_spaces``."""

    entries = study_space(spec, method, loss, protocol)
    options_of = set(METHODS.get(method).options())
    shared = sorted(n for n in entries if n not in options_of or "." in n)
    own = sorted(n for n in entries if n not in shared)
    options: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for name in shared + own:
        value = entries[name].suggest(trial, name)
        if name in own:
            options[name] = value
        else:
            overrides[name] = value
    overrides = _miner_overrides(overrides, loss, protocol)
    if spec.method_spaces and issubclass(cls := METHODS.get(method).cls, Tunable):
        # A name the entries hold was suggested above; Optuna answers it with that value.
        options.update(
            cls.search_space(
                cast("Trial", _Overriding(trial, entries)), embedding_size=protocol.embedding.size
            )
        )
    return options, overrides


def decade_space(protocol, fields: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``tune --space``: each field, a positive float of ``protocol``, searched log-uniform
    over a decade either side of its value, as ``[tune.space]`` entries; anything else is
    refused in one line naming the flag."""
    values = flatten_keys(protocol.to_dict())
    space: dict[str, dict[str, Any]] = {}
    for name in fields:
        if name not in values:
            raise HarnessError(
                f"--space: {unknown_name('protocol field', name, sorted(TUNABLE_FIELDS))}"
            )
        value = values[name]
        if not isinstance(value, float) or not math.isfinite(value) or value <= 0:
            raise HarnessError(
                f"--space: '{name}' = {value!r}; only positive float fields are tunable "
                f"({', '.join(TUNABLE_FIELDS)})"
            )
        space[name] = {"low": value / 10, "high": value * 10, "log": True}
    return space
