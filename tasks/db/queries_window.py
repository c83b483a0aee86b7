"""Reads behind a run's default sampling window: the newest stored request a clock can vouch for."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select

from .models import TrafficRequest, production_traffic
from .store import Store


def newest_request_at(store: Store, not_after: datetime) -> tuple[datetime | None, int]:
    """(the newest production request stamped at or before `not_after`, how many are stamped
    after it). Rows stamped in the future (a skewed clock upstream) never move a window."""
    with store.connect() as connection:
        newest = connection.execute(select(func.max(TrafficRequest.requested_at)).where(
            production_traffic() & (TrafficRequest.requested_at <= not_after))).scalar()
        future = connection.execute(select(func.count()).select_from(TrafficRequest).where(
            production_traffic() & (TrafficRequest.requested_at > not_after))).scalar()
    return newest, int(future or 0)
