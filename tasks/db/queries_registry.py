"""Reads of a run's stored results for the registry (tasks.registry: run_config, run_results,
run_view, registration, tracking): its eval_runs row, its domain_configs rows, the cost profile's
check, the engine checks, each domain's evidence, the Data Docs pages and what an evaluation's
MLflow run logs. Plain reads: the registry shapes them (tasks.registry.run_results).

Each public function reads in one unit of work (Store.transaction()) of the Store it is handed;
view_rows (what a run's view shows) and registration_rows (what a registration logs, the view's
rows included) gather the reads of a caller that needs several of them.
"""

from __future__ import annotations

from sqlalchemy import select

from .models import (AcceptanceEstimate, CostProfile, CostProfileCheck, DataDocsPage, DomainConfig,
                     EngineCheck, EvalRun, LiveMeasurement, QualityResult, Validation)
from .queries_load import load_checks_in
from .queries_run_view import engine_check_skip_in
from .store import Store, Unit

ENGINE_SAMPLING = "engine_sampling"      # check_name of the vLLM sampling test (steps.checks.engine_validate)


def eval_run(store: Store, run_id: str):
    """The run's eval_runs row (a mapping); None when there is none."""
    with store.transaction() as tx:
        return _eval_run(tx, run_id)


def _eval_run(tx: Unit, run_id: str):
    return tx.execute(select(EvalRun).where(EvalRun.run_id == run_id)).mappings().first()


def domain_configs(store: Store, run_id: str) -> list:
    """The run's domain_configs rows (mappings), by domain."""
    with store.transaction() as tx:
        return _domain_configs(tx, run_id)


def _domain_configs(tx: Unit, run_id: str) -> list:
    return tx.execute(select(DomainConfig).where(DomainConfig.run_id == run_id)
                              .order_by(DomainConfig.domain)).mappings().all()


def profile_check_row(store: Store, run_id: str) -> tuple[str, str, dict] | None:
    """(hardware_profile, profile_run, its cost_profile_checks row as a dict) of the profile the
    run planned with: its newest cost profile run; None when any of them is missing."""
    with store.transaction() as tx:
        return _profile_check(tx, run_id)


def _profile_check(tx: Unit, run_id: str) -> tuple[str, str, dict] | None:
    name = tx.execute(select(EvalRun.hardware_profile).where(EvalRun.run_id == run_id)).scalar()
    if not name:
        return None
    profile_run = tx.execute(
        select(CostProfile.run_id).where(CostProfile.hardware_profile == name)
        .order_by(CostProfile.created_at.desc(), CostProfile.id.desc()).limit(1)).scalar()
    if profile_run is None:
        return None
    check = tx.execute(
        select(CostProfileCheck.status, CostProfileCheck.reasons, CostProfileCheck.attempts,
               CostProfileCheck.max_spread, CostProfileCheck.reused_from,
               CostProfileCheck.measured_at)
        .where((CostProfileCheck.hardware_profile == name)
               & (CostProfileCheck.run_id == profile_run))).mappings().first()
    return None if check is None else (name, profile_run, dict(check))


def engine_check_rows(store: Store, run_id: str) -> list[dict]:
    """The run's engine_checks rows, by domain."""
    with store.transaction() as tx:
        return _engine_checks(tx, run_id)


def _engine_checks(tx: Unit, run_id: str) -> list[dict]:
    return [dict(row) for row in tx.execute(select(EngineCheck).where(
        EngineCheck.run_id == run_id).order_by(EngineCheck.domain)).mappings()]


def data_docs_rows(store: Store, run_id: str) -> list[tuple[str, str]]:
    """(page, html) of the run's Data Docs pages, by page."""
    with store.transaction() as tx:
        return _data_docs(tx, run_id)


def _data_docs(tx: Unit, run_id: str) -> list[tuple[str, str]]:
    return [tuple(row) for row in tx.execute(select(DataDocsPage.page, DataDocsPage.html).where(
        DataDocsPage.run_id == run_id).order_by(DataDocsPage.page))]


