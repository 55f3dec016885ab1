"""Recipe ledgers (protocols/ledgers/<paper>.toml): every entry resolves on every cell of
the grids and protocols its ledger covers, and a value that differs from the authors' is
named by a deviation that applies to that cell."""

from __future__ import annotations

import pytest

from harness.base.errors import HarnessError
from harness.cli.main import main
from harness.config.catalog import list_grids
from harness.config.ledger import (
    NOT_SETTINGS,
    check_ledger,
    family_counts,
    list_ledgers,
    load_ledger,
    protocol_keys,
    registered_options,
    required_keys,
    uncovered,
)
from harness.config.protocol import protocol_json_schema

PAPERS = ("agrouping", "diml", "diablo", "sam")


def test_the_papers_ledgers_are_shipped():
    assert set(PAPERS) <= set(list_ledgers())


@pytest.mark.parametrize("paper", list_ledgers())
def test_every_entry_is_the_authors_value_or_a_declared_deviation(paper):
    ledger = load_ledger(paper)
    assert ledger.paper == paper and ledger.entries
    assert ledger.grids or ledger.protocols
    assert set(ledger.grids) <= set(list_grids())
    checks = check_ledger(ledger)
    assert checks
    undeclared = sorted(
        {
            f"{c.case.family} {c.case.method}/{c.case.loss}: {c.entry.key} = {c.actual!r}, "
            f"the authors' {c.entry.value!r} ({c.entry.source})"
            + (f"; deviation '{c.entry.deviation}' does not apply" if c.entry.deviation else "")
            for c in checks
            if c.status == "undeclared"
        }
    )
    assert not undeclared, "\n".join(undeclared)
    used = {id(c.entry) for c in checks}
    unused = [e.setting for e in ledger.entries if id(e) not in used]
    assert not unused, f"entries that apply to no cell: {unused}"


@pytest.mark.parametrize("paper", list_ledgers())
def test_every_entry_cites_its_source_and_names_an_existing_deviation(paper):
    ledger = load_ledger(paper)
    for entry in ledger.entries:
        assert entry.source.strip() and entry.setting.strip()
    declared = {name for c in check_ledger(ledger) for name in c.case.deviations}
    for entry in ledger.entries:
        assert not entry.deviation or entry.deviation in declared, entry.setting


def _ledger(tmp_path, entry: str, grids: str = '["agrouping-table3"]'):
    path = tmp_path / "trial.toml"
    path.write_text(f'paper = "trial"\ngrids = {grids}\n[[entry]]\n{entry}\n', encoding="utf-8")
    return path


def test_a_value_that_differs_without_a_deviation_is_undeclared(tmp_path):
    entry = 'setting = "s"\nkey = "sampling.images_with_replacement"\nvalue = false\nsource = "x"'
    checks = check_ledger(load_ledger(_ledger(tmp_path, entry)))
    assert checks and {c.status for c in checks} == {"undeclared"}


def test_a_deviation_that_does_not_apply_to_the_cell_leaves_it_undeclared(tmp_path):
    # googlenet_weights is declared for the GoogLeNet cells only
    entry = (
        'setting = "s"\nkey = "backbone.freeze_bn"\nvalue = false\nsource = "x"\n'
        'deviation = "googlenet_weights"'
    )
    checks = check_ledger(load_ledger(_ledger(tmp_path, entry)))
    status = {
        c.case.backbone: {x.status for x in checks if x.case.backbone == c.case.backbone}
        for c in checks
    }
    assert status == {"googlenet": {"matched"}, "resnet50": {"undeclared"}}


def test_a_named_applicable_deviation_makes_a_difference_deviating(tmp_path):
    entry = (
        'setting = "s"\nkey = "selection.mode"\nvalue = "test-paper"\nsource = "x"\n'
        'deviation = "validation_selection"'
    )
    checks = check_ledger(load_ledger(_ledger(tmp_path, entry)))
    assert checks and {c.status for c in checks} == {"deviating"}
    counts = family_counts(checks)
    assert counts["agrouping-table3: resnet50/sop"] == {
        "matched": 0,
        "deviating": 1,
        "undeclared": 0,
    }


