"""The ops reports: one portable SQL file each under sql/ (SQLite and PostgreSQL).

Each file opens with a comment block whose first line is `-- Question: ...`; the report's name
is the file name without `.sql`. Where the files are looked up, first match wins:
$SPECDEC_SQL_DIR, the repository's sql/ beside the package (source checkout, editable install),
<prefix>/share/specdec-rollout/sql (a regular install).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import sys
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path

from ...db.queries_reports import run_report_sql
from ...db.store import Store
from ...errors import UnknownReport
from ...settings import specdec_home

log = logging.getLogger(__name__)

SQL_DIR_ENV = "SPECDEC_SQL_DIR"


def sql_dir() -> Path:
    """The directory holding the report files."""
    candidates = []
    if os.environ.get(SQL_DIR_ENV):
        candidates.append(Path(os.environ[SQL_DIR_ENV]))
    candidates.append(Path(__file__).resolve().parents[3] / "sql")
    candidates.append(Path(sys.prefix) / "share" / "specdec-rollout" / "sql")
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.sql")):
            return candidate
    raise UnknownReport(f"no report directory found (looked in {[str(c) for c in candidates]}); set "
                        f"{SQL_DIR_ENV} to the repository's sql/ directory")


def report_header(path: Path) -> str:
    """The leading comment block of a report file, without the `--` markers."""
    lines = []
    for line in path.read_text("utf-8").splitlines():
        if not line.startswith("--"):
            break
        lines.append(line[2:].strip())
    return "\n".join(lines)


def report_question(path: Path) -> str:
    header = report_header(path)
    first = header.splitlines()[0] if header else ""
    return first.removeprefix("Question:").strip()


def list_reports() -> dict[str, str]:
    """{name: question} of every report."""
    return {path.stem: report_question(path) for path in sorted(sql_dir().glob("*.sql"))}


# SQLite hands timestamps back as text: read them as datetimes so both databases print alike
_SQLITE_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(\.\d{1,6})?$")


def _plain(value):
    if isinstance(value, str) and _SQLITE_DATETIME.match(value):
        value = datetime.fromisoformat(value)
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (datetime, date)):
        return value.isoformat(sep=" ") if isinstance(value, datetime) else value.isoformat()
    return value


def _literal_colons(sql: str) -> str:
    """Reports take no parameters: escape every `:word` so that SQLAlchemy does not read it as a
    bind parameter (in comments and string literals alike); `::` casts are left alone."""
    return re.sub(r"(?<![:\\]):(?=\w)", r"\\:", sql)


def run_report(name: str, store: Store) -> dict:
    """Run one report. Output: {"name", "question", "columns", "rows"} (rows as lists of plain
    values: numbers, strings, None; dates as ISO strings)."""
    reports = list_reports()
    if name.endswith(".sql"):
        name = name[:-4]
    if name not in reports:
        raise UnknownReport(f"no report named {name!r}; choose one of {sorted(reports)} "
                            "(`specdec report --list`)")
    path = sql_dir() / f"{name}.sql"
    columns, result = run_report_sql(store, _literal_colons(path.read_text("utf-8")))
    rows = [[_plain(value) for value in row] for row in result]
    log.info("report %s: %d rows", name, len(rows))
    return {"name": name, "question": reports[name], "columns": columns, "rows": rows}


def format_report(report: dict, fmt: str) -> str:
    """The report as csv or json text (the CLI renders "table" itself)."""
    if fmt == "json":
        return json.dumps([dict(zip(report["columns"], row)) for row in report["rows"]], indent=2)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(report["columns"])
        writer.writerows(report["rows"])
        return buffer.getvalue()
    raise UnknownReport(f"format {fmt!r}: choose table, csv or json")


def cell_text(value) -> str:
    """How a value reads in a table: floats to 4 significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def materialise_report(name: str, store: Store, directory: str | Path | None = None) -> dict:
    """Run a report and write it as CSV to `directory` (default $SPECDEC_HOME/reports), atomically.
    Output: {"name", "rows", "path"}."""
    report = run_report(name, store)
    directory = Path(directory) if directory else specdec_home() / "reports"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{report['name']}.csv"
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(format_report(report, "csv"), encoding="utf-8")
    tmp.replace(path)
    log.info("report %s: %d rows written to %s", report["name"], len(report["rows"]), path)
    return {"name": report["name"], "rows": len(report["rows"]), "path": str(path)}
