"""The plan step's reads and write (tasks.steps.plan.plan): a run's acceptance estimates of a domain,
the sampling of its sampled requests, and the domain's plan stored."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .models import AcceptanceEstimate, DomainConfig, EvalSample, TrafficRequest
from .store import Store, Unit


def sampling_of_sample(tx: Unit, run_id: str, domain: str) -> list[tuple]:
    """(temperature, top_k, top_p) of each of the run's sampled requests of the domain."""
    return [tuple(row) for row in tx.execute(
        select(TrafficRequest.temperature, TrafficRequest.top_k, TrafficRequest.top_p)
        .join(EvalSample, EvalSample.request_id == TrafficRequest.id)
        .where((EvalSample.run_id == run_id) & (EvalSample.domain == domain))).all()]


def domain_estimates(store: Store, run_id: str, domain: str,
                     with_sampling: bool = False) -> tuple[list[dict], list[tuple] | None]:
    """The run's acceptance_estimates rows of the domain (by drafter, K) as dicts, and (with_sampling)
    the sampling of its sampled requests (sampling_of_sample), read on one connection (else None)."""
    with store.transaction() as tx:
        estimates = [dict(row) for row in tx.execute(
            select(AcceptanceEstimate).where((AcceptanceEstimate.run_id == run_id)
                                             & (AcceptanceEstimate.domain == domain))
            .order_by(AcceptanceEstimate.drafter, AcceptanceEstimate.k)).mappings()]
        sampling = sampling_of_sample(tx, run_id, domain) if with_sampling else None
    return estimates, sampling


def store_plan(store: Store, run_id: str, domain: str, updates: list[dict], row: dict) -> None:
    """One transaction: the estimates' predicted speedups, and the domain's row replaced."""
    now = utcnow()
    with store.begin() as connection:
        for item in updates:
            connection.execute(update(AcceptanceEstimate).where(AcceptanceEstimate.id == item["id"])
                               .values(**{k: v for k, v in item.items() if k != "id"}))
        connection.execute(delete(DomainConfig).where((DomainConfig.run_id == run_id)
                                                      & (DomainConfig.domain == domain)))
        connection.execute(insert(DomainConfig).values(**row, created_at=now))
