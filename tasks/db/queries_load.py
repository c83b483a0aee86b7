"""Reads and writes of the load check (tasks.steps.checks.load_check): load_check_domains and
load_check_levels, and the domain_configs a cut schedule changes. Every function takes the
Store (load_checks_in: a Unit of it, to read inside the caller's transaction); writes are one
transaction each, and a re-run of a run id replaces its own rows."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .load_records import DomainLoad
from .models import DomainConfig, EngineCheck, LoadCheckDomain, LoadCheckLevel
from .store import Store, Unit

LEVEL_COLUMNS = tuple(c.name for c in LoadCheckLevel.__table__.columns
                      if c.name not in ("run_id", "domain", "created_at"))
DOMAIN_COLUMNS = tuple(c.name for c in LoadCheckDomain.__table__.columns
                       if c.name not in ("run_id", "domain", "created_at"))


def domains_on(store: Store, run_id: str) -> dict[str, dict]:
    """The run's domains its config turns on with a drafter (after the engine check's gate)."""
    with store.connect() as connection:
        return {row["domain"]: dict(row) for row in connection.execute(select(DomainConfig).where(
            (DomainConfig.run_id == run_id) & (DomainConfig.status == "ok")
            & DomainConfig.enabled.is_(True) & DomainConfig.drafter.is_not(None))).mappings()}


def engine_versions(store: Store, run_id: str) -> dict[str, dict]:
    """Per domain, the engine check's vLLM version and the engine profile it predicted from."""
    with store.connect() as connection:
        return {row.domain: {"engine_version": row.engine_version, "engine_profile": row.engine_profile}
                for row in connection.execute(select(EngineCheck.domain, EngineCheck.engine_version,
                                                     EngineCheck.engine_profile)
                                              .where(EngineCheck.run_id == run_id))}


def store_load_check(store: Store, run_id: str, domains: dict[str, DomainLoad],
                     changes: dict[str, dict]) -> None:
    """One transaction: the run's load check rows of these domains (each with its levels)
    replaced; domain_configs updated where `changes` says (per domain: the columns to set, e.g. a
    cut k_schedule, or enabled False with the reason)."""
    now = utcnow()
    with store.begin() as connection:
        names = list(domains)
        connection.execute(delete(LoadCheckLevel).where((LoadCheckLevel.run_id == run_id)
                                                        & LoadCheckLevel.domain.in_(names)))
        connection.execute(delete(LoadCheckDomain).where((LoadCheckDomain.run_id == run_id)
                                                         & LoadCheckDomain.domain.in_(names)))
        for domain, check in domains.items():
            row = check.to_json()
            connection.execute(insert(LoadCheckDomain).values(
                run_id=run_id, domain=domain, created_at=now,
                **{column: row.get(column) for column in DOMAIN_COLUMNS}))
            for level in row["levels"]:
                connection.execute(insert(LoadCheckLevel).values(
                    run_id=run_id, domain=domain, created_at=now,
                    **{column: level.get(column) for column in LEVEL_COLUMNS}))
        for domain, values in changes.items():
            if values:
                connection.execute(update(DomainConfig).where(
                    (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain)).values(**values))


def load_checks(store: Store, run_id: str, per_request: bool = False) -> dict[str, DomainLoad]:
    """The run's load check by domain: its load_check_domains row with its load_check_levels
    rows by concurrency (per_request: with each level's requests)."""
    with store.connect() as connection:
        return load_checks_in(Unit(store, connection), run_id, per_request)


def load_checks_in(tx: Unit, run_id: str, per_request: bool = False) -> dict[str, DomainLoad]:
    """load_checks read inside the caller's unit of work (a registration's reads: one transaction)."""
    out = {row["domain"]: {**dict(row), "levels": []} for row in tx.execute(
        select(LoadCheckDomain).where(LoadCheckDomain.run_id == run_id)
        .order_by(LoadCheckDomain.domain)).mappings()}
    for row in tx.execute(select(LoadCheckLevel).where(LoadCheckLevel.run_id == run_id)
                          .order_by(LoadCheckLevel.domain, LoadCheckLevel.concurrency)).mappings():
        level = dict(row)
        if not per_request:
            level.pop("per_request", None)
        out.setdefault(row["domain"], {"domain": row["domain"], "levels": []})["levels"].append(level)
    return {domain: DomainLoad.from_json(check) for domain, check in out.items()}


SUMMARY_FIELDS = ("concurrency", "k", "measured_speedup", "measured_speedup_lo", "measured_speedup_hi",
                  "predicted_speedup", "predicted_served_speedup", "pays", "engine_e", "failed")


def load_summaries(store: Store, run_id: str) -> dict[str, dict]:
    """Per domain, its load check in short (status, passed, the schedules, the largest level
    paying, the reason and per level the speedup, its interval, the predicted one, E): what
    `specdec evaluate`'s table carries."""
    return {domain: {"status": check.status, "passed": check.passed, "reason": check.reason,
                     "max_level_paying": check.max_level_paying,
                     "schedule_before": check.schedule_before, "schedule_after": check.schedule_after,
                     "levels": [{key: getattr(level, key) for key in SUMMARY_FIELDS}
                                for level in check.levels]}
            for domain, check in load_checks(store, run_id).items()}