def test_when_filters_the_cells_and_defaults_resolve_from_the_plugin_and_the_loss(tmp_path):
    entry = (
        'setting = "s"\nkey = "methods.agrouping.diversity_beta"\nvalue = 25.0\nsource = "x"\n'
        'when = { method = ["agrouping"], dataset = "sop" }'
    )
    checks = check_ledger(load_ledger(_ledger(tmp_path, entry)))
    assert checks and {(c.case.method, c.case.dataset, c.status) for c in checks} == {
        ("agrouping", "sop", "matched")
    }
    entry = (
        'setting = "s"\nkey = "loss.args.multi_similarity.reduction"\nvalue = "pml"\nsource = "x"'
    )
    checks = check_ledger(load_ledger(_ledger(tmp_path, entry, grids='["fair-roth2020"]')))
    assert checks and {c.status for c in checks} == {"matched"}


@pytest.mark.parametrize(
    "key",
    [
        "sampling.images_with_replacment",
        "methods.agrouping.no_such_option",
        "loss.args.margin.no_such_arg",
        "deviations.seeds",
    ],
)
def test_an_unknown_key_is_one_error_line_through_the_cli(tmp_path, capsys, key):
    path = _ledger(tmp_path, f'setting = "s"\nkey = "{key}"\nvalue = 1\nsource = "x"')
    with pytest.raises(
        HarnessError, match=f"ledger trial .*entry 1 .*unknown protocol key '{key}'"
    ):
        check_ledger(load_ledger(path))
    assert main(["deviations", "--grid", "agrouping-table3", "--ledger", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and key in err[0]


def test_an_unknown_ledger_field_is_refused(tmp_path):
    path = _ledger(tmp_path, 'setting = "s"\nkey = "seeds"\nvalue = [0]\nsource = "x"\nwhy = "no"')
    with pytest.raises(HarnessError, match=r"unknown ledger trial key 'entry\[0\]\.why'"):
        load_ledger(path)


def test_the_deviations_command_ends_with_the_ledger_counts(capsys):
    assert main(["deviations", "--grid", "diml-table1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    tail = out[out.index(next(line for line in out if line.startswith("recipe ledger diml"))) :]
    assert len(tail) == 4  # the title, then cub200, cars196, sop
    for line in tail[1:]:
        assert (
            line.startswith("  diml-table1: resnet50/")
            and " matched, " in line
            and "deviating" in line
        )
        assert "UNDECLARED" not in line


# ------------------------------------------------------------------------- coverage


def _coverage_report(schema=None, method_options=registered_options) -> list[str]:
    """``ledger <paper>: <key>`` for every key a shipped ledger leaves without an entry or
    a reason."""
    return [
        f"ledger {paper}: {key}"
        for paper in list_ledgers()
        for key in uncovered(load_ledger(paper), schema, method_options)
    ]


def test_every_ledger_covers_every_protocol_key_and_method_option():
    report = _coverage_report()
    assert not report, "keys without an entry or a reason:\n" + "\n".join(report)


def test_a_new_protocol_key_fails_coverage_in_every_ledger():
    schema = protocol_json_schema()
    schema["$defs"]["BackboneSpec"]["properties"]["dummy_setting"] = {"type": "boolean"}
    schema["properties"]["dummy_section"] = {"type": "integer"}
    assert "backbone.dummy_setting" in protocol_keys(schema)
    report = _coverage_report(schema)
    assert sorted(report) == sorted(
        f"ledger {paper}: {key}"
        for paper in list_ledgers()
        for key in ("backbone.dummy_setting", "dummy_section")
    )


def test_a_new_method_option_fails_coverage_in_the_ledgers_that_run_the_method():
    def with_dummy(method):
        options = registered_options(method)
        return {**options, "dummy_option": 1} if method == "plain" else options

    report = _coverage_report(method_options=with_dummy)
    runs_plain = {"avsl", "diablo", "diml", "sam"}
    assert sorted(report) == sorted(f"ledger {p}: methods.plain.dummy_option" for p in runs_plain)


@pytest.mark.parametrize("paper", list_ledgers())
def test_a_reason_is_given_only_for_a_required_key_no_entry_reads(paper):
    ledger = load_ledger(paper)
    required = set(required_keys(ledger))
    keys = {e.key for e in ledger.entries}
    for key, reason in ledger.not_applicable.items():
        assert key in required and key not in NOT_SETTINGS, key
        assert not any(k == key or k.startswith(key + ".") for k in keys), key
        assert reason.strip(), key


@pytest.mark.parametrize("paper", list_ledgers())
def test_unmeasured_names_a_deviation_of_the_ledgers_cells(paper):
    ledger = load_ledger(paper)
    declared = {name for c in check_ledger(ledger) for name in c.case.deviations}
    assert set(ledger.unmeasured) <= declared, set(ledger.unmeasured) - declared
