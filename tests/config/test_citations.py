"""Code citations in the recipe ledgers (harness/config/citations.py): every citation
reads, every entry that cites released code stores the digest of its citations and of the
lines they cite, and a citation edited without its lines read again shows without the code.
``benchmarks/check_citations.py`` is checked on small checkouts made here."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.base.errors import HarnessError
from harness.config.citations import (
    Citation,
    CodeRepository,
    citations_digest,
    cited_lines,
    file_lines,
    lines_digest,
    parse_citations,
    reason_citations,
)
from harness.config.ledger import ledger_dir, list_ledgers, load_ledger, stale_citations

REPO = Path(__file__).resolve().parents[2]
COMMIT = "a" * 40
CODE = {"R": CodeRepository("R", "owner/repo", COMMIT)}
#: The repositories each ledger cites (none: the paper released no code).
RELEASED = {
    "agrouping": {"DGML": "XinyiXuXD/DGML-master"},
    "avsl": {"AVSL": "zbr17/AVSL", "GeDML": "zbr17/GeDML"},
    "diml": {"DIML": "wl-zhao/DIML"},
    "diablo": {},
    "sam": {},
}


def test_a_source_reads_as_files_and_line_ranges_notes_and_paper_parts_aside():
    source = (
        "Paper Sec. 4.3 (a note; R@aaaaaaa x.py:1 in a note); "
        "R@aaaaaaa configs/a.yaml:29-30, main.py:69, 73 (a note), lib/b.py"
    )
    assert parse_citations(source, CODE) == (
        Citation("R", "configs/a.yaml", ((29, 30),)),
        Citation("R", "main.py", ((69, 69), (73, 73))),
        Citation("R", "lib/b.py"),
    )
    assert str(parse_citations(source, CODE)[1]) == "R main.py:69,73"
    assert parse_citations("DIABLO Sec. 4.3 (Table 3), Table 1", {}) == ()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("Q@aaaaaaa a.py:1", "unknown repository tag 'Q' \\(known: R\\)"),
        ("R@bbbbbbb a.py:1", "'R@bbbbbbb' is not the commit its \\[\\[code\\]\\] table records"),
        ("R@aaaaaaa a.py:3-2", "line range '3-2' is empty"),
        ("R@aaaaaaa a.py:0", "starts before line 1"),
        ("R@aaaaaaa 12, a.py:1", "cannot read '12'"),
        ("R@aaaaaaa a.py, 3", "cannot read '3'"),
        ("R@aaaaaaa a.py:1 and b.py", "cannot read 'a.py:1 and b.py'"),
        ("R@aaaaaaa ../a.py:1", "cannot read '../a.py:1'"),
        ("Sec. 2; configs/a.yaml:3", "'configs/a.yaml:3' cites code without starting with a tag"),
        ("R@aaaaaaa a.py:1 (a note", "a '\\(' is never closed"),
    ],
)
def test_a_source_that_cannot_be_read_is_refused(source, message):
    with pytest.raises(HarnessError, match=message):
        parse_citations(source, CODE)


def _trial(tmp_path: Path, source: str, code: str = f'"{COMMIT}"', name: str = "trial") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'paper = "trial"\n[[code]]\nname = "R"\nrepository = "owner/repo"\ncommit = {code}\n'
        f'[[entry]]\nsetting = "s"\nkey = "seeds"\nvalue = [0]\nsource = "{source}"\n',
        encoding="utf-8",
    )
    return path


def test_a_bad_citation_or_code_table_is_one_line_naming_the_ledger(tmp_path):
    with pytest.raises(HarnessError) as err:
        load_ledger(_trial(tmp_path, "Q@aaaaaaa a.py:1"))
    assert str(err.value).startswith("ledger trial entry 1 (s): source: unknown repository tag")
    with pytest.raises(HarnessError, match=r"ledger trial key 'code\[0\]\.commit' = \"abc\""):
        load_ledger(_trial(tmp_path, "x", code='"abc"'))
    path = _trial(tmp_path, "x")
    path.write_text(path.read_text() + 'cited = "12"\n')
    with pytest.raises(HarnessError, match=r"ledger trial key 'entry\[0\]\.cited' = \"12\""):
        load_ledger(path)


def test_a_reason_cites_lines_in_its_prose():
    reason = "the code decays it with the backbone (ft_params, outline.py:20-33, 40)"
    assert reason_citations(reason, CODE) == (Citation("R", "outline.py", ((20, 33), (40, 40))),)
    assert reason_citations("the paper's Sec. 4.2: no file", CODE) == ()
    two = {**CODE, "S": CodeRepository("S", "owner/other", "b" * 40)}
    assert reason_citations("as S@bbbbbbb a/b.py:3 does", two) == (
        Citation("S", "a/b.py", ((3, 3),)),
    )
    with pytest.raises(HarnessError, match="names no repository"):
        reason_citations("(outline.py:20-33)", two)


def test_the_digest_binds_the_citations_at_their_commit_and_the_stripped_lines():
    cited = parse_citations("R@aaaaaaa a.py:2", CODE)
    assert citations_digest(cited, CODE) == citations_digest(
        parse_citations("R@aaaaaaa a.py:2 (a note); the paper's Sec. 2", CODE), CODE
    )
    assert citations_digest(cited, CODE) != citations_digest(
        parse_citations("R@aaaaaaa a.py:3", CODE), CODE
    )
    moved = {"R": CodeRepository("R", "owner/repo", "a" * 39 + "b")}
    assert citations_digest(cited, CODE) != citations_digest(cited, moved)
    lines = file_lines("one\r\n  two  \nthree\n")
    assert lines == ["one", "  two  ", "three"]
    assert cited_lines(lines, cited[0]) == ["two"]
    assert lines_digest([["two"]]) == lines_digest(
        [cited_lines(file_lines("one\n\ttwo\n"), cited[0])]
    )
    assert lines_digest([["two"]]) != lines_digest([["two!"]])
    with pytest.raises(HarnessError, match="line 4 is past the end of a.py \\(3 lines\\)"):
        cited_lines(lines, Citation("R", "a.py", ((3, 4),)))


@pytest.mark.parametrize("paper", list_ledgers())
def test_every_code_citation_of_a_ledger_reads_and_is_bound_by_its_digest(paper):
    ledger = load_ledger(paper)
    assert {name: code.repository for name, code in ledger.code.items()} == RELEASED[paper]
    assert stale_citations(ledger) == []
    assert any(entry.citations for entry in ledger.entries) == bool(ledger.code)
    for reason in [*ledger.not_applicable.values(), *ledger.unmeasured.values()]:
        reason_citations(reason, ledger.code)


def _copy(tmp_path: Path, paper: str, old: str, new: str) -> Path:
    path = tmp_path / f"{paper}.toml"
    text = (ledger_dir() / f"{paper}.toml").read_text(encoding="utf-8")
    assert text.count(old) == 1
    path.write_text(text.replace(old, new), encoding="utf-8")
    return path


def test_a_citation_edited_without_its_digest_is_stale(tmp_path):
    old = 'source = "DGML@7834411 configs/defaults.py:41, configs/cub200.yaml:30, main.py:69"'
    edited = _copy(tmp_path, "agrouping", old, old.replace("yaml:30", "yaml:29-30"))
    (found,) = stale_citations(load_ledger(edited))
    assert "(evaluated every epoch" in found and "other citations than the source's" in found
    noted = _copy(tmp_path, "agrouping", old, old.replace('main.py:69"', 'main.py:69 (a note)"'))
    assert stale_citations(load_ledger(noted)) == []


def test_a_recorded_commit_changed_without_new_digests_leaves_every_entry_stale(tmp_path):
    old = 'commit = "c15dbea696f68ddf889dcacfcaacd315d16a34ac"'
    moved = load_ledger(_copy(tmp_path, "diml", old, old.replace("34ac", "34ad")))
    assert len(stale_citations(moved)) == sum(1 for e in moved.entries if e.citations) > 0


# ------------------------------------------------------------- the checking script


@pytest.fixture(scope="module")
def check_citations():
    """The script's functions, as ``python benchmarks/check_citations.py`` runs them."""
    path = list(sys.path)
    try:
        yield runpy.run_path(str(REPO / "benchmarks" / "check_citations.py"), run_name="script")
    finally:
        sys.path[:] = path


