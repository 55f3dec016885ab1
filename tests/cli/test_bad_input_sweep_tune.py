"""Bad ``sweep`` and ``tune`` inputs (grid files, flags, studies), each refused with one
clear line before a trial is queued (:func:`tests.refusals.assert_refused`)."""

from __future__ import annotations

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
    # tune.
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
