"""The engine check: what we promote, served by the engine our users run, before it is registered.

For every domain the plan turns on, the domain's exported vLLM config (tasks.registry.vllm_export)
is started in the serving environment (tasks.serving.environment) and the domain's requests are
replayed with their logged sampling parameters and lengths, one at a time (the engines and their
items: tasks.steps.checks.engine_replay; the comparison: tasks.steps.checks.engine_compare). Which
requests: the domain's confirm requests first, then the sample's next ones in draw order
(engine_check_requests in all), each cut at confirm_max_new_tokens.

What it reads: vLLM's own counts, per request and per verify step (drafted and accepted tokens,
`per_request_spec_decode_metrics="detailed"`), and its vllm:spec_decode_* counters.
What it compares, on the same requests at the K vLLM runs at batch size 1:
- mean accepted length E = 1 + accepted / verify steps that had drafts (vLLM's definition; a round
  in which the drafter proposed nothing is not a draft), the estimate's the same way from its
  expected rounds, with the estimate's 95% interval by bootstrap over the requests. vLLM also
  counts the drafts its last step accepted past max_tokens (then cut), which the estimate cannot
  see: where vLLM's steps can be placed along its output (compare_request), only those inside it;
- per position i, the share of drafted steps whose draft i was accepted (vLLM's
  num_accepted_tokens_per_pos / num_drafts, counted the same way), side by side;
- greedy requests whose vLLM output equals the logged response: the accepted tokens and drafted
  steps must equal the estimate's exactly (a mismatch names the request); where the output departs
  from the log (float ties), the first differing position is reported.
Gate: a domain whose vLLM E falls below the estimate's interval by more than engine_check_tolerance
is not promotable as on (suffix decoding: reported, not gated, since vLLM's tree holds only the
engine_check_history requests served before the replay while our index holds the run's history);
so is one whose config vLLM refuses or whose engine dies or hangs (the reason is vLLM's own error
line, or the timeout naming the engine's log). Such a domain is turned off in the run's config
with the reason. A drafter without a vLLM equivalent is reported, not gated.

Then, with `engine_sampling` on, the sampling test on vLLM's OpenAI server
(tasks.steps.checks.engine_validate) for every domain the replay passed, on one server per drafter
method (vllm_export.deployment_specs), each request asking its domain's K; a domain that fails it
is turned off ("lossy"); a domain on that it cannot take (no vLLM config), or every domain on
where the check is skipped, gets the sampling test on our engine here instead, which the
validate step left out (engine_validate.own_sampling_fallback). A run planned on vLLM's costs
(tasks.steps.costs.engine_costs.plans_on_vllm) gets its live check here: vLLM's decode-phase
speedup on the replayed requests, plain and config, judged by confirm's live_verdict and stored as
the run's live measurement; a veto turns the domain off.

Cost: one engine per drafter method (domains whose configs differ in K only share it, as
one deployment serves them: tasks.registry.vllm_export.method_deployments, at the largest K of
its domains, each request asking its domain's K at batch size 1), started with enforce_eager
in-process, with K per request (the project's plugin): it serves every replayed request twice,
at its domain's K and then at K 0 (the plain control), so each speedup pairs the same request
on the same engine moments apart, whatever the machine did between engine starts. A K 0
request still pays the drafter's host search (vLLM proposes for the whole batch; the cut comes
after): the control is what that deployment serves off domains with.
No serving environment: the check is skipped with one line saying how to make one (a failure only
when engine_check_required is set). Rows go to `engine_checks` (one per run and domain, replaced
when the check re-runs); the run's other results are never touched except the gated domains'.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace

from ...db.domain_records import PlannedDomain
from ...db.engine_records import EngineCheckRow, EngineRecord, PlainFigures, ServedBy, rows_json
from ...db.queries_runs import domain_names
from ...db.queries_engine_checks import (enabled_domains, replace_engine_checks, replace_live_measurement,
                                         run_hardware_details)
from ...db.store import Store
from ...errors import ServingEnvUnavailable
from ...registry.live_check import LiveVerdict
from ...registry.vllm_export import deployment_specs, method_deployments
from ...serving import environment as serving_env
from ...serving.replay_answer import ReplayAnswer, ServedRequest
from ...serving.server import ServerPool, log_dir
from ...settings import Settings
from .confirm import live_verdict
from ..costs.costs import CostTable
from ..costs.engine_costs import engine_profile
from ..costs.vllm_hardware import profile_engine
from ..estimate.acceptance import acceptance_rate
from .engine_validate import own_sampling_fallback, served_export, validate_on_engine
from .engine_compare import domain_row, served_decode_tokens_per_s, served_tokens_per_s
from .engine_replay import (batch_one_k, pick_requests, local_spec, EngineRun, paired_items,
                            replay_history, HISTORY_BATCH, serve_replay, dtype_of)

log = logging.getLogger(__name__)


@dataclass
class CheckPlan:
    """What the check serves: the domains turned on (their PlannedDomains), the requests
    picked per domain, the engines in order, and the rows already decided (no vLLM config)."""
    on: dict[str, PlannedDomain]
    picked: dict[str, list]
    engines: list[EngineRun]
    rows: dict[str, EngineCheckRow]


@dataclass(frozen=True)
class Served:
    """One engine's replay: its record (the output's engines entry), the probe's answer, why the
    engine failed as a whole (None: it served) and how many history requests it served first."""
    record: EngineRecord
    answer: ReplayAnswer
    reason: str | None
    history: int


@dataclass
class CheckContext:
    """What every phase of one run's check reads."""
    run_id: str
    store: Store
    model_dir: object
    target_model: object
    requests_by_domain: dict
    settings: Settings

    @property
    def url(self) -> str:
        return self.store.url


