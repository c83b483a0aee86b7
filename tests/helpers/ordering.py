"""The order in which `make test` hands test files to its pytest-xdist workers: longest recorded
first (tests/file_seconds.json, written by scripts/test_durations.py from a full run's JUnit
report), files not recorded after every recorded one."""

from __future__ import annotations

import json
from pathlib import Path

from . import REPO

SECONDS_FILE = REPO / "tests" / "file_seconds.json"


def recorded_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """Seconds per test file (its path from the repository root); empty when none are recorded."""
    return json.loads(path.read_text()) if path.exists() else {}


def longest_first(path: Path, seconds: dict[str, float]) -> float:
    """A sort key for a test's file: its recorded seconds negated (the longest sorts first); files
    not recorded, or outside the repository, sort after every recorded file."""
    path = Path(path).resolve()
    if not path.is_relative_to(REPO):
        return 1.0
    recorded = seconds.get(path.relative_to(REPO).as_posix())
    return 1.0 if recorded is None else -float(recorded)
