"""The production monitor's reads and writes: per-request spec-decode metrics of imported traffic,
scrapes of the serving deployments, the promises they are compared with, and the monitor's events.

Every function takes the Store (or, for writes inside a caller's transaction, its Unit); times
are naive UTC datetimes, as everywhere in specdec's database.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, insert, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from .models import (AcceptanceEstimate, CostProfile, MonitorEvent, MonitorPromise,
                     MonitorScrape, Promotion, RequestSpecMetrics, TrafficRequest)
from .queries_engine_checks import planned_domains
from .store import Store, Unit


def _upsert_ignore(tx: Unit, model, keys: list[str]):
    dialect = postgresql if tx.dialect == "postgresql" else sqlite
    return dialect.insert(model.__table__).on_conflict_do_nothing(index_elements=keys)


# ------------------------------------------------------------------------------------------------
# per-request metrics (traffic import)
def insert_request_metrics(tx: Unit, rows: list[dict]) -> int:
    """Store the per-request metrics of requests just inserted, in the import's transaction (a
    request already holding metrics keeps them). Returns how many rows were given."""
    if rows:
        tx.execute(_upsert_ignore(tx, RequestSpecMetrics, ["request_id"]), rows)
    return len(rows)


def request_metrics_by_domain(store: Store, since: datetime | None = None,
                              until: datetime | None = None,
                              config_version: str | None = None,
                              unversioned: bool = False) -> dict[str, dict]:
    """Per domain of production traffic requested in [since, until]: requests with metrics,
    verify steps, draft tokens, accepted drafts and the summed acceptance histogram (of one
    config version's requests, with `unversioned` also those the gateway logged without one)."""
    query = (select(TrafficRequest.domain, RequestSpecMetrics.spec_steps,
                    RequestSpecMetrics.draft_tokens, RequestSpecMetrics.accepted_tokens,
                    RequestSpecMetrics.acceptance_histogram)
             .join(TrafficRequest, TrafficRequest.id == RequestSpecMetrics.request_id))
    if since is not None:
        query = query.where(TrafficRequest.requested_at >= since)
    if until is not None:
        query = query.where(TrafficRequest.requested_at <= until)
    if config_version is not None:
        same = RequestSpecMetrics.config_version == config_version
        query = query.where(or_(same, RequestSpecMetrics.config_version.is_(None)) if unversioned else same)
    out: dict[str, dict] = {}
    with store.connect() as connection:
        for domain, steps, drafted, accepted, histogram in connection.execute(query):
            row = out.setdefault(domain, {"requests": 0, "drafts": 0, "draft_tokens": 0,
                                          "accepted": 0, "histogram": []})
            row["requests"] += 1
            row["drafts"] += steps
            row["draft_tokens"] += drafted
            row["accepted"] += accepted
            for j, count in enumerate(histogram or []):
                if j >= len(row["histogram"]):
                    row["histogram"].append(0)
                row["histogram"][j] += count
    return out


# ------------------------------------------------------------------------------------------------
# scrapes
def last_scrape(store: Store, deployment: str) -> dict | None:
    with store.connect() as connection:
        row = connection.execute(select(MonitorScrape).where(MonitorScrape.deployment == deployment)
                                 .order_by(MonitorScrape.scraped_at.desc(), MonitorScrape.id.desc())
                                 .limit(1)).mappings().first()
    return dict(row) if row else None


def insert_scrape(store: Store, row: dict) -> int:
    with store.begin() as connection:
        return connection.execute(insert(MonitorScrape).values(**row)
                                  .returning(MonitorScrape.id)).scalar_one()


def scrapes(store: Store, deployment: str | None = None, since: datetime | None = None,
            until: datetime | None = None, config_version: str | None = None) -> list[dict]:
    """Scrapes in time order, optionally of one deployment, config version and time range."""
    query = select(MonitorScrape).order_by(MonitorScrape.scraped_at, MonitorScrape.id)
    if deployment is not None:
        query = query.where(MonitorScrape.deployment == deployment)
    if since is not None:
        query = query.where(MonitorScrape.scraped_at > since)
    if until is not None:
        query = query.where(MonitorScrape.scraped_at <= until)
    if config_version is not None:
        query = query.where(MonitorScrape.config_version == config_version)
    with store.connect() as connection:
        return [dict(row) for row in connection.execute(query).mappings()]


def deployments_seen(store: Store, since: datetime | None = None) -> list[str]:
    query = select(MonitorScrape.deployment).distinct().order_by(MonitorScrape.deployment)
    if since is not None:
        query = query.where(MonitorScrape.scraped_at > since)
    with store.connect() as connection:
        return list(connection.execute(query).scalars())


# ------------------------------------------------------------------------------------------------
# promises
def planned_estimates(store: Store, run_id: str, domains: list[str]) -> dict[str, dict]:
    """Per domain of a run: its planned domain (PlannedDomain.to_json: drafter label, K, drafter
    spec, ...; read by queries_engine_checks.planned_domains) and the acceptance estimate of that
    drafter at that K (E, its interval, the rounds' width shares)."""
    rows = planned_domains(store, run_id)
    out: dict[str, dict] = {}
    with store.connect() as connection:
        for domain in domains:
            planned = rows.get(domain)
            if planned is None:
                continue
            estimate = connection.execute(select(AcceptanceEstimate).where(
                (AcceptanceEstimate.run_id == run_id) & (AcceptanceEstimate.domain == domain)
                & (AcceptanceEstimate.drafter == planned.drafter)
                & (AcceptanceEstimate.k == planned.k))).mappings().first()
            out[domain] = {"planned": planned.to_json(), "estimate": dict(estimate) if estimate else None}
    return out


def cost_rows(store: Store, hardware_profile: str, run_id: str) -> list[dict]:
    """The cost profile rows a run planned with (CostTable.from_rows takes them)."""
    with store.connect() as connection:
        return [dict(r) for r in connection.execute(
            select(CostProfile.component, CostProfile.drafter, CostProfile.k, CostProfile.batch_size,
                   CostProfile.seconds, CostProfile.spread)
            .where((CostProfile.hardware_profile == hardware_profile) & (CostProfile.run_id == run_id))
        ).mappings()]


def save_promises(store: Store, rows: list[dict]) -> None:
    """Store promises not stored yet (a promise, once read for a deployment and version, stays)."""
    if not rows:
        return
    with store.transaction() as tx:
        tx.execute(_upsert_ignore(tx, MonitorPromise, [
            "deployment", "config_name", "config_version", "domain"]), rows)


def promises(store: Store, deployment: str | None = None, config_name: str | None = None,
             config_version: str | None = None) -> list[dict]:
    query = select(MonitorPromise).order_by(MonitorPromise.deployment, MonitorPromise.domain)
    for column, value in ((MonitorPromise.deployment, deployment),
                          (MonitorPromise.config_name, config_name),
                          (MonitorPromise.config_version, config_version)):
        if value is not None:
            query = query.where(column == value)
    with store.connect() as connection:
        return [dict(row) for row in connection.execute(query).mappings()]


# ------------------------------------------------------------------------------------------------
# the champion's moves and the monitor's events
def champion_moved_at(store: Store, config_name: str, version: str) -> datetime | None:
    """When `version` last became the champion (its newest promote or rollback row)."""
    with store.connect() as connection:
        return connection.execute(
            select(func.max(Promotion.created_at)).where(
                (Promotion.config_name == config_name) & (Promotion.alias == "champion")
                & (Promotion.config_version == version)
                & Promotion.action.in_(("promote", "rollback")))).scalar()


def has_event(store: Store, kind: str, deployment: str, config_name: str | None,
              version: str | None, series: int | None) -> bool:
    with store.connect() as connection:
        return connection.execute(select(MonitorEvent.id).where(
            (MonitorEvent.kind == kind) & (MonitorEvent.deployment == deployment)
            & (MonitorEvent.config_name == config_name) & (MonitorEvent.config_version == version)
            & (MonitorEvent.series == series)).limit(1)).first() is not None


def has_domain_event(store: Store, kind: str, deployment: str, config_name: str | None,
                     version: str | None, domain: str) -> bool:
    """Whether one domain's event of that kind was raised (from per-request metrics: no series)."""
    with store.connect() as connection:
        rows = connection.execute(select(MonitorEvent.domains).where(
            (MonitorEvent.kind == kind) & (MonitorEvent.deployment == deployment)
            & (MonitorEvent.config_name == config_name) & (MonitorEvent.config_version == version)
            & MonitorEvent.series.is_(None))).scalars()
        return any(domains == [domain] for domains in rows)


def insert_event(store: Store, row: dict) -> dict:
    with store.begin() as connection:
        row = dict(row)
        row["id"] = connection.execute(insert(MonitorEvent).values(**row)
                                       .returning(MonitorEvent.id)).scalar_one()
    return row


def events(store: Store, since: datetime | None = None, deployment: str | None = None) -> list[dict]:
    """The monitor's events whose window ended after `since`, in the order they were raised."""
    query = select(MonitorEvent).order_by(MonitorEvent.created_at, MonitorEvent.id)
    if since is not None:
        query = query.where(MonitorEvent.window_end > since)
    if deployment is not None:
        query = query.where(MonitorEvent.deployment == deployment)
    with store.connect() as connection:
        return [dict(row) for row in connection.execute(query).mappings()]
