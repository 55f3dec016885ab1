"""A command writes only to a path that does not exist or over an output the harness wrote
there (its folder's record names it with the digest it has); an output changed since is
replaced with ``--force``; a file the harness did not write is refused in one line, with
``--force`` too, whatever it holds (a user's README with a table, a paper with a
``\begin{table}``). The command's own inputs, the files inside its dataset, the harness's
records (a run's checkpoint folder, a dataset's folder) and another program's database are
refused too, each left byte for byte as it was.

One test goes over every output flag of every command, as the parser declares them."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from harness.base.errors import HarnessError
from harness.base.written import write_output_json
from harness.cli.main import build_parser, main
from harness.cli.outputs import option_flags, output_file, output_flags
from tests.conftest import TINY_PROTOCOL

ROOT = Path(__file__).resolve().parents[2]
GRID = str(ROOT / "tests" / "grids" / "tiny.toml")
RUN = ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL))
TUNE = ("tune", "--method", "plain", "--trials", "1", "--protocol", str(TINY_PROTOCOL))

#: The shortest command line of each command that has outputs, before its output flag.
COMMANDS: dict[str, tuple[str, ...]] = {
    "run": RUN,
    "evaluate": ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy"),
    "sweep": ("sweep", "--grid", GRID),
    "tune": TUNE,
    "table": ("table", "--experiment", "x"),
    "explain": ("explain", "--run", "0123456789abcdef"),
    "explain-table": ("explain-table", "--experiment", "x"),
    "env": ("env", "0123456789abcdef"),
    "rerun": ("rerun", "0123456789abcdef"),
}
OUTPUTS = [
    (command, flag, form)
    for command, flags in output_flags(build_parser()).items()
    for flag, form in flags.items()
]
FOREIGN = b"notes the harness did not write\n"


def _tables(database: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(database)) as db:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _other_database(path: Path) -> Path:
    """Another program's SQLite database: one table of its own, one row."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        db.execute("INSERT INTO notes (text) VALUES ('mine')")
        db.commit()
    return path


def _refused(argv: list[str], match: str, capsys) -> str:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}; stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], f"{match!r} not in {lines[0]!r}"
    return lines[0]


def test_every_output_flag_is_declared_and_has_a_command_line_here():
    """The test below covers every output: each --json, --out and --storage of every command
    is declared an output, and each command with outputs has its command line above."""
    flags = option_flags(build_parser())
    declared = output_flags(build_parser())
    for command, options in flags.items():
        for flag in options:
            if flag in ("--json", "--out", "--storage") or (
                flag == "--checkpoint-root" and command in ("run", "sweep")
            ):
                assert flag in declared[command], f"{command} {flag} is not declared an output"
    assert {c for c, outputs in declared.items() if outputs} == set(COMMANDS)
    assert len(OUTPUTS) >= 10


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("command, flag, form", OUTPUTS, ids=[f"{c} {f}" for c, f, _ in OUTPUTS])
def test_every_output_flag_refuses_an_existing_foreign_file(
    command, flag, form, force, workdir, capsys, tmp_path
):
    foreign = tmp_path / "foreign.txt"
    foreign.write_bytes(FOREIGN)
    value, match = {
        "file": (str(foreign), "the harness did not write it"),
        "stem": (str(tmp_path / "foreign"), "the harness did not write it"),
        "folder": (str(foreign), "is a file, not a folder"),
        "storage": (f"sqlite:///{foreign}", "is a file that is not an SQLite database"),
    }[form]
    if form == "stem":
        foreign = foreign.rename(tmp_path / "foreign.md")
    forced = ["--force"] if force and "--force" in option_flags(build_parser())[command] else []
    line = _refused([*COMMANDS[command], flag, value, *forced], match, capsys)
    assert f"{flag} " in line
    assert foreign.read_bytes() == FOREIGN


