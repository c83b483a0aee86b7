"""The load check: the speedup a promoted schedule claims at batch sizes above 1, measured on
vLLM's OpenAI server under concurrent streamed requests, and the schedule cut to what it measured.

The engine check replays a domain's requests one at a time; the exported
`num_speculative_tokens_per_batch_size` claims payoffs at batch 2-8 from a cost profile alone.
Here, for every domain the run's config turns on (after the engine check's gate) and that has a
vLLM config, at each concurrency level of `load_levels` where the domain's schedule drafts (K > 0),
the domain's requests (draw order, `load_requests` of them and at least the level, each its logged
prompt, sampling parameters and seed, its length cut at `load_max_tokens`) are streamed through one
vLLM server per drafter method, as production deploys it (vllm_export.method_deployments: at the
largest K of its domains), with K per request (the project's plugin), in waves of the level's size,
each wave twice: at K 0 (the plain control) and at the K the domain's schedule gives the level,
each request asking it, the order alternating wave by wave, so that every ratio pairs the same
requests on the same server a wave apart (a machine that slows between two server starts no longer
moves it). A suffix server learns from what it serves: there the config's wave goes first, each
level takes its own requests, and before the domain's first level the server is served, at K 0, up
to load_history of the domain's logged requests outside the run's sample (the newest the estimate's
suffix index holds): a serving deployment's tree holds the domain's history, and so does the index
the estimate is priced on; measured on a tree without it, suffix decoding drafts little. A wave
side a neighbour slowed (CPU of other processes read from /proc) is served again (load_retries),
and a level's interval leaves out the pairs a neighbour reached where at least 5 clean ones remain
(tasks.steps.checks.confirm.judged_pairs). A K 0 request on that server still pays the drafter's
host search (vLLM proposes for the whole batch; the cut is made after), so the control is what the
deployment serves its off domains with (tasks.serving.load: asyncio + httpx). Per level and server:
output tokens/s (over the level's wall time), time to first token and inter-token latency p50/p95,
failed requests; on the config's server vLLM's vllm:spec_decode_* counter deltas from /metrics (E =
1 + accepted / drafts, and the acceptance rate per position) beside the same requests' per-request
metrics summed (they must be equal). The measured speedup is the config's decode-phase tokens/s
over the plain one on the same requests, with its 95% interval by bootstrap over them
(tasks.steps.checks.confirm.speedup_interval); the predicted one is vLLM's cost profile at that
batch size (the engine check's profile, the estimate of these requests at that level's K: a
greedy request's along its logged response, which the server serves again; a sampled one's the
mean of the domain's logged requests sampled as it is, tasks.steps.checks.drawn, since it draws
its response anew on the server, and its acceptance with it), and beside it the same prediction
along what vLLM served (predicted_served_speedup), which knows the draws
(benchmarks/results/suffix_parity.md).

A level pays when none of its requests failed and its interval's lower end clears min_speedup
(a domain on in the champion config, with hysteresis: its lower end clears 1.0 and its upper end
min_speedup, the planner's rule); it does not when its upper end is under min_speedup. Between
the two (the interval straddles the bar) eight requests cannot tell, and a run would decide by
chance: the level is served more of the domain's requests (load_more_requests, 16, eight at
a time) while it straddles, and where it still does after them, its point estimate decides and
the reason says the level was unsure. The schedule keeps K > 0 only up to the largest level such that
every measured level up to it pays; above it, K = 0. A domain that pays at no level is turned off
("load check: 0.94x [0.88, 1.01] at 1 concurrent request"). A server that does not start, dies or
hangs under load: the domain is not promotable (off), the reason names the server's log, the
levels measured before stay stored, and the other domains go on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from specdec_core.estimate import LoggedRequest

from ...db.load_records import DomainLoad
from ...db.queries_load import domains_on, engine_versions, load_checks, store_load_check
from ...errors import ServingEnvUnavailable
from ...registry.vllm_export import deployment_specs
from ...serving import environment as serving_env
from ...serving.server import ServerPool, log_dir
from .confirm import offline_totals, truncated
from .drawn import priced_totals
from ..costs.costs import CostTable
from .engine_compare import pays_sampled
from .engine_replay import dtype_of, end_slot, local_spec
from ..costs.engine_costs import engine_profile
from .engine_validate import served_export
from ..drafters.suffix_index import run_history
from .load_levels import (k_at, claimed_k, exported_schedule, level_row, level_verdict, pays, level_text,
                          cut_schedule, predicted_at)
from .load_waves import SERVER, DomainMeasurement, level_items, history_items, measure_domain

log = logging.getLogger(__name__)


def _predicted(context, domain: str, config: dict, requests: list, k: int, level: int,
               costs: CostTable | None, pools: dict | None = None) -> float | None:
    """The speedup vLLM's cost profile predicts for these requests at the level's batch size: the
    estimate of the planned drafter at K along their responses, priced as the engine check prices
    its requests (predicted_at). pools: None, the estimate along each response as given (the
    served prediction); else a sampled request is priced at the mean of the domain's logged
    requests sampled as it is (tasks.steps.checks.drawn, pools its cache). None without a
    profile, at K 0 or without a request."""
    if costs is None or k <= 0 or not requests:
        return None
    drafter = context.domain_drafters(domain)[config["drafter"]][1]
    if pools is None:
        offline = offline_totals(context.model, drafter, requests, k)
    else:
        offline = priced_totals(context.model, drafter, requests, context.domain_requests(domain)[0], k,
                                context.settings.load.max_tokens, pools)
    kept = [r for r in requests if r.request_id in offline]
    return predicted_at(costs, config["drafter"], config.get("drafter_spec"),
                        [offline[r.request_id] for r in kept], [pays_sampled(r.sampling) for r in kept], level)


def _logged_requests(context, domain: str, items: list[dict]) -> list:
    """The level's streamed requests as logged, each cut where it was served."""
    by_id = {r.request_id: r for r in context.domain_requests(domain)[0]}
    return [end_slot(truncated(by_id[i], n)) for i, n in
            dict.fromkeys((item["request_id"], item["max_tokens"]) for item in items)]


