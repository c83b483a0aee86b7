"""The clock of the stored rows: every time in specdec's database is a naive UTC datetime."""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    """Now in UTC, without tzinfo (as the schema stores times)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def default_run_id() -> str:
    """The run id of a command run by hand: manual__ and the time to the second."""
    return "manual__" + utcnow().strftime("%Y-%m-%dT%H:%M:%S")
