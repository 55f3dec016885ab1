"""Protocol files: where the shipped ones are, their names, and reading one (by name, or
any ``.toml`` file by path) into a :class:`~harness.config.protocol.Protocol`, every name
it uses checked against the registries of methods, losses, miners and datasets."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError, unknown_name
from harness.base.paths import read_text
from harness.components.backbones import BACKBONES
from harness.components.data import DATASETS
from harness.components.losses import LOSSES, MINERS, check_loss_args
from harness.config.catalog import list_protocols, protocol_dir
from harness.config.deviations import check_names
from harness.config.protocol import Protocol, protocol_from_dict
from harness.methods import METHODS

__all__ = [
    "load_protocol",
    "default_protocol",
    "BENCHMARKS",
]

#: The field's benchmark datasets: ``roth2020`` is their default protocol.
BENCHMARKS = ("cub200", "cars196", "sop", "inshop")


def default_protocol(dataset: str) -> str:
    """``smoke`` on the small CPU datasets, the field's standard (``roth2020``) on benchmarks."""
    return "roth2020" if dataset in BENCHMARKS else "smoke"


def load_protocol(name_or_path: str | Path) -> Protocol:
    """Load a shipped protocol by name, or any ``.toml`` file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = protocol_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise unknown_name("protocol", str(name_or_path), list_protocols())
    if not path.is_file():
        raise HarnessError(f"protocol file not found: {path}")
    text = read_text(path, "TOML")
    key = (path.resolve(), text)
    if key not in _LOADED:
        _LOADED[key] = _parse_protocol(path, text)
    return _LOADED[key]


#: Protocols parsed, by file and text. A grid's cells, a sweep's runs and a table's rows
#: read the same few files hundreds of times, and a :class:`Protocol` is frozen, so each
#: text is parsed and validated once.
_LOADED: dict[tuple[Path, str], Protocol] = {}


def _parse_protocol(path: Path, text: str) -> Protocol:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise HarnessError(f"malformed protocol file {path}: {err}") from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise HarnessError(f"malformed protocol file {path}: nested too deeply") from None
    data.setdefault("name", path.stem)
    protocol = protocol_from_dict(data)
    for dataset, section in protocol.datasets.items():
        if not isinstance(section, dict) or {"name", "datasets"} & set(section):
            raise HarnessError(
                f"protocol key 'datasets.{dataset}' must be a table of protocol settings "
                f"(not name or datasets), got {section!r}"
            )
        protocol.for_dataset(dataset)  # unknown keys and bad values fail here, not mid-run
    _check_registered_names(protocol)
    return protocol


def _check_registered_names(protocol: Protocol) -> None:
    """Sections keyed by a method, loss or dataset name must name a registered one: a
    misspelt ``[methods.agroupng]`` would otherwise run with the defaults, unrecorded."""

    check_names(
        protocol.deviations,
        methods=METHODS.list(),
        datasets=DATASETS.list(),
        backbones=BACKBONES.list(),
        losses=LOSSES.list(),
    )
    keyed: list[tuple[str, Any, Any]] = [
        ("methods", protocol.methods, METHODS),
        ("loss.args", protocol.loss.args, LOSSES),
        ("datasets", protocol.datasets, DATASETS),
        ("sampling.loss_samplers", protocol.sampling.loss_samplers, LOSSES),
        (
            "evaluation.recall_k",
            {k: v for k, v in protocol.evaluation.recall_k.items() if k != "default"},
            DATASETS,
        ),
    ]
    for key, section, registry in keyed:
        for name in section:
            if name not in registry:
                raise HarnessError(
                    f"protocol key '{key}.{name}': {unknown_name(registry.kind, name, registry.list())}"
                )
    for (
        loss,
        args,
    ) in protocol.loss.args.items():  # unknown arguments and reductions fail here, not mid-run
        check_loss_args(loss, args)
    _check_loss_miners(protocol)


def _check_loss_miners(protocol: Protocol) -> None:
    """``[loss.miners.<loss>]``: a registered loss, a ``name`` that is a registered miner
    (or ``"none"``: every pair or triplet of the batch), optional ``args``, nothing else."""

    for loss, spec in protocol.loss.miners.items():
        key = f"loss.miners.{loss}"
        if loss not in LOSSES:
            raise HarnessError(
                f"protocol key '{key}': {unknown_name(LOSSES.kind, loss, LOSSES.list())}"
            )
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise HarnessError(
                f"protocol key '{key}' must be a table with a miner 'name', got {spec!r}"
            )
        extra = sorted(set(spec) - {"name", "args"})
        if extra:
            raise HarnessError(f"unknown protocol key '{key}.{extra[0]}' (expected name and args)")
        if spec["name"] != "none" and spec["name"] not in MINERS:
            raise HarnessError(
                f"protocol key '{key}.name': "
                f"{unknown_name(MINERS.kind, spec['name'], ['none', *MINERS.list()])}"
            )
        if not isinstance(spec.get("args", {}), dict):
            raise HarnessError(f"protocol key '{key}.args' must be a table, got {spec['args']!r}")
