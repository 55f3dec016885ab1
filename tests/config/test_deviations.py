"""Deviations from a paper or its code, as data: declared in protocol files, recorded with
each run (tags, records), printed by the run summary, the tables and ``harness deviations``."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest

from harness.base.errors import HarnessError
from harness.cli.main import main
from harness.config.deviations import PaperDeviation, deviation_tags, from_tag, grouped_notes
from harness.config.fingerprint import fingerprint
from harness.config.grids import load_grid
from harness.config.protocol_files import load_protocol
from harness.reports.tables import LatexRenderer, MarkdownRenderer, paper_deviation_notes

DEVIATION = """
[deviations.validation_carve]
paper = "trains on the whole training split"
harness = "a class-disjoint validation carve"
why = "model selection off the test set"
reference = "Sec. 3.5"
methods = ["plain"]
"""


@pytest.fixture
def protocol_with_deviation(tmp_path, tiny_protocol):
    path = tmp_path / "tiny-dev.toml"
    path.write_text(tiny_protocol.read_text() + DEVIATION)
    return path


def test_a_declared_deviation_is_parsed_and_left_out_of_the_fingerprint(
    protocol_with_deviation, tiny_protocol
):
    protocol = load_protocol(protocol_with_deviation)
    assert protocol.deviations["validation_carve"] == PaperDeviation(
        paper="trains on the whole training split",
        harness="a class-disjoint validation carve",
        why="model selection off the test set",
        reference="Sec. 3.5",
        methods=("plain",),
    )
    # Documentation, not a setting: the fingerprint is the protocol's without it.
    plain = load_protocol(tiny_protocol)
    assert fingerprint(protocol, "d") == fingerprint(
        plain.__class__(**{**plain.__dict__, "name": protocol.name}), "d"
    )


@pytest.mark.parametrize(
    "table, message",
    [
        ('[deviations.x]\npaper = "a"\nharness = "b"\n', "needs 'why'"),
        (
            '[deviations.x]\npaper = "a"\nharness = "b"\nwhy = "c"\ncolour = "d"\n',
            "unknown protocol key 'deviations.x.colour'",
        ),
        (
            '[deviations.x]\npaper = "a"\nharness = "b"\nwhy = "c"\nmethods = ["plian"]\n',
            "did you mean 'plain'",
        ),
        ('[deviations.Bad-Name]\npaper = "a"\nharness = "b"\nwhy = "c"\n', "lower-case letters"),
    ],
)
def test_a_malformed_deviation_is_one_clear_error(tmp_path, tiny_protocol, table, message):
    path = tmp_path / "bad.toml"
    path.write_text(tiny_protocol.read_text() + table)
    with pytest.raises(HarnessError, match=message):
        load_protocol(path)


def test_an_override_cannot_rewrite_a_deviation(protocol_with_deviation, capsys):
    code = main(
        [
            "run",
            "--protocol",
            str(protocol_with_deviation),
            "--methods",
            "plain",
            "--set",
            "deviations.validation_carve.why=none",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "protocol file" in err[0]


def test_tags_round_trip_and_notes_group_by_reason():
    deviations = {
        "b_two": PaperDeviation(paper="p2", harness="h2", why="same reason"),
        "a_one": PaperDeviation(paper="p1", harness="h1", why="same reason", reference="Eq. 3"),
        "c_three": PaperDeviation(paper="p3", harness="h3", why="another", methods=("avsl",)),
    }
    tags = deviation_tags(deviations, "plain", "synthetic")
    assert sorted(tags) == ["deviation.a_one", "deviation.b_two"]  # c_three concerns avsl only
    assert from_tag(tags["deviation.a_one"]) == deviations["a_one"]
    assert grouped_notes(deviations) == [
        "Same reason: a_one (paper: p1 [Eq. 3]; here: h1); b_two (paper: p2; here: h2).",
        "Another: c_three (paper: p3; here: h3).",
    ]
    runs = pd.DataFrame({"paper_deviations": [{"a_one": tags["deviation.a_one"]}, {}]})
    notes = paper_deviation_notes(runs)
    assert notes == ["Same reason: a_one (paper: p1 [Eq. 3]; here: h1)."]
    # The block every table's text ends with, in both formats.
    markdown = MarkdownRenderer().deviations_block(notes)
    assert markdown.rstrip().endswith("- Same reason: a_one (paper: p1 [Eq. 3]; here: h1).")
    latex = LatexRenderer().deviations_block(notes)
    assert latex.rstrip().endswith("\\end{itemize}\n}") and "a\\_\\allowbreak{}one" in latex
    assert LatexRenderer().deviations_block([]) == ""


def test_a_run_records_and_prints_its_deviations(workdir, protocol_with_deviation, capsys):
    out = workdir / "out.json"
    assert (
        main(
            [
                "run",
                "--methods",
                "plain",
                "--protocol",
                str(protocol_with_deviation),
                "--json",
                str(out),
                "--experiment",
                "deviations-e2e",
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())[0]
    assert record["paper_deviations"] == [
        "validation_carve: paper trains on the whole training split (Sec. 3.5); "
        "here a class-disjoint validation carve. model selection off the test set"
    ]
    printed = capsys.readouterr().out
    assert "deviations from the papers or their code:" in printed and "validation_carve" in printed
    tags = mlflow.MlflowClient().get_run(record["mlflow_run_id"]).data.tags
    assert from_tag(tags["deviation.validation_carve"]).why == "model selection off the test set"
    # Every table that shows the run ends with it.
    from harness.reports.tables import TableRequest, make_table

    for fmt, last in (
        ("markdown", "- Model selection off the test set: validation_carve"),
        ("latex", "}"),
    ):
        request = TableRequest(experiments=("deviations-e2e",), fmt=fmt, per_query=None)
        text = make_table(request).text.rstrip()
        assert text.splitlines()[-1].startswith(last), text[-300:]


def test_a_smoke_grid_lists_every_setting_it_changes_against_the_paper_protocol():
    grid = load_grid("agrouping-table3", smoke=True)
    names = set(grid.cells[0].paper_deviations)
    assert {"smoke_backbone", "smoke_dataset", "smoke_image_size", "smoke_embedding_size"} <= names
    full = load_grid("agrouping-table3")
    assert not any(
        name.startswith("smoke_") for cell in full.cells for name in cell.paper_deviations
    )


def test_the_deviations_command_lists_and_refuses_unknown_names(capsys):
    assert main(["deviations", "--grid", "agrouping-table3", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "smoke_backbone" in out and "efficientnet_lite0" in out
    assert (
        main(["deviations", "--grid", "agrouping-table3", "--smoke", "--name", "smoke_bakbone"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and err[0].startswith("error:") and "did you mean 'smoke_backbone'" in err[0]
    )
    assert "valid:" in err[0]


@pytest.mark.parametrize(
    "protocol, method, names",
    [
        # DIABLO: psi's input rescaled (Eq. 3 as printed is A . F) and the validation carve.
        ("diablo", "diablo", {"psi_input_rescaled", "validation_carve"}),
        ("sam", "sam", {"validation_carve"}),
        ("agrouping", "agrouping", {"validation_selection", "diversity_average"}),
        ("avsl", "avsl", {"validation_selection", "warm_up"}),
        ("roth2020", "diml", {"validation_selection"}),
    ],
)
def test_the_paper_protocols_name_their_known_deviations(protocol, method, names):
    from harness.config.deviations import applicable

    found = applicable(load_protocol(protocol).for_dataset("cub200").deviations, method, "cub200")
    assert names <= set(found)


def test_a_post_attention_diablo_run_does_not_carry_the_pre_attention_deviation():
    from harness.config.deviations import applicable

    found = applicable(load_protocol("diablo").deviations, "diablo_feature_post", "cub200")
    assert "psi_input_rescaled" not in found and "validation_carve" in found


def test_a_grid_cell_records_its_own_deviations_not_its_protocols():
    """A smoke cell runs the smoke protocol, but its deviations are against the paper's
    protocol (the grid hands them in as tags): the smoke protocol's own declarations, which
    describe ``run`` on it, are not added on top."""
    from types import SimpleNamespace

    from harness.config.deviations import deviation_tags
    from harness.engine.run.run_config import paper_deviations

    grid = load_grid("agrouping-table3", smoke=True)
    cell = next(c for c in grid.cells if c.method == "agrouping")
    smoke = load_protocol("smoke")
    handed = SimpleNamespace(
        tags=deviation_tags(cell.paper_deviations, cell.method, cell.dataset),
        protocol=smoke,
        method=cell.method,
        dataset=cell.dataset,
        loss=cell.loss,
    )
    assert set(paper_deviations(handed)) == set(cell.paper_deviations)
    assert "grouping_loss_reduction" not in paper_deviations(handed)  # the grid sets "dgml"
    alone = SimpleNamespace(
        tags={}, protocol=smoke, method="agrouping", dataset="synthetic", loss="margin"
    )
    assert {"attention_map_size", "grouping_loss_reduction"} <= set(paper_deviations(alone))