def test_an_own_output_is_replaced_a_changed_one_with_force_a_foreign_one_never(tmp_path):
    parser = build_parser()
    plain = parser.parse_args(["evaluate", "--embeddings", "e", "--labels", "l"])
    forced = parser.parse_args(["evaluate", "--embeddings", "e", "--labels", "l", "--force"])
    earlier = tmp_path / "earlier.json"
    write_output_json(earlier, {"mode": "self", "metrics": {}, "num_queries": 3})
    assert output_file(earlier, "--json", args=plain) == earlier
    earlier.write_text(earlier.read_text() + " ")
    with pytest.raises(HarnessError, match="changed since it was written; give --force"):
        output_file(earlier, "--json", args=plain)
    assert output_file(earlier, "--json", args=forced) == earlier
    foreign = tmp_path / "out.json"
    foreign.write_text('{"mode": "self", "metrics": {}, "num_queries": 3}\n')
    for args in (plain, forced):
        with pytest.raises(HarnessError, match="the harness did not write it"):
            output_file(foreign, "--json", args=args)


USER_FILES = {
    "README.md": "# My results\n\n| method | R@1 |\n|:---|:---:|\n| mine | 70.1 |\n",
    "paper.tex": "\\documentclass{article}\n\\begin{document}\n\\begin{table}\n"
    "\\begin{tabular}{lc} mine & 70.1 \\end{tabular}\n\\end{table}\n\\end{document}\n",
}
USER_TABLE_CALLS = [
    ("table", "--experiment", "x", "--out", "{dir}/README.md"),
    ("table", "--experiment", "x", "--format", "latex", "--out", "{dir}/paper.tex"),
    ("table", "--experiment", "x", "--out", "{dir}/paper.md"),  # beside: paper.forest.png
    ("explain-table", "--experiment", "x", "--out", "{dir}/README"),
    ("explain-table", "--experiment", "x", "--out", "{dir}/paper"),
    ("env", "0123456789abcdef", "--out", "{dir}/README.md"),
]


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize(
    "argv", USER_TABLE_CALLS, ids=[" ".join(c[:1] + c[-1:]) for c in USER_TABLE_CALLS]
)
def test_a_users_document_holding_a_table_survives_byte_for_byte(
    argv, force, workdir, capsys, tmp_path
):
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "paper.forest.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's figure")
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv] + (["--force"] if force else [])
    _refused(argv, "the harness did not write it", capsys)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


def _image_folder(root: Path) -> Path:
    """A dataset of the user's own: one folder of PNG images per class."""
    from PIL import Image

    for c in range(4):
        (root / "imgs" / f"class_{c:02d}").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (60 * c, 20 * i, 0)).save(
                root / "imgs" / f"class_{c:02d}" / f"img_{i}.png"
            )
    return root / "imgs"


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("target", ["class_00/img_0.png", "class_00/new.json", "new.json"])
def test_nothing_inside_a_runs_dataset_is_an_output(target, force, workdir, capsys, tmp_path):
    images = _image_folder(tmp_path)
    before = {p: p.read_bytes() for p in images.rglob("*") if p.is_file()}
    argv = [*RUN, "--dataset", str(images), "--json", str(images / target)]
    _refused(argv + (["--force"] if force else []), "inside the command's input --dataset", capsys)
    assert {p: p.read_bytes() for p in images.rglob("*") if p.is_file()} == before


def test_explain_writes_its_figures_only_into_a_folder_of_its_own(workdir, capsys, tmp_path):
    (tmp_path / "notes.txt").write_bytes(FOREIGN)
    argv = ["explain", "--run", "0123456789abcdef", "--out", str(tmp_path)]
    _refused(argv, "holds files the harness did not write (notes.txt)", capsys)
    assert (tmp_path / "notes.txt").read_bytes() == FOREIGN


def _checkpoint_folder(root: Path) -> Path:
    folder = root / "ck" / "run-key"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"PK weights")
    (folder / "last.pt.sha256.json").write_text('{"file": "last.pt", "sha256": "0"}')
    return folder


def _dataset_folder(root: Path) -> Path:
    folder = root / "data" / "synthetic" / "v1-seed0"
    (folder / "images").mkdir(parents=True)
    (folder / "manifest.json").write_text('{"version": 1, "items": []}')
    return folder


