"""Bad ``sweep`` and ``tune`` inputs (grid files, flags, studies), each refused with one
clear line before a trial is queued (:func:`tests.refusals.assert_refused`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TINY_PROTOCOL
from tests.refusals import Refusal, assert_refused_in, small_synthetic, write_file


def _grid(body: str) -> str:
    """A grid file on the tiny protocol with ``body`` appended (or replacing an axis)."""
    axes = {
        "methods": '["plain"]',
        "losses": '["margin"]',
        "backbones": '["efficientnet_lite0"]',
        "datasets": '["synthetic"]',
        "seeds": "[0]",
    }
    lines = [f'protocol = "{TINY_PROTOCOL}"']
    lines += [f"{axis} = {value}" for axis, value in axes.items() if f"{axis} =" not in body]
    return "\n".join([*lines, body]) + "\n"


TUNE = ("tune", "--method", "plain", "--trials", "1", "--protocol", str(TINY_PROTOCOL))


def _tuned(tune: str, *, data_root: bool = False) -> Callable[[Path], object]:
    """A ``prepare`` step: ``{dir}/g.toml``, a grid on the tiny protocol with the ``[tune]``
    table ``tune``, and (``data_root``) an empty data root ``{dir}/data``."""
    write = write_file("g.toml", _grid("[tune]\n" + tune))

    def prepare(folder: Path) -> None:
        write(folder)
        if data_root:
            (folder / "data").mkdir()

    return prepare


#: The command line ({dir}: the case's folder, where ``prepare`` writes; {store}: the
#: folder of the tracking store's database) and what its one error line must say.
SWEEP_TUNE_REFUSALS = [
    # sweep: grid files and flags, refused before a trial is queued.
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "protocol key 'optimizer.lr_head' = -0.001: expected a finite number > 0",
        write_file("g.toml", _grid('set = { "optimizer.lr_head" = -1e-3 }')),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'methods' = []: expected a non-empty list of strings",
        write_file("g.toml", _grid("methods = []")),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'seeds[0]' = \"0\": expected an integer >= 0",
        write_file("g.toml", _grid('seeds = ["0"]')),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "unknown grid key 'methdos' (did you mean 'methods'?)",
        write_file("g.toml", _grid('methdos = ["plain"]')),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "malformed grid file",
        write_file("g.toml", _grid("[smoke")),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'protocol' is missing",
        write_file("g.toml", 'methods = ["plain"]\n'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml", "--smoke"),
        "has no [smoke] table; --smoke needs one",
        write_file("g.toml", _grid("[smoke]")),
    ),
    Refusal(("sweep", "--grid", "nope"), "unknown grid 'nope'"),
    Refusal(("sweep", "--grid", "{dir}/none.toml"), "grid file not found"),
    Refusal(
        ("sweep", "--grid", "fair-roth2020", "--loader-workers", "-1"),
        "sweep: argument --loader-workers: expected an integer >= 0",
    ),
    Refusal(
        ("sweep", "--grid", "fair-roth2020", "--workers", "0"),
        "sweep: argument --workers: expected an integer >= 1",
    ),
    Refusal(
        ("sweep", "--grid", "fair-roth2020", "--heartbeat", "0"),
        "sweep: argument --heartbeat: expected an integer >= 1",
    ),
    Refusal(
        ("sweep", "--grid", "fair-roth2020", "--grace", "x"),
        "sweep: argument --grace: expected an integer >= 1",
    ),
    Refusal(("sweep",), "sweep: one of the arguments --grid --status --cancel is required"),
    # sweep: a tuned grid's [tune] table, refused before any data is generated.
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml", "--data-root", "{dir}/data"),
        "grid g, dataset synthetic: tune.folds = 31 needs at least 62 training classes (2 per "
        "fold); the training split has 60",
        _tuned("trials = 2\nfolds = 31", data_root=True),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid g's search has 100,000,000 trial runs (1 studies, 100,000,000 trials in all x 1 "
        "fold(s)), more than 5,000 (each a training run); check its [tune] table, or give --yes",
        _tuned("trials = 100_000_000"),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid g's search has 6,000 trial runs (1 studies, 3,000 trials in all x 2 fold(s))",
        _tuned("trials = 3000\nfolds = 2"),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'tune.space.\"optimizer.lr_head\"': log = 'no': expected true or false",
        _tuned(
            'trials = 2\n[tune.space]\n"optimizer.lr_head" = {low = 1e-5, high = 1e-3, log = "no"}'
        ),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'tune.space.\"optimizer.lr_head\"': high = '1e-3': expected a number",
        _tuned('trials = 2\n[tune.space]\n"optimizer.lr_head" = {low = 1e-5, high = "1e-3"}'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'tune.space.\"optimizer.lr_head\"' = [True, 2]: expected [low, high] (two numbers)",
        _tuned('trials = 2\n[tune.space]\n"optimizer.lr_head" = [true, 2]'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'tune.space.\"optimizer.lr_head\"': choices take no log",
        _tuned('trials = 2\n[tune.space]\n"optimizer.lr_head" = {choices = [1e-4], log = true}'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'tune.space.\"optimizer.lr_head\"': the range [-inf, inf]: expected finite "
        "bounds a finite distance apart",
        _tuned('trials = 2\n[tune.space]\n"optimizer.lr_head" = [-inf, inf]'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "the range [-1e+308, 1e+308]: expected finite bounds a finite distance apart",
        _tuned('trials = 2\n[tune.space]\n"loss.margin.margin" = [-1e308, 1e308]'),
    ),
    Refusal(
        ("sweep", "--grid", "{dir}/g.toml"),
        "grid key 'tune.space.\"optimizer.lr_head\"': choices [nan]: expected finite numbers",
        _tuned('trials = 2\n[tune.space]\n"optimizer.lr_head" = {choices = [nan]}'),
    ),
    # tune.
    Refusal(
        (*TUNE, "--folds", "31", "--data-root", "{dir}/data"),
        "--folds = 31 needs at least 62 training classes (2 per fold); the training split has 60",
        lambda folder: (folder / "data").mkdir(),
    ),
    Refusal(
        (
            "tune",
            "--method",
            "plain",
            "--trials",
            "1",
            "--protocol",
            str(TINY_PROTOCOL),
            "--space",
            "optimizer.lr_hed",
        ),
        "--space: unknown protocol field 'optimizer.lr_hed'; did you mean 'optimizer.lr_head'?",
    ),
    Refusal(
        (
            "tune",
            "--method",
            "plain",
            "--trials",
            "1",
            "--protocol",
            str(TINY_PROTOCOL),
            "--space",
            "schedule.epochs",
        ),
        "--space: 'schedule.epochs' = 2; only positive float fields are tunable",
    ),
    Refusal(
        ("tune", "--method", "plain", "--trials", "-1"),
        "tune: argument --trials: expected an integer >= 1",
    ),
    Refusal(
        ("tune", "--method", "plain", "--trials", "1", "--seeds", "1,a"),
        "tune: argument --seeds: expected comma-separated",
    ),
    Refusal(
        ("tune", "--method", "plain", "--trials", "1", "--loader-workers", "-1"),
        "tune: argument --loader-workers",
    ),
    Refusal(("tune", "--method", "nope", "--trials", "1"), "unknown method 'nope'"),
    Refusal(
        (
            "tune",
            "--method",
            "plain",
            "--trials",
            "1",
            "--protocol",
            str(TINY_PROTOCOL),
            "--data-root",
            "{dir}",
            "--set",
            "sampling.classes_per_batch=1000",
        ),
        "'sampling.classes_per_batch' = 1000: expected classes_per_batch x samples_per_class",
        small_synthetic,
    ),
    Refusal(
        (
            "tune",
            "--method",
            "plain",
            "--trials",
            "1",
            "--protocol",
            str(TINY_PROTOCOL),
            "--set",
            "optimizer.lr_head=nan",
        ),
        "protocol key 'optimizer.lr_head' = nan",
    ),
]


@pytest.mark.parametrize("case", SWEEP_TUNE_REFUSALS, ids=str)
def test_every_bad_input_is_refused_with_one_line(
    case, workdir, data_root, tracking_dir, capsys, tmp_path_factory
):
    """No case reads the synthetic dataset (each is refused first), so data_root stays as it was."""
    folder = tmp_path_factory.mktemp("input")
    assert_refused_in(
        case, folder, tracking_dir, capsys, watched=[workdir, data_root, folder, tracking_dir]
    )
