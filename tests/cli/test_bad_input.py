"""Each bad input gets one clear line on stderr, exit status 2, and no half-written result:
a table of refused inputs across every subcommand (each checked by
:func:`tests.refusals.assert_refused`), then the failures found only once a run started.
This module holds the output paths, ``run``'s own flags and the other commands; the
protocol's keys, options and files are in ``test_bad_input_protocol.py``, ``sweep`` and
``tune`` in ``test_bad_input_sweep_tune.py``."""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import mlflow
import pytest
import torch

from harness.cli.main import main
from harness.engine import train_run
from harness.methods import METHODS, HeadOutput
from harness.methods.base import MethodEntry
from harness.methods.plain import PlainHead
from tests.cli.test_bad_input_protocol import PROTOCOL_REFUSALS
from tests.cli.test_bad_input_sweep_tune import SWEEP_TUNE_REFUSALS
from tests.conftest import TINY_PROTOCOL
from tests.fixtures import make_cub
from tests.refusals import Refusal, assert_refused_in, write_file


def _fails(capsys, args, match, out_path, train=None):
    assert main(args, train=train) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and match in last, err
    assert "Traceback" not in err
    assert not out_path.exists()
    return last


def _fifo(name: str) -> Callable[[Path], object]:
    return lambda folder: os.mkfifo(folder / name)


def _sqlite(name: str) -> Callable[[Path], object]:
    """A ``prepare`` step: an SQLite database ``name`` with one table (another store, a study)."""

    def make(folder: Path) -> None:
        with contextlib.closing(sqlite3.connect(folder / name)) as db:
            db.execute("CREATE TABLE runs (id TEXT)")
            db.commit()

    return make


def _grid_of_seeds(seeds: int) -> str:
    """A grid file on the tiny protocol with ``seeds`` cells (one per seed)."""
    return (
        f'protocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
        f'backbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\n'
        f"seeds = {list(range(seeds))}\n"
    )


TINY_GRID = Path(__file__).parents[1] / "grids" / "tiny.toml"
RUN = ("run", "--protocol", str(TINY_PROTOCOL))
EXPLAIN = ("explain", "--run", "0123456789abcdef")