def engine_sampling_rows(store: Store, run_id: str) -> list:
    """The run's sampling tests on vLLM: validations rows (domain, passed, p_value, details) with
    check_name ENGINE_SAMPLING."""
    with store.transaction() as tx:
        return _engine_sampling(tx, run_id)


def _engine_sampling(tx: Unit, run_id: str) -> list:
    return tx.execute(select(
        Validation.domain, Validation.passed, Validation.p_value, Validation.details).where(
        (Validation.run_id == run_id) & (Validation.check_name == ENGINE_SAMPLING))).all()


def evidence_rows(store: Store, run_id: str) -> dict:
    """What a run's per-domain evidence is made of, read in one connection: {"configs" (domain,
    drafter, k, live_check of each domain_configs row), "lives" ({domain: live_measurements
    row}), "shares" ({(domain, drafter, k): draft_width_share}), "tests" ({domain: its sampling
    validations row}), "engine_sampling" (engine_sampling_rows)}."""
    with store.transaction() as tx:
        return _evidence(tx, run_id)


def _evidence(tx: Unit, run_id: str) -> dict:
    configs = tx.execute(select(
        DomainConfig.domain, DomainConfig.drafter, DomainConfig.k, DomainConfig.live_check)
        .where(DomainConfig.run_id == run_id)).mappings().all()
    lives = {row["domain"]: row for row in tx.execute(select(
        LiveMeasurement.domain, LiveMeasurement.measured_speedup, LiveMeasurement.measured_speedup_lo,
        LiveMeasurement.measured_speedup_hi, LiveMeasurement.predicted_same_requests,
        LiveMeasurement.predicted_speedup, LiveMeasurement.cost_model_error, LiveMeasurement.gap,
        LiveMeasurement.requests).where(LiveMeasurement.run_id == run_id)).mappings()}
    shares = {(row.domain, row.drafter, row.k): row.draft_width_share for row in tx.execute(
        select(AcceptanceEstimate.domain, AcceptanceEstimate.drafter, AcceptanceEstimate.k,
               AcceptanceEstimate.draft_width_share).where(AcceptanceEstimate.run_id == run_id))}
    tests = {row.domain: row for row in tx.execute(
        select(Validation.domain, Validation.k, Validation.request_id, Validation.passed,
               Validation.p_value, Validation.details).where(
            (Validation.run_id == run_id) & (Validation.check_name == "sampling")))}
    return {"configs": configs, "lives": lives, "shares": shares, "tests": tests,
            "engine_sampling": _engine_sampling(tx, run_id)}


def planned_acceptance(store: Store, run_id: str) -> list:
    """(domain, drafter, k, mean_accepted_length, enabled) of the run's planned domains (status
    ok), by domain."""
    with store.transaction() as tx:
        return _planned_acceptance(tx, run_id)


def _planned_acceptance(tx: Unit, run_id: str) -> list:
    return tx.execute(select(DomainConfig.domain, DomainConfig.drafter, DomainConfig.k,
                                     DomainConfig.mean_accepted_length, DomainConfig.enabled).where(
        (DomainConfig.run_id == run_id) & (DomainConfig.status == "ok"))
        .order_by(DomainConfig.domain)).all()


def _fingerprint_passed(tx: Unit, run_id: str) -> bool | None:
    return tx.execute(select(Validation.passed).where(
        (Validation.run_id == run_id) & (Validation.check_name == "fingerprint"))).scalar()


def view_rows(store: Store, run_id: str) -> dict:
    """What a run's view shows (tasks.registry.run_view.build_run_view), read once, in one
    transaction: {"evidence" (evidence_rows), "engine_checks" (engine_check_rows), "planned"
    (planned_acceptance), "profile" (profile_check_row), "fingerprint_passed" (the recorded
    target-fingerprint check; None: not recorded), "loads" (queries_load.load_checks),
    "engine_skipped" (queries_run_view.engine_check_skip)}."""
    with store.transaction() as tx:
        return _view_rows(tx, run_id)


