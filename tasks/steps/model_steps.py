"""The steps of an evaluation run that run the model: profile, estimate, confirm, validate,
finish, the engine check when it is on, the load check and the sampling test on vLLM.

They load torch, transformers and the engine (tasks.steps.context builds each step's
RunContext: the target, its tokenizer and the candidate drafters, loaded once per process). Each
step hands its phase the RunContext and its domain (confirm_in, validate_in, estimate_in) or
domains (validate_run_in, engine_check_in, engine_validate_in); serving_pool is where a run's
vLLM servers are set up (the engine check with its load check, the engine validate step).
tasks.steps.pipeline holds the steps that touch only the database and the registry and makes
these its attributes too; callers import them from there.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from datetime import datetime

import torch
from mlflow.exceptions import MlflowException

from specdec_core.models import default_device, default_dtype

from ..db.queries_runs import (domain_names, finish_inputs, has_live_measurement, has_sampling_test,
                               run_hardware_profile, run_params, set_run_status)
from ..db.queries_run_view import record_engine_check_skip
from ..db.store import Store
from ..errors import ServingEnvUnavailable
from ..masking import mask_text
from ..registry.config_schema import config_model_name
from ..registry.registry import Registry
from ..registry.tracking import CHAMPION, alias_version, load_version_config
from ..serving import environment as serving_env
from ..serving.server import ServerPool
from ..settings import worker_name
from .checks.confirm import confirm_in
from .context import RunContext, RunSpec, loaded_model
from ..registry.run_results import profile_check
from .costs.costs import describe_device, describe_hardware, hardware_of, load_costs
from .costs.reuse import measure_or_reuse_in, profile_check_text
from .checks.engine_check import engine_check_in
from .checks.engine_replay import dtype_of
from .costs.engine_costs import plans_on_vllm, vllm_profile_or_reuse
from .costs.vllm_hardware import profile_engine
from .checks.engine_validate import engine_validate_in
from .failures import record_domain_failure
from .checks.load_check import load_check, load_check_json
from .estimate.offline_estimate import estimate_in
from .plan.plan import plan_domain
from .traffic.quality import check_result_table
from .checks.validate import DEFERRED, engine_sampling_gates, validate_in, validate_run_in

log = logging.getLogger(__name__)


def step_profile(spec, new_profile: bool = False) -> dict:
    """The run's cost profile: the stored one the settings name (plan_hardware_profile), else the
    newest stored profile of this worker's hardware, engine, dtype and target that passed its
    checks, covers the run and is younger than profile_max_age_days, copied under the run's id,
    else one measured here under the timing lock (tasks.steps.costs.reuse.measure_or_reuse).
    new_profile: measure whatever is stored (the DAG Param new_profile, `specdec evaluate
    --new-profile`).

    Output: {"hardware_profile": its name (what the estimate steps take), "reused",
    "measured_by": the run that measured the costs, "measured_at", "age_days", "text"}."""
    spec = RunSpec.of(spec)
    settings = spec.settings()
    store = spec.open_store(settings)
    name = settings.plan.hardware_profile
    measured = None
    if name is None and plans_on_vllm(settings, spec.target):
        # the serving engine's costs plan the run (its own profile, reused or measured)
        measured = vllm_profile_or_reuse(spec.run_id, spec.target, list(settings.plan.candidates),
                                         store, settings=settings,
                                         k_max=settings.plan.k_max, new_profile=new_profile)
        name = measured["hardware_profile"]["name"]
    elif name is None:
        measured = measure_or_reuse_in(RunContext.build(spec), new_profile=new_profile)
        name = measured["hardware_profile"]["name"]
    costs = load_costs(name, store)
    if measured is not None:
        provenance = dict(measured["profile"])
    else:
        provenance = {"reused": False, "run_id": costs.run_id, "measured_at": None, "age_days": None,
                      "text": f"the stored profile {name} of run {costs.run_id}, named by the setting "
                              "hardware_profile"}
    worker = worker_hardware(spec, None if measured is None else measured["hardware_profile"])
    if provenance["reused"]:
        worker["reused_from"] = provenance["run_id"]
    with store.transaction() as tx:
        set_run_status(tx, spec.run_id, "profiled", hardware_profile=name, worker_hardware=worker)
    log.info("run %s: planning with cost profile %s (run %s; %s); profile task on worker %s (%s %s)",
             spec.run_id, name, costs.run_id, provenance["text"], worker["worker"], worker["device"],
             worker["dtype"])
    log_profile_check(spec.run_id, store)
    return {"hardware_profile": name, "reused": provenance["reused"],
            "measured_by": provenance["run_id"], "measured_at": provenance["measured_at"],
            "age_days": provenance["age_days"], "text": provenance["text"]}


def log_profile_check(run_id: str, store: Store) -> None:
    """The profile task's line on its cost profile's check: a WARNING when it is noisy (no domain
    turns on from it that the champion has off), INFO otherwise."""
    check = profile_check(run_id, store)
    noisy = check is not None and check["status"] == "noisy"
    (log.warning if noisy else log.info)("run %s: %s", run_id, profile_check_text(check))


def run_profile_name(context: RunContext) -> str | None:
    return run_hardware_profile(context.store, context.run_id)


def profile_name(profile) -> str:
    """The cost profile's name from step_profile's output (or the name itself)."""
    return profile["hardware_profile"] if isinstance(profile, dict) else profile


def worker_hardware(spec: RunSpec, measured: dict | None = None) -> dict:
    """This worker's hardware description ({name, device, dtype, details}, plus `worker`, its
    name, and `measured`: whether this run's costs are of this worker's hardware class: measured
    here, or reused from a profile of the same key, `reused_from` naming the run that measured
    it). Without either, the device and dtype the target loads with here (no model is loaded for
    it)."""
    model = loaded_model(spec.target, spec.device)
    if measured is not None:
        hardware = dict(measured)
    elif model is not None:
        hardware = describe_hardware(model)
    else:
        device = torch.device(spec.device) if spec.device else default_device()
        hardware = describe_device(device, default_dtype(device))
    hardware.update(worker=worker_name(), measured=measured is not None)
    return hardware


def step_estimate(spec, domain: str, profile) -> dict:
    """Offline estimate and plan of one domain with the run's cost profile (step_profile's output,
    or its name). Output: the domain's plan (domain_configs row)."""
    context = RunContext.build(spec)
    settings, run_id = context.settings, context.run_id
    requests, excluded = context.domain_requests(domain)
    costs = load_costs(profile_name(profile), context.store)
    minimum = _sample_minimum(context)
    if len(requests) < minimum:
        log.warning("run %s, domain %s: %d usable requests of this target < minimum %d (%d from other "
                    "fingerprints)", run_id, domain, len(requests), minimum,
                    len(excluded["other_fingerprint"]))
        return _plain(plan_domain(run_id, domain, costs, context.store, settings=settings,
                                  status="insufficient", samples=len(requests)))
    estimate_in(context, domain)
    return _plain(plan_domain(run_id, domain, costs, context.store, settings=settings,
                              samples=len(requests),
                              currently_on=domain in champion_domains_on(context.registry, context.spec)))


