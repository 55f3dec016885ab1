"""Citations of released code in a recipe ledger, and the digest that binds each entry to
the lines it cites.

A ledger that cites released code names each repository once, with the full commit its
citations read::

    [[code]]
    name = "DGML"                              # the tag the citations use
    repository = "XinyiXuXD/DGML-master"
    commit = "7834411c8b5ba4ded5061bd529f3f5deaf2a7c97"

An entry's ``source`` is a list of parts separated by ``;``. A part that starts with a tag,
``<name>@<commit prefix>``, cites code: the rest of the part is a comma-separated list of
repository-relative files, each optionally followed by ``:<line>`` or ``:<first>-<last>``,
and bare line ranges that add to the file before them::

    source = "A-grouping Sec. 4.3; DGML@7834411 configs/cub200.yaml:29-30, main.py:69, 73"

Text in parentheses is a note, never a citation; every other part (``A-grouping Sec. 4.3``)
cites the paper and is not read here. A file without a line cites the whole file.

``cited`` stores ``<citations>:<lines>``, two 8-digit hex prefixes of SHA-256 digests:

* ``<citations>`` of the citations themselves, one line per citation
  ``<repository>@<commit> <path>[:<ranges>]`` (the ``[[code]]`` table's repository and
  full commit; the ranges as ``a`` or ``a-b`` joined by ``,``), the lines joined by ``\\n``;
* ``<lines>`` of the cited text: each citation's lines in order (a file's lines are its
  text split at ``\\n``, a ``\\r`` before it dropped; the whole file for a citation without
  a line), each line stripped of surrounding whitespace, all joined by ``\\n``.

``benchmarks/check_citations.py`` computes both from a checkout of the commit and writes
them; a test recomputes the first half from ``source`` alone, so a citation edited after
its lines were read (and the commit changed in ``[[code]]``) shows without the checkout.
A note or a paper part can change freely: only the citations enter the digest.

The ``[not_applicable]`` and ``[unmeasured]`` reasons may cite ``<file>:<lines>`` in their
prose (:func:`reason_citations`): the script resolves and prints them, no digest binds them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from harness.base.errors import HarnessError

__all__ = [
    "CodeRepository",
    "Citation",
    "DIGEST_PATTERN",
    "parse_citations",
    "reason_citations",
    "citations_digest",
    "lines_digest",
    "file_lines",
    "cited_lines",
]

#: The form of an entry's ``cited`` value.
DIGEST_PATTERN = r"^[0-9a-f]{8}:[0-9a-f]{8}$"
_DIGITS = 8
_TAG = re.compile(r"^(?P<name>[\w./-]+)@(?P<commit>[0-9a-f]{7,40})\s+(?P<body>.*)$")
_SEGMENT = r"[\w+-][\w.+-]*"
_PATH = rf"{_SEGMENT}(?:/{_SEGMENT})*\.[A-Za-z0-9]+"
_FILE = re.compile(rf"^(?P<path>{_PATH})(?::(?P<range>\d+(?:-\d+)?))?$")
_RANGE = re.compile(r"^\d+(?:-\d+)?$")
#: A file and its lines in prose (a reason), optionally after a tag.
_PROSE = re.compile(
    rf"(?:(?P<name>[\w./-]+)@[0-9a-f]{{7,40}}\s+)?(?P<path>{_PATH})"
    r":(?P<ranges>\d+(?:-\d+)?(?:,\s*\d+(?:-\d+)?)*)"
)
_STRAY = re.compile(rf"@[0-9a-f]{{7}}|{_PATH}:\d")


@dataclass(frozen=True)
class CodeRepository:
    """A ``[[code]]`` table: the tag citations use, the repository and the full commit."""

    name: str
    repository: str
    commit: str


@dataclass(frozen=True)
class Citation:
    """A file of a cited repository and its line ranges (none: the whole file)."""

    repo: str
    path: str
    ranges: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        return f"{self.repo} {self.path}" + (f":{_ranges(self.ranges)}" if self.ranges else "")


def _ranges(ranges: Iterable[tuple[int, int]]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    a, b = int(first), int(last or first)
    if a < 1 or b < a:
        raise HarnessError(f"line range '{text}' is empty or starts before line 1")
    return a, b


def _without_notes(source: str) -> str:
    out, depth = [], 0
    for char in source:
        depth += char == "("
        if depth == 0:
            out.append(char)
        depth -= char == ")" and depth > 0
    if depth:
        raise HarnessError("a '(' is never closed")
    return "".join(out)


def _repository(name: str, commit: str, code: Mapping[str, CodeRepository]) -> CodeRepository:
    if name not in code:
        known = ", ".join(sorted(code)) or "none: the ledger has no [[code]] table"
        raise HarnessError(f"unknown repository tag '{name}' (known: {known})")
    if not code[name].commit.startswith(commit):
        raise HarnessError(
            f"'{name}@{commit}' is not the commit its [[code]] table records "
            f"({code[name].commit[:7]})"
        )
    return code[name]


def _code_part(name: str, body: str) -> list[Citation]:
    found: list[Citation] = []
    for item in (i.strip() for i in body.split(",")):
        if (match := _FILE.match(item)) is not None:
            ranges = (_range(match["range"]),) if match["range"] else ()
            found.append(Citation(name, match["path"], ranges))
        elif _RANGE.match(item) and found and found[-1].ranges:
            last = found.pop()
            found.append(Citation(name, last.path, (*last.ranges, _range(item))))
        else:
            raise HarnessError(
                f"cannot read '{item}' as a file, file:line or line range after '{name}@'"
            )
    return found


def parse_citations(source: str, code: Mapping[str, CodeRepository]) -> tuple[Citation, ...]:
    """The code citations of an entry's ``source`` in order (the module's grammar); a part
    that cannot be read, an unknown tag or a commit other than its ``[[code]]`` table's is a
    :class:`HarnessError`."""
    found: list[Citation] = []
    for part in (p.strip() for p in _without_notes(source).split(";")):
        match = _TAG.match(part)
        if match is None:
            if _STRAY.search(part):
                raise HarnessError(f"'{part}' cites code without starting with a tag (name@commit)")
            continue
        _repository(match["name"], match["commit"], code)
        found += _code_part(match["name"], match["body"])
    return tuple(found)


def reason_citations(reason: str, code: Mapping[str, CodeRepository]) -> tuple[Citation, ...]:
    """The ``<file>:<lines>`` citations in a reason's prose, each of the repository its tag
    names or, without a tag, of the ledger's only ``[[code]]`` repository."""
    found = []
    for match in _PROSE.finditer(reason):
        name = match["name"]
        if name is None:
            if len(code) != 1:
                raise HarnessError(
                    f"'{match[0]}' names no repository and the ledger has {len(code)} [[code]] tables"
                )
            name = next(iter(code))
        elif name not in code:
            _repository(name, "", code)
        ranges = tuple(_range(r.strip()) for r in match["ranges"].split(","))
        found.append(Citation(name, match["path"], ranges))
    return tuple(found)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_DIGITS]


