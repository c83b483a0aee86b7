"""The suffix index step's reads and write (tasks.steps.drafters.suffix_index): a domain's stored
production traffic to index, a run's window end and sample, and the request ids an index holds
(draft_training_requests, split "index")."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from .models import DraftTrainingRequest, EvalRun, EvalSample, TrafficRequest, production_traffic
from .store import Store, Unit


def domain_traffic(store: Store, domain: str, until: datetime | None = None,
                   since: datetime | None = None) -> list[TrafficRequest]:
    """The domain's production requests in [since, until] (either open), oldest first (ties by
    id), detached from their session (plain objects to read)."""
    query = (select(TrafficRequest).where(production_traffic() & (TrafficRequest.domain == domain))
             .order_by(TrafficRequest.requested_at, TrafficRequest.id))
    if until is not None:
        query = query.where(TrafficRequest.requested_at <= until)
    if since is not None:
        query = query.where(TrafficRequest.requested_at >= since)
    with Session(store.engine) as session:
        rows = session.execute(query).scalars().all()
        session.expunge_all()
    return rows


def run_window_and_sample(store: Store, run_id: str) -> tuple[datetime | None, set[str]]:
    """(the run's window end, None without an eval_runs row; the ids of its sampled requests)."""
    with store.connect() as connection:
        run = connection.execute(select(EvalRun.window_end).where(EvalRun.run_id == run_id)).first()
        sampled = set(connection.execute(select(EvalSample.request_id).where(
            EvalSample.run_id == run_id)).scalars())
    return (run[0] if run is not None else None), sampled


def production_domains(store: Store) -> list[str]:
    """The domains with production traffic stored, sorted."""
    with store.connect() as connection:
        return sorted(set(connection.execute(
            select(TrafficRequest.domain).where(production_traffic()).distinct()).scalars()))


def newest_in_domain(store: Store, domain: str) -> datetime | None:
    """When the domain's newest production request was made (None: the domain has none)."""
    with store.connect() as connection:
        return connection.execute(select(TrafficRequest.requested_at)
                                  .where(production_traffic() & (TrafficRequest.domain == domain))
                                  .order_by(TrafficRequest.requested_at.desc()).limit(1)).scalar()


def replace_index_requests(tx: Unit, name: str, request_ids: list[str]) -> None:
    """In the caller's transaction: the request ids recorded for index `name` (split "index")
    replaced by `request_ids`."""
    tx.execute(delete(DraftTrainingRequest).where(DraftTrainingRequest.draft_name == name))
    if request_ids:
        tx.execute(insert(DraftTrainingRequest),
                           [{"draft_name": name, "request_id": i, "split": "index"} for i in request_ids])