#: Every bad input of this topic: the command line ({dir}: the case's folder, where
#: ``prepare`` writes; {store}: the folder of the tracking store's database) and what its
#: one error line must say.
REFUSALS = [
    # Output paths that would destroy data: the store's database and artifacts, devices,
    # FIFOs, folders, other databases. Each is refused before any work.
    Refusal(
        (*RUN, "--json", "{store}/mlflow.db"),
        "--json {store}/mlflow.db is the tracking store's database",
    ),
    Refusal((*RUN, "--json", "{store}/mlflow.db-wal"), "is the tracking store's database"),
    Refusal(
        (*RUN, "--json", "{store}/mlartifacts/1/x.json"),
        "is inside the tracking store's artifact folder",
    ),
    Refusal(
        (*RUN, "--checkpoint-root", "{store}/mlartifacts/ckpt"),
        "--checkpoint-root {store}/mlartifacts/ckpt is inside the tracking store's artifact folder",
    ),
    Refusal(
        (*RUN, "--json", "{dir}/other.db"),
        "is an SQLite database (a tracking store, study or queue)",
        _sqlite("other.db"),
    ),
    Refusal(
        (*RUN, "--json", "{dir}/pipe"),
        "--json {dir}/pipe is a FIFO, not a regular file",
        _fifo("pipe"),
    ),
    Refusal(
        ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy", "--json", "/dev/full"),
        "--json /dev/full is a character device, not a regular file",
    ),
    Refusal(
        ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy", "--json", "/dev/null"),
        "--json /dev/null is a character device",
    ),
    Refusal(
        ("table", "--experiment", "x", "--out", "{store}/mlflow.db"),
        "--out {store}/mlflow.db is the tracking store's",
    ),
    Refusal(
        ("table", "--experiment", "x", "--out", "{store}/mlartifacts/t.md"),
        "is inside the tracking store's artifact",
    ),
    Refusal(
        ("table", "--experiment", "x", "--out", "{dir}/t.tex"),
        "--out (forest plot) {dir}/t.forest.png is a FIFO",
        _fifo("t.forest.png"),
    ),
    Refusal(
        ("explain-table", "--experiment", "x", "--out", "{store}/mlartifacts/e"),
        "is inside the tracking store's",
    ),
    Refusal(
        ("explain-table", "--experiment", "x", "--out", "{dir}/e"),
        "--out {dir}/e.md is a FIFO",
        _fifo("e.md"),
    ),
    Refusal(
        (*EXPLAIN, "--json", "{store}/mlflow.db"),
        "--json {store}/mlflow.db is the tracking store's database",
    ),
    Refusal(
        (*EXPLAIN, "--out", "{store}/mlartifacts"),
        "--out {store}/mlartifacts is the tracking store's artifact",
    ),
    Refusal(
        ("tune", "--method", "plain", "--trials", "1", "--storage", "sqlite:///{store}/mlflow.db"),
        "--storage sqlite:///{store}/mlflow.db is the tracking store's database",
    ),
    Refusal(
        ("sweep", "--grid", "fair-roth2020", "--storage", "sqlite:///{store}/mlflow.db"),
        "is the tracking store's database",
    ),
    # Output names longer than a file system takes (255 bytes), refused before any work.
    Refusal(
        (*RUN, "--json", "{dir}/" + "a" * 300 + ".json"),
        "--json: the name 'aaaaaaaaaaaaaaaaaaaaaaaa...' is 305 bytes long; expected a file name "
        "of at most 255 bytes",
    ),
    Refusal(
        ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy", "--json", "é" * 200),
        "--json: the name 'éééééééééééééééééééééééé...' is 400 bytes long",
    ),
    Refusal(
        ("table", "--experiment", "x", "--out", "{dir}/" + "t" * 250),
        "--out (forest plot): the name 'tttttttttttttttttttttttt...' is 261 bytes long",
    ),
    # run's own flags and names.
    Refusal(
        (*RUN, "--seeds", ","), "run: argument --seeds: expected comma-separated integers >= 0"
    ),
    Refusal(
        (*RUN, "--seeds", "0,x"),
        "run: argument --seeds: expected comma-separated integers >= 0 like 0,1,2, got '0,x'",
    ),
    Refusal(
        (*RUN, "--seeds", "-1"), "run: argument --seeds: expected comma-separated integers >= 0"
    ),
    Refusal(
        (*RUN, "--methods", ","),
        "run: argument --methods: expected one or more comma-separated names, got ','",
    ),
    Refusal((*RUN, "--methods", "plain,agroupin"), "unknown method 'agroupin'"),
    Refusal(
        (*RUN, "--workers", "-2"), "run: argument --workers: expected an integer >= 0, got '-2'"
    ),
    Refusal((*RUN, "--workers", "x"), "run: argument --workers: expected an integer >= 0, got 'x'"),
    Refusal(
        (*RUN, "--epochs", "-1"),
        "run: argument --epochs: expected an integer >= 0 and <= 100000, got '-1'",
    ),
    Refusal((*RUN, "--bogus"), "unrecognized arguments: --bogus"),
    Refusal(
        ("run", "--dataset", "cub"),
        "unknown dataset 'cub'; did you mean 'cub200'? valid: cars196, cub200",
    ),
    Refusal(
        ("run", "--loss", "tripplet"), "unknown loss 'tripplet'; did you mean 'triplet'? valid:"
    ),
    Refusal(
        ("run", "--protocol", "rot2020"),
        "unknown protocol 'rot2020'; did you mean 'roth2020'? valid:",
    ),
    Refusal(
        ("run", "--dataset", "cub200", "--data-root", "/nonexistent/dir"),
        "--data-root /nonexistent/dir does not exist",
    ),
    Refusal(
        (*RUN, "--evaluate-only"),
        "--evaluate-only evaluates the weights of a finished run: give --init-from",
    ),
    # evaluate, table, explain, explain-table, deviations, methods, datasets, schema.
    Refusal(
        ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy", "--chunk-size", "0"),
        "evaluate: argument --chunk-size: expected an integer >= 1, got '0'",
    ),
    Refusal(
        ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy", "--seed", "-1"),
        "evaluate: argument --seed",
    ),
    Refusal(
        ("evaluate", "--embeddings", "e.npy", "--labels", "l.npy", "--device", "tpu"),
        "evaluate: argument --device: invalid choice",
    ),
    Refusal(
        ("evaluate", "--embeddings", "{dir}/e.npy", "--labels", "{dir}/l.npy", "--recall-k", "0"),
        "--recall-k expects positive integers",
    ),
    Refusal(
        ("evaluate", "--labels", "l.npy"),
        "evaluate: the following arguments are required: --embeddings",
    ),
    Refusal(
        ("table", "--experiment", "x", "--format", "html"),
        "table: argument --format: invalid choice: 'html'",
    ),
    Refusal(("table", "--experiment", "x", "--table", "3"), "--table needs --published"),
    Refusal(
        (*EXPLAIN, "--pairs", "0"), "explain: argument --pairs: expected an integer >= 1, got '0'"
    ),
    Refusal(
        (*EXPLAIN, "--curve-pairs", "-3"),
        "explain: argument --curve-pairs: expected an integer >= 1",
    ),
    Refusal((*EXPLAIN, "--seed", "x"), "explain: argument --seed: expected an integer >= 0"),
    Refusal(
        ("explain-table",), "explain-table: the following arguments are required: --experiment"
    ),
    Refusal(("deviations", "--grid", "nope"), "unknown grid 'nope'"),
    Refusal(("deviations", "--protocol", "nope"), "unknown protocol 'nope'"),
    Refusal(
        ("deviations", "--grid", "{dir}/big.toml"),
        "grid big has 10,000 cells, more than 5,000 (each a training run); check its axes, "
        "or give --yes",
        write_file("big.toml", _grid_of_seeds(10_000)),
    ),
    Refusal(
        ("deviations", "--grid", str(TINY_GRID), "--ledger", "{dir}/l.toml"),
        "{dir}/l.toml is not a UTF-8 TOML file (byte 10 cannot be decoded)",
        lambda folder: (folder / "l.toml").write_bytes(b'paper = "x\xff"\n'),
    ),
    Refusal(("deviations", "--yes"), "--smoke, --ledger, --yes and --measure go with --grid"),
    # rerun, explain and deviations --measure: every argument checked before any work.
    Refusal(
        ("rerun", "0123456789abcdef", "--workers", "-3"),
        "rerun: argument --workers: expected an integer >= 0, got '-3'",
    ),
    Refusal(
        ("rerun", "0123456789abcdef", "--checkpoint-root", "{dir}/f"),
        "--checkpoint-root {dir}/f is a file, not a folder",
        write_file("f", "a file"),
    ),
    Refusal(
        ("rerun", "0123456789abcdef", "--checkpoint-root", "{store}/mlartifacts/ck"),
        "--checkpoint-root {store}/mlartifacts/ck is inside the tracking store's artifact folder",
    ),
    Refusal(("rerun", "0123456789abcdef", "--device", "tpu"), "unknown device 'tpu'"),
    Refusal((*EXPLAIN, "--device", "tpu"), "unknown device 'tpu'"),
    Refusal(
        (*EXPLAIN, "--checkpoint-root", "{dir}/nope"),
        "--checkpoint-root {dir}/nope does not exist or is not a folder",
    ),
    Refusal(
        ("deviations", "--grid", "agrouping-table3", "--measure", "--device", "tpu"),
        "unknown device 'tpu'",
    ),
    Refusal(
        ("deviations", "--grid", "agrouping-table3", "--measure", "--name", "nope"),
        "unknown deviation of grid agrouping-table3-smoke 'nope'",
    ),
    Refusal(
        ("deviations", "--grid", "agrouping-table3", "--measure", "--ledger", "nope"),
        "unknown ledger 'nope'",
    ),
    Refusal(
        ("deviations", "--grid", "agrouping-table3", "--measure", "--data-root", "{dir}/nope"),
        "--data-root {dir}/nope does not exist or is not a folder",
    ),
    # Names made file names: no path separator, no '..', room for the files beside them.
    Refusal(
        ("table", "--experiment", "x", "--name", "../../escaped"),
        "table: argument --name: expected a file name without '/'",
    ),
    Refusal(
        ("explain-table", "--experiment", "x", "--name", "../../escaped"),
        "explain-table: argument --name: expected a file name without '/'",
    ),
    Refusal(
        ("table", "--experiment", "x", "--name", "n" * 250),
        "is 250 bytes long; expected at most 200",
    ),
    Refusal(
        ("table", "--experiment", "e" * 300),
        "the experiments' names make a file name of 300 bytes, more than 200; give --name NAME",
    ),
    Refusal(
        ("explain-table", "--experiment", "e" * 300),
        "the experiments' names make a file name of 300 bytes, more than 200; give --name NAME",
    ),
    Refusal(
        (*RUN, "--experiment", "e" * 5000),
        "is 5,000 characters long; expected at most 500 (MLflow's limit)",
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/long.toml", "--executor", "local"),
        "is 300 characters long; expected at most 200",
        write_file("long.toml", f'name = "{"g" * 300}"\n' + _grid_of_seeds(1)),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'experiment'",
        write_file("g.toml", f'experiment = "{"e" * 501}"\n' + _grid_of_seeds(1)),
    ),
    Refusal(("methods", "--bogus"), "unrecognized arguments: --bogus"),
    Refusal(
        ("datasets", "fetch", "cub200", "--timeout", "0"),
        "fetch: argument --timeout: expected a finite number > 0",
    ),
    Refusal(
        ("datasets", "fetch", "cub200", "--timeout", "nan"),
        "fetch: argument --timeout: expected a finite number > 0",
    ),
    Refusal(("schema", "yaml"), "schema: argument kind: invalid choice: 'yaml'"),
    Refusal(("bogus",), "argument command: invalid choice: 'bogus'"),
    Refusal(("--debug",), "the following arguments are required: command"),
    # --debug shows the traceback of an internal error only: a user's error stays one line.
    Refusal(("--debug", "run", "--loss", "tripplet"), "unknown loss 'tripplet'"),
    Refusal((*RUN, "--methods", "nope", "--debug"), "unknown method 'nope'"),
]


