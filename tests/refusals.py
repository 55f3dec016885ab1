"""The one check every refused input must pass: exit status 2, exactly one ``error:`` line on
stderr that names what was wrong, no traceback, and nothing new on disk or in the store.

Used by the table-driven refusal tests; a case is a command line, the text its error line
must contain, and optionally a ``prepare`` callable that builds the bad input first (a file,
a directory, a port in use) so that what it creates is not counted as the command's output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import mlflow

from harness.cli.main import main


@dataclass(frozen=True)
class Refusal:
    """One bad input: ``argv`` after ``python -m harness``, the text the error line must hold."""

    argv: tuple[str, ...]
    match: str
    prepare: Callable[[Path], object] | None = field(default=None, compare=False)

    def __str__(self) -> str:  # the pytest id
        return " ".join(self.argv)[:90]


def files_under(roots: Iterable[Path]) -> set[str]:
    """Every file and directory below ``roots`` (the roots themselves excluded)."""
    found: set[str] = set()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            found.update(os.path.join(folder, name) for name in (*dirs, *files))
    return found


def all_runs() -> set[str]:
    """Ids of every run in every experiment of the current tracking store."""
    client = mlflow.MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments(view_type=3)]
    if not experiments:
        return set()
    return {
        r.info.run_id for r in client.search_runs(experiments, run_view_type=3, max_results=50000)
    }


def assert_refused(argv: list[str], match: str, capsys, watched: Iterable[Path]) -> str:
    """Run ``main(argv)`` and check the refusal contract; returns the error line."""
    watched = [Path(p) for p in watched]
    runs_before = all_runs()  # first: reading the store may create its database
    files_before = files_under(watched)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse exits; the contract is the same
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}, expected 2; stderr:\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert match in lines[0], f"{match!r} not in {lines[0]!r}"
    new_files = files_under(watched) - files_before
    assert not new_files, f"left behind: {sorted(new_files)}"
    assert all_runs() == runs_before, "a new MLflow run was created"
    return lines[0]


def assert_refused_in(
    case: Refusal, folder: Path, store: Path, capsys, watched: Iterable[Path]
) -> str:
    """:func:`assert_refused` for ``case`` with its bad input built in ``folder``: its
    ``prepare`` writes there, and ``{dir}`` in its command line and expected text is
    ``folder``, ``{store}`` the folder of the tracking store's database."""
    if case.prepare is not None:
        case.prepare(folder)

    def fill(text: str) -> str:
        return text.replace("{dir}", str(folder)).replace("{store}", str(store))

    argv = [fill(arg) for arg in case.argv]
    return assert_refused(argv, fill(case.match), capsys, watched=watched)


# ------------------------------------------------------------------ prepare steps


def write_file(name: str, text: str) -> Callable[[Path], object]:
    """A ``prepare`` step: the bad input file ``name`` with ``text``, under the case's folder."""
    return lambda folder: (folder / name).write_text(text, encoding="utf-8")


def small_synthetic(folder: Path) -> None:
    """A ``prepare`` step: the synthetic dataset at a sixth of its classes and size, generated
    in seconds, and loaded once (which packs its images) so that the case itself writes
    nothing."""
    from harness.components.data.synthetic import generate, load_synthetic, synthetic_root

    generate(synthetic_root(folder), num_classes=16, images_per_class=4, size=32)
    load_synthetic(folder)


def unwritable_folder(folder: Path) -> Path:
    """A folder under ``folder`` that no file can be created in, for any user (``/proc`` for
    root, for whom a ``chmod 0o500`` folder stays writable)."""
    if os.geteuid() == 0:
        (folder / "ro").symlink_to("/proc", target_is_directory=True)
    else:
        (folder / "ro").mkdir()
        (folder / "ro").chmod(0o500)
    return folder / "ro"