def _view_rows(tx: Unit, run_id: str) -> dict:
    return {"evidence": _evidence(tx, run_id), "engine_checks": _engine_checks(tx, run_id),
            "planned": _planned_acceptance(tx, run_id),
            "profile": _profile_check(tx, run_id),
            "fingerprint_passed": _fingerprint_passed(tx, run_id),
            "loads": load_checks_in(tx, run_id),
            "engine_skipped": engine_check_skip_in(tx, run_id)}


def registration_rows(store: Store, run_id: str) -> dict:
    """What registering a run reads of it, once, in one transaction (tasks.registry.registration):
    {"run" (eval_run), "domain_configs", "data_docs" (data_docs_rows), "view" (view_rows), and
    tracked_rows' keys}."""
    with store.transaction() as tx:
        return {"run": _eval_run(tx, run_id), "domain_configs": _domain_configs(tx, run_id),
                "data_docs": _data_docs(tx, run_id), **_tracked(tx, run_id),
                "view": _view_rows(tx, run_id)}


def tracked_rows(store: Store, run_id: str) -> dict:
    """What an evaluation's MLflow run logs from the database, read in one connection:
    {"validations", "quality" (dicts), "estimate_drafters" (the drafters estimated), "estimates"
    (acceptance_estimates rows as dicts), "configs" ({domain: {drafter, k, enabled}}), "live"
    (the live checks with a prediction and a measurement, for the plots)}."""
    with store.transaction() as tx:
        return _tracked(tx, run_id)


def _tracked(tx: Unit, run_id: str) -> dict:
    validations = [dict(r) for r in tx.execute(
        select(Validation.domain, Validation.check_name, Validation.drafter, Validation.k,
               Validation.request_id, Validation.passed, Validation.statistic,
               Validation.p_value, Validation.details)
        .where(Validation.run_id == run_id)).mappings()]
    quality = [dict(r) for r in tx.execute(
        select(QualityResult.suite, QualityResult.scope, QualityResult.expectation,
               QualityResult.column_name, QualityResult.success, QualityResult.status,
               QualityResult.observed).where(QualityResult.run_id == run_id)).mappings()]
    drafters = tx.execute(select(AcceptanceEstimate.drafter).where(
        AcceptanceEstimate.run_id == run_id).distinct()).scalars().all()
    estimates = [dict(r) for r in tx.execute(
        select(AcceptanceEstimate).where(AcceptanceEstimate.run_id == run_id)
        .order_by(AcceptanceEstimate.domain, AcceptanceEstimate.drafter, AcceptanceEstimate.k)).mappings()]
    configs = {r.domain: {"drafter": r.drafter, "k": r.k, "enabled": bool(r.enabled)}
               for r in tx.execute(select(DomainConfig.domain, DomainConfig.drafter,
                                                  DomainConfig.k, DomainConfig.enabled)
                                           .where(DomainConfig.run_id == run_id))}
    live = [{"domain": r.domain, "predicted": r.predicted_same_requests, "measured": r.measured_speedup,
             "lo": r.measured_speedup_lo, "hi": r.measured_speedup_hi, "requests": r.requests}
            for r in tx.execute(
                select(LiveMeasurement.domain, LiveMeasurement.predicted_same_requests,
                       LiveMeasurement.measured_speedup, LiveMeasurement.measured_speedup_lo,
                       LiveMeasurement.measured_speedup_hi, LiveMeasurement.requests)
                .where(LiveMeasurement.run_id == run_id)
                .order_by(LiveMeasurement.domain))
            if r.predicted_same_requests and r.measured_speedup]
    return {"validations": validations, "quality": quality, "estimate_drafters": drafters,
            "estimates": estimates, "configs": configs, "live": live}
