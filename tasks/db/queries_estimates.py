"""The offline estimate step's read and write (tasks.steps.estimate.offline_estimate): a run's sampled
requests, and its acceptance_estimates rows."""

from __future__ import annotations

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from .models import AcceptanceEstimate, EvalSample, TrafficRequest
from .store import Store, Unit


def sampled_requests(store: Store, run_id: str, domains=None) -> list[tuple]:
    """[(domain, position, TrafficRequest)] of the run's sample (in `domains` when given), in draw
    order; the requests are detached from their session (plain objects to read)."""
    query = (select(EvalSample.domain, EvalSample.position, TrafficRequest)
             .join(TrafficRequest, TrafficRequest.id == EvalSample.request_id)
             .where(EvalSample.run_id == run_id)
             .order_by(EvalSample.domain, EvalSample.position))
    if domains is not None:
        query = query.where(EvalSample.domain.in_(list(domains)))
    with Session(store.engine) as session:
        rows = session.execute(query).all()
        session.expunge_all()
    return rows


def replace_acceptance_estimates(tx: Unit, run_id: str, domains: list[str],
                                 rows: list[dict]) -> None:
    """In the caller's transaction: the run's acceptance_estimates of `domains` replaced by `rows`
    (the run's other domains keep theirs)."""
    tx.execute(delete(AcceptanceEstimate).where(
        (AcceptanceEstimate.run_id == run_id) & AcceptanceEstimate.domain.in_(list(domains))))
    if rows:
        tx.execute(insert(AcceptanceEstimate), rows)