def _git(folder: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    done = subprocess.run([*command, "-C", str(folder), *args], capture_output=True, check=True)
    return done.stdout.decode().strip()


@pytest.fixture
def checkout(tmp_path):
    """A git repository of one commit holding ``src/a.py`` (3 lines); its commit."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    folder = tmp_path / "checkout"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "a.py").write_text("first = 1\n    second = 2\nthird = 3\n")
    _git(folder, "init", "-q")
    _git(folder, "add", "-A")
    _git(folder, "commit", "-qm", "one")
    return folder, _git(folder, "rev-parse", "HEAD")


def _ledger(tmp_path: Path, commit: str, source: str, name: str = "trial") -> Path:
    return _trial(tmp_path, source.replace("@c", f"@{commit[:7]}"), f'"{commit}"', name)


def test_the_script_writes_then_checks_the_digests_and_prints_the_lines(
    check_citations, checkout, tmp_path, capsys
):
    folder, commit = checkout
    path = _ledger(tmp_path, commit, "Paper Sec. 1; R@c src/a.py:2-3")
    args = ["--ledger", str(path), "--checkout", str(folder)]
    assert check_citations["main"]([*args, "--write-digests"]) == 0
    assert 'cited = "' in path.read_text() and stale_citations(load_ledger(path)) == []
    capsys.readouterr()
    assert check_citations["main"](args) == 0
    out = capsys.readouterr().out
    assert "  R src/a.py:2-3\n       2      second = 2\n       3  third = 3\n" in out
    assert "trial: 1 of 1 entries cite code; 1 citations (2 lines) and 0 reason" in out
    assert out.rstrip().endswith(": pass")


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("R@c src/a.py:2-4", "R src/a.py:2-4: line 4 is past the end of src/a.py (3 lines)"),
        ("R@c src/b.py:1", "R src/b.py:1: no such file at "),
        ("R@c src/a.py:1, b.py", "R b.py: no such file at "),
    ],
)
def test_the_script_fails_on_a_line_or_file_the_checkout_lacks(
    check_citations, checkout, tmp_path, capsys, source, problem
):
    folder, commit = checkout
    path = _ledger(tmp_path, commit, source)
    for write in ([], ["--write-digests"]):
        assert (
            check_citations["main"](["--ledger", str(path), "--checkout", str(folder), *write]) == 1
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and err[0].startswith("error: trial entry 1 (s): ") and problem in err[0]
        )
    assert "cited" not in path.read_text()


def test_the_script_fails_on_a_digest_its_lines_do_not_give(
    check_citations, checkout, tmp_path, capsys
):
    folder, commit = checkout
    path = _ledger(tmp_path, commit, "R@c src/a.py:2")
    args = ["--ledger", str(path), "--checkout", str(folder)]
    assert check_citations["main"]([*args, "--write-digests"]) == 0
    path.write_text(path.read_text().replace("src/a.py:2", "src/a.py:3"))
    assert check_citations["main"](args) == 1
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "error: trial entry 1 (s): cited is " in err and ", the cited lines give " in err
    assert check_citations["main"]([*args, "--write-digests"]) == 0
    assert check_citations["main"](args) == 0


def test_the_script_reads_the_recorded_commit_not_the_work_tree(
    check_citations, checkout, tmp_path, capsys
):
    folder, commit = checkout
    path = _ledger(tmp_path, commit, "R@c src/a.py:2")
    args = ["--ledger", str(path), "--checkout", str(folder)]
    assert check_citations["main"]([*args, "--write-digests"]) == 0
    (folder / "src" / "a.py").write_text("first = 1\nchanged = 2\nthird = 3\n")
    _git(folder, "commit", "-qam", "two")
    assert check_citations["main"](args) == 0
    assert f"not at its HEAD {_git(folder, 'rev-parse', 'HEAD')[:7]}" in capsys.readouterr().out
    plain = tmp_path / "plain"
    shutil.copytree(folder / "src", plain / "src")
    assert check_citations["main"](["--ledger", str(path), "--checkout", str(plain)]) == 1
    assert "the cited lines give" in capsys.readouterr().err
    other = _ledger(tmp_path, "b" * 40, "R@c src/a.py:2", name="other")
    assert check_citations["main"](["--ledger", str(other), "--checkout", str(folder)]) == 1
    assert f"commit {'b' * 40} of owner/repo cannot be read there" in capsys.readouterr().err
