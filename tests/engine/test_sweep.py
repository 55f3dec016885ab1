"""Grids as data and ``sweep``: validation, expansion of the A-grouping Table 3 grid,
every cell run once, restart skips finished cells (no new MLflow runs), a failed cell
is retried on the next start; PostgreSQL with three workers and one killed mid-cell."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import mlflow
import pytest

from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.cli.sweep import add_sweep_parser
from harness.config.grids import load_grid
from harness.engine.grid.sweep import CELL_ATTR
from harness.methods.plain import PlainHead
from tests.revisions import PLAIN_TEST, RevisedPlainHead, plain_test
from tests.waiting import run_in_progress

TINY_GRID = Path(__file__).parents[1] / "grids" / "tiny.toml"
TINY_PROTOCOL = Path(__file__).parents[1] / "protocols" / "tiny.toml"


def _grid(tmp: Path, *, methods=("plain", "ngrouping"), seeds=(0,), extra: str = "") -> Path:
    """The tiny grid with its own experiment name (the tracking store is shared by the session)."""
    path = tmp / "grid.toml"
    path.write_text(
        f'name = "tiny-{uuid.uuid4().hex[:6]}"\nprotocol = "{TINY_PROTOCOL}"\n'
        f"methods = {list(methods)!r}\nlosses = ['margin']\nbackbones = ['efficientnet_lite0']\n"
        f"datasets = ['synthetic']\nseeds = {list(seeds)!r}\n{extra}".replace("'", '"')
    )
    return path


def _sweep(*argv: str, train=None) -> int:
    """``sweep`` with ``argv`` in this process; ``train``: what trains a cell's run."""
    parser = argparse.ArgumentParser()
    add_sweep_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sweep", *argv])
    return args.func(args, train=train)


def _runs(experiment: str) -> list:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name(experiment)
    return [] if exp is None else mlflow.MlflowClient().search_runs([exp.experiment_id])


# ------------------------------------------------------------------------------ grids


def test_unknown_grid_keys_are_errors_naming_the_key(tmp_path):
    bad = _grid(tmp_path, extra="methdos = ['plain']\n")
    with pytest.raises(HarnessError, match="unknown grid key 'methdos'.*did you mean 'methods'"):
        load_grid(bad)
    bad = _grid(tmp_path, extra="[smoke]\nepochs = 1\n")
    with pytest.raises(HarnessError, match="unknown grid key 'smoke.epochs'"):
        load_grid(bad)
    bad = _grid(tmp_path, extra="[backbone.googlenet]\nlr = 1\n")
    with pytest.raises(HarnessError, match="unknown grid key 'backbone.googlenet.lr'"):
        load_grid(bad)
    bad = _grid(tmp_path, methods=("plain", "agroupin"))
    with pytest.raises(HarnessError, match="did you mean 'agrouping'"):
        load_grid(bad)
    with pytest.raises(HarnessError, match="unknown grid 'nope'"):
        load_grid("nope")
    bad = _grid(tmp_path, extra="baseline = 'plan'\n")
    with pytest.raises(
        HarnessError, match="grid key 'baseline' = \"plan\": expected a method of the grid"
    ):
        load_grid(bad)


def test_agrouping_table3_grid():
    grid = load_grid("agrouping-table3")
    cells = grid.cells
    assert grid.protocol == "agrouping" and grid.published_tables == ("3", "4")
    # 5 methods x 3 losses x 2 backbones x 2 datasets x 3 seeds + SOP (ResNet-50 + margin) x 5 x 3
    assert len(cells) == 5 * 3 * 2 * 2 * 3 + 5 * 3
    assert {c.dataset for c in cells if c.backbone == "googlenet"} == {"cub200", "cars196"}
    assert {(c.backbone, c.loss) for c in cells if c.dataset == "sop"} == {("resnet50", "margin")}
    google = next(c for c in cells if c.backbone == "googlenet")
    resnet = next(c for c in cells if c.backbone == "resnet50")
    assert google.protocol.optimizer.lr_backbone == 2e-5 == google.protocol.optimizer.lr_head
    assert (
        google.protocol.backbone.name == "googlenet"
        and resnet.protocol.optimizer.lr_backbone == 1e-5
    )
    assert all(c.deviations == () for c in cells)  # the paper's settings, not deviations
    assert len({c.key for c in cells}) == len(cells)
    assert (
        resnet.loss_args and resnet.method_options == {} if resnet.method == "ngrouping" else True
    )

    smoke = load_grid("agrouping-table3", smoke=True)
    assert smoke.experiment == "agrouping-table3-smoke" and smoke.protocol == "smoke"
    assert {c.method for c in smoke.cells} == {
        "ngrouping",
        "mgrouping",
        "ggrouping",
        "cgrouping",
        "agrouping",
    }
    assert {c.loss for c in smoke.cells} == {"contrastive", "binomial_deviance", "margin"}
    # two seeds, so that every smoke cell has an interval and a paired test
    assert {c.dataset for c in smoke.cells} == {"synthetic"} and len(smoke.cells) == 15 * 2
    assert grid.baseline == "ngrouping" and smoke.baseline == "ngrouping"
    assert all(
        c.protocol.schedule.epochs == 1 and c.protocol.sampling.batches_per_epoch == 2
        for c in smoke.cells
    )
    # smoke's own epoch count is 1: two batches of it are the grid's deviation, the epoch is not
    assert all(
        {d.field for d in c.deviations} & {"sampling.batches_per_epoch", "schedule.epochs"}
        == {"sampling.batches_per_epoch"}
        for c in smoke.cells
    )


