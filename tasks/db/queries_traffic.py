"""Reads and writes of stored traffic (traffic_requests, quarantined_requests) for the steps that
add to it or purge it: generated traffic (tasks.steps.traffic.traffic_generate) and imports and retention
(tasks.steps.traffic.traffic_import). Reads take the Store or a Unit; writes take the Unit of the
transaction the step opened (Store.transaction()) (an import batch is one transaction)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from ..timeutil import utcnow
from .models import QuarantinedRequest, TrafficRequest, production_traffic
from .store import Store, Unit


def dialect_insert(tx: Unit, model):
    """An INSERT of `model`'s table in the unit's dialect (PostgreSQL or SQLite), so that
    ON CONFLICT clauses can be added."""
    dialect = postgresql if tx.dialect == "postgresql" else sqlite
    return dialect.insert(model.__table__)


def target_domains(tx: Unit, fingerprint: str) -> list[str]:
    """The domains with production traffic answered by the target of `fingerprint`, sorted."""
    return sorted(set(tx.execute(
        select(TrafficRequest.domain).where(production_traffic()
                                            & (TrafficRequest.target_fingerprint == fingerprint))
        .distinct()).scalars()))


def generated_sources(tx: Unit, run_id: str) -> set[str]:
    """The ids of the logged requests that generation run `run_id` already answered."""
    return set(tx.execute(select(TrafficRequest.generated_from)
                                  .where(TrafficRequest.generated_by == run_id)).scalars())


def target_rows(tx: Unit, domain: str, fingerprint: str, window_days: float | None):
    """The domain's logged production rows answered by this target, in the last window_days
    days up to the newest production request (None or 0: all)."""
    query = select(TrafficRequest).where(production_traffic() & (TrafficRequest.domain == domain)
                                         & (TrafficRequest.target_fingerprint == fingerprint))
    if window_days:
        newest = tx.execute(select(func.max(TrafficRequest.requested_at))
                                    .where(production_traffic())).scalar()
        if newest is not None:
            query = query.where(TrafficRequest.requested_at >= newest - timedelta(days=window_days))
    return tx.execute(query).all()


def generated_count(store: Store, run_id: str, domain: str) -> int:
    """How many rows generation run `run_id` has stored in `domain`."""
    with store.connect() as connection:
        return connection.execute(select(func.count()).select_from(TrafficRequest).where(
            (TrafficRequest.generated_by == run_id) & (TrafficRequest.domain == domain))).scalar()


def insert_generated(tx: Unit, records: list[dict]) -> None:
    """In the caller's transaction: generated rows stored, a row whose id is already stored left
    as it is (a re-run of the generation run resumes)."""
    tx.execute(dialect_insert(tx, TrafficRequest).on_conflict_do_nothing(
        index_elements=["id"]), records)


# ------------------------------------------------------------------------------------------------
# imports (tasks.steps.traffic.traffic_import)
CHUNK = 500     # ids or line numbers per IN (...) list


def insert_new_requests(tx: Unit, rows: list[dict]) -> set[str]:
    """In the caller's transaction: each row inserted unless its id is already stored (INSERT ...
    ON CONFLICT DO NOTHING RETURNING id); the ids the database took."""
    statement = dialect_insert(tx, TrafficRequest).on_conflict_do_nothing(
        index_elements=["id"]).returning(TrafficRequest.id)
    return set(tx.execute(statement, rows).scalars())


def stored_content_hashes(tx: Unit, ids: list[str]) -> dict[str, str]:
    """{id: content_hash} of the stored requests among `ids`."""
    stored: dict[str, str] = {}
    for offset in range(0, len(ids), CHUNK):
        stored.update(tx.execute(
            select(TrafficRequest.id, TrafficRequest.content_hash)
            .where(TrafficRequest.id.in_(ids[offset:offset + CHUNK]))).all())
    return stored


def quarantined_lines(tx: Unit, source_file: str, lines: list[int]) -> dict[int, bool]:
    """{line: whether its entry was left by a broken read or superseded} of the file's quarantine
    entries among `lines`."""
    return dict(tx.execute(
        select(QuarantinedRequest.line_number,
               QuarantinedRequest.file_error.is_not(None)
               | QuarantinedRequest.superseded_at.is_not(None))
        .where(QuarantinedRequest.source_file == source_file,
               QuarantinedRequest.line_number.in_(lines))).all())


def replace_quarantined(tx: Unit, source_file: str, row: dict) -> None:
    """In the caller's transaction: the file's quarantine entry of row["line_number"] replaced by
    `row`, reopened (no file error, not superseded)."""
    tx.execute(update(QuarantinedRequest).where(
        (QuarantinedRequest.source_file == source_file)
        & (QuarantinedRequest.line_number == row["line_number"])).values(
        **row, file_error=None, superseded_at=None, superseded_by=None))


def insert_quarantined(tx: Unit, rows: list[dict]) -> set[int]:
    """In the caller's transaction: quarantine entries inserted unless the file's line already
    has one; the line numbers inserted."""
    statement = dialect_insert(tx, QuarantinedRequest).on_conflict_do_nothing(
        index_elements=["source_file", "line_number"]).returning(QuarantinedRequest.line_number)
    return set(tx.execute(statement, rows).scalars())


def mark_file_error(tx: Unit, source_file: str, lines: list[int], error: str) -> None:
    """In the caller's transaction: the file's open quarantine entries of `lines` marked as left
    by a broken read (file_error, at most 2000 characters)."""
    for first in range(0, len(lines), CHUNK):
        tx.execute(update(QuarantinedRequest).where(
            (QuarantinedRequest.source_file == source_file)
            & QuarantinedRequest.line_number.in_(lines[first:first + CHUNK])
            & QuarantinedRequest.superseded_at.is_(None)).values(file_error=error[:2000]))


def supersede_broken_entries(tx: Unit, source_file: str) -> int:
    """In the caller's transaction: the file's open entries an earlier, broken read left
    (file_error set) superseded (now), by the request stored from that line when there is one.
    Returns how many."""
    lines = list(tx.execute(select(QuarantinedRequest.line_number).where(
        (QuarantinedRequest.source_file == source_file)
        & QuarantinedRequest.file_error.is_not(None)
        & QuarantinedRequest.superseded_at.is_(None))).scalars())
    now = utcnow()
    for first in range(0, len(lines), CHUNK):
        chunk = lines[first:first + CHUNK]
        stored = dict(tx.execute(
            select(TrafficRequest.source_line, TrafficRequest.id).where(
                (TrafficRequest.source_file == source_file)
                & TrafficRequest.source_line.in_(chunk))).all())
        for line in chunk:
            tx.execute(update(QuarantinedRequest).where(
                (QuarantinedRequest.source_file == source_file)
                & (QuarantinedRequest.line_number == line)).values(
                superseded_at=now, superseded_by=stored.get(line)))
    return len(lines)


def delete_request(tx: Unit, request_id: str, dry_run: bool = False) -> bool:
    """In the caller's transaction: whether a request with this id is stored; deleted unless
    dry_run."""
    found = tx.execute(select(func.count()).select_from(TrafficRequest).where(
        TrafficRequest.id == request_id)).scalar() > 0
    if found and not dry_run:
        tx.execute(delete(TrafficRequest).where(TrafficRequest.id == request_id))
    return found


def purge_before(tx: Unit, cutoff: datetime, dry_run: bool = False) -> dict[str, int]:
    """In the caller's transaction: traffic requested, and quarantined rows imported, before
    `cutoff` counted and (unless dry_run) deleted. {table name: rows}."""
    counts = {}
    for model, column in ((TrafficRequest, TrafficRequest.requested_at),
                          (QuarantinedRequest, QuarantinedRequest.imported_at)):
        counts[model.__tablename__] = tx.execute(
            select(func.count()).select_from(model).where(column < cutoff)).scalar()
        if not dry_run:
            tx.execute(delete(model).where(column < cutoff))
    return counts
