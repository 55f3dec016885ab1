"""Each bad input gets one clear line on stderr, exit status 2, and no half-written result."""

from __future__ import annotations

import mlflow
import pytest
import torch

from harness.cli.main import main
from methods import METHODS, HeadOutput
from methods.base import MethodEntry
from methods.plain import PlainHead

from .fixtures import make_cub


def _fails(capsys, args, match, out_path):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and match in last, err
    assert "Traceback" not in err
    assert not out_path.exists()
    return last


@pytest.mark.parametrize("args, match", [
    (["--methods", "plain,agroupin"], "unknown method 'agroupin'"),
    (["--dataset", "cub"], "unknown dataset 'cub'; did you mean 'cub200'? valid: cars196, cub200"),
    (["--loss", "tripplet"], "unknown loss 'tripplet'; did you mean 'triplet'? valid:"),
    (["--protocol", "rot2020"], "unknown protocol 'rot2020'; did you mean 'roth2020'? valid:"),
    (["--seeds", "0,x"], "--seeds expects comma-separated integers"),
    (["--set", "optimizer.lr=1"], "unknown protocol key 'optimizer.lr'"),
    (["--dataset", "cub200", "--data-root", "/nonexistent/dir"], "--data-root /nonexistent/dir does not exist"),
    (["--protocol", "agrouping", "--set", 'loss.args.margin.reduction="mean"'],
     "loss 'margin': unknown reduction 'mean' valid: dgml, pml"),
])
def test_unknown_names_list_the_valid_ones(workdir, capsys, args, match):
    _fails(capsys, ["run", *args, "--json", str(workdir / "o.json")], match, workdir / "o.json")


def test_missing_data_root_names_the_expected_file(workdir, capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _fails(capsys, ["run", "--dataset", "cub200", "--data-root", str(empty), "--json",
                           str(workdir / "o.json")], "dataset 'cub200' not found: expected", workdir / "o.json")
    assert str(empty / "CUB_200_2011" / "images.txt") in line


def test_malformed_protocol_names_the_key(workdir, capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling]\nclasses_per_bach = 8\n")
    _fails(capsys, ["run", "--protocol", str(bad), "--json", str(workdir / "o.json")],
           "unknown protocol key 'sampling.classes_per_bach' (did you mean 'classes_per_batch'?)",
           workdir / "o.json")


def test_corrupt_image_names_its_path(workdir, capsys, tmp_path, tiny_protocol):
    base = make_cub(tmp_path / "cub")
    corrupt = base / "images" / "150.Bird_150" / "Bird_150_0000.jpg"
    corrupt.write_bytes(b"this is not a jpeg")
    line = _fails(capsys, ["run", "--methods", "plain", "--dataset", "cub200", "--data-root",
                           str(tmp_path / "cub"), "--protocol", str(tiny_protocol), "--epochs", "0",
                           "--set", "splits.max_test_images_per_class=0", "--json", str(workdir / "o.json")],
                  "corrupt image", workdir / "o.json")
    assert str(corrupt) in line


class NanHead(PlainHead):
    """A plain head whose loss becomes NaN (test only)."""

    def loss_terms(self, output: HeadOutput, batch):
        return {"metric": batch.metric_loss(output.embedding, batch.labels) * torch.tensor(float("nan"))}


def test_nan_loss_stops_the_run_and_marks_it_failed(workdir, capsys, tiny_protocol, monkeypatch):
    monkeypatch.setitem(METHODS._entries, "nan-test", MethodEntry("nan-test", NanHead, {}))
    out = workdir / "o.json"
    _fails(capsys, ["run", "--methods", "nan-test", "--protocol", str(tiny_protocol), "--json", str(out)],
           "loss is nan at epoch 1, batch 1", out)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.method = 'nan-test'",
                              output_format="list")
    assert runs and all(r.info.status == "FAILED" for r in runs)
    assert "loss is nan" in runs[0].data.tags["failure"]


def test_a_selection_metric_that_is_never_a_number_fails_the_run(workdir, capsys, tiny_protocol, monkeypatch):
    import harness.engine.training as training

    def no_scores(*args, metrics=None, **kwargs):
        return {name: float("nan") for name in metrics or ("mean_average_precision_at_r",)}

    monkeypatch.setattr(training, "evaluate_split", no_scores)
    out = workdir / "o.json"
    _fails(capsys, ["run", "--methods", "plain", "--protocol", str(tiny_protocol), "--epochs", "1",
                    "--json", str(out)], "was NaN at every evaluation", out)


@pytest.mark.parametrize("section, match", [
    ("[methods.agroupng]\ngroups = 4\n", "protocol key 'methods.agroupng': unknown method 'agroupng'; did you mean 'agrouping'?"),
    ("[loss.args.margn]\nmargin = 0.1\n", "protocol key 'loss.args.margn': unknown loss 'margn'; did you mean 'margin'?"),
    ('[loss.args.margin]\nreduction = "dgm"\n', "loss 'margin': unknown reduction 'dgm'; did you mean 'dgml'? "
                                                 "valid: dgml, pml"),
])
def test_a_misspelt_name_in_a_protocol_section_is_an_error(workdir, capsys, tmp_path, section, match):
    bad = tmp_path / "bad.toml"
    bad.write_text(section)
    _fails(capsys, ["run", "--protocol", str(bad), "--json", str(workdir / "o.json")], match, workdir / "o.json")


def test_a_bad_method_option_is_one_line_before_the_dataset_loads(workdir, capsys, monkeypatch):
    """A value the method's constructor refuses (groups not dividing the embedding size) is
    one ``error:`` line, raised before any dataset is read."""
    import harness.engine.training as training

    monkeypatch.setattr(training, "prepare_splits", lambda *a, **k: pytest.fail("dataset loaded"))
    _fails(capsys, ["run", "--methods", "agrouping", "--set", "methods.agrouping.groups=3",
                    "--json", str(workdir / "o.json")],
           "method 'agrouping': groups must divide the embedding size 128, got 3", workdir / "o.json")
    _fails(capsys, ["run", "--methods", "diablo", "--set", "methods.diablo.entries=7",
                    "--json", str(workdir / "o.json")], "DIABLO entries (N) must be a positive divisor",
           workdir / "o.json")
    _fails(capsys, ["run", "--methods", "plain", "--set", "methods.plain.groups=2",
                    "--json", str(workdir / "o.json")], "unknown option 'groups' for method 'plain'",
           workdir / "o.json")
    _fails(capsys, ["run", "--methods", "diml_train", "--loss", "proxy_anchor",
                    "--json", str(workdir / "o.json")], "method 'diml_train' cannot train with loss 'proxy_anchor'",
           workdir / "o.json")
