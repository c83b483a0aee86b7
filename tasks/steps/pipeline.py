"""The evaluation run as steps: plain functions taking a JSON-able RunSpec and returning small
JSON-able results, so the same run works from the CLI (tasks.steps.evaluate), tests and Airflow
(dags/specdec_evaluate.py wires one task per step, the per-domain steps mapped over domains).

Walk (docs/design.md): sample -> check -> profile -> per domain: estimate + plan -> confirm -> validate
-> finish (insufficient and failed domains recorded, greedy check and fingerprint once, result
checks) -> engine check (each config served by vLLM) -> register -> promote -> report. Every step
stores its rows by run id, so a retried step replaces its own rows; a domain's failure is recorded and does not touch the other domains.

The steps defined here touch only the database and the registry (sample, check, register, promote,
the low-acceptance alert, and the engine check when it is off): importing this module loads
neither torch nor transformers (nor MLflow, which the steps that use it import when they run),
so their Airflow tasks start in a second or two instead of six to eight. The steps that run
the model (profile, estimate, confirm, validate, finish, the engine check when it is on, the load
check, the sampling test on vLLM) are defined in tasks.steps.model_steps and are attributes of
this module too, imported the first time one of them is asked for (`from tasks.steps.pipeline
import step_estimate` works as before).
"""

from __future__ import annotations

import logging

from ..db.queries_runs import domain_names, merge_run_params
from ..db.queries_run_view import record_engine_check_skip
from ..db.store import Store
from ..registry.gate import gates_of
from ..registry.run_results import low_acceptance
from ..registry.version_page import gates_summary, version_url
from .traffic.quality import check_traffic_sample
from .spec import RunSpec, freeze_candidates
from .traffic.traffic_sample import sample_traffic

log = logging.getLogger(__name__)

# the steps of tasks.steps.model_steps, resolved on first use (module __getattr__, PEP 562)
MODEL_STEPS = ("step_profile", "step_estimate", "step_confirm", "step_validate", "step_finish",
               "step_load_check", "step_engine_validate", "profile_name", "worker_hardware",
               "champion_domains_on", "run_profile_name")


def _model_steps():
    """tasks.steps.model_steps, imported on first use: it loads the engine (torch) and MLflow."""
    from . import model_steps

    return model_steps