def test_the_table_walks_every_subcommand():
    commands = {case.argv[0] for case in (*REFUSALS, *PROTOCOL_REFUSALS, *SWEEP_TUNE_REFUSALS)}
    assert {
        "run",
        "sweep",
        "tune",
        "evaluate",
        "table",
        "explain",
        "explain-table",
        "deviations",
        "methods",
        "datasets",
        "schema",
    } <= commands
    assert len(REFUSALS) + len(PROTOCOL_REFUSALS) + len(SWEEP_TUNE_REFUSALS) >= 100


@pytest.mark.parametrize("case", REFUSALS, ids=str)
def test_every_bad_input_is_refused_with_one_line(
    case, workdir, data_root, tracking_dir, capsys, tmp_path_factory
):
    """No case reads the synthetic dataset (each is refused first), so data_root stays as it was."""
    folder = tmp_path_factory.mktemp("input")
    assert_refused_in(
        case, folder, tracking_dir, capsys, watched=[workdir, data_root, folder, tracking_dir]
    )


def test_deviations_of_a_grid_over_the_cell_cap_lists_them_with_yes(workdir, capsys):
    """The refusal of a grid over the cap says "give --yes"; with it, the grid is listed."""
    (workdir / "big.toml").write_text(_grid_of_seeds(5_001))
    assert main(["deviations", "--grid", str(workdir / "big.toml")]) == 2
    assert "give --yes" in capsys.readouterr().err
    assert main(["deviations", "--grid", str(workdir / "big.toml"), "--yes"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("grid big (protocol tiny): 0 deviations from the paper or its code")


def test_missing_data_root_names_the_expected_file(workdir, capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _fails(
        capsys,
        [
            "run",
            "--dataset",
            "cub200",
            "--data-root",
            str(empty),
            "--json",
            str(workdir / "o.json"),
        ],
        "dataset 'cub200' not found: expected",
        workdir / "o.json",
    )
    assert str(empty / "CUB_200_2011" / "images.txt") in line


def test_corrupt_image_names_its_path(workdir, capsys, tmp_path, tiny_protocol):
    base = make_cub(tmp_path / "cub")
    corrupt = base / "images" / "150.Bird_150" / "Bird_150_0000.jpg"
    corrupt.write_bytes(b"this is not a jpeg")
    line = _fails(
        capsys,
        [
            "run",
            "--methods",
            "plain",
            "--dataset",
            "cub200",
            "--data-root",
            str(tmp_path / "cub"),
            "--protocol",
            str(tiny_protocol),
            "--epochs",
            "0",
            "--set",
            "splits.max_test_images_per_class=0",
            "--json",
            str(workdir / "o.json"),
        ],
        "corrupt image",
        workdir / "o.json",
    )
    assert str(corrupt) in line


class NanHead(PlainHead):
    """A plain head whose loss becomes NaN (test only)."""

    def loss_terms(self, output: HeadOutput, batch):
        return {
            "metric": batch.metric_loss(output.embedding, batch.labels) * torch.tensor(float("nan"))
        }


def test_nan_loss_stops_the_run_and_marks_it_failed(workdir, capsys, tiny_protocol):
    out = workdir / "o.json"
    with METHODS.temporarily("nan-test", MethodEntry("nan-test", NanHead, {})):
        _fails(
            capsys,
            ["run", "--methods", "nan-test", "--protocol", str(tiny_protocol), "--json", str(out)],
            "loss is nan at epoch 1, batch 1",
            out,
        )
    runs = mlflow.search_runs(
        search_all_experiments=True, filter_string="tags.method = 'nan-test'", output_format="list"
    )
    assert runs and all(r.info.status == "FAILED" for r in runs)
    assert "loss is nan" in runs[0].data.tags["failure"]


def test_a_selection_metric_that_is_never_a_number_fails_the_run(workdir, capsys, tiny_protocol):
    def no_scores(*args, metrics=None, **kwargs):
        return {name: float("nan") for name in metrics or ("mean_average_precision_at_r",)}

    out = workdir / "o.json"
    _fails(
        capsys,
        [
            "run",
            "--methods",
            "plain",
            "--protocol",
            str(tiny_protocol),
            "--epochs",
            "1",
            "--json",
            str(out),
        ],
        "was NaN at every evaluation",
        out,
        train=functools.partial(train_run, evaluator=no_scores),
    )


def test_a_bad_method_option_is_one_line_before_the_dataset_loads(workdir, capsys):
    """A value the method's constructor refuses (groups not dividing the embedding size) is
    one ``error:`` line, raised before any dataset is read: the empty data root given stays
    empty (reading the synthetic dataset would generate it there)."""
    empty = workdir / "data"
    empty.mkdir()
    _fails(
        capsys,
        [
            "run",
            "--data-root",
            str(empty),
            "--methods",
            "agrouping",
            "--set",
            "methods.agrouping.groups=3",
            "--json",
            str(workdir / "o.json"),
        ],
        "method 'agrouping': groups must divide the embedding size 128, got 3",
        workdir / "o.json",
    )
    _fails(
        capsys,
        [
            "run",
            "--data-root",
            str(empty),
            "--methods",
            "diablo",
            "--set",
            "methods.diablo.entries=7",
            "--json",
            str(workdir / "o.json"),
        ],
        "DIABLO entries (N) must be a positive divisor",
        workdir / "o.json",
    )
    _fails(
        capsys,
        [
            "run",
            "--data-root",
            str(empty),
            "--methods",
            "plain",
            "--set",
            "methods.plain.groups=2",
            "--json",
            str(workdir / "o.json"),
        ],
        "unknown option 'groups' for method 'plain'",
        workdir / "o.json",
    )
    _fails(
        capsys,
        [
            "run",
            "--data-root",
            str(empty),
            "--methods",
            "diml_train",
            "--loss",
            "proxy_anchor",
            "--json",
            str(workdir / "o.json"),
        ],
        "method 'diml_train' cannot train with loss 'proxy_anchor'",
        workdir / "o.json",
    )

    assert list(empty.iterdir()) == []


class BuggyEntry(MethodEntry):
    """A method plugin's registry entry with a bug: listing its options raises (test only)."""

    def options(self):
        raise RuntimeError("a bug")


def test_an_internal_error_is_one_line_and_its_traceback_is_behind_debug(workdir, capsys):
    """A bug (not a user's mistake; here a plugin's, met by ``methods``) exits 1 with one
    line; ``--debug`` raises it with its traceback, before or after the subcommand."""
    with METHODS.temporarily("buggy-test", BuggyEntry("buggy-test", PlainHead, {})):
        assert main(["methods"]) == 1
        err = capsys.readouterr().err
        assert err == (
            "error: internal error: RuntimeError: a bug (run again with --debug for the traceback)\n"
        )
        for argv in (["--debug", "methods"], ["methods", "--debug"]):
            with pytest.raises(RuntimeError, match="a bug"):
                main(argv)
