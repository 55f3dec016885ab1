"""Where a protocol departs from its paper or the authors' released code, as data.

A protocol file declares each departure once, in a ``[deviations.<name>]`` table::

    [deviations.validation_carve]
    paper = "trains on the whole training split"        # the paper's or the code's value
    harness = "20% of the training classes held out"    # this protocol's value
    why = "model selection on a class-disjoint validation split (fair protocol)"
    reference = "DIABLO Sec. 3.5"                        # optional: section, or file:line
    methods = ["diablo"]                                 # optional: only these methods' runs
    datasets = ["sop"]                                   # optional: only these datasets
    backbones = ["googlenet"]                            # optional: only these backbones
    losses = ["margin"]                                  # optional: only these losses

Every run records the deviations that apply to it as tags (``deviation.<name>``), the run
summary prints them, and every table that shows the run lists them under it. They are
documentation of the protocol, not settings: they do not enter its fingerprint.

Two kinds of deviation exist, and both are printed: these (the protocol against the
paper) and :class:`~harness.config.overrides.Deviation` (a run against its protocol: a
``--set`` override, a grid's smoke settings).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from harness.base.errors import HarnessError, unknown_name
from harness.config.schema import SPEC_CONFIG, Str

__all__ = [
    "PaperDeviation",
    "TAG_PREFIX",
    "applicable",
    "deviation_tags",
    "find_deviation",
    "footnote",
    "from_tag",
    "grouped_notes",
    "to_tag",
]

#: Tag of a run per applicable deviation: ``deviation.<name>`` = :func:`footnote` text.
TAG_PREFIX = "deviation."
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class PaperDeviation:
    """One departure of a protocol from its paper or the authors' code."""

    __pydantic_config__ = SPEC_CONFIG

    #: What the paper (or, where it is silent, the released code) does.
    paper: Str = ""
    #: What this protocol does instead.
    harness: Str = ""
    #: Why: the fair protocol's rule, a missing detail, a cost.
    why: Str = ""
    #: Paper section or released-code file and line the ``paper`` value comes from.
    reference: Str = ""
    #: Methods whose runs it concerns (empty: every method).
    methods: tuple[Str, ...] = ()
    #: Datasets whose runs it concerns (empty: every dataset).
    datasets: tuple[Str, ...] = ()
    #: Backbones whose runs it concerns (empty: every backbone), for a grid whose cells run
    #: one protocol over several backbones (A-grouping Table 3's GoogLeNet cells).
    backbones: tuple[Str, ...] = ()
    #: Losses whose runs it concerns (empty: every loss), for a setting the authors' code
    #: gives one loss's runs only (AVSL's Margin configurations).
    losses: tuple[Str, ...] = ()

    def __post_init__(self) -> None:
        for key in ("paper", "harness", "why"):
            if not getattr(self, key).strip():
                raise HarnessError(
                    f"a protocol deviation needs '{key}' (paper, harness and why are required)"
                )

    def applies(
        self, method: str, dataset: str, backbone: str | None = None, loss: str | None = None
    ) -> bool:
        """Whether it concerns a run of ``method`` on ``dataset`` with ``backbone`` and
        ``loss`` (None: any)."""
        return (
            (not self.methods or method in self.methods)
            and (not self.datasets or dataset in self.datasets)
            and (backbone is None or not self.backbones or backbone in self.backbones)
            and (loss is None or not self.losses or loss in self.losses)
        )


def check_names(
    deviations: dict[str, PaperDeviation],
    *,
    methods: Iterable[str],
    datasets: Iterable[str],
    backbones: Iterable[str] | None = None,
    losses: Iterable[str] | None = None,
) -> None:
    """Deviation names are identifiers; the methods, datasets, backbones and losses they
    name are registered (``None``: any backbone, any loss)."""
    known = {
        "method": list(methods),
        "dataset": list(datasets),
        "backbone": None if backbones is None else list(backbones),
        "loss": None if losses is None else list(losses),
    }
    for name, deviation in deviations.items():
        if not _NAME.match(name):
            raise HarnessError(
                f"protocol key 'deviations.{name}': a deviation name is lower-case "
                f"letters, digits and underscores, starting with a letter"
            )
        named = {
            "method": deviation.methods,
            "dataset": deviation.datasets,
            "backbone": deviation.backbones,
            "loss": deviation.losses,
        }
        for kind, values in named.items():
            _check_named(name, kind, values, known[kind])


def _check_named(name: str, kind: str, values: Iterable[str], known: list[str] | None) -> None:
    """Each of ``values`` (the ``kind``s deviation ``name`` concerns) among ``known``."""
    for value in values:
        if known is not None and value not in known:
            raise HarnessError(
                f"protocol key 'deviations.{name}.{kind}"
                f"{'es' if kind == 'loss' else 's'}': {unknown_name(kind, value, known)}"
            )


def applicable(
    deviations: dict[str, PaperDeviation],
    method: str,
    dataset: str,
    backbone: str | None = None,
    loss: str | None = None,
) -> dict[str, PaperDeviation]:
    """The deviations that concern a run of ``method`` on ``dataset`` (with ``backbone``
    and ``loss``), by name."""
    return {
        name: d
        for name, d in sorted(deviations.items())
        if d.applies(method, dataset, backbone, loss)
    }


def footnote(name: str, deviation: PaperDeviation) -> str:
    """One line: ``name: paper X (ref); here Y. Why.``"""
    source = f" ({deviation.reference})" if deviation.reference else ""
    return f"{name}: paper {deviation.paper}{source}; here {deviation.harness}. {deviation.why}"


def deviation_tags(
    deviations: dict[str, PaperDeviation], method: str, dataset: str
) -> dict[str, str]:
    """MLflow tags of a run: ``deviation.<name>`` -> ``{"paper", "harness", "why",
    "reference"}`` as JSON (what the tables read back with :func:`from_tag`)."""
    return {
        TAG_PREFIX + name: to_tag(d) for name, d in applicable(deviations, method, dataset).items()
    }


def to_tag(deviation: PaperDeviation) -> str:
    """A deviation as the value of its ``deviation.<name>`` tag (read back by :func:`from_tag`)."""
    return json.dumps({k: getattr(deviation, k) for k in ("paper", "harness", "why", "reference")})


def from_tag(text: str) -> PaperDeviation:
    """A ``deviation.<name>`` tag's value back as a :class:`PaperDeviation`."""
    return PaperDeviation(**json.loads(text))


def grouped_notes(deviations: dict[str, PaperDeviation]) -> list[str]:
    """One sentence per reason: ``why: name (paper P [ref] -> here H); ...``, in name order,
    so that the smoke version's many settings read as one footnote."""
    by_why: dict[str, list[str]] = {}
    for name, d in sorted(deviations.items()):
        source = f" [{d.reference}]" if d.reference else ""
        by_why.setdefault(d.why, []).append(f"{name} (paper: {d.paper}{source}; here: {d.harness})")
    return [
        f"{why[0].upper()}{why[1:].rstrip('.')}: {'; '.join(items)}."
        for why, items in by_why.items()
    ]


def find_deviation(deviations: dict[str, PaperDeviation], name: str, where: str) -> PaperDeviation:
    """The deviation called ``name``, or one error line listing the valid names."""
    if name not in deviations:
        raise unknown_name(f"deviation of {where}", name, deviations)
    return deviations[name]
