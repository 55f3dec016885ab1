"""``deviations --measure`` (harness.engine.audit.deviation_effects): a deviation switched to the
authors' value its ledger gives, against the grid's value, on the smoke cells it
changes, as paired differences over seeds; unmeasurable ones with their reason."""

from __future__ import annotations

import math

import pytest

from harness.cli.main import main
from harness.config.ledger import load_ledger
from harness.engine.audit.deviation_effects import (
    EFFECT_METRICS,
    Effect,
    effect_lines,
    measure_deviations,
)
from tests.conftest import TINY_PROTOCOL


def _trial(tmp_path):
    """A tiny grid whose protocol declares three deviations, and a ledger naming them."""
    protocol = tmp_path / "trial.toml"
    protocol.write_text(
        TINY_PROTOCOL.read_text(encoding="utf-8")
        + """
[deviations.head_rate]
paper = "head rate 1e-2"
harness = "1e-3"
why = "a test"
methods = ["plain"]

[deviations.unrunnable]
paper = "a setting no key holds"
harness = "another"
why = "a test"

[deviations.no_entry]
paper = "a setting the ledger does not list"
harness = "another"
why = "a test"
""",
        encoding="utf-8",
    )
    grid = tmp_path / "grid.toml"
    grid.write_text(
        f'name = "trial"\nprotocol = "{protocol}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
        'backbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\nseeds = [0]\n'
        '[smoke]\nseeds = [0]\n[smoke.set]\n"schedule.epochs" = 1\n',
        encoding="utf-8",
    )
    ledger = tmp_path / "ledger.toml"
    ledger.write_text(
        f'paper = "trial"\ngrids = ["{grid}"]\n[unmeasured]\nunrunnable = "no key"\n'
        '[[entry]]\nsetting = "head rate"\nkey = "optimizer.lr_head"\nvalue = 0.01\n'
        'source = "x"\ndeviation = "head_rate"\n',
        encoding="utf-8",
    )
    return grid, load_ledger(ledger)


def test_a_deviation_is_measured_on_the_cells_it_changes_and_the_rest_say_why(tmp_path):
    grid, ledger = _trial(tmp_path)
    lines: list[str] = []
    effects = measure_deviations(
        str(grid), seeds=(0, 1), device="cpu", log=lines.append, ledgers=[ledger]
    )
    by_name = {e.deviation: e for e in effects}
    assert set(by_name) == {"head_rate", "unrunnable", "no_entry"}
    measured = by_name["head_rate"]
    assert measured.cell == "plain/margin" and measured.settings == {"optimizer.lr_head": 0.01}
    for metric in EFFECT_METRICS:
        mean, half_width, n = measured.differences[metric]
        assert n == 2 and math.isfinite(mean) and math.isfinite(half_width)
    # two seeds, each run once with the grid's value and once with the authors'
    assert len([line for line in lines if line.startswith("measure: plain/margin")]) == 4
    assert by_name["unrunnable"].reason == "no key"
    assert "no ledger entry sets it" in by_name["no_entry"].reason
    table = effect_lines("trial", effects, (0, 1))
    assert any(
        line.startswith("| head_rate | plain/margin | optimizer.lr_head = 0.01 | ")
        for line in table
    )
    assert any("| unrunnable | - | - | not measured: no key |" in line for line in table)


def test_a_selection_window_is_measured_on_runs_long_enough_for_it_to_act(tmp_path):
    """A one-epoch smoke run evaluates its last epoch alone whatever the window: both arms
    run the fewest epochs at which the window closes an epoch (two), and the row says so."""
    protocol = tmp_path / "trial.toml"
    protocol.write_text(
        TINY_PROTOCOL.read_text(encoding="utf-8")
        + '\n[deviations.window]\npaper = "epochs up to 5 not kept"\nharness = "any epoch"\n'
        'why = "a test"\n',
        encoding="utf-8",
    )
    grid = tmp_path / "grid.toml"
    grid.write_text(
        f'name = "trial"\nprotocol = "{protocol}"\nmethods = ["plain"]\nlosses = ["margin"]\n'
        'backbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\nseeds = [0]\n'
        '[smoke]\nseeds = [0]\n[smoke.set]\n"schedule.epochs" = 1\n',
        encoding="utf-8",
    )
    ledger = tmp_path / "ledger.toml"
    ledger.write_text(
        f'paper = "trial"\ngrids = ["{grid}"]\n[[entry]]\nsetting = "window"\n'
        'key = "selection.after_epoch"\nvalue = 5\nsource = "x"\ndeviation = "window"\n',
        encoding="utf-8",
    )
    effects = measure_deviations(
        str(grid), seeds=(0, 1), device="cpu", log=lambda line: None, ledgers=[load_ledger(ledger)]
    )
    assert [e.reason for e in effects] == [""]
    assert effects[0].settings == {
        "selection.after_epoch": 5,
        "schedule.epochs (both arms)": 2,
    }
    assert effects[0].differences[EFFECT_METRICS[0]][2] == 2


def test_an_effect_line_reports_the_interval_and_n():
    effect = Effect("d", "plain/margin", {"k": 1}, {m: (1.5, 0.25, 3) for m in EFFECT_METRICS})
    line = effect_lines("g", [effect], (0, 1, 2))[-1]
    assert line == "| d | plain/margin | k = 1 | +1.50 +- 0.25 | +1.50 +- 0.25 | 3 |"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["deviations", "--measure"], "--measure go with --grid"),
        (["deviations", "--grid", "avsl-table1", "--measure", "--seeds", "0"], "at least two"),
        (["deviations", "--grid", "avsl-table1", "--measure", "--seeds", "a,b"], "integers"),
    ],
)
def test_bad_measure_input_is_one_error_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_measured_effects_reach_the_notes_of_the_grids_tables(tmp_path):
    from harness.engine.audit.deviation_effects import effect_sentences
    from harness.reports.tables.effects import effect_notes, write_effect_notes

    effects = [
        Effect("d", "plain/margin", {"k": 1}, {m: (1.5, 0.25, 3) for m in EFFECT_METRICS}),
        Effect("u", reason="no key"),
    ]
    sentences = effect_sentences(effects)
    assert sentences == {
        "d": "plain/margin P@1 +1.50 +- 0.25, MAP@R +1.50 +- 0.25",
        "u": "not measured (no key)",
    }
    write_effect_notes("g", ["g", "g-smoke"], (0, 1, 2), sentences, folder=tmp_path)
    (tmp_path / "other.json").write_text("not a record", encoding="utf-8")
    [line] = effect_notes({"g-smoke"}, folder=tmp_path)
    assert "d: plain/margin P@1 +1.50 +- 0.25" in line and "u: not measured (no key)" in line
    assert effect_notes({"another"}, folder=tmp_path) == []