def engine_check(run_id: str, target: str, target_model, drafters_by_domain: dict,
                 requests_by_domain: dict, store: Store,
                 settings: Settings | None = None, pool: ServerPool | None = None) -> dict:
    """Run the engine check of one run (see the module's docstring); pool: the OpenAI servers of
    the sampling test, left running for the caller (the load check), else a pool of its own closed
    after the test. Output: {"skipped": line or None, "domains": {domain: row}, "engines":
    [{domains, start_s, seconds, status}], "sampling": {domain: the sampling test on vLLM
    (EngineSamplingResult.to_dict())}}."""
    settings = settings or store.settings
    try:
        serving_env.serving_python(settings)
        model_dir = serving_env.served_model_dir(target)
    except ServingEnvUnavailable as exc:
        if settings.engine.check_required:
            raise
        line = f"engine check skipped: {exc}"
        log.warning("run %s: %s", run_id, line)
        own_sampling_fallback(store, run_id, enabled_domains(store, run_id)[0], target_model,
                              drafters_by_domain, requests_by_domain, settings)
        return {"skipped": line, "domains": {}, "engines": [], "sampling": {}}
    context = CheckContext(run_id, store, model_dir, target_model, requests_by_domain, settings)
    on, confirmed = enabled_domains(store, run_id)
    exported = served_export(run_id, store, target, model_dir)
    plan = _plan_check(on, confirmed, exported, requests_by_domain, settings)
    rows = plan.rows
    engines, answers = [], {}
    profiles: dict[str, CostTable | None] = {}      # the serving engine's cost profile, by version
    directory = log_dir(run_id)
    plain: dict[str, ServedRequest] = {}           # the K 0 twins, by their request's id
    for run in plan.engines:
        served = _replay(context, run, plan.picked, directory)
        engines.append(served.record)
        answer, twins = served.answer.without_plain()
        served = replace(served, answer=answer)
        plain.update(twins)
        answers[run.name] = answer
        rows.update(_engine_rows(context, run, served, plan, drafters_by_domain, profiles))
    rows = _add_plain_figures(rows, plan.picked, plain)
    if planned_on_vllm(store, run_id):
        rows = _live_checks(context, plan, rows, answers, plain)
    rows, sampling = _sampling_test(context, plan, rows, exported, pool)
    _store(store, run_id, on, rows, settings)
    own_sampling_fallback(store, run_id, [d for d in on if d not in sampling and (
        d not in rows or rows[d].passed is not False)], target_model, drafters_by_domain,
        requests_by_domain, settings)
    _log_outcome(run_id, rows, engines)
    return {"skipped": None, "domains": rows_json(rows), "engines": [e.to_json() for e in engines],
            "sampling": sampling}


