"""Refusals of bad files, folders, ports, stores and datasets: each is one ``error:`` line,
exit status 2, no traceback, and nothing new on disk or in the tracking store
(:func:`tests.refusals.assert_refused`). Every case is refused before any training.

Cases name their paths relative to the working directory (``workdir``); ``prepare``
builds the bad input there first. An unwritable folder is a symlink to ``/proc`` (no
file can be created there, not even by root, for whom a ``chmod 0o500`` folder stays
writable) or, for other users, a folder without write permission.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest
import torch

from harness.cli.main import main
from harness.methods import METHODS, HeadOutput
from harness.methods.base import MethodEntry
from harness.methods.plain import PlainHead
from tests.fixtures import make_cars, make_cub, make_inshop, make_sop
from tests.refusals import Refusal, assert_refused

TINY = str(Path(__file__).parents[1] / "protocols" / "tiny.toml")
GRID = str(Path(__file__).parents[1] / "grids" / "tiny.toml")
RUN = ("run", "--methods", "plain", "--protocol", TINY, "--epochs", "1")


def a_file(name: str = "afile"):
    def prepare(where: Path) -> None:
        (where / name).write_text("not a folder\n")

    return prepare


def a_folder(name: str = "adir"):
    def prepare(where: Path) -> None:
        (where / name).mkdir()

    return prepare


def unwritable(name: str = "ro"):
    """A folder no file can be created in, for any user."""

    def prepare(where: Path) -> None:
        if os.geteuid() == 0:
            (where / name).symlink_to("/proc", target_is_directory=True)
        else:
            (where / name).mkdir()
            (where / name).chmod(0o500)

    return prepare


def embeddings(labels: list[int], query_labels: list[int] | None = None):
    """``emb.npy``/``lab.npy`` (and ``q.npy``/``ql.npy``) of random embeddings."""

    def prepare(where: Path) -> None:
        rng = np.random.default_rng(0)
        np.save(where / "emb.npy", rng.normal(size=(len(labels), 4)).astype(np.float32))
        np.save(where / "lab.npy", np.array(labels))
        if query_labels is not None:
            np.save(where / "q.npy", rng.normal(size=(len(query_labels), 4)).astype(np.float32))
            np.save(where / "ql.npy", np.array(query_labels))

    return prepare


def cub(damage):
    """A CUB tree in the official layout under ``cub/``, then ``damage(tree)``."""

    def prepare(where: Path) -> None:
        damage(make_cub(where / "cub", classes=200, per_class=1))

    return prepare


def sop(damage):
    def prepare(where: Path) -> None:
        damage(make_sop(where / "sop"))

    return prepare


def grid_on_cub(damage):
    """``cub-grid.toml``: the tiny grid on cub200, whose tree under ``cub/`` is damaged."""

    def prepare(where: Path) -> None:
        grid = (
            Path(GRID)
            .read_text()
            .replace('"synthetic"', '"cub200"')
            .replace("../protocols/tiny.toml", TINY)
        )
        (where / "cub-grid.toml").write_text(grid)
        cub(damage)(where)

    return prepare


def _rewrite(path: Path, old: str, new: str) -> None:
    path.write_text(path.read_text().replace(old, new, 1))


EVALUATE = ("evaluate", "--embeddings", "emb.npy", "--labels", "lab.npy")
CUB_RUN = (
    *RUN,
    "--dataset",
    "cub200",
    "--data-root",
    "cub",
    "--set",
    "splits.max_test_images_per_class=0",
)
SOP_RUN = (*RUN, "--dataset", "sop", "--data-root", "sop")

CASES = [
    # --- output files: --json, --out (item 1, 8)
    Refusal((*RUN, "--json", "afile/o.json"), "afile is a file, not a folder", a_file()),
    Refusal((*RUN, "--json", "adir"), "--json adir is a folder; give a file name", a_folder()),
    Refusal((*RUN, "--json", "newdir/"), "--json newdir/ is a folder"),
    Refusal((*RUN, "--json", "ro/o.json"), "cannot write in ro", unwritable()),
    Refusal((*RUN, "--json", ""), "--json is empty"),
    Refusal(
        (*RUN, "--checkpoint-root", "afile"),
        "--checkpoint-root afile is a file, not a folder",
        a_file(),
    ),
    Refusal(
        (*RUN, "--checkpoint-root", "afile/ckpt"),
        "--checkpoint-root afile/ckpt: afile is a file",
        a_file(),
    ),
    Refusal(
        (*RUN, "--checkpoint-root", "ro/ckpt"),
        "--checkpoint-root ro/ckpt: cannot write in ro",
        unwritable(),
    ),
    Refusal((*EVALUATE, "--json", "adir"), "--json adir is a folder", a_folder()),
    Refusal((*EVALUATE, "--json", "ro/r.json"), "cannot write in ro", unwritable()),
    Refusal(
        ("explain", "--run", "0" * 32, "--json", "adir"), "--json adir is a folder", a_folder()
    ),
    Refusal(
        ("explain", "--run", "0" * 32, "--json", "ro/x.json"),
        "--json ro/x.json: cannot write in ro",
        unwritable(),
    ),
    Refusal(
        ("explain", "--run", "0" * 32, "--out", "afile"),
        "--out afile is a file, not a folder",
        a_file(),
    ),
    Refusal(
        ("explain", "--run", "0" * 32, "--out", "ro/figures"), "cannot write in ro", unwritable()
    ),
    Refusal(
        ("explain-table", "--experiment", "e", "--out", "adir/"),
        "--out adir/ is a folder",
        a_folder(),
    ),
    Refusal(
        ("explain-table", "--experiment", "e", "--out", "adir"),
        "--out adir is a folder",
        a_folder(),
    ),
    Refusal(
        ("explain-table", "--experiment", "e", "--out", "afile/t"), "afile is a file", a_file()
    ),
    Refusal(("table", "--experiment", "e", "--out", "adir"), "--out adir is a folder", a_folder()),
    Refusal(
        ("table", "--experiment", "e", "--out", "ro/t.tex"), "cannot write in ro", unwritable()
    ),
    Refusal(("table", "--experiment", "e", "--out", "afile/t.tex"), "afile is a file", a_file()),
    Refusal(
        ("sweep", "--grid", GRID, "--smoke", "--checkpoint-root", "afile"),
        "--checkpoint-root afile is a file",
        a_file(),
    ),
    # --- datasets: index files, images, data roots (item 2)
    Refusal(
        CUB_RUN, "expected the index file", cub(lambda t: (t / "image_class_labels.txt").unlink())
    ),
    Refusal(
        CUB_RUN,
        "corrupt image",
        cub(lambda t: (t / "images/150.Bird_150/Bird_150_0000.jpg").write_bytes(b"not a jpeg")),
    ),
    Refusal(
        CUB_RUN,
        "corrupt image",
        cub(lambda t: (t / "images/007.Bird_7/Bird_7_0000.jpg").write_bytes(b"")),
    ),
    Refusal(
        CUB_RUN,
        "image listed by the dataset is missing",
        cub(lambda t: (t / "images/160.Bird_160/Bird_160_0000.jpg").unlink()),
    ),
    Refusal(
        CUB_RUN, "has no row in", cub(lambda t: _rewrite(t / "image_class_labels.txt", "1 1\n", ""))
    ),
    Refusal(
        CUB_RUN,
        "malformed class id",
        cub(lambda t: _rewrite(t / "image_class_labels.txt", "1 1\n", "1 one\n")),
    ),
    Refusal(SOP_RUN, "expected the index file", sop(lambda t: (t / "Ebay_test.txt").unlink())),
    Refusal(
        SOP_RUN,
        "expected header 'image_id class_id super_class_id path'",
        sop(lambda t: _rewrite(t / "Ebay_test.txt", "image_id", "id")),
    ),
    Refusal(
        (*RUN, "--dataset", "cars196", "--data-root", "cars"),
        "cannot read",
        lambda w: (
            make_cars(w / "cars", classes=196, per_class=1)
            .joinpath("cars_annos.mat")
            .write_bytes(b"x")
        ),
    ),
    Refusal(
        (*RUN, "--dataset", "inshop", "--data-root", "shop"),
        "expected a count on line 1",
        lambda w: _rewrite(
            make_inshop(w / "shop") / "list_eval_partition.txt", "image_name", "name"
        ),
    ),
    Refusal(
        (*RUN, "--data-root", "afile"),
        "--data-root afile does not exist or is not a folder",
        a_file(),
    ),
    Refusal(
        ("datasets", "--data-root", "/nonexistent/data"),
        "--data-root /nonexistent/data does not exist",
    ),
    Refusal(("datasets", "verify", "cub"), "unknown dataset 'cub'; did you mean 'cub200'?"),
    Refusal(
        ("datasets", "verify", "cub200", "--data-root", "afile"),
        "does not exist or is not a folder",
        a_file(),
    ),
    Refusal(
        ("datasets", "verify", "cub200", "--data-root", "adir"),
        "dataset 'cub200' not found",
        a_folder(),
    ),
    Refusal(("datasets", "verify", "sop", "--threads", "0"), "--threads must be >= 1"),
    Refusal(
        ("datasets", "verify", "cub200", "--data-root", "cub"),
        "corrupt image",
        cub(
            lambda t: (t / "images/003.Bird_3/Bird_3_0000.jpg").write_bytes(
                b"\xff\xd8\xff\xe0 truncated"
            )
        ),
    ),
    # --- ports (item 4)
    Refusal(("ui", "--port", "99999"), "--port 99999 is out of range; give a port from 1 to 65535"),
    Refusal(("ui", "--port", "0"), "--port 0 is out of range"),
    Refusal(("ui", "--port", "-80"), "--port -80 is out of range"),
    Refusal(
        ("ui", "--host", "no-such-host.invalid"), "--host no-such-host.invalid is not an address"
    ),
    # --- evaluate (item 5) and other input files
    Refusal(EVALUATE, "all 5 labels are distinct", embeddings([0, 1, 2, 3, 4])),
    Refusal(
        (*EVALUATE, "--query-embeddings", "q.npy", "--query-labels", "ql.npy"),
        "none of the 2 queries",
        embeddings([0, 0, 1, 1], [5, 6]),
    ),
    Refusal(("evaluate", "--embeddings", "missing.npy", "--labels", "lab.npy"), "missing.npy"),
    Refusal(("evaluate", "--embeddings", "adir", "--labels", "lab.npy"), "adir", a_folder()),
    Refusal(
        ("evaluate", "--embeddings", "empty.npy", "--labels", "lab.npy"),
        "empty.npy",
        lambda w: (w / "empty.npy").write_bytes(b""),
    ),
    # --- tables (item 6) and the store
    Refusal(
        ("table", "--experiment", "e", "--baseline", "nosuch"), "unknown --baseline method 'nosuch'"
    ),
    Refusal(("table", "--experiment", "e", "--baseline", "plian"), "did you mean 'plain'?"),
    Refusal(("table", "--experiment", "no-such-experiment"), "no-such-experiment"),
    Refusal(("table", "--experiment", "e", "--published", "missing.csv"), "missing.csv"),
    Refusal(("table", "--experiment", "e", "--published", "adir"), "adir", a_folder()),
    Refusal(("explain-table", "--experiment", "no-such-experiment"), "no-such-experiment"),
    Refusal(("explain", "--run", "0" * 32), "0" * 32),
    Refusal(
        ("explain", "--run", "0" * 32, "--data-root", "afile"),
        "--data-root afile does not exist",
        a_file(),
    ),
    Refusal((*RUN, "--init-from", "0" * 32), "0" * 32),
    Refusal(("run", "--protocol", "missing.toml"), "missing.toml"),
    Refusal(
        (
            "tune",
            "--method",
            "plain",
            "--trials",
            "1",
            "--protocol",
            TINY,
            "--storage",
            "sqlite:///afile/o.db",
        ),
        "cannot open the Optuna storage",
        a_file(),
    ),
    Refusal(
        ("sweep", "--grid", GRID, "--smoke", "--storage", "sqlite:///afile/o.db"),
        "cannot open the Optuna storage",
        a_file(),
    ),
    Refusal(("sweep", "--grid", "missing-grid.toml"), "missing-grid"),
    Refusal(
        ("sweep", "--grid", "cub-grid.toml", "--data-root", "cub"),
        "expected the index file",
        grid_on_cub(lambda t: (t / "image_class_labels.txt").unlink()),
    ),
    Refusal(
        ("datasets", "fetch", "cub200", "--data-root", ".", "--from", "missing.tgz"), "missing.tgz"
    ),
]


@pytest.fixture
def store_settled(tracking_dir):
    """The session store with no run of a dead process left RUNNING (another test's), so
    that marking one FAILED does not add a line to a refusal's stderr."""
    from harness.store.dead_runs import fail_dead_runs
    from harness.store.location import tracking_uri

    fail_dead_runs()
    mlflow.set_tracking_uri(tracking_uri())


def _case_id(case: Refusal) -> str:
    return " ".join(case.argv).replace(TINY, "tiny.toml").replace(GRID, "tiny-grid.toml")[:100]


def _restore_writable(where: Path) -> None:
    """Let pytest remove the unwritable folder of a case (not needed for the symlink)."""
    folder = where / "ro"
    if folder.is_dir() and not folder.is_symlink():
        folder.chmod(0o700)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_refused(case, workdir, data_root, capsys, store_settled):
    if case.prepare is not None:
        case.prepare(workdir)
    try:
        assert_refused(list(case.argv), case.match, capsys, [workdir, data_root])
    finally:
        _restore_writable(workdir)


ENV_CASES = [
    (
        {"DML_HARNESS_CHECKPOINTS": "afile"},
        RUN,
        "the checkpoint root ($DML_HARNESS_CHECKPOINTS, else results/checkpoints) afile is a file",
    ),
    (
        {"DML_HARNESS_CHECKPOINTS": "ro/ckpt"},
        ("tune", "--method", "plain", "--trials", "1", "--protocol", TINY),
        "cannot write in ro",
    ),
    (
        {"MLFLOW_TRACKING_URI": "sqlite:///{w}/afile/mlflow.db"},
        ("table", "--experiment", "e"),
        "afile, a file (MLFLOW_TRACKING_URI)",
    ),
    (
        {"MLFLOW_TRACKING_URI": "sqlite:///{w}/adir"},
        ("table", "--experiment", "e"),
        "is a folder, not a database file (MLFLOW_TRACKING_URI)",
    ),
    (
        {"MLFLOW_TRACKING_URI": "sqlite:///{w}/afile/mlflow.db"},
        ("explain-table", "--experiment", "e"),
        "afile, a file",
    ),
    (
        {"MLFLOW_TRACKING_URI": ""},
        RUN,
        "MLFLOW_TRACKING_URI is set but empty: expected a tracking store",
    ),
    (
        {"MLFLOW_TRACKING_URI": " "},
        ("table", "--experiment", "e"),
        "MLFLOW_TRACKING_URI is set but empty",
    ),
    (
        {"DML_HARNESS_DATA": "afile"},
        ("datasets",),
        "the data root ($DML_HARNESS_DATA, else ~/.cache/dml-harness) afile is a file, "
        "not a folder",
    ),
]


@pytest.mark.parametrize(
    "env, argv, match",
    ENV_CASES,
    ids=[" ".join(c[1][:1]) + " " + next(iter(c[0])) for c in ENV_CASES],
)
def test_refused_settings(env, argv, match, workdir, data_root, capsys, monkeypatch, store_settled):
    """Bad stores and checkpoint roots given by environment variable; the refusal's own
    store look-ups keep the session store (set in MLflow before the variable changes)."""
    a_file()(workdir)
    a_folder()(workdir)
    unwritable()(workdir)
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(w=workdir))
    try:
        assert_refused(list(argv), match, capsys, [workdir, data_root])
    finally:
        _restore_writable(workdir)


