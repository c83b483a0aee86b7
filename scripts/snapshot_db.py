"""Compare every table's rows of two specdec databases, timings aside.

    PYTHONPATH=. python scripts/snapshot_db.py A B [--show 5] [--ignore COLUMN ...]

A and B: SQLAlchemy URLs, or paths of SQLite files. Every table of A and B (specdec's own version
table included) is read in full; a row's timing columns are left out before comparing: date and
time columns (created_at, updated_at, measured_at, ...), durations (a name ending in `_s` or
`_ms`, or `seconds`), the same keys inside JSON values, and inside a Data Docs page (a column
named `html`) the times, random UUIDs and batch hashes Great Expectations writes into it. --ignore leaves out more columns
(e.g. traffic_requests.source_file, the path of the imported file, which names the checkout). Rows are compared as multisets (the
order of a read does not matter). Prints one line per table (rows in A and B, equal or not) and,
for a table that differs, up to --show rows found only in A and only in B. Exit status 0 when
every table is equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path

from sqlalchemy import MetaData, create_engine, select
from sqlalchemy.types import Date, DateTime, Interval, Time

# inside a Data Docs page (a column named `html`): ISO times, compact times (20261127T080054.48Z),
# random UUIDs and the batch's MD5 (Great Expectations hashes the batch, timestamps included)
VOLATILE_HTML = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?Z?|\d{8}T\d{6}(\.\d+)?Z?"
                           r"|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|\b[0-9a-f]{32}\b")
TIMING_NAME = re.compile(r"(^|_)(seconds|s|ms)$|_at$|^(created|updated|started|finished|exported)(_|$)")


def is_timing(name: str) -> bool:
    return bool(TIMING_NAME.search(name.lower()))


def _url(value: str) -> str:
    return value if "://" in value else f"sqlite:///{Path(value).resolve()}"


def _plain(value, ignore: set[str]):
    """A value made comparable and hashable: timing keys of JSON objects dropped, floats rounded
    to 12 significant digits (a database's float round trip), containers as tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, _plain(v, ignore)) for k, v in value.items()
                            if not is_timing(str(k)) and str(k) not in ignore))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v, ignore) for v in value)
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, Decimal):
        return float(f"{float(value):.12g}")
    if isinstance(value, (datetime, date, time, timedelta)):
        return None
    if isinstance(value, (bytes, memoryview)):
        return bytes(value)
    return value


def table_rows(url: str, ignore: set[str]) -> dict[str, tuple[list[str], Counter, list[str]]]:
    """{table: (compared columns, Counter of rows, primary-key columns among them)} of every table
    of the database."""
    engine = create_engine(url)
    metadata = MetaData()
    metadata.reflect(engine)
    out = {}
    with engine.connect() as connection:
        for name, table in sorted(metadata.tables.items()):
            columns = [c for c in table.columns
                       if not is_timing(c.name) and c.name not in ignore
                       and not isinstance(c.type, (Date, DateTime, Time, Interval))]
            rows = Counter()
            for row in connection.execute(select(*columns)):
                rows[tuple(VOLATILE_HTML.sub("<volatile>", value) if c.name == "html" and isinstance(value, str)
                           else _plain(value, ignore) for c, value in zip(columns, row))] += 1
            out[name] = ([c.name for c in columns], rows, [c.name for c in columns if c.primary_key])
    engine.dispose()
    return out


def differing_columns(columns: list[str], key: list[str], rows_a: Counter, rows_b: Counter) -> dict:
    """{column: rows whose value differs} over the rows of A and B with the same primary key
    (and "unmatched": rows whose key is on one side only)."""
    index = [columns.index(k) for k in key]
    by_key = lambda rows: {tuple(row[i] for i in index): row for row in rows.elements()}
    a, b = by_key(rows_a), by_key(rows_b)
    counts = Counter()
    for k in set(a) & set(b):
        for i, column in enumerate(columns):
            if a[k][i] != b[k][i]:
                counts[column] += 1
    unmatched = len(set(a) ^ set(b))
    return {**dict(counts), **({"unmatched": unmatched} if unmatched else {})}


def compare(a: str, b: str, show: int = 5, ignore: set[str] | None = None, out=sys.stdout) -> bool:
    """Print the comparison of databases a and b; True when every table's rows are equal."""
    ignore = ignore or set()
    left, right = table_rows(_url(a), ignore), table_rows(_url(b), ignore)
    equal = True
    for name in sorted(set(left) | set(right)):
        if name not in left or name not in right:
            equal = False
            print(f"{name}: only in {'A' if name in left else 'B'}", file=out)
            continue
        (columns, rows_a, key), (columns_b, rows_b, _) = left[name], right[name]
        if columns != columns_b:
            equal = False
            print(f"{name}: columns differ: {columns} vs {columns_b}", file=out)
            continue
        same = rows_a == rows_b
        equal = equal and same
        print(f"{name}: {sum(rows_a.values())} rows in A, {sum(rows_b.values())} in B: "
              f"{'equal' if same else 'DIFFERENT'}", file=out)
        if not same and key:
            print(f"  columns that differ, rows matched by {key}: "
                  f"{json.dumps(differing_columns(columns, key, rows_a, rows_b))}", file=out)
        if not same:
            for label, only in (("only in A", rows_a - rows_b), ("only in B", rows_b - rows_a)):
                for row in list(only.elements())[:show]:
                    shown = {c: v for c, v in zip(columns, row)}
                    print(f"  {label}: {json.dumps(shown, default=str)[:2000]}", file=out)
    return equal


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--show", type=int, default=5, help="differing rows shown per table and side")
    parser.add_argument("--ignore", action="append", default=[],
                        help="another column (or JSON key) to leave out, repeatable")
    args = parser.parse_args(argv)
    equal = compare(args.a, args.b, args.show, set(args.ignore))
    print("EQUAL: every table's rows, timings aside" if equal else "DIFFERENT")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