def engine_check_in(context, domains: list[str], pool: ServerPool | None = None) -> dict:
    """engine_check of `domains` (the ones the plan turns on) with a RunContext
    (tasks.steps.context): each domain's candidates as the run's context gives them, the
    requests of every domain it planned (status ok: the off ones are a suffix engine's history
    too, engine_replay.replay_history), its target, store and settings; pool: as engine_check's."""
    sampled = sorted(set(domains) | set(domain_names(context.store, context.run_id, status="ok")))
    return engine_check(context.run_id, context.spec.target, context.model,
                        {d: context.domain_drafters(d) for d in domains},
                        {d: context.domain_requests(d)[0] for d in sampled},
                        context.store, settings=context.settings, pool=pool)


def _plan_check(on: dict[str, PlannedDomain], confirmed: dict, exported: dict, requests_by_domain: dict,
                settings: Settings) -> CheckPlan:
    """The requests each domain replays and the engines serving them: one per drafter method
    (its domains' configs differ in K only); a domain without a vLLM config gets its row here
    (unsupported, not gated)."""
    rows: dict[str, EngineCheckRow] = {}
    specs: dict[str, dict] = {}
    picked: dict[str, list] = {}
    for domain in sorted(on):
        spec = exported["speculative_config"].get(domain)
        if spec is None:
            rows[domain] = EngineCheckRow(status="unsupported", passed=None, reason="engine check: "
                                          + exported["unsupported"].get(domain, "no vLLM config"))
            continue
        picked[domain] = pick_requests(requests_by_domain.get(domain, []), confirmed.get(domain, []),
                                       settings.engine.check_requests, settings.live.max_new_tokens)
        specs[domain] = spec
    # one engine per deployment (tasks.registry.vllm_export.method_deployments: one per drafter
    # method, at the largest K of its domains, each domain's K asked per request, as production
    # serves them) and no plain engine: every request is served twice, at K 0 (the plain
    # control) and at its domain's K (paired_items)
    engines = [EngineRun(f"spec-{n}", deployment["speculative_config"], deployment["domains"],
                         {d: specs[d] for d in deployment["domains"]})
               for n, deployment in enumerate(method_deployments(specs, ""))]
    return CheckPlan(on, picked, engines, rows)


def _replay(context: CheckContext, run: EngineRun, picked: dict, directory) -> Served:
    """Start one engine and replay its domains' picked requests (after its history); the record
    says how it went (ok, refused, unresolved, timeout, died) and how long it took."""
    settings, spec, domains = context.settings, run.spec, run.domains
    # (each request seeded by its place in its domain's pick)
    items = paired_items([(i, r, batch_one_k(run.spec_of(d)))
                           for d in domains for i, r in enumerate(picked[d])])
    history = replay_history(run, picked, context.requests_by_domain, settings)
    what = f"run {context.run_id}, domains {', '.join(domains)} ({run.name} engine)"
    log.info("%s: starting vLLM with %s; %d requests%s", what,
             json.dumps(spec) if spec else "no speculation", len(items),
             f" after {len(history)} of history" if history else "")
    began = time.perf_counter()
    log_path = directory / ("plain.log" if spec is None else f"spec-{'+'.join(domains)[:100]}.log")
    try:
        served = local_spec(spec)
    except Exception as exc:  # noqa: BLE001 - the registry's or the download's own error
        answer = ReplayAnswer(failed=("unresolved", f"the drafter's checkpoint {spec['model']} could not "
                                                    f"be fetched for the engine: {type(exc).__name__}: {exc}"))
    else:
        answer = serve_replay(serving_env, settings, what, log_path,
                        {"model": str(context.model_dir), "speculative_config": served, "requests": items,
                         "history": history, "dtype": dtype_of(context.target_model),
                         "contention_cores": settings.profile.contention_cores,
                         "retries": settings.engine.check_retries,
                         # seconds of serving shared out over the domains; the pairs not started
                         # within a domain's share are left out and named (engine_compare)
                         "budget_s": settings.engine.check_budget_s,
                         # a request whose step is this much over its K's fastest was slowed
                         "slowed": settings.profile.slowed,
                         # the history is served batched; the replay one request at a time
                         "max_num_seqs": max(1, min(len(history), HISTORY_BATCH))})
    record = EngineRecord(engine=run.name, domains=domains, speculative_config=spec,
                          log=str(log_path), start_s=answer.start_s, starts=answer.starts,
                          seconds=round(time.perf_counter() - began, 1), mends=answer.mends)
    for mend in record.mends:
        log.info("%s: %s", what, mend)
    record, reason = _outcome(record, answer)
    log.info("%s: %s in %.0f s (engine start %s)", what, record.status, record.seconds,
             "-" if record.start_s is None else f"{record.start_s:.1f} s")
    return Served(record, answer, reason, len(history))


