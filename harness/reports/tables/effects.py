"""The measured effects of a grid's deviations (``python -m harness deviations --grid G
--measure``), kept beside the results so that the grid's tables say, under their
deviations, which were measured at the smoke scale and by how much.

``results/deviation_effects/<grid>.json`` holds ``{"grid", "experiments", "seeds",
"notes": {deviation: sentence}}``; ``experiments`` are the grid's and its smoke
version's, the tables whose notes take the sentences."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness.base.atomic import atomic_write_json

__all__ = ["EFFECTS_DIR", "write_effect_notes", "effect_notes"]

#: Where ``deviations --measure`` keeps each grid's measured effects.
EFFECTS_DIR = Path("results") / "deviation_effects"


def write_effect_notes(
    grid: str,
    experiments: Iterable[str],
    seeds: Iterable[int],
    notes: dict[str, str],
    folder: Path = EFFECTS_DIR,
    *,
    merge: bool = False,
) -> Path:
    """Keep ``notes`` (one sentence per deviation) for the tables of ``experiments``.
    ``merge``: keep the grid's other notes measured over the same seeds (one deviation
    measured again)."""
    path = folder / f"{grid}.json"
    data = {"grid": grid, "experiments": sorted(set(experiments)), "seeds": list(seeds)}
    kept = _notes_of(path, list(seeds)) if merge else {}
    atomic_write_json(path, {**data, "notes": dict(sorted({**kept, **notes}.items()))})
    return path


def _notes_of(path: Path, seeds: list[int]) -> dict[str, str]:
    """The notes of the record at ``path`` when it was measured over ``seeds``."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        return dict(data["notes"]) if data["seeds"] == seeds else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def effect_notes(experiments: Iterable[str], folder: Path = EFFECTS_DIR) -> list[str]:
    """One line per measured grid whose experiments include one of ``experiments``:
    ``Measured at the smoke scale (deviations --measure): name: sentence; ...``. A file
    that is not such a record is skipped."""
    wanted = set(experiments)
    lines = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data: Any = json.loads(path.read_text(encoding="utf-8"))
            shown = wanted & set(data["experiments"])
            notes = dict(data["notes"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if shown and notes:
            items = "; ".join(f"{name}: {text}" for name, text in notes.items())
            lines.append(f"Deviations measured at the smoke scale (deviations --measure): {items}.")
    return lines