def test_a_port_in_use_is_refused_with_a_hint(workdir, data_root, capsys, store_settled):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = assert_refused(
            ["ui", "--port", str(port)],
            f"--port {port}: cannot listen on 127.0.0.1:{port}",
            capsys,
            [workdir],
        )
    assert "--port" in line.split(";")[-1]


class FailingHead(PlainHead):
    """A plain head whose loss is NaN: every trial of a study over it fails (test only)."""

    def loss_terms(self, output: HeadOutput, batch):
        return {
            "metric": batch.metric_loss(output.embedding, batch.labels) * torch.tensor(float("nan"))
        }


@pytest.mark.slow  # about a minute: two stores created, the synthetic set loaded, one trial
def test_tune_whose_trials_all_fail_is_an_error_saying_where_to_look(
    workdir, capsys, store_settled
):
    experiment = "tune-all-fail"
    with METHODS.temporarily("failing-test", MethodEntry("failing-test", FailingHead, {})):
        code = main(
            [
                "tune",
                "--method",
                "failing-test",
                "--trials",
                "1",
                "--protocol",
                TINY,
                "--space",
                "",
                "--storage",
                f"sqlite:///{workdir / 'optuna.db'}",
                "--experiment",
                experiment,
                "--no-reproduce",
            ]
        )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert (
        last.startswith("error: all 1 trial(s) of study ") and f"experiment '{experiment}'" in last
    )


def test_tune_exits_1_when_some_trials_failed_and_names_them(capsys):
    """A search that lost trials reports its best setting, then exit status 1 and one line
    counting the failed trials (not the interrupted ones, which run again)."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from harness.cli.tune_command import failures_status

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    space = {"lr": FloatDistribution(1e-5, 1e-2)}
    study.add_trial(create_trial(params={"lr": 1e-3}, distributions=space, value=0.5))
    study.add_trial(create_trial(params={"lr": 1e-2}, distributions=space, state=TrialState.FAIL))
    study.add_trial(
        create_trial(
            params={"lr": 1e-4},
            distributions=space,
            state=TrialState.FAIL,
            user_attrs={"interrupted": True},
        )
    )
    setup = SimpleNamespace(name="tune:plain", experiment="tune-plain")
    assert failures_status(setup, study) == 1
    line = capsys.readouterr().err.strip()
    assert (
        line.startswith("1 of 3 trial(s) failed (numbers 1); ")
        and "experiment 'tune-plain'" in line
    )

    clean = optuna.create_study(direction="maximize")
    clean.add_trial(create_trial(params={"lr": 1e-3}, distributions=space, value=0.5))
    assert failures_status(setup, clean) == 0