def _outcome(record: EngineRecord, answer: ReplayAnswer) -> tuple[EngineRecord, str | None]:
    """How the engine's replay went (the record's status, pairs left out) and why it failed as a
    whole (None: it served)."""
    if answer.failed:
        return replace(record, status=answer.failed[0]), answer.failed[1]
    if answer.refused:
        return replace(record, status="refused"), f"vLLM refused the config: {answer.refused}"
    if answer.died:
        record = replace(record, status=f"died on {len(answer.died)} requests (started again)")
    return replace(record, left_out=len(answer.left_out) or None), None


def _engine_rows(context: CheckContext, run: EngineRun, served: Served, plan: CheckPlan,
                 drafters_by_domain: dict, profiles: dict) -> dict[str, EngineCheckRow]:
    """The rows of the domains one speculative engine served: failed as a whole where the engine
    did (its reason), else each domain's comparison with the estimate (domain_row). profiles:
    the serving engine's cost profiles by version, filled as versions are met."""
    answer, record, reason = served.answer, served.record, served.reason
    rows = {}
    for domain in run.domains:
        if answer.vllm and answer.vllm not in profiles:
            profiles[answer.vllm] = engine_profile(context.store, answer.vllm, context.settings.engine.profile)
        costs = profiles.get(answer.vllm)
        by = ServedBy(log_path=record.log, engine_version=answer.vllm, start_s=record.start_s,
                      counters=answer.counters,
                      engine_profile=None if costs is None else costs.hardware_profile)
        if reason is not None:
            rows[domain] = EngineCheckRow(status=record.status, passed=False, served=by,
                                          speculative_config=run.spec_of(domain),
                                          reason=f"engine check: {reason}"[:2000])
            continue
        on = plan.on[domain]
        drafter = drafters_by_domain[domain][on.drafter][1]
        row = domain_row(plan.picked[domain], answer, run.spec_of(domain), drafter, context.target_model,
                         served.history, record.log, context.settings, on, costs,
                         context.requests_by_domain.get(domain, []))
        if record.mends:
            row = replace(row, reason=(f"{row.reason} (served with {len(record.mends)} "
                                       "mend of vLLM's CPU build, named in the task log)")[:2000])
        rows[domain] = replace(row, speculative_config=run.spec_of(domain), served=by)
    return rows


def _add_plain_figures(rows: dict[str, EngineCheckRow], picked: dict,
                       plain: dict[str, ServedRequest]) -> dict[str, EngineCheckRow]:
    """The rows with the plain engine's tokens/s on each domain's replayed requests (plain: the
    K 0 twins by their request's id), beside the config's, and the decode-phase speedup between
    them (for information)."""
    out = dict(rows)
    for domain in picked:
        if domain in rows and plain:
            replayed = [plain[r.request_id] for r in picked[domain] if r.request_id in plain]
            plain_decode = served_decode_tokens_per_s(replayed)
            comparison = rows[domain].comparison
            spec_decode = None if comparison is None else comparison.spec_decode_tokens_per_s
            out[domain] = replace(rows[domain], plain=PlainFigures(
                plain_tokens_per_s=served_tokens_per_s(replayed), plain_decode_tokens_per_s=plain_decode,
                measured_speedup=spec_decode / plain_decode if spec_decode and plain_decode else None))
    return out


def _live_checks(context: CheckContext, plan: CheckPlan, rows: dict[str, EngineCheckRow],
                 answers: dict[str, ReplayAnswer], plain: dict[str, ServedRequest]) -> dict[str, EngineCheckRow]:
    """The run planned on vLLM's costs: the live check is vLLM's speedup on these requests, stored
    as the run's live measurement; a veto fails the domain's row. The rows with their checks."""
    engine_of = {d: run.name for run in plan.engines if run.name != "plain" for d in run.domains}
    out = dict(rows)
    for domain in plan.picked:
        row = rows.get(domain)
        if row is None or row.passed is False or row.comparison is None or domain not in engine_of:
            continue
        live = vllm_live_check(domain, plan.on[domain], plan.picked[domain],
                               answers.get(engine_of[domain], ReplayAnswer()).requests, plain,
                               row.predicted_speedup,
                               context.settings)
        if live is not None:
            _store_live(context.store, context.run_id, domain, plan.on[domain], live, row,
                        context.settings)
            out[domain] = _judged(row, live["verdict"])
    return out


