"""The validate step's reads and writes (tasks.steps.checks.validate, and the sampling test on vLLM in
tasks.steps.checks.engine_validate): validations rows replaced by check, a run's sampling tests, the last
fingerprint of the same weights, and the verdicts on domain_configs and eval_runs (a domain's
config is read by queries_runs.domain_config)."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .models import DomainConfig, EvalRun, Validation
from .store import Store, Unit


def _jsonable(value):
    """JSON-safe copy: infinite or NaN floats (an impossible token makes G infinite) become strings."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


def replace_validations(tx: Unit, run_id: str, check: str, domain: str | None,
                        rows: list[dict]) -> None:
    """In the caller's transaction: the run's validations rows of `check` (of `domain` when given)
    replaced by `rows` (their details made JSON-safe)."""
    where = (Validation.run_id == run_id) & (Validation.check_name == check)
    if domain is not None:
        where = where & (Validation.domain == domain)
    tx.execute(delete(Validation).where(where))
    now = utcnow()
    for row in rows:
        row = dict(row, details=_jsonable(row.get("details")))
        tx.execute(insert(Validation).values(**row, run_id=run_id, check_name=check,
                                                     created_at=now))


def other_sampling_tests(store: Store, run_id: str, domain: str) -> list:
    """The run's stored sampling tests of its other domains (mappings), in the order stored."""
    with store.connect() as connection:
        return list(connection.execute(select(Validation).where(
            (Validation.run_id == run_id) & (Validation.check_name == "sampling")
            & (Validation.domain != domain)).order_by(Validation.id)).mappings())


def sampling_results(tx: Unit, run_id: str) -> dict:
    """{domain: passed} of the run's stored sampling tests."""
    return {row.domain: row.passed for row in tx.execute(
        select(Validation.domain, Validation.passed).where(
            (Validation.run_id == run_id) & (Validation.check_name == "sampling")))}


def fingerprint_run(store: Store, run_id: str, fid: str):
    """(the newest fingerprint row of another run that measured the same weights or None, the
    run's domain_configs rows by domain)."""
    with store.connect() as connection:
        previous = connection.execute(
            select(Validation.run_id, Validation.details)
            .join(EvalRun, EvalRun.run_id == Validation.run_id)
            .where((Validation.check_name == "fingerprint") & (Validation.run_id != run_id)
                   & (EvalRun.target_fingerprint == fid))
            .order_by(Validation.created_at.desc()).limit(1)).first()
        configs = {row["domain"]: dict(row) for row in connection.execute(
            select(DomainConfig).where(DomainConfig.run_id == run_id)).mappings()}
    return previous, configs


def set_domain_verdict(tx: Unit, run_id: str, domain: str, verdict: str,
                       promotable: bool) -> None:
    """In the caller's transaction: the domain's validation verdict and promotability."""
    tx.execute(update(DomainConfig).where(
        (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain))
        .values(validation=verdict, promotable=promotable))


def set_run_target(tx: Unit, run_id: str, target_id: str, fid: str) -> None:
    """In the caller's transaction: the run's target and its fingerprint id."""
    tx.execute(update(EvalRun).where(EvalRun.run_id == run_id)
                       .values(target_id=target_id, target_fingerprint=fid, updated_at=utcnow()))
