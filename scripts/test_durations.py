"""Seconds per test file, from a JUnit XML report of a full run, for the order in which `make test`
hands files to its pytest-xdist workers (tests/conftest.py: the longest file first).

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    python scripts/test_durations.py /tmp/junit.xml            # writes tests/file_seconds.json
    python scripts/test_durations.py /tmp/junit.xml --print    # and prints the table

A file missing from tests/file_seconds.json runs after every file listed there, so a new file never
needs this script to run; it only starts later than its length would place it.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECONDS_FILE = ROOT / "tests" / "file_seconds.json"


def file_seconds(junit: Path) -> dict[str, float]:
    """Each test file's summed setup, call and teardown seconds (pytest's JUnit `time`), keyed by
    its path from the repository root, longest first."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        # classname is the module's dotted path, then the class for tests in a class
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
        if module is None:
            continue
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.get("time") or 0.0)
    return {path: round(value, 1) for path, value in seconds.most_common()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="pytest's --junitxml report of a full run")
    parser.add_argument("--out", type=Path, default=SECONDS_FILE)
    parser.add_argument("--print", action="store_true", help="print seconds per file too")
    args = parser.parse_args(argv)
    seconds = file_seconds(args.junit)
    if not seconds:
        parser.error(f"{args.junit}: no test cases in this report: pass the --junitxml report of a full run")
    args.out.write_text(json.dumps(seconds, indent=1) + "\n")
    if args.print:
        for path, value in seconds.items():
            print(f"{value:8.1f}  {path}")
    print(f"{args.out}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main()