def test_smoke_table_replaces_keys_and_adds_deviations():
    grid = load_grid(TINY_GRID, smoke=True)
    assert [c.seed for c in grid.cells] == [1, 1] and grid.name == "tiny-smoke"
    assert [str(d) for d in grid.cells[0].deviations] == ["schedule.epochs: 2 -> 1"]
    assert {c.key for c in grid.cells}.isdisjoint({c.key for c in load_grid(TINY_GRID).cells})


# ------------------------------------------------------------------------------ sweep


def test_sweep_runs_every_cell_once_and_a_restart_skips_finished_cells(workdir, capsys):
    grid_path = _grid(workdir)
    grid = load_grid(grid_path)
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    assert _sweep("--grid", str(grid_path), "--storage", storage) == 0
    runs = _runs(grid.experiment)
    assert sorted(r.data.tags[CELL_ATTR] for r in runs) == sorted(c.key for c in grid.cells)
    assert all(r.info.status == "FINISHED" for r in runs)
    tags = runs[0].data.tags
    assert tags["optuna_study"] == f"sweep:{grid.name}" and tags["grid"] == grid.name
    assert "backbone.name=efficientnet_lite0" in tags["grid_variant"]
    assert "2/2 cells finished" in capsys.readouterr().out

    assert _sweep("--grid", str(grid_path), "--storage", storage) == 0
    assert len(_runs(grid.experiment)) == 2  # nothing ran again
    assert "2/2 cells finished" in capsys.readouterr().out


@pytest.mark.parametrize("same_code", [True, False])
def test_an_untagged_finished_run_is_adopted_only_when_the_same_code_made_it(
    workdir, capsys, same_code
):
    """A worker killed after its run finished but before tagging it: the next start adopts
    the run, unless the method has a newer revision since."""
    from harness.cli.main import main

    grid_path = _grid(workdir, methods=(PLAIN_TEST,))
    with plain_test():
        grid = load_grid(grid_path)
        assert (
            main(
                [
                    "run",
                    "--methods",
                    PLAIN_TEST,
                    "--protocol",
                    str(TINY_PROTOCOL),
                    "--experiment",
                    grid.experiment,
                ]
            )
            == 0
        )
    with plain_test(PlainHead if same_code else RevisedPlainHead):
        storage = f"sqlite:///{workdir / 'optuna.db'}"
        assert _sweep("--grid", str(grid_path), "--storage", storage) == 0
    adopted = "adopted finished untagged run" in capsys.readouterr().err
    assert adopted == same_code
    assert len(_runs(grid.experiment)) == (1 if same_code else 2)


def test_a_failed_cell_is_reported_and_retried_on_the_next_start(workdir, capsys):
    import optuna

    grid_path = _grid(workdir, methods=("ngrouping",))
    grid = load_grid(grid_path)
    storage = f"sqlite:///{workdir / 'optuna.db'}"

    def crash(cfg, splits=None):
        raise RuntimeError("simulated crash")

    assert _sweep("--grid", str(grid_path), "--storage", storage, train=crash) == 1
    out = capsys.readouterr()
    assert "0/1 cells finished" in out.out and "RuntimeError: simulated crash" in out.out
    assert "FAILED efficientnet_lite0/margin/ngrouping/synthetic/seed0" in out.err

    assert _sweep("--grid", str(grid_path), "--storage", storage) == 0
    out = capsys.readouterr()
    assert (
        "retrying efficientnet_lite0/margin/ngrouping" in out.err
        and "1/1 cells finished" in out.out
    )
    finished = [r for r in _runs(grid.experiment) if r.info.status == "FINISHED"]
    assert [r.data.tags["method"] for r in finished] == ["ngrouping"]
    study = optuna.load_study(study_name=f"sweep:{grid.name}", storage=storage)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "FAIL"]


