"""Fair protocols as data: ``protocols/<name>.toml`` parsed into a frozen, validated object.

A protocol fixes everything that must be equal for two numbers to be comparable:
backbone and weights, image size and transforms, embedding size, batch sampling,
optimizer, schedule, splits, model selection and metrics. Each section's
annotations are its schema (types, ranges, finiteness; :mod:`harness.config.sections`,
:mod:`harness.config.schema`), validated by pydantic whenever a protocol is read or
overridden; unknown keys are errors naming the key (OML silently drops them; we do not).
Command-line overrides are allowed, but each one is recorded as a named
:class:`~harness.config.overrides.Deviation` and changes the fingerprint
(:mod:`harness.config.fingerprint`). Protocol files are found and read by
:mod:`harness.config.protocol_files`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from harness.base.errors import HarnessError, unknown_name
from harness.components.backbones import (
    BACKBONES,
    check_input_transform,
    check_output_stride,
)
from harness.components.data.transforms import EVAL_TRANSFORMS, TRAIN_TRANSFORMS
from harness.components.evaluation import parse_metrics
from harness.components.losses import LOSSES, MINERS
from harness.config.deviations import PaperDeviation
from harness.config.executor import ExecutorTable
from harness.config.options import (
    LossArguments,
    check_loss_arg_values,
    check_option_values,
    options_model,
)
from harness.config.overrides import (
    Deviation,
    flatten_keys,
    jsonable,
    parse_overrides,
    set_dotted_keys,
)
from harness.config.schema import SPEC_CONFIG, Int, Str, refusal, shown
from harness.config.sections import (
    BackboneSpec,
    EmbeddingSpec,
    EvaluationSpec,
    ImageSpec,
    LossSpec,
    MinerSpec,
    NumericsSpec,
    OptimizerSpec,
    SamplingSpec,
    ScheduleSpec,
    Seed,
    SelectionSpec,
    SplitSpec,
    TrainingSpec,
)
from harness.methods import METHODS

__all__ = [
    "Protocol",
    "apply_overrides",
    "protocol_json_schema",
    "check_batch_fits",
    "protocol_from_dict",
    "FINGERPRINT_OMITTED_AT_DEFAULT",
    "UNCOUNTED_KEYS",
    "changes_no_number",
]


@dataclass(frozen=True)
class Protocol:
    __pydantic_config__ = SPEC_CONFIG
    name: Str
    description: Str = ""
    #: Paper or source the protocol transcribes.
    source: Str = ""
    seeds: Annotated[tuple[Annotated[Int, Seed], ...], Field(min_length=1)] = (0,)
    backbone: BackboneSpec = BackboneSpec()
    image: ImageSpec = ImageSpec()
    embedding: EmbeddingSpec = EmbeddingSpec()
    sampling: SamplingSpec = SamplingSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    training: TrainingSpec = TrainingSpec()
    numerics: NumericsSpec = NumericsSpec()
    loss: LossSpec = LossSpec()
    miner: MinerSpec = MinerSpec()
    splits: SplitSpec = SplitSpec()
    selection: SelectionSpec = SelectionSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    #: Method options fixed by this protocol: ``{method: {option: value}}``.
    methods: dict[Str, dict[Str, Any]] = field(default_factory=dict)
    #: Settings for one dataset, part of the protocol (not deviations), as partial protocol
    #: tables: ``[datasets.sop.schedule] epochs = 100``. :meth:`for_dataset` applies them.
    datasets: dict[Str, dict[Str, Any]] = field(default_factory=dict)
    #: Where this protocol departs from its paper or the authors' code (documentation:
    #: recorded and printed with every run, not fingerprinted): ``[deviations.<name>]``.
    deviations: dict[Str, PaperDeviation] = field(default_factory=dict)
    #: ``[executor.slurm]``: the resources each cell of a grid on this protocol asks of a
    #: Slurm cluster (a grid's own table and ``sweep``'s options win); not fingerprinted:
    #: where a cell runs changes nothing it computes.
    executor: ExecutorTable = field(default_factory=ExecutorTable)

    def __post_init__(self) -> None:
        """The rules that relate two keys (each key's own type and range is its annotation's)."""
        image, splits = self.image, self.splits
        _check(
            image.resize >= image.size,
            "image.resize",
            image.resize,
            f">= image.size ({image.size})",
        )
        _check(
            image.crop_scale[0] <= image.crop_scale[1],
            "image.crop_scale",
            list(image.crop_scale),
            "[low, high] with low <= high",
        )
        _check(
            image.crop_ratio[0] <= image.crop_ratio[1],
            "image.crop_ratio",
            list(image.crop_ratio),
            "[low, high] with low <= high",
        )
        _check(
            self.selection.mode != "validation" or splits.validation_classes > 0,
            "splits.validation_classes",
            splits.validation_classes,
            '> 0 when selection.mode is "validation"',
        )
        multiscale = image.multiscale_range
        _check(
            image.train_transform != "multiscale_crop_flip"
            or (len(multiscale) == 2 and multiscale[0] <= multiscale[1]),
            "image.multiscale_range",
            list(multiscale),
            "[low, high] with 0 < low <= high for multiscale_crop_flip",
        )
        _check(
            not splits.validation_by_run_seed or splits.validation_classes > 0,
            "splits.validation_by_run_seed",
            True,
            "false unless splits.validation_classes > 0 (a carve to seed)",
        )
        _check(
            splits.max_train_images_per_class != 1,
            "splits.max_train_images_per_class",
            1,
            "0 (all) or >= 2 (a class needs two images to make a positive pair)",
        )

    def to_dict(self) -> dict[str, Any]:
        """The canonical form (fingerprinted): the optional keys (``_OPTIONAL_KEYS``) are
        absent while at their defaults, so a protocol that does not use them has the
        fingerprint (and sweep cell keys) it would have without them."""
        data = self._full_dict()
        del data["deviations"]  # documentation of the protocol, not a setting
        del data["executor"]  # where the cells run
        if not data["datasets"]:
            del data["datasets"]
        for section, key in _OPTIONAL_KEYS:
            if data[section][key] == jsonable(getattr(getattr(Protocol, section), key)):
                del data[section][key]
        if data["training"] == jsonable(dataclasses.asdict(TrainingSpec())):
            del data["training"]  # absent at its defaults, as the optional keys
        for dotted, default in FINGERPRINT_OMITTED_AT_DEFAULT.items():
            section, key = dotted.split(".")
            if data[section].get(key, default) == jsonable(default):
                data[section].pop(key, None)
                if not data[section]:
                    del data[section]
        return data

    def _full_dict(self) -> dict[str, Any]:
        """Every field (what overrides address)."""
        data = jsonable(dataclasses.asdict(self))
        data["executor"] = self.executor.model_dump(exclude_none=True)
        return data

    def for_dataset(self, dataset: str) -> Protocol:
        """The protocol as it runs on ``dataset``: that dataset's settings applied, and
        the per-dataset sections consumed (so applying it again changes nothing, and
        command-line overrides made afterwards stay in force)."""
        if not self.datasets:
            return self
        settings = flatten_keys(self.datasets.get(dataset, {}))
        base = dataclasses.replace(self, datasets={})
        try:
            resolved, _ = apply_overrides(base, settings)
        except HarnessError as err:
            raise HarnessError(
                f"protocol '{self.name}', section datasets.{dataset}: {err}"
            ) from None
        return resolved

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def loss_args(self, loss_name: str) -> dict[str, Any]:
        return dict(self.loss.args.get(loss_name, {}))


#: (section, key) of fields left out of :meth:`Protocol.to_dict` at their default values.
_OPTIONAL_KEYS = (
    ("image", "multiscale_range"),
    ("splits", "validation_by_run_seed"),
    ("loss", "miners"),
)

#: ``"section.key"`` -> default of the keys left out of the canonical form
#: (:meth:`Protocol.to_dict`, what :func:`harness.config.fingerprint.fingerprint` and the
#: grids' cell keys hash) while they hold that default. Each is a setting added after runs
#: were recorded: a protocol that leaves it at its default computes what it computed
#: before, so it keeps the fingerprint and cell keys of those runs; one that sets it gets
#: new ones. Each default here equals the field's (``tests/config/test_recipe_settings.py``
#: checks it). A section left empty is dropped with them.
FINGERPRINT_OMITTED_AT_DEFAULT: dict[str, Any] = {
    "backbone.input_transform": True,
    "backbone.freeze_bn_affine": False,
    "backbone.output_stride": 32,
    "sampling.classes_with_replacement": False,
    "sampling.images_with_replacement": False,
    "optimizer.clip_grad_norm": 0.0,
    "optimizer.clip_steps": "every",
    "selection.after_epoch": 0,
    "optimizer.loss_weight_decay": 0.0,
    "numerics.precision": "bf16",
    "image.train_resize": 0,
    "image.crop_ratio": (3 / 4, 4 / 3),
    "sampling.sampler": "classes",
    "sampling.loss_samplers": {},
    "evaluation.examples": 6,
    "evaluation.map_points": 5000,
}


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise HarnessError(f"protocol key '{key}' = {shown(value)}: expected {expected}")


@functools.cache
def _adapter() -> TypeAdapter[Protocol]:
    return TypeAdapter(Protocol)


@functools.cache
def _sections_schema() -> dict[str, Any]:
    return _adapter().json_schema()


def check_batch_fits(protocol: Protocol, dataset: str, *, images: int, classes: int) -> None:
    """The rule that needs the dataset's sizes, checked once its training split is known
    and before a run is tracked: a batch of ``classes_per_batch x samples_per_class``
    images must fit in the training images. A split with fewer classes than a batch asks
    for gives every batch all of them, with more images each and the same batch size
    (:func:`harness.engine.run.data.adapted_sampling`), so the classes are not refused."""
    s = protocol.sampling
    if s.batch_size > images:
        raise HarnessError(
            f"protocol key 'sampling.classes_per_batch' = {s.classes_per_batch}: expected classes_per_batch x "
            f"samples_per_class ({s.classes_per_batch} x {s.samples_per_class} = {s.batch_size}) <= the {images} "
            f"training images of {dataset} ({classes} classes)"
        )


#: ``[methods.<name>]`` of a method the schema was generated without (a plugin added or
#: installed since): any table; the harness checks its options when it reads the file.
_UNLISTED_METHOD = {
    "type": "object",
    "description": "Options of a method registered after this schema was "
    "generated; python -m harness schema lists them.",
}


def protocol_json_schema() -> dict[str, Any]:
    """The JSON Schema of a protocol file (what ``python -m harness schema`` prints and
    ``docs/protocol.schema.json`` holds): the sections' declared types, every registered
    method's options under ``[methods.<name>]`` (any table for another name, so that a copy
    generated earlier accepts a plugin added since) and the declared loss-argument ranges."""

    schema = json.loads(json.dumps(_sections_schema()))  # a copy: the cached one serves refusals
    schema.update(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "dml-harness protocol",
            "description": "A fair protocol (protocols/<name>.toml); python -m harness schema prints this.",
        }
    )
    schema["required"] = []  # name defaults to the file's stem
    schema["properties"]["methods"] = {
        "type": "object",
        "additionalProperties": _UNLISTED_METHOD,
        "description": "Method options fixed by the protocol.",
        "properties": {name: options_model(name).model_json_schema() for name in METHODS.list()},
    }
    args = schema["$defs"]["LossSpec"]["properties"]["args"]
    args["additionalProperties"] = LossArguments.model_json_schema()
    return schema


def protocol_from_dict(data: dict[str, Any]) -> Protocol:
    """The protocol of the table ``data``: a protocol file's, or the canonical form a run
    recorded (:meth:`Protocol.to_dict`), validated the same way."""
    return _validated(data)


def _validated(data: dict[str, Any]) -> Protocol:
    """The protocol of the table ``data``, checked against the declared schema: the
    sections' annotations (types, ranges, finiteness, unknown keys), the cross-key rules, and
    the options of every method it configures (run or not)."""
    try:
        protocol = _adapter().validate_python(data)
    except ValidationError as err:
        raise refusal(err, _sections_schema(), what="protocol key") from None

    for method, options in protocol.methods.items():
        if method in METHODS:  # an unknown name is refused by name on loading
            check_option_values(method, options)
    check_loss_arg_values(protocol.loss.args)
    _check_component_names(protocol)
    return protocol


def _check_component_names(protocol: Protocol) -> None:
    """The backbone, miner, transforms and metrics a protocol names are registered ones:
    a misspelt name is refused when the protocol is read, not once the dataset has loaded."""

    named = [
        ("backbone.name", protocol.backbone.name, BACKBONES.kind, BACKBONES.list()),
        ("miner.name", protocol.miner.name, MINERS.kind, ["none", *MINERS.list()]),
        ("image.train_transform", protocol.image.train_transform, "transform", TRAIN_TRANSFORMS),
        ("image.eval_transform", protocol.image.eval_transform, "transform", EVAL_TRANSFORMS),
    ]
    for key, name, kind, valid in named:
        if name not in valid:
            raise HarnessError(f"protocol key '{key}': {unknown_name(kind, name, valid)}")
    for loss in protocol.sampling.loss_samplers:
        if loss not in LOSSES:
            raise HarnessError(
                f"protocol key 'sampling.loss_samplers': {unknown_name(LOSSES.kind, loss, LOSSES.list())}"
            )
    check_output_stride(protocol.backbone.name, protocol.backbone.output_stride)
    check_input_transform(protocol.backbone.name, protocol.backbone.input_transform)
    for key, metrics in (
        ("evaluation.metrics", protocol.evaluation.metrics),
        ("selection.metric", (protocol.selection.metric,)),
    ):
        try:
            parse_metrics(metrics)
        except HarnessError as err:
            raise HarnessError(f"protocol key '{key}': {err}") from None


def apply_overrides(
    protocol: Protocol, overrides: dict[str, Any] | list[str]
) -> tuple[Protocol, tuple[Deviation, ...]]:
    """Return the protocol with ``{"schedule.epochs": 3}`` (or ``["schedule.epochs=3"]``) applied.

    Each changed field becomes a :class:`~harness.config.overrides.Deviation`; values equal
    to the protocol's are not deviations (:func:`harness.config.overrides.set_dotted_keys`),
    nor are the keys that change no number (:func:`changes_no_number`).
    """
    table = protocol._full_dict()
    deviations = set_dotted_keys(table, parse_overrides(overrides))
    return _validated(table), tuple(d for d in deviations if not changes_no_number(d.field))


#: Protocol keys (a section, or ``section.key``) that change no number a run computes:
#: ``[training]`` says how often the loop reads the device, ``evaluation.examples`` and
#: ``evaluation.map_points`` what the run's figures show. The fingerprint leaves them out
#: (:func:`harness.config.fingerprint.fingerprint`) and a change of one is no deviation
#: (:func:`apply_overrides`): the run stays comparable with every other, unflagged.
UNCOUNTED_KEYS = ("training", "evaluation.examples", "evaluation.map_points")


def changes_no_number(key: str) -> bool:
    """Whether the dotted protocol ``key`` is (or lies in) one of :data:`UNCOUNTED_KEYS`."""
    return any(key == k or key.startswith(f"{k}.") for k in UNCOUNTED_KEYS)
