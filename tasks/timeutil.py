"""The clock of the stored rows: every time in specdec's database is a naive UTC datetime."""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    """Now in UTC, without tzinfo (as the schema stores times)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)
