"""The ops reports' read (tasks.steps.traffic.reports): one report file's SQL run as it is."""

from __future__ import annotations

from sqlalchemy import text

from .store import Store


def run_report_sql(store: Store, sql: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of the report query `sql`, a single read on its own connection. The
    SQL is taken as written (reports take no parameters: the caller escapes `:word`)."""
    with store.connect() as connection:
        result = connection.execute(text(sql))
        return list(result.keys()), [tuple(row) for row in result]