def champion_domains_on(registry: Registry, spec: RunSpec) -> set[str]:
    """Domains on in the target's champion config (for the planner's hysteresis); empty when there
    is no champion or no tracking store yet (none is created to find out). registry: the run's
    tracking store (RunContext.registry)."""
    if registry.local_store_missing():
        return set()
    try:
        mlflow_client = registry.client
        name = config_model_name(spec.target)
        version = alias_version(mlflow_client, name, CHAMPION)
        return set() if version is None else set(load_version_config(mlflow_client, name, version).domains_on)
    except MlflowException as exc:
        log.warning("run %s: champion config not read (%s): planning without hysteresis", spec.run_id,
                    mask_text(str(exc)))
        return set()


def _sample_minimum(context: RunContext) -> int:
    params = run_params(context.store, context.run_id)
    return int(params.get("min_per_domain") or context.settings.sample.min_per_domain)


def _plain(row: dict) -> dict:
    return {key: (value.isoformat() if isinstance(value, datetime) else value) for key, value in row.items()}


def step_confirm(spec, domain: str) -> dict:
    """Live confirmation of one domain's plan (under the timing lock) on our engine; none for a
    run planned on vLLM's costs (the engine check measures the plan on vLLM, on the same
    requests, and its verdict is the live check). Output: the measurement, or {"skipped":
    why nothing was measured}."""
    context = RunContext.build(spec)
    if profile_engine(hardware_of(run_profile_name(context), context.store)) == "vllm":
        why = ("planned on vLLM's costs: the live check runs on vLLM in the engine check, not on "
               "this engine")
        log.info("run %s, domain %s: %s", context.run_id, domain, why)
        return {"skipped": why}
    row = confirm_in(context, domain)
    if row is None:
        why = "nothing to measure: no planned drafter, no requests, or no comparable hardware"
        log.info("run %s, domain %s: %s", context.run_id, domain, why)
        return {"skipped": why}
    return _plain(row)


def step_validate(spec, domain: str) -> dict:
    """The sampling test of one domain's planned drafter on our engine (or the run's shared
    result for it); none where the sampling test on vLLM gates the run (the engine check runs
    it on the server that serves the config, and runs ours only for a domain vLLM's cannot
    test: tasks.steps.checks.engine_validate.own_sampling_fallback). Output: the test, or
    {"skipped": why nothing was tested}."""
    context = RunContext.build(spec)
    result = validate_in(context, domain, defer=engine_sampling_gates(context.settings))
    return {"skipped": DEFERRED} if result["validation"] == "deferred" else result