# What the command reads or the harness keeps: refused with --force too.
NEVER_REPLACED = [
    (
        ("table", "--experiment", "x", "--published", "{dir}/pub.csv", "--out", "{dir}/pub.csv"),
        "pub.csv",
        "is the command's input --published",
    ),
    (
        ("evaluate", "--embeddings", "{dir}/e.npy", "--labels", "{dir}/l.npy"),
        "e.npy",
        "is the command's input --embeddings",
    ),
    (("run", "--methods", "plain", "--protocol", "{dir}/p.toml"), "p.toml", "input --protocol"),
    (
        ("table", "--experiment", "x", "--out", "{dir}/ck/run-key/model.pt"),
        "ck/run-key/model.pt",
        "in a run's checkpoint folder",
    ),
    (
        (*RUN, "--json", "{dir}/ck/run-key/model.pt"),
        "ck/run-key/model.pt",
        "in a run's checkpoint folder",
    ),
    (
        (*RUN, "--json", "{dir}/data/synthetic/v1-seed0/manifest.json"),
        "data/synthetic/v1-seed0/manifest.json",
        "in a dataset's folder",
    ),
]


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize(
    "argv, target, match", NEVER_REPLACED, ids=[c[1] + " " + c[0][0] for c in NEVER_REPLACED]
)
def test_an_input_or_a_harness_record_is_never_an_output(
    argv, target, match, force, workdir, capsys, tmp_path
):
    (tmp_path / "pub.csv").write_text("table,method,setting,dataset,metric,value\n")
    np.save(tmp_path / "e.npy", np.eye(4, dtype=np.float32))
    np.save(tmp_path / "l.npy", np.arange(4))
    (tmp_path / "p.toml").write_bytes(TINY_PROTOCOL.read_bytes())
    _checkpoint_folder(tmp_path)
    _dataset_folder(tmp_path)
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    if argv[0] == "evaluate":
        argv += ["--json", str(tmp_path / "e.npy")]
    elif argv[0] == "run" and "--json" not in argv:
        argv += ["--json", str(tmp_path / "p.toml")]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    _refused(argv + (["--force"] if force else []), match, capsys)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert (tmp_path / target).is_file()


STORAGES = [
    ("sweep", "--storage"),
    ("tune", "--storage"),
]


@pytest.mark.parametrize("command, flag", STORAGES)
@pytest.mark.parametrize("name", ["other.db", "notes.txt"])
def test_a_storage_is_never_another_programs_file(command, flag, name, workdir, capsys, tmp_path):
    path = tmp_path / name
    if name == "other.db":
        _other_database(path)
        match = "is an SQLite database without Optuna's tables (it holds notes)"
    else:
        path.write_bytes(FOREIGN)
        match = "is a file that is not an SQLite database"
    before = path.read_bytes()
    _refused([*COMMANDS[command], flag, f"sqlite:///{path}"], match, capsys)
    assert path.read_bytes() == before
    if name == "other.db":
        assert _tables(path) == {"notes"}


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("argv", [RUN, ("ui", "--port")], ids=["run", "ui"])
@pytest.mark.parametrize("name", ["other.db", "notes.txt"])
def test_the_tracking_store_is_never_another_programs_file(
    argv, name, workdir, tracking_dir, capsys, tmp_path, monkeypatch
):
    from tests.refusals import small_synthetic

    if argv[0] == "ui":
        argv = (*argv, _free_port())
    if argv[0] == "run":  # the dataset is there: the store is what is refused
        small_synthetic(tmp_path / "data")
        argv = (*argv, "--data-root", str(tmp_path / "data"))
    path = tmp_path / name
    if name == "other.db":
        _other_database(path)
        match = f"the tracking store sqlite:///{path} (MLFLOW_TRACKING_URI) is an SQLite database"
    else:
        path.write_bytes(FOREIGN)
        match = "is a file that is not an SQLite database"
    before = path.read_bytes()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{path}")
    _refused(list(argv), match, capsys)
    assert path.read_bytes() == before
    if name == "other.db":
        assert _tables(path) == {"notes"}


def test_a_tuned_sweep_checks_its_whole_table_set_before_any_work(workdir, capsys):
    """The sweep writes results/tables/<grid>.* at its end: a file there that the harness
    did not write is refused before the first trial, and left as it was."""
    tables = Path("results") / "tables"
    tables.mkdir(parents=True)
    mine = tables / "tiny-tuned-smoke.settings.tex"
    mine.write_text(USER_FILES["paper.tex"])
    argv = ["sweep", "--grid", str(ROOT / "tests" / "grids" / "tiny-tuned.toml"), "--smoke"]
    line = _refused(argv, "the harness did not write it", capsys)
    assert "tiny-tuned-smoke.settings.tex" in line
    assert mine.read_text() == USER_FILES["paper.tex"]
    assert sorted(p.name for p in tables.iterdir()) == [mine.name]
