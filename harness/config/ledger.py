"""Recipe ledgers: a paper's training and evaluation recipe as data, checked against the
protocols that claim to reproduce it.

``protocols/ledgers/<paper>.toml`` lists, per setting of the authors' released code (or,
for a paper without released code, of its text), the protocol key it maps to, the
authors' value and where that value is read::

    paper = "agrouping"
    grids = ["agrouping-table3"]          # reproduce grids it covers
    [[entry]]
    setting = "class sampler draws a class's images with replacement"
    key = "sampling.images_with_replacement"
    value = true                           # the authors' value
    source = "DGML@7834411 datasampler/class_random_sampler.py:43"   # see [[code]] below
    cited = "9c0e51d2:5b1f0a7e"            # the digest benchmarks/check_citations.py writes
    when = { dataset = ["sop"], method = ["agrouping"], loss = ["margin"] }   # optional
    deviation = "sampler_replacement"      # optional: the deviation that names a difference
    observe = "unit_groups"                # optional: a claim the key cannot show, checked
                                           # on the built run (harness.engine.audit.built_run)

A ledger that cites released code names each repository once, in a ``[[code]]`` table
(``name``, the tag its citations use; ``repository``; the full ``commit``), and each entry
that cites it stores ``cited``, the digest of its citations and of the lines they cite
(:mod:`harness.config.citations` gives the grammar and the digest)::

    [[code]]
    name = "DGML"
    repository = "XinyiXuXD/DGML-master"
    commit = "7834411c8b5ba4ded5061bd529f3f5deaf2a7c97"

``benchmarks/check_citations.py`` reads a checkout of the commit, prints the cited lines
beside each entry and writes the digests; :func:`stale_citations` lists the entries whose
citations differ from those their digest was computed for (``tests/config/test_citations.py``).

``key`` is a dotted protocol key, read from the protocol a cell runs (its grid variant,
its grid's settings and its dataset's section applied). ``methods.<method>.<option>``
reads a method option, its default resolved from the plugin; ``loss.args.<loss>.<arg>``
a loss argument, its default resolved from the loss registry (``reduction``: ``"pml"``).
``when`` restricts an entry to the cells whose ``dataset``, ``method``, ``loss``,
``backbone`` or ``protocol`` (name) it lists. A protocol that no grid runs is covered by a ``[[protocols]]``
table naming it and the ``methods``, ``losses`` and ``datasets`` the paper runs it with.

Each entry is then, per cell, *matched* (the cell runs the authors' value), *deviating*
(it runs another value and the entry's ``deviation`` is one of the cell's declared
deviations, :mod:`harness.config.deviations`) or *undeclared* (another value that no
applicable deviation names: a number its table would print without saying so).
``tests/config/test_ledger.py`` requires no undeclared entry; ``python -m harness deviations
--grid G`` prints the counts per cell family.

Coverage. Every leaf key of the protocol schema (:func:`protocol_keys`) and every option
of the methods the ledger's cells run is an entry's key (or a prefix of one: ``loss.args``
is covered by ``loss.args.margin.beta``), or in the ledger's ``[not_applicable]`` table
with a one-line reason, or one of :data:`NOT_SETTINGS`; :func:`uncovered` lists the rest,
so a new protocol key cannot land without each paper's ledger saying what its authors
did::

    [not_applicable]
    "image.multiscale_range" = "only the multiscale_crop_flip transform reads it"

``[unmeasured]`` names, per deviation of the ledger's grids, why its authors' value cannot
be run (no key sets it, or the key cannot express it): ``deviations --measure`` prints the
reason instead of an effect.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError

from harness.base.errors import HarnessError, unknown_name
from harness.base.paths import read_text
from harness.components.losses import LOSSES, PML_REDUCTION, loss_defaults
from harness.config.catalog import MAX_CELLS, protocol_dir
from harness.config.citations import (
    DIGEST_PATTERN,
    Citation,
    CodeRepository,
    citations_digest,
    parse_citations,
)
from harness.config.deviations import PaperDeviation, applicable
from harness.config.grids import load_grid
from harness.config.protocol import Protocol, protocol_json_schema
from harness.config.protocol_files import load_protocol
from harness.config.schema import SPEC_CONFIG, Str, refusal
from harness.methods import METHODS

__all__ = [
    "Ledger",
    "LedgerEntry",
    "Check",
    "ledger_dir",
    "list_ledgers",
    "load_ledger",
    "ledgers_for_grid",
    "check_ledger",
    "same_value",
    "family_counts",
    "resolve_key",
    "STATUSES",
    "NOT_SETTINGS",
    "protocol_keys",
    "ledger_cases",
    "registered_options",
    "required_keys",
    "uncovered",
    "stale_citations",
]

#: The outcomes of an entry on a cell, best first.
STATUSES = ("matched", "deviating", "undeclared")
_WHEN = ("dataset", "method", "loss", "backbone", "protocol")


class _Entry(BaseModel):
    model_config = SPEC_CONFIG
    setting: Str
    key: Str
    value: Any
    source: Str
    when: dict[Str, list[Str] | Str] = {}
    deviation: Str = ""
    observe: Str = ""
    cited: Annotated[Str, Field(pattern=DIGEST_PATTERN, examples=["3f9a01bc:77e0d1aa"])] = ""


class _Code(BaseModel):
    model_config = SPEC_CONFIG
    name: Annotated[Str, Field(pattern=r"^[\w.-]+$", examples=["DGML"])]
    repository: Annotated[Str, Field(pattern=r"^[\w.-]+/[\w.-]+$", examples=["owner/name"])]
    commit: Annotated[Str, Field(pattern=r"^[0-9a-f]{40}$", examples=["<40 hex digits>"])]


class _Protocols(BaseModel):
    model_config = SPEC_CONFIG
    name: Str
    methods: list[Str]
    losses: list[Str]
    datasets: list[Str]


class _LedgerFile(BaseModel):
    model_config = SPEC_CONFIG
    paper: Str
    code: list[_Code] = []
    grids: list[Str] = []
    protocols: list[_Protocols] = []
    not_applicable: dict[Str, Str] = {}
    unmeasured: dict[Str, Str] = {}
    entry: list[_Entry]


@dataclass(frozen=True)
class LedgerEntry:
    setting: str
    key: str
    value: Any
    source: str
    when: dict[str, tuple[str, ...]]
    deviation: str = ""
    #: A claim about the built run that the key's value cannot show (``unit_groups``:
    #: each group of the embedding has unit norm), checked by the built-run checks.
    observe: str = ""
    #: The code citations of ``source`` (:mod:`harness.config.citations`), in order.
    citations: tuple[Citation, ...] = ()
    #: ``<citations>:<lines>``: the digest of the citations and of the lines they cite.
    cited: str = ""

    def applies(self, case: Case) -> bool:
        return all(
            (case.protocol.name if axis == "protocol" else getattr(case, axis)) in names
            for axis, names in self.when.items()
        )


@dataclass(frozen=True)
class Ledger:
    paper: str
    path: Path
    grids: tuple[str, ...]
    #: ``(protocol name, methods, losses, datasets)`` of the protocols no grid runs.
    protocols: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...]
    entries: tuple[LedgerEntry, ...]
    #: Keys the authors' recipe has no value for, each with its reason.
    not_applicable: dict[str, str] = field(default_factory=dict)
    #: Deviations whose authors' value cannot be run, each with its reason.
    unmeasured: dict[str, str] = field(default_factory=dict)
    #: The released code the entries cite, by the tag their citations use.
    code: dict[str, CodeRepository] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One cell an entry is checked on: a grid cell (seeds aside) or a ledger-listed protocol run."""

    family: str
    backbone: str
    loss: str
    method: str
    dataset: str
    protocol: Protocol
    deviations: dict[str, PaperDeviation] = field(compare=False, hash=False)


