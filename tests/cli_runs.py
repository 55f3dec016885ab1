"""``python -m harness run`` called in the test process, and the records it writes."""

from __future__ import annotations

import json
from pathlib import Path

from harness.cli.main import main


def run_cli(*args: str) -> int:
    return main(["run", *args])


def read_records(path: Path) -> list[dict]:
    return json.loads(path.read_text())