def test_test_time_cells_name_their_base_cell_and_keep_other_keys(tmp_path):
    plain_only = load_grid(_grid(tmp_path, methods=("plain",)))
    grid = load_grid(
        _grid(
            tmp_path, methods=("diml", "plain"), seeds=(0, 1), extra='[test_time]\ndiml = "plain"\n'
        )
    )
    plains = {c.seed: c for c in grid.cells if c.method == "plain"}
    dimls = {c.seed: c for c in grid.cells if c.method == "diml"}
    assert [c.method for c in grid.cells] == ["plain", "plain", "diml", "diml"]  # bases first
    assert all(dimls[s].base_key == plains[s].key and not plains[s].base_key for s in (0, 1))
    # Adding a test-time method does not change the keys of the trained cells.
    assert plains[0].key == plain_only.cells[0].key
    bad = _grid(tmp_path, methods=("diml",), extra='[test_time]\ndiml = "plain"\n')
    with pytest.raises(HarnessError, match="test_time.diml = 'plain' must name a trained method"):
        load_grid(bad)
    # A test-time method must train as its base: diml_train trains its own way (App. A.3),
    # and ngrouping is not plain at all.
    for method in ("diml_train", "ngrouping"):
        wrong = _grid(
            tmp_path, methods=(method, "plain"), extra=f'[test_time]\n{method} = "plain"\n'
        )
        with pytest.raises(HarnessError, match=f"{method} does not train as plain"):
            load_grid(wrong)


def test_a_method_revision_from_two_on_changes_its_cell_keys(tmp_path):
    path = _grid(tmp_path, methods=(PLAIN_TEST, "ngrouping"))
    with plain_test():
        before = {c.method: c.key for c in load_grid(path).cells}
    with plain_test(RevisedPlainHead):
        after = {c.method: c.key for c in load_grid(path).cells}
    assert after[PLAIN_TEST] != before[PLAIN_TEST] and after["ngrouping"] == before["ngrouping"]


def test_diml_table1_grid():
    grid = load_grid("diml-table1")
    assert grid.protocol == "diml" and grid.published_tables == ("1",)
    assert grid.metrics == (
        "precision_at_1",
        "r_precision",
        "mean_average_precision_at_r",
        "r_precision_query_in_r",
        "mean_average_precision_at_r_query_in_r",
    )
    assert grid.published_metrics == {
        "r_precision": "r_precision_query_in_r",
        "mean_average_precision_at_r": "mean_average_precision_at_r_query_in_r",
    }
    # 2 methods x 3 losses x 3 datasets x 3 seeds, every diml cell on its plain cell.
    assert len(grid.cells) == 2 * 3 * 3 * 3
    by_key = {c.key: c for c in grid.cells}
    for cell in grid.cells:
        if cell.method == "diml":
            base = by_key[cell.base_key]
            assert (base.method, base.loss, base.dataset, base.seed) == (
                "plain",
                cell.loss,
                cell.dataset,
                cell.seed,
            )
            assert base.protocol == cell.protocol


def test_sweep_runs_test_time_cells_on_their_finished_base_runs(workdir, capsys):
    from harness.reports.tables import load_runs, summarize

    grid_path = _grid(workdir, methods=("plain", "diml"), extra='[test_time]\ndiml = "plain"\n')
    grid = load_grid(grid_path)
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    assert _sweep("--grid", str(grid_path), "--storage", storage) == 0
    runs = {r.data.tags["method"]: r for r in _runs(grid.experiment)}
    plain, diml = runs["plain"], runs["diml"]
    assert diml.data.tags["init_from"] == plain.info.run_id
    assert diml.data.tags["evaluate_only"] == "True" and diml.data.tags["deviations"] == "none"
    assert diml.data.tags["fingerprint"] == plain.data.tags["fingerprint"]
    assert not any(k.startswith("val/") for k in diml.data.metrics)  # no training epoch
    # DIML re-ranks the same trained embedding: its cosine numbers are the baseline's.
    assert diml.data.metrics[metric_key("test", "global_precision_at_1")] == pytest.approx(
        plain.data.metrics[metric_key("test", "precision_at_1")]
    )
    assert "2/2 cells finished" in capsys.readouterr().out
    cells = summarize(load_runs([grid.experiment]), ["precision_at_1"])
    assert set(cells["method"]) == {"plain", "diml"}  # one block, one fingerprint: comparable

    assert _sweep("--grid", str(grid_path), "--storage", storage) == 0
    assert len(_runs(grid.experiment)) == 2  # nothing ran again


