"""The A/A check: ``plain`` beside twins of itself that differ only in the random stream of
their head's initialisation, trained in one grid on the tiny protocol with 3 seeds. Every
difference between them is noise, so their table must carry no up/down mark, untuned and
tuned, with the chance rule switched off (the correction and the seed rule alone) as well
as on."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.methods import METHODS
from harness.methods.base import PLUGIN_GROUP

REPO = Path(__file__).resolve().parents[2]
TWINS = 3

#: A plugin package of its own: each twin is plain's head with its Linear drawn again from
#: a generator seeded by the run's seed and the twin's number (another random stream; the
#: global stream, and so the batches, stay the run's).
TWIN_MODULE = textwrap.dedent(
    f"""
    import torch
    from torch import nn

    from harness.methods.base import register_method
    from harness.methods.plain import PlainHead


    def twin(k):
        class Twin(PlainHead):
            label = f"Twin {{k}}"

            def __init__(self, **options):
                super().__init__(**options)
                stream = torch.Generator().manual_seed(torch.initial_seed() + 7919 * k)
                bound = 1.0 / self.in_channels ** 0.5
                with torch.no_grad():
                    self.project.weight.uniform_(-bound, bound, generator=stream)
                    self.project.bias.uniform_(-bound, bound, generator=stream)

        return Twin


    for k in range(1, {TWINS + 1}):
        register_method(f"aatwin{{k}}", description="plain, initialised from another stream")(twin(k))
    """
)

MARKS = re.compile("[↑↓⇑⇓]")


@pytest.fixture
def twins(tmp_path, monkeypatch):
    """The twin package installed on the path (dist-info and entry points, for any worker
    process) and imported here; unregistered afterwards."""
    site = tmp_path / "site"
    info = site / "aa_twins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aa-twins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\naatwins = aa_twins\n")
    (site / "aa_twins.py").write_text(TWIN_MODULE)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", f"{site}:{REPO}")
    __import__("aa_twins")
    names = [f"aatwin{k}" for k in range(1, TWINS + 1)]
    yield names
    for name in names:
        METHODS.remove(name)
    sys.modules.pop("aa_twins", None)


def _grid(folder: Path, names: list[str], tuned: bool) -> Path:
    tune = "\n[tune]\ntrials = 3\nfolds = 2\nround = 3\n" if tuned else ""
    path = folder / ("twins-tuned.toml" if tuned else "twins.toml")
    path.write_text(
        f'name = "{path.stem}"\n'
        f'protocol = "{REPO / "tests" / "protocols" / "tiny.toml"}"\n'
        f'experiment = "aa-{path.stem}"\n'
        f"methods = {['plain', *names]!r}\n".replace("'", '"')
        + 'losses = ["margin"]\nbackbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\n'
        "seeds = [0, 1, 2]\n" + tune
    )
    return path


def _twin_rows(text: str) -> list[str]:
    """The twins' rows: ``Twin k`` untuned, ``aatwink [tuned]`` tuned."""
    return [line for line in text.splitlines() if re.match(r"\| (Twin \d|aatwin\d)", line)]


def _marks(table: Path) -> list[str]:
    return [row for row in _twin_rows(table.read_text()) if MARKS.search(row)]


@pytest.mark.slow
@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_plain_against_its_twins_carries_no_mark(twins, workdir, tuned, capsys):
    grid = _grid(workdir, twins, tuned)
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    assert main(["sweep", "--grid", str(grid), "--storage", storage]) == 0
    experiment = f"aa-{grid.stem}"
    for extra in ([], ["--chance-draws", "0"]):
        out = workdir / f"aa{len(extra)}.md"
        args = ["table", "--experiment", experiment, "--format", "markdown", "--out", str(out)]
        assert main([*args, *extra]) == 0
        text = out.read_text()
        assert len(_twin_rows(text)) == TWINS
        assert "Holm's step-down correction" in text
        assert _marks(out) == [], text
    print(text)  # the table with the chance rule off, for the record
