"""What the command line names and bounds before any protocol is read: the shipped
protocols and grids (the names of their ``.toml`` files), the largest grid a sweep expands
unasked, the protocol fields ``tune`` searches by default and the ways a tuned grid's fold
models are reported. The module imports no registry, so ``--help`` lists these names
without loading the plugins or torch."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "protocol_dir",
    "list_protocols",
    "grid_dir",
    "list_grids",
    "MAX_CELLS",
    "DEFAULT_PROTOCOL_SPACE",
    "REPORTS",
]

#: The most cells a grid expands to unless its sweep is given ``--yes``: a larger one is
#: most likely an axis written by mistake (each cell is a training run).
MAX_CELLS = 5_000

#: ``harness tune``'s default protocol fields (one method searched on its own): a decade
#: either side of the protocol's value, log-uniform. A tuned grid searches MLRC's space
#: instead (:mod:`harness.config.tuning`).
DEFAULT_PROTOCOL_SPACE = ("optimizer.lr_head", "optimizer.lr_backbone")

#: A tuned grid's final results with k > 1 folds: the mean over the k fold models
#: ("separated") or their concatenated embeddings ("concatenated"); "single" for k = 1.
REPORTS = ("separated", "concatenated")


def protocol_dir() -> Path:
    """The shipped protocols: ``protocols/`` of the source checkout (the source of truth),
    else the copy a wheel installs as package data (``harness/_protocols``, mapped from
    ``protocols/`` in pyproject.toml), else ``protocols/`` in the working directory."""
    package = Path(__file__).resolve().parents[1]  # harness/
    for folder in (package.parent / "protocols", package / "_protocols"):
        if (folder / "smoke.toml").is_file():  # not just any folder named protocols
            return folder
    return Path.cwd() / "protocols"


def list_protocols() -> list[str]:
    return sorted(p.stem for p in protocol_dir().glob("*.toml"))


def grid_dir() -> Path:
    return protocol_dir() / "grids"


def list_grids() -> list[str]:
    return sorted(p.stem for p in grid_dir().glob("*.toml"))
