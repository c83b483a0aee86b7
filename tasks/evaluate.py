"""One evaluation run end to end, without Airflow:
sample -> check -> profile -> estimate -> plan -> confirm -> validate (per domain) -> greedy and
fingerprint (once). Every step stores its rows by run id; re-running a run id replaces them.
The DAG (dags/specdec_evaluate.py) wires the same step functions one task each.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from sqlalchemy import select, update

from .candidates import build_drafters
from .costs import load_costs, profile_costs
from .db.engine import database_url, ensure_ready
from .db.models import DomainConfig, EvalRun, LiveMeasurement
from .measure import estimate_domains, load_sample_requests
from .plan import plan_domain
from .confirm import confirm_domain
from .quality import check_result_table, check_traffic_sample
from .sampling import sample_traffic
from .settings import Settings, load_settings
from .validate import validate_domain, validate_run

log = logging.getLogger(__name__)

TABLE_COLUMNS = ("domain", "status", "drafter", "k", "max_batch_size", "mean_accepted_length",
                 "predicted_speedup", "predicted_speedup_lo", "predicted_speedup_hi",
                 "measured_speedup", "gap", "enabled", "validation", "promotable")


def default_run_id() -> str:
    return "manual__" + datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def evaluation_table(run_id: str, db_url: str | None = None) -> list[dict]:
    """The run's per-domain table (domain_configs joined with its live measurement)."""
    engine = ensure_ready(database_url(db_url))
    with engine.connect() as connection:
        configs = connection.execute(select(DomainConfig).where(DomainConfig.run_id == run_id)
                                     .order_by(DomainConfig.domain)).mappings().all()
        gaps = dict(connection.execute(select(LiveMeasurement.domain, LiveMeasurement.gap)
                                       .where(LiveMeasurement.run_id == run_id)).all())
    return [{column: (gaps.get(row["domain"]) if column == "gap" else row[column])
             for column in TABLE_COLUMNS} for row in configs]


def _set_status(engine, run_id: str, status: str, **values) -> None:
    with engine.begin() as connection:
        connection.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
            status=status, updated_at=datetime.now(timezone.utc).replace(tzinfo=None), **values))


def evaluate(run_id: str | None = None, target: str = "smollm2-135m-instruct",
             db_url: str | None = None, settings: Settings | None = None, domains=None, window=None,
             candidates=None, hardware_profile: str | None = None, k_max: int | None = None,
             max_per_domain: int | None = None, min_per_domain: int | None = None,
             device: str | None = None, progress: bool = True, model=None, tokenizer=None,
             register: bool = False, promote: bool = False, tracking_uri: str | None = None) -> dict:
    """Run every step for one run id; returns {"run_id", "table", "steps": {step: seconds}, ...}.

    hardware_profile: plan with that stored cost profile (measured elsewhere and imported);
    default (settings.hardware_profile None): measure this machine in this run.
    model/tokenizer: an already loaded target (then `target` only names it).
    register: track the run in MLflow and register its config (alias challenger); promote: then
    gate it and move the champion alias (implies register).
    """
    from specdec_core import load_model

    settings = settings or load_settings()
    run_id = run_id or default_run_id()
    db_url = database_url(db_url or settings.database_url)
    engine = ensure_ready(db_url)
    k_max = k_max or settings.eval_k_max
    steps: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps[name] = round(now - clock, 2)
        clock = now
        log.info("run %s: %s done in %.1f s", run_id, name, steps[name])

    sample = sample_traffic(run_id, db_url=db_url, domains=domains, window=window, settings=settings,
                            max_per_domain=max_per_domain, min_per_domain=min_per_domain)
    lap("sample")
    checked = check_traffic_sample(run_id, db_url=db_url, settings=settings)   # raises on table level
    status = {domain: info["status"] for domain, info in checked["domains"].items()}
    lap("check")

    if model is None:
        model, tokenizer = load_model(target, device=device)
    drafters = build_drafters(candidates or settings.candidates, model, tokenizer)
    lap("load")
    profile_name = hardware_profile or settings.hardware_profile
    if profile_name is None:
        measured = profile_costs(run_id, model, {label: d for label, (_, d) in drafters.items()},
                                 db_url=db_url, settings=settings, k_max=k_max, progress=progress)
        profile_name = measured["hardware_profile"]["name"]
    costs = load_costs(profile_name, db_url)
    _set_status(engine, run_id, "profiled", hardware_profile=profile_name)
    lap("profile")

    from specdec_core.validation import fingerprint_id, target_fingerprint

    fid = fingerprint_id(target_fingerprint(model))
    ok_domains = [d for d, s in status.items() if s == "ok"]
    requests, excluded = load_sample_requests(run_id, db_url, domains=ok_domains, tokenizer=tokenizer,
                                              fingerprint=fid)
    usable = {domain: (len(requests.get(domain, [])) if domain in ok_domains
                       else sample["domains"].get(domain, {}).get("sampled", 0)) for domain in status}
    for domain in ok_domains:      # rows of other targets were excluded: count what is left
        if usable[domain] < sample["min_per_domain"]:
            status[domain] = "insufficient"
            log.warning("run %s, domain %s: %d usable requests of this target < minimum %d", run_id,
                        domain, usable[domain], sample["min_per_domain"])
    requests = {domain: items for domain, items in requests.items() if status[domain] == "ok"}
    estimate_domains(run_id, model, drafters, requests, db_url=db_url, settings=settings,
                     k_max=k_max, progress=progress)
    lap("estimate")
    for domain in sorted(status):
        plan_domain(run_id, domain, costs, db_url=db_url, settings=settings, status=status[domain],
                    samples=usable[domain])
    lap("plan")
    for domain in sorted(requests):
        confirm_domain(run_id, domain, model, drafters, requests[domain], db_url=db_url,
                       settings=settings, progress=progress)
    lap("confirm")
    for domain in sorted(requests):
        validate_domain(run_id, domain, model, drafters, requests[domain], db_url=db_url,
                        settings=settings)
    lap("validate")
    verdicts = validate_run(run_id, model, tokenizer, drafters, requests, target_id=target,
                            db_url=db_url, settings=settings, excluded=excluded)
    lap("greedy_and_fingerprint")
    checked_tables = ["domain_configs"] + (["acceptance_estimates", "live_measurements"]
                                           if requests else [])   # all insufficient: nothing measured
    for table in checked_tables:
        check_result_table(run_id, table, db_url=db_url, settings=settings)
    _set_status(engine, run_id, "evaluated")
    lap("check_results")
    registered = promoted = None
    if register or promote:
        from .registry import promote as promote_version
        from .registry import register_config

        registered = register_config(run_id, db_url=db_url, uri=tracking_uri, settings=settings)
        lap("register")
        if promote:
            promoted = promote_version(registered["name"], registered["version"], db_url=db_url,
                                       uri=tracking_uri, settings=settings,
                                       expected_champion=registered["champion_version"])
            lap("promote")
    return {"run_id": run_id, "target": target, "fingerprint": verdicts["fingerprint"],
            "registered": registered, "promoted": promoted,
            "hardware_profile": profile_name, "sample": sample, "excluded": {
                key: len(value) for key, value in excluded.items()},
            "table": evaluation_table(run_id, db_url), "steps": steps,
            "seconds": round(sum(steps.values()), 1)}