def _served_prediction(context, domain: str, config: dict, served: dict, chosen: list[dict], k: int,
                       level: int, costs: CostTable | None) -> float | None:
    """The level's speedup predicted along what vLLM served (the config side's tokens of each
    request, its first serving where it was served twice) in place of the logged responses: the
    same acceptance estimate and cost profile, without the draw a sampled request makes anew
    on the server (another response than the logged one, so another acceptance). None without
    a vLLM cost profile or a served request."""
    if costs is None or k <= 0:
        return None
    by_id = {r.request_id: r for r in context.domain_requests(domain)[0]}
    request_of = {str(item["id"]): item["request_id"] for item in chosen}
    requests = {}
    for result in served["requests"]:
        request_id = request_of.get(str(result["id"]))
        if request_id in by_id and request_id not in requests and result["ok"] and len(result["token_ids"]) >= 2:
            logged = by_id[request_id]
            requests[request_id] = end_slot(LoggedRequest(request_id, logged.prompt_ids, list(result["token_ids"]),
                                                          logged.sampling, logged.domain))
    return _predicted(context, domain, config, list(requests.values()), k, level, costs)


def _domain_result(context, domain: str, config: dict, spec: dict, measured: DomainMeasurement, costs,
                   items: list[dict]) -> tuple[DomainLoad, dict]:
    """(the load check's record, domain_configs changes) of one measured domain."""
    settings = context.settings
    champion_on = bool(config.get("champion_on"))
    rows, pools = [], {}
    for level, k, plain, served, chosen in measured.levels:
        row = level_row(level, k, plain, served)
        predicted = _predicted(context, domain, config, _logged_requests(context, domain, chosen), k, level, costs,
                               pools)
        row = replace(row, predicted_served_speedup=_served_prediction(context, domain, config, served, chosen,
                                                                       k, level, costs))
        rows.append(replace(row, predicted_speedup=predicted, pays=pays(row, settings, champion_on),
                            verdict=level_verdict(row, settings, champion_on)))
    record = DomainLoad(domain=domain, speculative_config=spec, schedule_before=exported_schedule(config),
                        plain_log=measured.logs.get("plain"), spec_log=measured.logs.get("config"),
                        levels=tuple(rows))
    if measured.failure is not None:
        status, reason = measured.failure
        measured_text = "; ".join(level_text(r) for r in rows)
        reason = f"{reason}{'; measured before: ' + measured_text if rows else ''}"[:2000]
        changes = {"enabled": False, "max_batch_size": None, "k_schedule": None,
                   "reason": f"{reason}; not promotable as on, the domain is off. "
                             f"Planner: {config.get('reason') or '-'}"[:2000]}
        return replace(record, status=status, passed=False, reason=reason, schedule_after=None,
                       max_level_paying=None), changes
    verdict = cut_schedule(config, rows, settings)
    after = dict(config, **verdict.changes)
    primed = (f" (the suffix server first served {measured.history} of the domain's logged "
              f"requests outside the sample)" if measured.history else "")
    record = replace(record, status=verdict.status, passed=verdict.status != "off",
                     reason=(verdict.reason + primed)[:2000], max_level_paying=verdict.largest,
                     schedule_after=exported_schedule(after) if after.get("enabled") else None)
    return record, verdict.changes


