"""The config registry without an evaluation: the rows an evaluation leaves (eval_runs,
domain_configs, optionally acceptance_estimates) written straight into the specdec database, and
registration and promotion with the documented default settings."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import create_engine, insert

from tasks.db.models import AcceptanceEstimate, DomainConfig, EvalRun
from tasks.registry.promotion import promote
from tasks.registry.registration import register_config
from tasks.settings import load_settings

DEFAULTS = load_settings({})          # the documented defaults, whatever SPECDEC_* says
LABEL = "prompt_lookup(max_ngram=3)"
SPEC = {"kind": "prompt_lookup", "params": {"max_ngram": 3}}


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def domain_row(run_id: str, domain: str, enabled: bool = True, **overrides) -> dict:
    """A finished domain_configs row: on (prompt lookup, K=3, 1.5x measured, validation passed)
    or off (no drafter, validation not needed)."""
    row = dict(run_id=run_id, domain=domain, enabled=enabled, status="ok", samples=25,
               created_at=now(), reason="test row")
    if enabled:
        row.update(drafter=LABEL, drafter_spec=SPEC, k=3, max_batch_size=4, predicted_speedup=1.6,
                   predicted_speedup_lo=1.3, predicted_speedup_hi=1.9, measured_speedup=1.5,
                   mean_accepted_length=2.2, conditional_acceptance=[0.8, 0.6, 0.4],
                   validation="passed", promotable=True)
    else:
        row.update(drafter=None, drafter_spec=None, k=None, max_batch_size=None, predicted_speedup=None,
                   predicted_speedup_lo=None, predicted_speedup_hi=None, measured_speedup=0.9,
                   mean_accepted_length=None, conditional_acceptance=None, validation="not_needed",
                   promotable=False)
    row.update(overrides)
    return row


def finished_run(db_url: str, run_id: str, domains: dict, target_id: str = "tiny-target",
                 fingerprint: str | None = "sha256:aaa", hardware: str | None = "cpu-test",
                 estimates: bool = False) -> None:
    """An evaluated run: an eval_runs row and one domain_configs row per domain.

    domains: {name: overrides of domain_row (e.g. {"enabled": False}, {"validation": "failed"})}.
    estimates: also acceptance_estimates for K = 1..3 of each enabled domain (the plots' data).
    """
    at = now()
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(EvalRun).values(
            run_id=run_id, created_at=at - timedelta(minutes=5), updated_at=at, status="evaluated",
            target_id=target_id, target_fingerprint=fingerprint, hardware_profile=hardware,
            params={"min_per_domain": 20, "max_per_domain": 30}))
        for name, overrides in domains.items():
            row = domain_row(run_id, name, **overrides)
            connection.execute(insert(DomainConfig).values(**row))
            if estimates and row["enabled"]:
                for k in (1, 2, 3):
                    rates = [0.8, 0.6, 0.4][:k]
                    connection.execute(insert(AcceptanceEstimate).values(
                        run_id=run_id, domain=name, drafter=LABEL, k=k, requests=25, tokens=400,
                        acceptance_rate=sum(rates) / k, mean_accepted_length=1 + sum(rates),
                        conditional_acceptance=rates, predicted_speedup=1.0 + 0.2 * k,
                        predicted_speedup_lo=0.9 + 0.2 * k, predicted_speedup_hi=1.1 + 0.2 * k,
                        created_at=at, drafter_spec=SPEC))
    engine.dispose()


def register(run_id: str, db_url: str, uri: str) -> dict:
    return register_config(run_id, db_url=db_url, uri=uri, settings=DEFAULTS, actor="pytest")


def promote_(name: str, version: str, db_url: str, uri: str, **kwargs) -> dict:
    return promote(name, version, db_url=db_url, uri=uri, settings=DEFAULTS, actor="pytest", **kwargs)