@pytest.mark.slow  # 17 s on 2 cores: worker processes train a base and its test-time cells
def test_worker_processes_queue_test_time_cells_when_their_base_finishes(workdir, capsys):
    """Workers (here two processes on SQLite) pick up DIML cells themselves once the
    plain cell they evaluate has finished: no coordinator round is needed."""
    grid_path = _grid(
        workdir, methods=("plain", "diml"), seeds=(0,), extra='[test_time]\ndiml = "plain"\n'
    )
    grid = load_grid(grid_path)
    assert (
        _sweep(
            "--grid",
            str(grid_path),
            "--storage",
            f"sqlite:///{workdir / 'optuna.db'}",
            "--workers",
            "2",
        )
        == 0
    )
    assert "2/2 cells finished" in capsys.readouterr().out
    runs = _runs(grid.experiment)
    plain = {r.data.tags["seed"]: r.info.run_id for r in runs if r.data.tags["method"] == "plain"}
    diml = {
        r.data.tags["seed"]: r.data.tags["init_from"]
        for r in runs
        if r.data.tags["method"] == "diml"
    }
    assert len(runs) == 2 and diml == plain


def test_a_worker_losing_the_race_to_create_the_experiment_joins_it(workdir, monkeypatch):
    """Two workers look the experiment up, find none, and both create it: the store's
    unique name fails the second, which must then use the first one's experiment."""
    from harness.store.tracking import experiment_id

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    name = f"race-{uuid.uuid4().hex[:6]}"
    first = mlflow.create_experiment(name)
    real = mlflow.get_experiment_by_name
    calls = []

    def stale_then_real(n):  # the look-up ran before the other worker's create
        calls.append(n)
        return None if len(calls) == 1 else real(n)

    monkeypatch.setattr(mlflow, "get_experiment_by_name", stale_then_real)
    assert experiment_id(name) == first and len(calls) == 2


def test_a_test_time_cell_waits_while_its_base_cell_fails(workdir, capsys):
    from harness.engine import train_run

    grid_path = _grid(workdir, methods=("plain", "diml"), extra='[test_time]\ndiml = "plain"\n')

    def crash_plain(cfg, splits=None):
        if cfg.method == "plain":
            raise RuntimeError("simulated crash")
        return train_run(cfg, splits)

    storage = f"sqlite:///{workdir / 'optuna.db'}"
    assert _sweep("--grid", str(grid_path), "--storage", storage, train=crash_plain) == 1
    out = capsys.readouterr().out
    assert "0/2 cells finished" in out
    assert "diml/synthetic/seed0: waiting for its base cell efficientnet_lite0/margin/plain" in out