def __getattr__(name: str):
    if name in MODEL_STEPS:
        return getattr(_model_steps(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(MODEL_STEPS))


def step_sample(spec) -> dict:
    """Draw the run's sample and freeze its candidates (tasks.steps.spec.freeze_candidates) into the spec
    and into the run's eval_runs.params. Output: the sample
    (tasks.steps.traffic.traffic_sample.sample_traffic) and "spec", the frozen spec as a dict: the spec
    every later step of the run takes."""
    spec = RunSpec.of(spec)
    settings = spec.settings()
    spec = freeze_candidates(spec, settings)
    store = spec.open_store(settings)
    sample = sample_traffic(spec.run_id, store, domains=spec.domains,
                            window=spec.window_days, settings=settings)
    with store.transaction() as tx:
        merge_run_params(tx, spec.run_id, {
            "candidates": list(spec.candidates), "drafts": spec.drafts,
            # the run's own choices, logged as its MLflow params (registration)
            "window_days": spec.window_days or settings.sample.window_days,
            "acceptance_alert": settings.plan.acceptance_alert, "promote": bool(spec.promote)})
    return {**sample, "spec": spec.to_dict()}


def step_check(spec) -> dict:
    """Data-quality gates; raises QualityGateFailed on table-level failures (the run stops).
    Output: {"ok": [domains], "insufficient": [domains]}."""
    spec = RunSpec.of(spec)
    settings = spec.settings()
    checked = check_traffic_sample(spec.run_id, spec.open_store(settings), settings=settings)
    status = {domain: info["status"] for domain, info in checked["domains"].items()}
    return {"ok": sorted(d for d, s in status.items() if s == "ok"),
            "insufficient": sorted(d for d, s in status.items() if s != "ok")}


def step_engine_check(spec) -> dict:
    """Serve each domain the plan turns on with its exported config on vLLM (tasks.steps.checks.engine_check);
    a domain whose engine check fails is turned off before register."""
    spec = RunSpec.of(spec)
    settings = spec.settings()
    store = spec.open_store(settings)
    if not domain_names(store, spec.run_id, status="ok", enabled=True):
        line = "engine check not run: no domain is on (nothing to serve on vLLM)"
        record_engine_check_skip(store, spec.run_id, line)
        log.warning("run %s: %s", spec.run_id, line)
        return {"skipped": line, "nothing_on": True, "domains": {}, "engines": []}
    if not settings.engine.check:
        line = "engine check off (setting engine_check)"
        record_engine_check_skip(store, spec.run_id, line)     # the page says so
        log.warning("run %s: %s: the config is NOT checked on the serving engine", spec.run_id, line)
        return {"skipped": line, "domains": {}, "engines": []}
    return _model_steps().served_engine_check(spec)     # the model and vLLM: only when the check is on


def step_register(spec, started_at=None) -> dict:
    """Register the run's config (tasks.registry.registration.register_config); logs one line:
    the version, its page, validation and the gates' preview. started_at (its DAG run's start) is
    when its MLflow run starts."""
    from ..registry.registration import register_config     # MLflow: only register and promote

    spec = RunSpec.of(spec)
    settings = spec.settings()
    store = spec.open_store(settings)
    registry = spec.open_registry(store)
    registered = register_config(spec.run_id, store, settings=settings, started_at=started_at,
                                 registry=registry)
    log.info("run %s: registered %s version %s%s (alias challenger; champion %s); validation %s; "
             "gates (preview): %s; page: %s", spec.run_id, registered["name"], registered["version"],
             " (reused)" if registered["reused"] else "", registered["champion_version"] or "none",
             registered["validation"], gates_summary(gates_of(registered["gates"])),
             version_url(registry.uri, registered["name"], registered["version"]))
    return registered


def step_promote(spec, registered: dict) -> dict:
    """Gate and promote the registered version (tasks.registry.promotion.promote); logs one line.
    A version that turns no domain on is not promoted automatically (promoted: False, the reason
    says so; `specdec config promote N` promotes it when that is meant): docs/registry.md."""
    from ..registry.promotion import promote

    spec = RunSpec.of(spec)
    if registered.get("domains_on") == []:
        reason = (f"version {registered['version']} turns no domain on (served, every domain "
                  "decodes plain): automatic promotion skips it; `specdec config promote "
                  f"{registered['version']}` promotes it when that is meant")
        log.warning("run %s: %s NOT promoted: %s", spec.run_id, registered["name"], reason)
        return {"promoted": False, "forced": False, "version": registered["version"],
                "champion": registered["champion_version"], "gates": registered.get("gates") or [],
                "reason": reason}
    settings = spec.settings()
    store = spec.open_store(settings)
    result = promote(registered["name"], registered["version"], store, settings=settings,
                     expected_champion=registered["champion_version"],
                     registry=spec.open_registry(store))
    log.info("run %s: %s version %s %s: %s; gates: %s", spec.run_id, registered["name"],
             registered["version"], "promoted to champion" if result["promoted"] else "NOT promoted",
             result["reason"], gates_summary(gates_of(result["gates"])))
    return result


def low_acceptance_domains(spec, threshold: float) -> list[dict]:
    """Domains whose planned drafter's expected tokens per round fell below `threshold`
    (tasks.registry.run_results.low_acceptance: the rule the version page states too)."""
    spec = RunSpec.of(spec)
    low = low_acceptance(spec.run_id, threshold, spec.open_store())
    if low:
        log.warning("run %s: low-acceptance alert (expected tokens per round below %.2f): %s", spec.run_id,
                    threshold, ", ".join(f"{r['domain']} ({'on' if r['enabled'] else 'off'}, {r['drafter']} "
                                         f"K={r['k']}: E = {r['mean_accepted_length']:.2f})" for r in low))
    else:
        log.info("run %s: no domain below the low-acceptance alert (E < %.2f)", spec.run_id, threshold)
    return [{key: row[key] for key in ("domain", "drafter", "k", "mean_accepted_length")} for row in low]