def _judged(row: EngineCheckRow, verdict: dict) -> EngineCheckRow:
    """The row with its live check's verdict: the figure judged as its measured speedup, over the
    pairs no neighbour reached (confirm.judged_pairs); failed on a veto."""
    row = replace(row, live_check=verdict)
    if verdict.get("measured") is not None:
        row = replace(row, plain=replace(row.plain or PlainFigures(), measured_speedup=verdict["measured"]))
    if LiveVerdict.read(verdict["verdict"]) is LiveVerdict.VETO:
        row = replace(row, status="below", passed=False,
                      reason=f"engine check: {verdict['reason']}; "
                             f"{row.reason.removeprefix('engine check: ')}"[:2000])
    return row


def _sampling_test(context: CheckContext, plan: CheckPlan, rows: dict[str, EngineCheckRow], exported: dict,
                   pool: ServerPool | None = None) -> tuple[dict[str, EngineCheckRow], dict]:
    """With engine_sampling on, the sampling test on vLLM's OpenAI server for every domain the
    replay passed; a domain that fails it is turned off ("lossy", or "died" on an error).
    Output: the rows with the test's verdicts, and {domain: EngineSamplingResult.to_dict()}."""
    sampling = {}
    if not context.settings.engine.sampling:
        return rows, sampling
    tested = {d: exported["speculative_config"][d] for d in plan.picked
              if d not in rows or rows[d].passed is not False}
    if not tested:
        return rows, sampling
    own = pool is None
    pool = pool or ServerPool(context.run_id, context.model_dir, dtype=dtype_of(context.target_model),
                              settings=context.settings)
    try:
        # on one server per drafter method, as the replay and production serve them
        servers = deployment_specs({d: exported["speculative_config"][d] for d in plan.picked})
        results = validate_on_engine(context.run_id, context.store, pool, context.target_model,
                                     tested, context.requests_by_domain, plan.on, context.settings,
                                     servers=servers)
    finally:
        if own:
            pool.close()
    out = dict(rows)
    for domain, result in results.items():
        sampling[domain] = result.to_dict()
        if not result.passed:
            out[domain] = replace(rows[domain], status="lossy" if result.status != "error" else "died",
                                  passed=False,
                                  reason=f"engine check: {result.reason}; {rows[domain].reason}"[:2000])
    return out, sampling


def _log_outcome(run_id: str, rows: dict[str, EngineCheckRow], engines: list[EngineRecord]) -> None:
    """The task log's account of the check: mends of vLLM's CPU build, greedy requests whose
    counts differ from the estimate's, and each domain's verdict."""
    mends = sorted({m for record in engines for m in record.mends})
    if mends:
        log.warning("run %s: vLLM's CPU sampler was mended in %d engine(s) before serving: %s", run_id,
                    sum(1 for record in engines if record.mends), " ".join(mends))
    for domain, row in sorted(rows.items()):
        for item in (row.comparison.per_request if row.comparison else None) or []:
            if item.counts_equal is False:
                log.error("run %s, domain %s, request %s: vLLM's greedy output equals the log but it "
                          "accepted %s drafts inside it in %d drafted steps, the estimate %.0f in "
                          "%.0f", run_id, domain, item.request_id,
                          item.engine_accepted_in_log if item.engine_accepted_in_log is not None
                          else "(steps not placeable)", item.engine_steps,
                          item.estimate_accepted, item.estimate_steps)
        (log.warning if row.passed is False else log.info)("run %s, domain %s: %s", run_id,
                                                            domain, row.reason)


def planned_on_vllm(store: Store, run_id: str) -> bool:
    """Whether the run planned on a cost profile of vLLM's own steps (its hardware names vLLM)."""
    return profile_engine({"details": run_hardware_details(store, run_id)}) == "vllm"


