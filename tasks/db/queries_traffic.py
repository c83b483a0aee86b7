"""Reads and writes of stored traffic (traffic_requests) for the steps that add to it: generated
traffic (tasks.steps.traffic_generate). Reads take a Connection or the Store; writes take the
Connection of the transaction the step opened."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from .models import TrafficRequest, production_traffic
from .store import Store


def dialect_insert(connection: Connection, model):
    """An INSERT of `model`'s table in the connection's dialect (PostgreSQL or SQLite), so that
    ON CONFLICT clauses can be added."""
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    return dialect.insert(model.__table__)


def target_domains(connection: Connection, fingerprint: str) -> list[str]:
    """The domains with production traffic answered by the target of `fingerprint`, sorted."""
    return sorted(set(connection.execute(
        select(TrafficRequest.domain).where(production_traffic()
                                            & (TrafficRequest.target_fingerprint == fingerprint))
        .distinct()).scalars()))


def generated_sources(connection: Connection, run_id: str) -> set[str]:
    """The ids of the logged requests that generation run `run_id` already answered."""
    return set(connection.execute(select(TrafficRequest.generated_from)
                                  .where(TrafficRequest.generated_by == run_id)).scalars())


def target_rows(connection: Connection, domain: str, fingerprint: str, window_days: float | None):
    """The domain's logged production rows answered by this target, in the last window_days
    days up to the newest production request (None or 0: all)."""
    query = select(TrafficRequest).where(production_traffic() & (TrafficRequest.domain == domain)
                                         & (TrafficRequest.target_fingerprint == fingerprint))
    if window_days:
        newest = connection.execute(select(func.max(TrafficRequest.requested_at))
                                    .where(production_traffic())).scalar()
        if newest is not None:
            query = query.where(TrafficRequest.requested_at >= newest - timedelta(days=window_days))
    return connection.execute(query).all()


def generated_count(store: Store, run_id: str, domain: str) -> int:
    """How many rows generation run `run_id` has stored in `domain`."""
    with store.connect() as connection:
        return connection.execute(select(func.count()).select_from(TrafficRequest).where(
            (TrafficRequest.generated_by == run_id) & (TrafficRequest.domain == domain))).scalar()


def insert_generated(connection: Connection, records: list[dict]) -> None:
    """In the caller's transaction: generated rows stored, a row whose id is already stored left
    as it is (a re-run of the generation run resumes)."""
    connection.execute(dialect_insert(connection, TrafficRequest).on_conflict_do_nothing(
        index_elements=["id"]), records)