def citations_digest(citations: Sequence[Citation], code: Mapping[str, CodeRepository]) -> str:
    """The first half of ``cited``: the digest of the citations at their full commits."""
    return _digest(
        "\n".join(
            f"{code[c.repo].repository}@{code[c.repo].commit} {c.path}"
            + (f":{_ranges(c.ranges)}" if c.ranges else "")
            for c in citations
        )
    )


def lines_digest(cited: Iterable[Sequence[str]]) -> str:
    """The second half of ``cited``: the digest of each citation's lines (:func:`cited_lines`)."""
    return _digest("\n".join(line for lines in cited for line in lines))


def file_lines(text: str) -> list[str]:
    """A file's lines as citations number them (from 1): split at ``\\n``, a ``\\r`` before
    it dropped, no empty line after a final ``\\n``."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def cited_lines(lines: Sequence[str], citation: Citation) -> list[str]:
    """The lines ``citation`` cites in a file of ``lines``, stripped, in the order cited; a
    range past the file's end is a :class:`HarnessError`."""
    if not citation.ranges:
        return [line.strip() for line in lines]
    out = []
    for a, b in citation.ranges:
        if b > len(lines):
            raise HarnessError(f"line {b} is past the end of {citation.path} ({len(lines)} lines)")
        out += [line.strip() for line in lines[a - 1 : b]]
    return out
