"""A recipe ledger's code citations read against a checkout of the code they cite.

Every ``<file>:<lines>`` citation of each entry's ``source`` (the grammar of
:mod:`harness.config.citations`) is resolved in a checkout of the repository at the commit
its ledger's ``[[code]]`` table records, and its lines are printed under the entry's
setting, key and value, for a reader to see that they say what the entry claims. The
citations in the ``[not_applicable]`` and ``[unmeasured]`` reasons are resolved and printed
too (no digest binds them).

A checkout is a git repository, a clone or a bare mirror: the files are read at the
recorded commit (``git cat-file blob <commit>:<file>``), whatever its work tree holds, and
the commit must be in it. A plain folder of the commit's files is taken as that commit,
unverified. The project keeps no copy of the cited code.

Usage::

    python benchmarks/check_citations.py --ledger agrouping --checkout ~/src/DGML-master
    python benchmarks/check_citations.py --ledger avsl \\
        --checkout AVSL=~/src/AVSL --checkout GeDML=~/src/GeDML [--write-digests] [--quiet]

``--checkout NAME=PATH`` names the ``[[code]]`` table a checkout is for (a bare ``PATH``
when the ledgers given cite one repository); ``--ledger`` is a shipped ledger's name or a
``.toml`` path, and repeats. Exit 1, with one ``error:`` line per problem, when a file is
missing, a range runs past its file's end, or an entry's ``cited`` is not the digest of its
citations and their lines. ``--write-digests`` writes each entry's ``cited`` instead (only
when every citation resolves): run it after reading the printed lines. ``--quiet`` prints
the problems and the summary only.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.base.errors import HarnessError  # noqa: E402
from harness.config.citations import (  # noqa: E402
    Citation,
    CodeRepository,
    citations_digest,
    cited_lines,
    file_lines,
    lines_digest,
    reason_citations,
)
from harness.config.ledger import Ledger, LedgerEntry, load_ledger, stale_citations  # noqa: E402


class Checkout:
    """The files of one repository at its recorded commit."""

    def __init__(self, path: Path, code: CodeRepository):
        self.path, self.code = path, code
        self.git = (
            (path / ".git").exists() or (path / "HEAD").is_file() and (path / "objects").is_dir()
        )
        self._files: dict[str, list[str] | None] = {}
        if not path.is_dir():
            raise HarnessError(f"checkout of {code.repository} not found: {path}")
        if not self.git:
            self.note = f"{path} is no git repository: its files are taken as {code.commit[:7]}"
            return
        found = _git(path, "cat-file", "-e", f"{code.commit}^{{commit}}")
        if found.returncode:
            why = found.stderr.decode("utf-8", errors="replace").strip().splitlines()
            raise HarnessError(
                f"{path}: commit {code.commit} of {code.repository} cannot be read there"
                + (f" ({why[-1]})" if why else "")
            )
        head = _git(path, "rev-parse", "HEAD").stdout.decode().strip()
        self.note = f"{path}: files read at {code.commit[:7]} (git cat-file)" + (
            f", not at its HEAD {head[:7]}" if head != code.commit else ""
        )

    def lines(self, path: str) -> list[str] | None:
        """The file's lines at the commit (None: no such file)."""
        if path not in self._files:
            if self.git:
                done = _git(self.path, "cat-file", "blob", f"{self.code.commit}:{path}")
                text = None if done.returncode else done.stdout.decode("utf-8", errors="replace")
            else:
                file = self.path / path
                text = (
                    file.read_text(encoding="utf-8", errors="replace") if file.is_file() else None
                )
            self._files[path] = None if text is None else file_lines(text)
        return self._files[path]


def _git(path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(path), *args], capture_output=True, check=False)


@dataclass
class Report:
    """What one ledger's check found; the cited lines go to ``out``."""

    ledger: Ledger
    out: TextIO
    #: Citations that cannot be read: a missing file, a range past its file's end.
    problems: list[str] = field(default_factory=list)
    #: Entries whose ``cited`` is not what their lines give.
    mismatched: list[str] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    citations: int = 0
    lines: int = 0
    reasons: int = 0

    def summary(self) -> str:
        citing = sum(1 for entry in self.ledger.entries if entry.citations)
        found = len(self.problems) + len(self.mismatched)
        verdict = f"{found} problems" if found else "pass"
        return (
            f"{self.ledger.paper}: {citing} of {len(self.digests)} entries cite code; "
            f"{self.citations} citations ({self.lines} lines) and {self.reasons} reason "
            f"citations resolved: {verdict}"
        )

    def show(self, text: str) -> None:
        print(text, file=self.out)


def _read(
    citation: Citation, checkouts: dict[str, Checkout], report: Report, where: str
) -> list[str] | None:
    """The cited lines, printed; None (and a problem) when they cannot be read."""
    lines = checkouts[citation.repo].lines(citation.path)
    if lines is None:
        commit = checkouts[citation.repo].code.commit[:7]
        report.problems.append(f"{where}: {citation}: no such file at {commit}")
        return None
    try:
        cited = cited_lines(lines, citation)
    except HarnessError as err:
        report.problems.append(f"{where}: {citation}: {err}")
        return None
    report.show(f"  {citation}")
    if not citation.ranges:
        report.show(f"        (the whole file, {len(lines)} lines)")
    for number in (n for a, b in citation.ranges for n in range(a, b + 1)):
        report.show(f"    {number:>4}  {lines[number - 1].rstrip()}")
    return cited


