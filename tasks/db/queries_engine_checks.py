"""The engine check's reads and writes (tasks.steps.checks.engine_check,
tasks.steps.checks.engine_validate): a run's planned and confirmed domains, its hardware profile's
details, the engine_checks rows, the vLLM live check as a live measurement, and the domain_configs a
failed check turns off."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .domain_records import PlannedDomain
from .models import DomainConfig, EngineCheck, EvalRun, HardwareProfile, LiveMeasurement, Validation
from .store import Store, Unit


def planned_domains(store: Store, run_id: str) -> dict[str, PlannedDomain]:
    """{domain: its domain_configs row, as a PlannedDomain} of the run (every planned domain)."""
    with store.connect() as connection:
        return {row["domain"]: PlannedDomain.from_row(row) for row in connection.execute(
            select(DomainConfig).where(DomainConfig.run_id == run_id)).mappings()}


def enabled_domains(store: Store, run_id: str) -> tuple[dict[str, PlannedDomain], dict[str, list[str]]]:
    """The run's domains turned on with a drafter (their domain_configs rows, as PlannedDomains),
    and per domain the request ids its confirm step measured."""
    with store.connect() as connection:
        on = {row["domain"]: PlannedDomain.from_row(row) for row in connection.execute(select(DomainConfig).where(
            (DomainConfig.run_id == run_id) & (DomainConfig.status == "ok")
            & DomainConfig.enabled.is_(True) & DomainConfig.drafter.is_not(None))).mappings()}
        confirmed = {row.domain: [r["request_id"] for r in row.per_request or []] for row in
                     connection.execute(select(LiveMeasurement.domain, LiveMeasurement.per_request)
                                        .where(LiveMeasurement.run_id == run_id))}
    return on, confirmed


def run_hardware_details(store: Store, run_id: str) -> dict | None:
    """The details of the hardware profile the run planned on (None: no profile named)."""
    with store.connect() as connection:
        name = connection.execute(select(EvalRun.hardware_profile).where(EvalRun.run_id == run_id)).scalar()
        return None if name is None else connection.execute(select(HardwareProfile.details).where(
            HardwareProfile.name == name)).scalar()


def fail_own_sampling_domains(tx: Unit, run_id: str) -> list[str]:
    """In the caller's transaction: the run's domains whose own-engine sampling test failed,
    marked failed and unpromotable where they are on. The domains so found, sorted."""
    failed = sorted(tx.execute(select(Validation.domain).where(
        (Validation.run_id == run_id) & (Validation.check_name == "sampling")
        & Validation.passed.is_(False))).scalars())
    if failed:
        tx.execute(update(DomainConfig).where(
            (DomainConfig.run_id == run_id) & DomainConfig.domain.in_(failed)
            & DomainConfig.enabled.is_(True)).values(validation="failed", promotable=False))
    return failed


def mark_validation_failed(tx: Unit, run_id: str, domain: str) -> None:
    """In the caller's transaction: the domain's config marked failed and unpromotable."""
    tx.execute(update(DomainConfig).where(
        (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain))
        .values(validation="failed", promotable=False))


def replace_live_measurement(tx: Unit, record: dict, live_check: dict) -> None:
    """In the caller's transaction: the run's live measurement of the domain replaced by `record`,
    and the domain's config given its measured speedup and live check."""
    run_id, domain = record["run_id"], record["domain"]
    tx.execute(delete(LiveMeasurement).where((LiveMeasurement.run_id == run_id)
                                                     & (LiveMeasurement.domain == domain)))
    tx.execute(insert(LiveMeasurement).values(**record, created_at=utcnow()))
    tx.execute(update(DomainConfig).where((DomainConfig.run_id == run_id)
                                                  & (DomainConfig.domain == domain))
                       .values(measured_speedup=record["measured_speedup"], live_check=live_check))


def replace_engine_checks(tx: Unit, run_id: str, rows: dict[str, dict],
                          off_reasons: dict[str, str]) -> None:
    """In the caller's transaction: the run's engine_checks rows of these domains replaced by
    `rows` ({domain: column values}); the domains in off_reasons turned off with that reason."""
    now = utcnow()
    tx.execute(delete(EngineCheck).where((EngineCheck.run_id == run_id)
                                                 & EngineCheck.domain.in_(list(rows))))
    for domain, row in rows.items():
        tx.execute(insert(EngineCheck).values(
            run_id=run_id, domain=domain, engine="vllm", created_at=now, **row))
        if domain in off_reasons:
            tx.execute(update(DomainConfig).where(
                (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain)).values(
                enabled=False, max_batch_size=None, k_schedule=None, reason=off_reasons[domain]))
