"""``python -m harness env RUN_ID``: the environment a run recorded, as a pip constraints file.

Every run records the commit of the harness that made it (the ``git_commit`` tag, with
``-dirty`` and the artifact ``source/uncommitted.patch`` when the tree had local changes)
and the installed version of each package its numbers depend on (``version.<name>`` tags,
:data:`harness.store.provenance.PACKAGES`). This command prints them as comment lines (the
run, the commit, Python, the torch build and its CUDA) followed by one ``name==version``
line per recorded package that was installed, so that::

    git checkout COMMIT
    python -m harness env RUN_ID --out constraints.txt
    pip install -c constraints.txt -e .

rebuilds the run's environment. The harness itself (``dml-harness``) is the ``-e .`` and
gets no line. A version with a local label (``2.5.1+cpu``, PyTorch's own builds) stays
exact: PyPI serves no such build, so pip refuses the constraint there
(``ResolutionImpossible``), and a comment names the index that serves it.
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata

from harness.base.errors import HarnessError
from harness.base.written import write_outputs
from harness.cli.outputs import output_file
from harness.cli.store import open_store
from harness.store.location import tracking_uri
from harness.store.queries import find_run

__all__ = ["cmd_env", "constraints_text", "pytorch_index"]

#: The prefix of the tags that hold the installed versions (``version.torch``).
VERSION_TAG = "version."
#: Recorded versions that are not pins: Python (a comment line) and the harness (``-e .``).
NOT_PINNED = ("python", "dml-harness")
#: The artifact of a ``-dirty`` run that holds its uncommitted changes.
PATCH_ARTIFACT = "source/uncommitted.patch"
#: A local version label of PyPI-absent PyTorch builds: ``cpu``, ``cu121``, ``rocm6.2``.
_PYTORCH_LABEL = re.compile(r"^(cpu|cu\d+|rocm[\d.]+)$")


def pytorch_index(label: str) -> str | None:
    """The package index that serves PyTorch's builds with local label ``label``
    (``cpu`` -> ``https://download.pytorch.org/whl/cpu``), or None for a label PyTorch's
    index does not use (a build made elsewhere)."""
    if _PYTORCH_LABEL.match(label):
        return f"https://download.pytorch.org/whl/{label}"
    return None


def _requirements_of_harness() -> set[str] | None:
    """The names of the installed harness's requirements (extras left out), or None when it
    runs from a source tree that is not installed."""
    try:
        requires = metadata.requires("dml-harness") or []
    except metadata.PackageNotFoundError:
        return None
    names = set()
    for line in requires:
        if "extra ==" in line:
            continue
        name = re.split(r"[\s<>=!~\[;(]", line, maxsplit=1)[0]
        names.add(name.lower().replace("_", "-"))
    return names


def _pins(tags: dict[str, str]) -> dict[str, str]:
    """``{package: version}`` of the recorded packages that were installed, by name."""
    versions = {
        key.removeprefix(VERSION_TAG): value.strip()
        for key, value in tags.items()
        if key.startswith(VERSION_TAG)
    }
    return {
        name: version
        for name, version in sorted(versions.items())
        if name not in NOT_PINNED and version and version != "not installed"
    }


def _commit_lines(tags: dict[str, str]) -> list[str]:
    commit = tags.get("git_commit") or tags.get("mlflow.source.git.commit") or "unknown"
    if commit == "unknown":
        return ["# commit unknown: the run was not made from a git checkout of the harness"]
    bare = commit.removesuffix("-dirty")
    lines = [f"# commit {bare}"]
    if commit.endswith("-dirty"):
        lines.append(
            f"# the run had uncommitted changes: they are stored with it as the artifact "
            f"{PATCH_ARTIFACT} (git apply it at that commit)"
        )
    return lines


def _build_lines(tags: dict[str, str]) -> list[str]:
    lines = []
    if python := tags.get(f"{VERSION_TAG}python"):
        lines.append(f"# python {python}")
    if build := tags.get("torch_build"):
        cuda = tags.get("cuda", "None")
        lines.append(f"# torch build {build}, " + ("no CUDA" if cuda == "None" else f"CUDA {cuda}"))
    return lines


def _pin_notes(pins: dict[str, str], out_name: str) -> list[str]:
    """One comment per pin pip cannot take from PyPI, and per recorded package that the
    harness does not require (a constraint alone installs nothing)."""
    notes = []
    for name, version in pins.items():
        if "+" not in version:
            continue
        index = pytorch_index(version.split("+", 1)[1])
        where = (
            f"add --extra-index-url {index} to the pip line"
            if index
            else "install it from where it was built"
        )
        notes.append(f"# {name}=={version} is a build PyPI does not serve: {where}")
    required = _requirements_of_harness()
    if required is not None:
        for name in pins:
            if name not in required:
                notes.append(
                    f"# {name} is not a requirement of the harness: "
                    f"pip install -c {out_name} {name}"
                )
    return notes


def constraints_text(
    run_id: str, tags: dict[str, str], *, out_name: str = "constraints.txt"
) -> str:
    """The constraints file of the run ``run_id`` with tags ``tags``: comment lines, then
    ``name==version`` per recorded package (module docstring). ``out_name``: the file's
    name as the install line in its comments spells it."""
    pins = _pins(tags)
    if not pins:
        raise HarnessError(
            f"env: run '{run_id}' records no installed package versions (no version.* tags): "
            f"it was not made by this harness's run command"
        )
    lines = [
        f"# run {run_id}",
        *_commit_lines(tags),
        *_build_lines(tags),
        f"# rebuild at that commit: pip install -c {out_name} -e .",
        *_pin_notes(pins, out_name),
        *(f"{name}=={version}" for name, version in pins.items()),
    ]
    return "\n".join(lines) + "\n"


def cmd_env(args: argparse.Namespace) -> int:
    out = output_file(args.out, "--out", args=args)
    open_store(read_only=True)
    run = find_run(args.run_id)
    if run is None:
        raise HarnessError(
            f"env: no run '{args.run_id}' in the tracking store {tracking_uri()} "
            f"(give a run id from the MLflow UI or a run --json record's mlflow_run_id)"
        )
    text = constraints_text(
        run.info.run_id, dict(run.data.tags), out_name=out.name if out else "constraints.txt"
    )
    if out is None:
        print(text, end="")
    else:
        write_outputs({out: text})
    return 0