# ------------------------------------------------------------------------- PostgreSQL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres(tmp_path):
    """A throw-away PostgreSQL server on 127.0.0.1 (Debian's ``postgresql``), or a skip."""
    import importlib.util

    # The driver named in the URL: SQLAlchemy's default for postgresql:// is psycopg (3)
    # from its 2.1 on, psycopg2 before; the test extras install psycopg2-binary.
    driver = next((d for d in ("psycopg", "psycopg2") if importlib.util.find_spec(d)), None)
    if driver is None:
        pytest.skip("no PostgreSQL driver: pip install psycopg2-binary (or 'psycopg[binary]')")
    bindir = (
        next((p for p in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None)
        if Path("/usr/lib/postgresql").is_dir()
        else None
    )
    initdb = shutil.which("initdb") or (str(bindir / "initdb") if bindir else None)
    if not initdb or not Path(initdb).exists():
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    bindir = Path(initdb).resolve().parent
    import tempfile

    # Not under pytest's tmp_path: its parents are private to root, the server user
    # must reach its data folder and socket.
    base = Path(tempfile.mkdtemp(prefix="harness-pg-"))
    os.chmod(base, 0o777)
    data = base / "pg"
    prefix: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        user = "postgres"
        try:
            import pwd

            pwd.getpwnam(user)
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server")
        prefix = ["runuser", "-u", user, "--"]
    else:
        user = os.environ.get("USER", "postgres")
    port = _free_port()
    try:
        subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"],
            check=True,
            capture_output=True,
            timeout=120,
            cwd=base,
        )
        subprocess.run(
            [
                *prefix,
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-w",
                "-l",
                str(base / "pg.log"),
                "-o",
                f"-h 127.0.0.1 -p {port} -k {base}",
                "start",
            ],
            check=True,
            capture_output=True,
            timeout=120,
            cwd=base,
        )
    except (subprocess.SubprocessError, OSError) as err:
        detail = getattr(err, "stderr", b"") or b""
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(
            f"cannot start PostgreSQL: {err} {detail.decode(errors='replace').strip()[:300]}"
        )
    try:
        subprocess.run(
            [
                str(bindir / "createdb"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "postgres",
                "sweep",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield f"postgresql+{driver}://postgres@127.0.0.1:{port}/sweep"
    finally:
        subprocess.run(
            [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
            cwd=base,
        )
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_postgres_three_workers_every_cell_once_and_a_killed_worker_is_retried(workdir, postgres):
    import optuna

    grid_path = _grid(workdir, methods=("plain", "ngrouping"), seeds=(0, 1))
    grid = load_grid(grid_path)
    # Grace 15 s, not 4: on a loaded 2-core machine a live worker's heartbeat was late by
    # more than 4 s, another worker failed its trial as stale and ran the cell again.
    common = ["--grid", str(grid_path), "--storage", postgres, "--heartbeat", "1", "--grace", "15"]
    # Queue the cells (no worker in this process: zero cells are run by it) ...
    from harness.engine.grid.sweep import enqueue_cells, open_study, storage_url

    study = open_study(grid, postgres, heartbeat=1, grace=15)
    assert enqueue_cells(grid, study)["queued"] == 4
    # ... then three worker processes, as `sweep --workers 3` starts them.
    cmd = [sys.executable, "-m", "harness", "sweep", *common, "--worker-only"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    workers = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        victim, deadline = None, time.time() + 900  # a loaded machine trains slowly
        while victim is None and time.time() < deadline:
            ended = [w for w in workers if w.poll() is not None]
            assert not ended, "a worker ended before any was killed: " + " | ".join(
                w.stderr.read()[-1000:] for w in ended
            )
            running = [
                t
                for t in study.get_trials(deepcopy=False)
                if t.state.name == "RUNNING"
                and "worker" in t.user_attrs
                and CELL_ATTR in t.user_attrs
            ]
            # Mid-cell: the trial's run is open. Its worker's heartbeats started before the
            # cell did, so the killed trial goes stale (a state, not a number of seconds).
            mid_cell = [
                t
                for t in running
                if run_in_progress(
                    grid.experiment, after_an_epoch=False, **{CELL_ATTR: t.user_attrs[CELL_ATTR]}
                )
            ]
            if mid_cell:
                # The trial may have ended since the snapshot, its worker moved on (killing
                # it then would hit another cell, or one not yet heartbeating).
                now = next(
                    t for t in study.get_trials(deepcopy=False) if t.number == mid_cell[0].number
                )
                if now.state.name == "RUNNING":
                    victim = now
                    pid = int(victim.user_attrs["worker"].rsplit(":", 1)[1])
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        assert victim is not None, "no worker was seen running a cell"
        for w in workers:
            w.wait(timeout=900)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    trials = optuna.load_study(
        study_name=f"sweep:{grid.name}", storage=storage_url(postgres)
    ).trials
    killed = next(t for t in trials if t.number == victim.number)
    assert killed.state.name == "FAIL"
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert retry and retry[-1].state.name == "COMPLETE"
    finished = [r for r in _runs(grid.experiment) if r.info.status == "FINISHED"]
    keys = sorted(r.data.tags[CELL_ATTR] for r in finished)
    assert keys == sorted(c.key for c in grid.cells)  # every cell exactly once, none lost
    assert all(r.info.status in ("FINISHED", "KILLED") for r in _runs(grid.experiment))
    # a restart finds nothing to do
    assert _sweep(*common) == 0
    assert len([r for r in _runs(grid.experiment) if r.info.status == "FINISHED"]) == 4