def _planned(context, on: dict, exported: dict) -> dict:
    """{domain: (spec, server, [(level, K)], items, history)} of the domains to measure: on,
    with a vLLM config, a level where the schedule drafts and requests to stream (server: the
    speculative config of its method's one deployment, vllm_export.deployment_specs; history: a
    suffix server's, history_items)."""
    settings = context.settings
    planned, servers = {}, deployment_specs(exported)
    for domain in sorted(on):
        spec = exported.get(domain)
        levels = [(b, k_at(spec, b)) for b in sorted(set(settings.load.levels))
                  if spec is not None and claimed_k(on[domain], b) > 0]
        counts = [max(settings.load.requests, b) for b, _ in levels]
        # a suffix server learns from what it serves: each level its own requests (level_slices)
        learns = spec is not None and spec.get("method") == "suffix"
        items = level_items(context.domain_requests(domain)[0],
                            (sum(counts) if learns else max(counts, default=0)) + settings.load.more_requests,
                            settings.load.max_tokens)
        if spec is not None and levels and items:
            history = history_items(run_history(
                context.run_id, domain, context.store, context.fingerprint, context.tokenizer,
                settings.load.history), settings.load.max_tokens) if learns else []
            planned[domain] = (spec, servers[domain], levels, items, history)
    return planned


def _measure(context, pool: ServerPool, server: dict, levels: list, items: list, config: dict,
             history: list[dict]) -> DomainMeasurement:
    try:
        served = local_spec(server)
    except Exception as exc:  # noqa: BLE001 - the registry's or the download's own error
        return DomainMeasurement(failure=(
            "failed", f"load check: the drafter's checkpoint {server.get('model')} could not be "
                      f"fetched for the server: {type(exc).__name__}: {exc}"))
    champion_on = bool(config.get("champion_on"))
    return measure_domain(pool, served, levels, items, context.settings,
                          settle=lambda row: level_verdict(row, context.settings, champion_on),
                          history=history)


def load_check(context, pool: ServerPool | None = None) -> dict:
    """Run the load check of one run (see the module's docstring) with a RunContext (pool: the
    servers to use, else a pool of the run's own, closed at the end). Output: {"skipped": line
    or None, "domains": {domain: its DomainLoad as stored}} (load_check_json: as JSON)."""
    settings, run_id = context.settings, context.spec.run_id
    if not settings.load.check:
        return {"skipped": "load check off (setting load_check)", "domains": {}}
    try:
        serving_env.working_python(settings)      # a broken one turns no domain off
        model_dir = serving_env.served_model_dir(context.spec.target)
    except ServingEnvUnavailable as exc:
        return {"skipped": f"load check skipped: {exc}", "domains": {}}
    on = domains_on(context.store, run_id)
    exported = served_export(run_id, context.store, context.spec.target, model_dir)["speculative_config"]
    planned = _planned(context, on, exported)
    versions = engine_versions(context.store, run_id)
    profiles: dict = {}
    records, changes = {}, {}
    own = pool is None
    pool = pool or ServerPool(run_id, model_dir, dtype=dtype_of(context.model), settings=settings,
                              directory=log_dir(run_id) / "load")
    try:
        # one server per drafter method, each level asking the domain's K: domains of one method
        # one after the other, those whose server the engine check's sampling test left running
        # first
        for domain, (spec, server, levels, items, history) in sorted(planned.items(), key=lambda p: (
                not pool.running(p[1][1], **SERVER, share=True), json.dumps(p[1][1], sort_keys=True))):
            measured = _measure(context, pool, server, levels, items, on[domain], history)
            version = (versions.get(domain) or {}).get("engine_version")
            if version and version not in profiles:
                profiles[version] = engine_profile(context.store, version, settings.engine.profile)
            records[domain], changes[domain] = _domain_result(
                context, domain, on[domain], spec, measured, profiles.get(version), items)
            (log.warning if records[domain].passed is False else log.info)(
                "run %s, domain %s: %s", run_id, domain, records[domain].reason)
    finally:
        if own:
            pool.close()
    if records:
        store_load_check(context.store, run_id, records, changes)
    return {"skipped": None, "domains": load_checks(context.store, run_id)}


def load_check_json(result: dict) -> dict:
    """load_check's output as the steps return it (Airflow's XCom): each domain's record as JSON."""
    return {**result, "domains": {domain: check.to_json() for domain, check in result["domains"].items()}}
