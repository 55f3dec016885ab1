"""``python -m harness run`` called in the test process, and the records it writes."""

from __future__ import annotations

import json
from pathlib import Path

from harness.cli.main import main


def run_cli(*args: str, train=None) -> int:
    """``run`` with ``args``; ``train``: what trains each run (default: the harness's own)."""
    return main(["run", *args], train=train)


def read_records(path: Path) -> list[dict]:
    return json.loads(path.read_text())