def vllm_live_check(domain: str, config: PlannedDomain, requests: list, served: dict[str, ServedRequest],
                    plain: dict[str, ServedRequest], predicted: float | None, settings: Settings) -> dict | None:
    """The live check of a run planned on vLLM's costs, on vLLM: per replayed request, the decode
    phase of the plain engine and of the config's (vLLM's own timestamps; served: the config's
    requests by id, plain: their K 0 twins), judged by the same rule as our engine's confirm
    step (tasks.steps.checks.confirm.live_verdict: slower than plain decoding, the interval's
    upper end below min_speedup, a veto for a domain turning on). None without both engines'
    timings. predicted: the speedup vLLM's cost profile predicts for the requests.
    Output: {"per_request", "verdict"}."""
    per_request = []
    for request in requests:
        spec, flat = served.get(request.request_id), plain.get(request.request_id)
        if not spec or not flat or not spec.decode_s or not flat.decode_s:
            continue
        per_request.append({"request_id": request.request_id,
                            "plain_tokens": flat.tokens - 1, "plain_decode_s": flat.decode_s,
                            "spec_tokens": spec.tokens - 1, "spec_decode_s": spec.decode_s,
                            "plain_latency_s": flat.seconds, "spec_latency_s": spec.seconds,
                            # a twin that ran beside other processes' CPU, or slowed (a step
                            # over profile_slowed past its K's fastest on the engine)
                            "contended": any(twin.contended or twin.slowed for twin in (spec, flat))})
    if not per_request:
        return None
    # confirm's rule reads the plan's columns from the domain_configs row (enabled, champion_on,
    # predicted_speedup): the record's JSON has them by the same names
    verdict = live_verdict(per_request, config.to_json(), settings, predicted)
    verdict["engine"] = "vllm"
    verdict["reason"] = "on vLLM: " + verdict["reason"]
    return {"per_request": per_request, "verdict": verdict}


def _store_live(store: Store, run_id: str, domain: str, config: PlannedDomain, live: dict,
                row: EngineCheckRow, settings: Settings) -> None:
    """The vLLM live check as the run's live measurement of the domain (live_measurements and
    domain_configs' measured_speedup and live_check: what the live_check gate and the page read)."""
    verdict, per_request = live["verdict"], live["per_request"]
    compared, plain, served = row.comparison, row.plain or PlainFigures(), row.served or ServedBy()
    same = compared.predicted_speedup
    measured = verdict.get("measured")
    counters = served.counters or {}
    record = {"run_id": run_id, "domain": domain, "drafter": config.drafter, "k": compared.k or config.k,
              "batch_size": 1, "requests": len(per_request),
              "tokens": sum(r["spec_tokens"] + 1 for r in per_request),
              "acceptance_rate": acceptance_rate(counters.get("accepted_tokens"), counters.get("draft_tokens")),
              "mean_accepted_length": compared.engine_e,
              "plain_tokens_per_s": plain.plain_decode_tokens_per_s,
              "spec_tokens_per_s": compared.spec_decode_tokens_per_s,
              "predicted_speedup": config.predicted_speedup, "measured_speedup": measured,
              "plain_latency_s": _mean([r["plain_latency_s"] for r in per_request]),
              "spec_latency_s": _mean([r["spec_latency_s"] for r in per_request]),
              "predicted_same_requests": same,
              "cost_model_error": measured / same - 1.0 if measured is not None and same else None,
              "gap": (abs(measured / same - 1.0) > settings.live.tolerance
                      if measured is not None and same else None),
              "per_request": per_request, "hardware": {"engine": "vllm", "version": served.engine_version},
              "measured_speedup_lo": verdict.get("lo"), "measured_speedup_hi": verdict.get("hi")}
    with store.transaction() as tx:
        replace_live_measurement(tx, record, verdict)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _store(store: Store, run_id: str, on: dict[str, PlannedDomain], rows: dict[str, EngineCheckRow],
           settings: Settings) -> None:
    """One transaction: the run's engine_checks rows replaced, gated domains turned off."""
    off = {domain: (f"{row.reason}; not promotable as on, the domain is off. "
                    f"Planner: {on[domain].reason}")[:2000]
           for domain, row in rows.items() if row.passed is False}
    with store.transaction() as tx:
        replace_engine_checks(tx, run_id, {domain: row.columns() for domain, row in rows.items()}, off)