def step_finish(spec, insufficient: list[str] | None = None) -> dict:
    """After the per-domain steps (whatever their outcome): record insufficient domains and domains
    whose steps did not complete, run the greedy and fingerprint checks, check the result tables.
    Output: {"fingerprint", "greedy", "domains": {domain: validation}, "failed": [...]}."""
    context = RunContext.build(spec)
    spec, settings, store, run_id = (context.spec, context.settings, context.store,
                                     context.run_id)
    sampled, configs, profile = finish_inputs(store, run_id)
    insufficient = set(insufficient or [])
    failed = []
    for domain in sorted(sampled):
        config = configs.get(domain)
        if config is None and domain in insufficient:
            plan_domain(run_id, domain, load_costs(profile, context.store), context.store,
                        settings=settings, status="insufficient", samples=sampled[domain])
        elif config is None:
            record_domain_failure(spec, domain, "no plan was stored (its estimate step failed)", store)
            failed.append(domain)
        elif config["status"] == "ok" and config["enabled"] and config["validation"] is None \
                and not has_sampling_test(store, run_id, domain) and not engine_sampling_gates(settings):
            record_domain_failure(spec, domain, "its confirm or validate step did not complete", store)
            failed.append(domain)
    ok_domains = domain_names(store, run_id, status="ok")
    verdicts, excluded = validate_run_in(context, ok_domains)
    tables = ["domain_configs"]
    if ok_domains:
        tables.append("acceptance_estimates")
    if has_live_measurement(store, run_id):
        tables.append("live_measurements")
    for table in tables:
        check_result_table(run_id, table, context.store, settings=settings)
    with store.transaction() as tx:
        set_run_status(tx, run_id, "evaluated")
    log.info("run %s: finished: target fingerprint %s%s; greedy check %s; validation %s; failed "
             "domains %s", run_id, verdicts["fingerprint"]["id"],
             "" if verdicts["fingerprint"]["passed"] else " FAILED (" + "; ".join(verdicts["fingerprint"]["reasons"]) + ")",
             ", ".join(f"{d} {'passed' if ok else 'FAILED'}" for d, ok in sorted(verdicts["greedy"].items())) or "none",
             ", ".join(f"{d} {v}" for d, v in sorted(verdicts["domains"].items())) or "none",
             failed or "none")
    return {**verdicts, "failed": failed,
            "excluded": {key: len(value) for key, value in (excluded or {}).items()}}


def served_engine_check(spec) -> dict:
    """step_engine_check when the check is on: each domain the plan turns on served by vLLM, then
    the load check."""
    spec = RunSpec.of(spec)
    context = RunContext.build(spec)
    domains = domain_names(context.store, spec.run_id, status="ok", enabled=True)
    # one serving set-up for the sampling test and the load check: a config's OpenAI server
    # starts once for both (closed here, whatever happens)
    with serving_pool(context) as pool:
        result = engine_check_in(context, domains, pool=pool)
        record_engine_check_skip(context.store, spec.run_id, result["skipped"])
        if result["skipped"]:
            log.warning("run %s: %s: the config is NOT checked on the serving engine", spec.run_id,
                        result["skipped"])
        if not result["skipped"]:
            # under load, at the batch sizes the schedules claim (tasks.steps.checks.load_check)
            result["load_check"] = load_check_json(load_check(context, pool))
    return json.loads(json.dumps(result, default=str))


@contextmanager
def serving_pool(context):
    """The run's pool of vLLM OpenAI servers (None where there is no serving environment to serve
    from: the steps then say why they skip), closed when the block ends."""
    try:
        model_dir = serving_env.served_model_dir(context.spec.target)
    except ServingEnvUnavailable:
        yield None
        return
    with ServerPool(context.spec.run_id, model_dir, dtype=dtype_of(context.model),
                    settings=context.settings) as pool:
        yield pool


def step_load_check(spec) -> dict:
    """The load check alone (tasks.steps.checks.load_check), on the run's config as it stands."""
    spec = RunSpec.of(spec)
    return json.loads(json.dumps(load_check_json(load_check(RunContext.build(spec))), default=str))


def step_engine_validate(spec, domains: list[str] | None = None, speculative_config: dict | None = None,
                         mended: bool = True) -> dict:
    """The sampling test on vLLM's OpenAI server alone (tasks.steps.checks.engine_validate), on
    the run's serving pool (serving_pool)."""
    context = RunContext.build(RunSpec.of(spec))
    with serving_pool(context) as pool:
        result = engine_validate_in(context, domains, speculative_config=speculative_config,
                                    mended=mended, pool=pool)
    return json.loads(json.dumps(result, default=str))