def _entry(number: int, entry: LedgerEntry, checkouts: dict[str, Checkout], report: Report) -> str:
    """The entry's digest from its cited lines ("" when it cites no code or a file or line
    is missing)."""
    if not entry.citations:
        return ""
    where = f"{report.ledger.paper} entry {number} ({entry.setting})"
    report.show(f"\n{where}: {entry.key} = {entry.value!r}\n  source: {entry.source}")
    found = [_read(c, checkouts, report, where) for c in entry.citations]
    report.citations += len(found)
    read = [lines for lines in found if lines is not None]
    if len(read) < len(found):
        return ""
    report.lines += sum(map(len, read))
    digest = f"{citations_digest(entry.citations, report.ledger.code)}:{lines_digest(read)}"
    if entry.cited != digest:
        report.mismatched.append(
            f"{where}: cited is {entry.cited or 'missing'}, the cited lines give {digest} "
            "(read them, then --write-digests)"
        )
    return digest


def _reasons(checkouts: dict[str, Checkout], report: Report) -> None:
    ledger = report.ledger
    for table, reasons in (
        ("not_applicable", ledger.not_applicable),
        ("unmeasured", ledger.unmeasured),
    ):
        for key, reason in reasons.items():
            where = f"{ledger.paper} [{table}] {key}"
            try:
                citations = reason_citations(reason, ledger.code)
            except HarnessError as err:
                report.problems.append(f"{where}: {err}")
                continue
            if citations:
                report.show(f"\n{where}: {reason}")
            for citation in citations:
                report.reasons += 1
                _read(citation, checkouts, report, where)


def check(ledger: Ledger, checkouts: dict[str, Checkout], out: TextIO = sys.stdout) -> Report:
    """Every citation of ``ledger`` resolved and printed to ``out``; the problems and
    digests found."""
    report = Report(ledger, out)
    for checkout in checkouts.values():
        report.show(checkout.note)
    for number, entry in enumerate(ledger.entries, 1):
        report.digests.append(_entry(number, entry, checkouts, report))
    _reasons(checkouts, report)
    return report


def write_digests(path: Path, digests: Sequence[str]) -> None:
    """Each ``[[entry]]`` table's ``cited`` line set to its digest (removed where it is ""),
    right after the entry's ``source`` line; the rest of the file as it was."""
    out: list[str] = []
    index, inside = -1, False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.startswith("["):
            inside = line.strip() == "[[entry]]"
            index += inside
        if inside and line.startswith("cited = "):
            continue
        out.append(line)
        if inside and line.startswith("source = ") and digests[index]:
            out.append(f'cited = "{digests[index]}"')
    if index + 1 != len(digests):
        raise HarnessError(f"{path}: {index + 1} [[entry]] tables, {len(digests)} entries")
    path.write_text("\n".join(out), encoding="utf-8")


def _checkouts(ledger: Ledger, given: dict[str, Path]) -> dict[str, Checkout]:
    missing = sorted(set(ledger.code) - set(given))
    if missing:
        raise HarnessError(f"ledger {ledger.paper}: no --checkout for {', '.join(missing)}")
    return {name: Checkout(given[name], code) for name, code in ledger.code.items()}


def _named(ledgers: Sequence[Ledger], given: Sequence[str]) -> dict[str, Path]:
    """``--checkout`` values by repository name; a bare path is the only repository's."""
    names = {name for ledger in ledgers for name in ledger.code}
    paths: dict[str, Path] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep:
            if len(names) != 1:
                raise HarnessError(
                    f"--checkout {item}: name its repository ({', '.join(sorted(names))})"
                )
            name, path = next(iter(names)), item
        if name not in names:
            raise HarnessError(f"--checkout {item}: no ledger given cites '{name}'")
        paths[name] = Path(path).expanduser()
    return paths


def run(ledger: Ledger, given: dict[str, Path], *, write: bool, out: TextIO) -> Report:
    """Check one ledger, writing its digests with ``write`` when every citation resolves."""
    report = check(ledger, _checkouts(ledger, given), out)
    if write and not report.problems:
        write_digests(ledger.path, report.digests)
        report.show(f"wrote the digests of {ledger.path}")
        report.mismatched = stale_citations(load_ledger(ledger.path))
    elif write:
        report.mismatched = []
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--ledger", action="append", required=True, help="name or .toml path")
    parser.add_argument("--checkout", action="append", default=[], help="[NAME=]PATH")
    parser.add_argument("--write-digests", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="the problems and summary only")
    args = parser.parse_args(argv)
    out = io.StringIO() if args.quiet else sys.stdout
    problems = []
    try:
        ledgers = [load_ledger(name) for name in args.ledger]
        given = _named(ledgers, args.checkout)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for ledger in ledgers:
        try:
            report = run(ledger, given, write=args.write_digests, out=out)
        except HarnessError as err:
            problems.append(str(err))
            continue
        print(report.summary())
        problems += report.problems + report.mismatched
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