@dataclass(frozen=True)
class Check:
    entry: LedgerEntry
    case: Case
    status: str
    actual: Any


def ledger_dir() -> Path:
    return protocol_dir() / "ledgers"


def list_ledgers() -> list[str]:
    return sorted(p.stem for p in ledger_dir().glob("*.toml"))


def load_ledger(name_or_path: str | Path) -> Ledger:
    """Parse and validate a ledger (a name under ``protocols/ledgers`` or a ``.toml`` path)."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = ledger_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise unknown_name("ledger", str(name_or_path), list_ledgers())
    if not path.is_file():
        raise HarnessError(f"ledger file not found: {path}")
    try:
        data = tomllib.loads(read_text(path, "TOML"))
    except tomllib.TOMLDecodeError as err:
        raise HarnessError(f"malformed ledger file {path}: {err}") from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise HarnessError(f"malformed ledger file {path}: nested too deeply") from None
    try:
        parsed = _LedgerFile.model_validate(data)
    except ValidationError as err:
        raise refusal(
            err, _LedgerFile.model_json_schema(), what=f"ledger {path.stem} key"
        ) from None
    code = {c.name: CodeRepository(c.name, c.repository, c.commit) for c in parsed.code}
    if len(code) != len(parsed.code):
        raise HarnessError(f"ledger {parsed.paper}: two [[code]] tables share a name")
    entries = [_entry(parsed.paper, number, e, code) for number, e in enumerate(parsed.entry, 1)]
    protocols = tuple(
        (p.name, tuple(p.methods), tuple(p.losses), tuple(p.datasets)) for p in parsed.protocols
    )
    return Ledger(
        parsed.paper,
        path,
        tuple(parsed.grids),
        protocols,
        tuple(entries),
        dict(parsed.not_applicable),
        dict(parsed.unmeasured),
        code,
    )


def _entry(paper: str, number: int, e: _Entry, code: dict[str, CodeRepository]) -> LedgerEntry:
    where = f"ledger {paper} entry {number} ({e.setting})"
    unknown = sorted(set(e.when) - set(_WHEN))
    if unknown:
        raise HarnessError(
            f"{where}: unknown 'when' key '{unknown[0]}' (expected {', '.join(_WHEN)})"
        )
    try:
        citations = parse_citations(e.source, code)
    except HarnessError as err:
        raise HarnessError(f"{where}: source: {err}") from None
    when = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in e.when.items()}
    return LedgerEntry(
        e.setting, e.key, e.value, e.source, when, e.deviation, e.observe, citations, e.cited
    )


def ledgers_for_grid(grid: str) -> list[Ledger]:
    """The shipped ledgers that cover grid ``grid``."""
    return [ledger for ledger in map(load_ledger, list_ledgers()) if grid in ledger.grids]


# ------------------------------------------------------------------------ resolution


def resolve_key(protocol: Protocol, key: str) -> Any:
    """The value of dotted ``key`` in ``protocol`` (JSON-like: tuples as lists), method
    options and loss arguments resolved to their defaults where the protocol leaves them
    out. An unknown key is a :class:`HarnessError` naming it."""
    parts = key.split(".")
    if parts[0] == "methods" and len(parts) == 3:
        method, option = parts[1:]
        if method not in METHODS:
            raise HarnessError(
                f"unknown protocol key '{key}': {unknown_name('method', method, METHODS.list())}"
            )
        options = {**METHODS.get(method).options(), **protocol.methods.get(method, {})}
        if option not in options:
            raise HarnessError(
                f"unknown protocol key '{key}': method '{method}' has no option '{option}'"
            )
        return _plain(options[option])
    if parts[:2] == ["loss", "args"] and len(parts) == 4:
        loss, arg = parts[2:]
        if loss not in LOSSES:
            raise HarnessError(
                f"unknown protocol key '{key}': {unknown_name('loss', loss, LOSSES.list())}"
            )
        args = {"reduction": PML_REDUCTION, **loss_defaults(loss), **protocol.loss_args(loss)}
        if arg not in args:
            raise HarnessError(
                f"unknown protocol key '{key}': loss '{loss}' has no argument '{arg}' with a default"
            )
        return _plain(args[arg])
    node: Any = protocol._full_dict()
    for depth, part in enumerate(parts):
        if (
            not isinstance(node, dict)
            or part not in node
            or (depth == 0 and part in ("deviations", "datasets"))
        ):
            raise HarnessError(f"unknown protocol key '{key}'")
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def same_value(a: Any, b: Any) -> bool:
    """Equal values, numbers compared to a relative 1e-9 (``3e-3`` is ``0.003``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------------------- checks


def _grid_cases(name: str, max_cells: int | None) -> list[Case]:
    cases, seen = [], set()
    for cell in load_grid(name, max_cells=max_cells).cells:
        marker = (cell.backbone, cell.loss, cell.method, cell.dataset)
        if marker in seen:  # seeds share everything a ledger reads
            continue
        seen.add(marker)
        cases.append(
            Case(
                f"{name}: {cell.backbone}/{cell.dataset}",
                cell.backbone,
                cell.loss,
                cell.method,
                cell.dataset,
                cell.protocol,
                dict(cell.paper_deviations),
            )
        )
    return cases


def _protocol_cases(
    name: str, methods: tuple[str, ...], losses: tuple[str, ...], datasets: tuple[str, ...]
) -> list[Case]:
    base = load_protocol(name)
    cases: list[Case] = []
    for dataset in datasets:
        protocol = base.for_dataset(dataset)
        backbone = protocol.backbone.name
        for method in methods:
            cases.extend(
                Case(
                    f"protocol {name}: {backbone}/{dataset}",
                    backbone,
                    loss,
                    method,
                    dataset,
                    protocol,
                    applicable(protocol.deviations, method, dataset, backbone, loss),
                )
                for loss in losses
            )
    return cases


def _status(entry: LedgerEntry, case: Case, actual: Any) -> str:
    if same_value(actual, entry.value):
        return "matched"
    return "deviating" if entry.deviation and entry.deviation in case.deviations else "undeclared"


def ledger_cases(
    ledger: Ledger, grids: list[str] | None = None, *, max_cells: int | None = MAX_CELLS
) -> list[Case]:
    """The cells a ledger is checked on: those of the grids it covers (or of ``grids``),
    seeds aside, and of the protocols it lists (only when ``grids`` is None)."""
    cases = [
        c for g in (ledger.grids if grids is None else grids) for c in _grid_cases(g, max_cells)
    ]
    if grids is None:
        cases += [c for spec in ledger.protocols for c in _protocol_cases(*spec)]
    return cases


def check_ledger(
    ledger: Ledger, grids: list[str] | None = None, *, max_cells: int | None = MAX_CELLS
) -> list[Check]:
    """Every entry of ``ledger`` on every cell it applies to, of the grids it covers (or
    of ``grids``) and of the protocols it lists (only when ``grids`` is None). An entry
    naming an unknown key is a :class:`HarnessError` naming the ledger, the entry and the
    key; a grid of more than ``max_cells`` cells (None: no cap) is refused."""
    cases = ledger_cases(ledger, grids, max_cells=max_cells)
    checks = []
    for number, entry in enumerate(ledger.entries, 1):
        for case in cases:
            if not entry.applies(case):
                continue
            try:
                actual = resolve_key(case.protocol, entry.key)
            except HarnessError as err:
                raise HarnessError(
                    f"ledger {ledger.paper} ({ledger.path.name}) entry {number} "
                    f"({entry.setting}): {err}"
                ) from None
            checks.append(Check(entry, case, _status(entry, case, actual), actual))
    return checks


def family_counts(checks: list[Check]) -> dict[str, dict[str, int]]:
    """``{family: {status: entries}}``: each entry counted once per cell family (a grid's
    backbone and dataset, seeds, methods and losses together) with its worst status there."""
    worst: dict[str, dict[int, int]] = {}
    ids: dict[int, int] = {}
    for check in checks:
        entry_id = ids.setdefault(id(check.entry), len(ids))
        family = worst.setdefault(check.case.family, {})
        family[entry_id] = max(family.get(entry_id, 0), STATUSES.index(check.status))
    return {
        family: {s: sum(1 for v in found.values() if STATUSES[v] == s) for s in STATUSES}
        for family, found in worst.items()
    }


# -------------------------------------------------------------------------- coverage

#: Protocol keys that are no training or evaluation setting, with the reason: no ledger
#: needs to say what the authors did for them.
NOT_SETTINGS: dict[str, str] = {
    "name": "the protocol's name (documentation)",
    "description": "the protocol's description (documentation)",
    "source": "what the protocol transcribes (documentation)",
    "deviations": "documents the protocol's departures: what the entries' deviation names",
    "datasets": "per-dataset sections of the other keys, applied before an entry is checked",
    "executor.slurm": "where a grid's cells run, not what they compute",
    "training.sync_every": "how often the training loop reads the device; changes no number",
    "evaluation.examples": "how many test queries the run's figures show; changes no number",
    "evaluation.map_points": "how many test embeddings the run's map draws; changes no number",
}


def protocol_keys(schema: dict[str, Any] | None = None) -> list[str]:
    """Every leaf key of the protocol schema (default: :func:`protocol_json_schema`'s):
    ``section.field`` for each field of a section, the name of every other top-level field
    (``seeds``; ``methods``, whose options :func:`required_keys` lists instead)."""

    schema = protocol_json_schema() if schema is None else schema
    defs = schema.get("$defs", {})
    keys = []
    for name, prop in schema["properties"].items():
        ref = prop.get("$ref") or next(
            (p["$ref"] for p in prop.get("allOf", []) if "$ref" in p), ""
        )
        section = defs.get(ref.rsplit("/", 1)[-1], {}) if ref else {}
        if "properties" in section:
            keys += [f"{name}.{field_name}" for field_name in section["properties"]]
        else:
            keys.append(name)
    return keys


def registered_options(method: str) -> dict[str, Any]:
    """The options of the registered method ``method`` with their defaults."""
    return METHODS.get(method).options()


def required_keys(
    ledger: Ledger,
    schema: dict[str, Any] | None = None,
    method_options: Callable[[str], Mapping[str, Any]] = registered_options,
) -> list[str]:
    """The keys ``ledger`` must cover: the protocol schema's leaf keys (``methods`` aside)
    and ``methods.<method>.<option>`` for every option (``method_options``) of every method
    its cells run."""

    methods = sorted({case.method for case in ledger_cases(ledger, max_cells=None)})
    options = [f"methods.{m}.{o}" for m in methods for o in method_options(m)]
    return [k for k in protocol_keys(schema) if k != "methods"] + options


def uncovered(
    ledger: Ledger,
    schema: dict[str, Any] | None = None,
    method_options: Callable[[str], Mapping[str, Any]] = registered_options,
) -> list[str]:
    """The keys of :func:`required_keys` that no entry of ``ledger`` reads (as its key or a
    prefix of it), its ``[not_applicable]`` table does not list and :data:`NOT_SETTINGS`
    does not hold."""
    keys = {entry.key for entry in ledger.entries}
    return [
        key
        for key in required_keys(ledger, schema, method_options)
        if key not in NOT_SETTINGS
        and key not in ledger.not_applicable
        and not any(k == key or k.startswith(key + ".") for k in keys)
    ]


def stale_citations(ledger: Ledger) -> list[str]:
    """One line per entry whose ``cited`` does not fit its citations: missing where
    ``source`` cites code, set where it cites none, or computed for other citations (or
    another commit) than ``source`` and ``[[code]]`` name: citations whose lines were not
    read again after an edit (``benchmarks/check_citations.py --write-digests``)."""
    found = []
    for number, entry in enumerate(ledger.entries, 1):
        where = f"ledger {ledger.paper} entry {number} ({entry.setting})"
        if not entry.citations:
            if entry.cited:
                found.append(f"{where}: 'cited' is set but the source cites no code")
        elif not entry.cited:
            found.append(f"{where}: the source cites code but 'cited' is missing")
        elif entry.cited.split(":")[0] != citations_digest(entry.citations, ledger.code):
            found.append(f"{where}: 'cited' was computed for other citations than the source's")
    return found
