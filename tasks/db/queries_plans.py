"""The plan step's reads and write (tasks.steps.plan.plan): a run's acceptance estimates of a domain,
the share of its sampled requests that sample, and the domain's plan stored."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .models import AcceptanceEstimate, DomainConfig, EvalSample, TrafficRequest
from .store import Store, Unit


def sampled_share(tx: Unit, run_id: str, domain: str) -> float:
    """Share of the run's sampled requests of the domain that sample (temperature > 0)."""
    rows = tx.execute(
        select(TrafficRequest.temperature).join(EvalSample, EvalSample.request_id == TrafficRequest.id)
        .where((EvalSample.run_id == run_id) & (EvalSample.domain == domain))).scalars().all()
    return sum(1 for t in rows if t and t > 0) / len(rows) if rows else 0.0


def domain_estimates(store: Store, run_id: str, domain: str,
                     with_share: bool = False) -> tuple[list[dict], float | None]:
    """The run's acceptance_estimates rows of the domain (by drafter, K) as dicts, and (with_share)
    the share of its sampled requests that sample, read on one connection (else None)."""
    with store.transaction() as tx:
        estimates = [dict(row) for row in tx.execute(
            select(AcceptanceEstimate).where((AcceptanceEstimate.run_id == run_id)
                                             & (AcceptanceEstimate.domain == domain))
            .order_by(AcceptanceEstimate.drafter, AcceptanceEstimate.k)).mappings()]
        share = sampled_share(tx, run_id, domain) if with_share else None
    return estimates, share


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
