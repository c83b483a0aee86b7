"""The sampling test on the serving engine: vLLM's OpenAI server, run as production runs it.

For each distinct config a run would promote (its exported speculative config, the sampling
settings of the domain's traffic and the context the own-engine test uses), the server with that
config draws N continuations of M tokens from the context (`n` continuations per request, at most
as many at once as the config's schedule still drafts at, so that speculation is on for every
row), and each position is G-tested against the target's exact next-token distribution,
teacher-forced by our engine on the same weights: the same bins, Bonferroni correction and
false-alarm rate as specdec_core.validation.sampling_check (position_tests).

Draws that fail are drawn again, afresh (another seed), at `validation_confirm_factor` (4) times
the rows, and that confirmation decides: at a false-alarm rate of 0.01 per check a lossless config
fails one test in a hundred by chance (json, in one of six runs of the busy-neighbour series: p
0.0002 at T1 position 2; 1200 fresh rows passed), which turned a domain off that every other run
kept on; two independent draws both fail by chance about once in ten thousand, while a gross
fault (vLLM's unmended CPU sampler: p about 0 in 10 of 10 draws) fails both. The version page
names the first draw's failure beside the confirmation.

The same server without speculation (each request asking K 0, the project's plugin's K per
request) goes through the same test from the same context, at as many rows, as a control
wherever the deciding draws fail (a passing config needs no control; this halves the test's cost;
no plain server is started). Verdicts:
- passed: the config's draws pass (the first, or their confirmation);
- failed: they fail (and their confirmation) while the K 0 control's pass: the config changes what
  users receive (the reason names the setting, position, statistic and p-value of both draws);
  not promotable;
- engine_differs: the K 0 control fails too: the engine's own sampling, or a numeric difference
  between the engines, departs from the target's distribution; the config is not called lossless
  and is not promotable.

Rows go to `validations` with check_name "engine_sampling", one per domain (domains with equal
configs and samplings share one test, from the first one's context: "shared_from"; with
`engine_sampling_scope` "domain" only those whose contexts are equal too), replaced when the test
re-runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from specdec_core import SamplingParams
from specdec_core.validation import SamplingReport, position_tests

from ...db.domain_records import PlannedDomain
from ...db.queries_engine_checks import fail_own_sampling_domains, mark_validation_failed, planned_domains
from ...db.queries_runs import domain_names, has_sampling_test
from ...db.store import Store
from ...errors import EngineTimeout, InvalidValue, ServingProbeError
from ...registry.run_config import build_config
from ...registry.vllm_export import vllm_export
from ...serving import environment as serving_env
from ...serving.server import ServerPool, VllmServer
from ...settings import Settings
from ...db.queries_validations import replace_validations
from .validate import validate_domain, validation_context, validation_samplings

log = logging.getLogger(__name__)

CHECK = "engine_sampling"
# KV blocks of 32 tokens (vLLM's CPU default is 128) so that the context's full blocks are cached
# and shared by the rows; the block size does not change what is sampled
BLOCK_SIZE = 32
MOST_AT_ONCE = 64      # continuations per request when the config drafts at every batch size


def drafting_batch(spec: dict | None) -> int:
    """The most continuations to draw at once with `spec` so that every row is drafted for: the
    largest batch size its schedule still gives K > 0 (MOST_AT_ONCE without a schedule)."""
    schedule = (spec or {}).get("num_speculative_tokens_per_batch_size")
    if not schedule:
        return MOST_AT_ONCE
    drafting = [hi for lo, hi, k in schedule if k > 0]
    return max(1, min(max(drafting, default=1), MOST_AT_ONCE))


def draw(server: VllmServer, context: list[int], sampling: SamplingParams, rows: int, length: int,
         at_once: int, k: int | None = None) -> torch.Tensor:
    """[rows, length] continuations drawn by the server from `context` under `sampling` (k: each
    request's own K, the plugin's K per request; None: the server's). One token is asked first,
    so that the context's full KV blocks are cached before the rows (all started at once) look
    for them."""
    server.complete(context, max_tokens=1)
    drawn: list[list[int]] = []
    while len(drawn) < rows:
        n = min(at_once, rows - len(drawn))
        answer = server.complete(context, max_tokens=length, n=n, temperature=sampling.temperature,
                                 top_k=sampling.top_k, top_p=sampling.top_p, k=k)
        for choice in answer["choices"]:
            tokens = list(choice.get("token_ids") or [])
            if len(tokens) != length:
                raise ServingProbeError(f"vLLM server {server.name} answered {len(tokens)} tokens where "
                                        f"{length} were asked (ignore_eos); its log: {server.log_path}")
            drawn.append(tokens)
    return torch.tensor(drawn[:rows], dtype=torch.long)


def engine_report(server: VllmServer, target, context: list[int], samplings: list[SamplingParams],
                  rows: int, length: int, alpha: float, seed: int = 0,
                  k: int | None = None) -> SamplingReport:
    """The sampling test of one server: every sampling setting, every position (k: the requests'
    own K on a server with K per request; None: the server's K)."""
    threshold = alpha / (len(samplings) * length)
    asked, k = k, int((server.spec or {}).get("num_speculative_tokens", 0)) if k is None else k
    report = SamplingReport(alpha=alpha, rows_per_test=rows)
    at_once = drafting_batch(server.spec)
    for index, sampling in enumerate(samplings):
        tokens = draw(server, context, sampling, rows, length, at_once, k=asked)
        report.tests += position_tests(target, context, tokens, sampling, threshold, k=k,
                                       seed=seed * 31 + index * 7)
    return report


def _summary(report: SamplingReport) -> dict:
    worst = min(report.tests, key=lambda t: t.p_value)
    return {"passed": report.passed, "positions": len(report.tests), "rows": report.rows_per_test,
            "min_p": worst.p_value, "statistic": worst.statistic, "threshold": worst.threshold,
            "failures": [_failure(t) for t in report.failures]}


def _failure(test) -> dict:
    return {"sampling": test.sampling, "position": test.position, "statistic": test.statistic,
            "p_value": test.p_value, "threshold": test.threshold, "rows": test.rows}


def _failure_text(failure: dict) -> str:
    sampling = failure["sampling"]
    setting = f"T{sampling['temperature']:g}" + (f" top-k {sampling['top_k']}" if sampling.get("top_k") else "") + (
        f" top-p {sampling['top_p']:g}" if sampling.get("top_p", 1.0) < 1.0 else "")
    return (f"{setting} position {failure['position']}: G={failure['statistic']:.1f}, "
            f"p={failure['p_value']:.2g} < {failure['threshold']:.2g}")


def verdict(config: SamplingReport, plain: SamplingReport | None,
            first: SamplingReport | None = None) -> tuple[str, bool, str]:
    """(status, passed, reason) of a config's test beside its K 0 control's (see the module);
    first: the failed first draw where `config` is its confirmation."""
    mine = _summary(config)
    before = "" if first is None else (
        f"the first draw of {first.rows_per_test} rows failed at "
        f"{_failure_text(_summary(first)['failures'][0])}; ")
    if mine["passed"]:
        if first is not None:
            return "passed", True, (
                f"vLLM sampling test passed on confirmation: {before}{mine['rows']} fresh rows per "
                f"setting pass all {mine['positions']} G-tests (smallest p {mine['min_p']:.3g}): "
                f"the first draw's failure was a false alarm (alpha {config.alpha:g} per check)")
        return "passed", True, (f"vLLM sampling test passed: {mine['positions']} G-tests of "
                                f"{mine['rows']} rows, smallest p {mine['min_p']:.3g}")
    again = "" if first is None else f"{before}its confirmation of {mine['rows']} fresh rows failed too, "
    failed = _failure_text(mine["failures"][0])
    if plain is None or plain.passed:
        control = "the same server at K 0 passes" if plain is not None else "no K 0 control"
        return "failed", False, (f"vLLM sampling test FAILED with the config at {failed} ({again}{control}): "
                                 "vLLM with this config changes the output distribution")
    return "engine_differs", False, (
        f"vLLM sampling test failed at {failed}{' (' + again.rstrip(', ') + ')' if again else ''}, and the "
        f"same server at K 0 fails too ({_failure_text(_summary(plain)['failures'][0])}): vLLM's own "
        "sampling, or a numeric difference between the engines, departs from the target's distribution; "
        "not called lossless")


@dataclass
class EngineSamplingResult:
    """One domain's sampling test on vLLM."""

    domain: str
    status: str                       # passed | failed | engine_differs | error
    passed: bool
    reason: str
    rows: int | None = None
    positions: int | None = None
    min_p: float | None = None
    shared_from: str | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"domain": self.domain, "status": self.status, "passed": self.passed,
                "reason": self.reason, "rows": self.rows, "positions": self.positions,
                "min_p": self.min_p, "shared_from": self.shared_from}


def _seed(run_id: str, settings: Settings, domain: str) -> int:
    stem = run_id if settings.validation.seed is None else f"seed-{settings.validation.seed}"
    return int.from_bytes(hashlib.sha256(f"{stem}/{domain}/vllm".encode()).digest()[:4], "big") % (2 ** 31)


def validate_on_engine(run_id: str, store: Store, pool: ServerPool, target, specs: dict,
                       requests_by_domain: dict, planned: dict[str, PlannedDomain], settings: Settings,
                       mended: bool = True, save: bool = True,
                       servers: dict | None = None) -> dict[str, EngineSamplingResult]:
    """The sampling test on vLLM of each domain in `specs` ({domain: speculative config}), with
    the same server at K 0 as control; stored (check "engine_sampling"), and a domain that does not pass
    marked failed and unpromotable in domain_configs. planned: {domain: its PlannedDomain}.
    A server that cannot start or dies: the domain's status is "error" (not promotable), the
    reason naming the server's log. save=False: nothing stored (a power test). servers: {domain:
    the speculative config of the server to test it on} (its method's one deployment,
    vllm_export.deployment_specs: each request asks the domain's K; mended servers only), else
    each domain's own config's server."""
    rows = settings.engine.sampling_rows or settings.validation.rows
    length = settings.engine.sampling_tokens
    results: dict[str, EngineSamplingResult] = {}
    done: dict[str, EngineSamplingResult] = {}            # by test key: shared by equal configs
    controls: dict[tuple, SamplingReport | Exception] = {}  # by ((context, samplings), rows)
    for domain in sorted(specs):
        spec = specs[domain]
        requests = requests_by_domain.get(domain) or []
        if not requests:
            continue
        request_id, context = validation_context(target, requests)
        samplings = validation_samplings(requests, settings.validation.samplings)
        base = json.dumps({"context": context, "samplings": [s.to_dict() for s in samplings]})
        # one test per served config and samplings (engine_sampling_scope "config": the verifier
        # is the config's, whichever domain's context), or per domain's own context too
        shared = {"samplings": [s.to_dict() for s in samplings]} \
            if settings.engine.sampling_scope == "config" else base
        key = json.dumps({"spec": spec, "base": shared, "mended": mended}, sort_keys=True)
        if key in done:
            first = done[key]
            results[domain] = EngineSamplingResult(
                domain, first.status, first.passed, first.reason, first.rows, first.positions,
                first.min_p, shared_from=first.domain, details=dict(first.details, shared_from=first.domain))
        else:
            served = (servers or {}).get(domain) if mended else None
            results[domain] = done[key] = _test_domain(
                run_id, domain, pool, target, spec, context, samplings, rows, length, settings,
                controls, base, mended, request_id, served)
        if save:
            _store(store, run_id, results[domain], planned.get(domain), spec, request_id)
    return results


def _test_domain(run_id, domain, pool, target, spec, context, samplings, rows, length, settings,
                 controls, base, mended, request_id, served=None) -> EngineSamplingResult:
    """One domain's sampling test (validate_on_engine) on the server of `spec`, or of `served`
    (its method's deployment) with each request asking `spec`'s K."""
    began = time.perf_counter()
    seed = _seed(run_id, settings, domain)
    what = f"run {run_id}, domain {domain}: sampling test on vLLM"
    k = int(spec["num_speculative_tokens"]) if served is not None else None
    try:
        server = (pool.get(served, mended=mended, block_size=BLOCK_SIZE, share=True)
                  if served is not None else pool.get(spec, mended=mended, block_size=BLOCK_SIZE))
        log.info("%s with %s (%s%s), %d rows x %d tokens at %s, from request %s (%d context tokens)",
                 what, json.dumps(spec, sort_keys=True), server.name,
                 "" if k is None else f" at K {k} per request", rows, length,
                 ", ".join(json.dumps(s.to_dict()) for s in samplings), request_id, len(context))
        report = engine_report(server, target, context, samplings, rows, length,
                               settings.validation.alpha, seed, k=k)
        mends = server.mends()
        log_path = str(server.log_path)
    except (EngineTimeout, ServingProbeError) as exc:
        return EngineSamplingResult(domain, "error", False, f"vLLM sampling test could not run: {exc}"[:1500],
                                    details={"speculative_config": spec, "error": str(exc)[:2000]})
    first = None
    if not report.passed and settings.validation.confirm_factor:
        first, report = report, _confirmation(what, server, target, context, samplings,
                                               rows * settings.validation.confirm_factor, length,
                                               settings.validation.alpha, seed + 2, k)
        if isinstance(report, Exception):
            return EngineSamplingResult(domain, "error", False, (
                f"vLLM sampling test failed its first draw ({_failure_text(_summary(first)['failures'][0])}) "
                f"and its confirmation could not run: {report}")[:1500],
                details={"speculative_config": spec, "error": str(report)[:2000], "first": _summary(first)})
    plain = control = None
    if not report.passed:
        # the control, where the verdict needs it: does vLLM without speculation pass (as many
        # rows as the draws it is set beside)?
        if (base, report.rows_per_test) not in controls:
            try:
                # the same server at K 0 (K per request): vLLM's sampling without speculation
                controls[(base, report.rows_per_test)] = engine_report(
                    server, target, context, samplings, report.rows_per_test, length,
                    settings.validation.alpha, seed + 1, k=0)
            except (EngineTimeout, ServingProbeError) as exc:
                controls[(base, report.rows_per_test)] = exc
        control = controls[(base, report.rows_per_test)]
        plain = control if isinstance(control, SamplingReport) else None
    status, passed, reason = verdict(report, plain, first)
    if control is not None and plain is None:
        reason += f" (the K 0 control could not run: {control})"[:500]
    summary = _summary(report)
    seconds = time.perf_counter() - began
    (log.info if passed else log.error)("%s: %s (%.0f s)", what, reason, seconds)
    return EngineSamplingResult(
        domain, status, passed, reason, rows=report.rows_per_test, positions=summary["positions"],
        min_p=summary["min_p"],
        details={"engine": "vllm", "speculative_config": spec, "mended": mended, "mends": mends,
                 "log": log_path, "tokens": length, "context_tokens": len(context),
                 "samplings": [s.to_dict() for s in samplings], "status": status, "reason": reason,
                 "seconds": seconds, "config": summary, "report": report.to_dict(),
                 "first": None if first is None else _summary(first),
                 "control": None if plain is None else _summary(plain), "shared_from": None})


def _confirmation(what: str, server: VllmServer, target, context: list[int], samplings: list, rows: int,
                  length: int, alpha: float, seed: int, k: int | None) -> SamplingReport | Exception:
    """The failed test drawn again afresh (another seed) at `rows` per setting; the error where
    the server fails it."""
    log.warning("%s: the first draw failed; drawing %d fresh rows per setting to confirm it", what, rows)
    try:
        return engine_report(server, target, context, samplings, rows, length, alpha, seed, k=k)
    except (EngineTimeout, ServingProbeError) as exc:
        return exc


def own_sampling_gates(store: Store, run_id: str) -> list[str]:
    """Where the vLLM test was meant to gate but could not run (the engine check skipped): the
    own-engine sampling test gates again; its failed domains are marked failed and unpromotable.
    The domains so marked."""
    with store.transaction() as tx:
        return fail_own_sampling_domains(tx, run_id)


def own_sampling_fallback(store: Store, run_id: str, domains, target_model, drafters_by_domain: dict,
                          requests_by_domain: dict, settings: Settings) -> list[str]:
    """Where the sampling test on vLLM gates in place of ours (the validate step then leaves
    ours out) but cannot test a domain that is on -- the engine check skipped, or the domain's
    drafter has no vLLM config --, ours runs now for each such domain without one
    (validate_domain), and gates: own_sampling_gates. domains: the domains so left untested.
    The domains marked failed."""
    for domain in sorted(domains):
        if domain in drafters_by_domain and not has_sampling_test(store, run_id, domain):
            log.info("run %s, domain %s: vLLM's sampling test cannot test it: the test on our engine "
                     "runs in its place", run_id, domain)
            validate_domain(run_id, domain, target_model, drafters_by_domain[domain],
                            requests_by_domain.get(domain, []), store, settings=settings)
    return own_sampling_gates(store, run_id)


def _store(store: Store, run_id: str, result: EngineSamplingResult, planned: PlannedDomain | None,
           spec: dict, request_id) -> None:
    details = result.details.get("config") or {}
    row = {"domain": result.domain, "drafter": None if planned is None else planned.drafter,
           "k": int(spec.get("num_speculative_tokens", 0)) if spec else None,
           "request_id": request_id, "passed": result.passed,
           "statistic": min(details.get("statistic", 0.0), 1e308) if details else None,
           "p_value": result.min_p,
           "details": dict(result.details, status=result.status, reason=result.reason)}
    with store.transaction() as tx:
        replace_validations(tx, run_id, CHECK, result.domain, [row])
        if not result.passed:
            mark_validation_failed(tx, run_id, result.domain)


def served_export(run_id: str, store: Store, target: str, model_dir) -> dict:
    """The run's config exported for vLLM (vllm_export) against the served copy of the target,
    after checking that the copy holds the weights the run evaluated."""
    config = build_config(run_id, store)
    served = serving_env.served_fingerprint(model_dir)
    if served is not None and served != config.target.fingerprint:
        raise ServingProbeError(
            f"run {run_id}: the served copy of {target} at {model_dir} has fingerprint {served}, the "
            f"run evaluated {config.target.fingerprint}: delete {model_dir} to have it written again "
            "from the target the run evaluated")
    return vllm_export(config, target_path=str(model_dir))


def validation_domains(planned: dict[str, PlannedDomain], run_id: str, domains: list[str] | None,
                       speculative_config: dict | None) -> list[str]:
    """The domains `specdec engine validate` tests: `domains`, else every planned one with a
    speculative_config given, else the ones the run turns on. InvalidValue (one line, before any
    model is loaded) for a domain the run does not have, or when there is nothing to validate.
    planned: planned_domains' {domain: row}."""
    known = ", ".join(sorted(planned)) or "none"
    if not planned:
        raise InvalidValue(f"run {run_id} has no planned domains: evaluate it first")
    unknown = sorted(set(domains or []) - set(planned))
    if unknown:
        raise InvalidValue(f"--domain {', '.join(unknown)}: run {run_id} has no domain "
                           f"{', '.join(unknown)}; its domains: {known}")
    if domains:
        return list(domains)
    if speculative_config is not None:
        return sorted(planned)
    chosen = sorted(d for d, row in planned.items() if row.enabled)
    if not chosen:
        raise InvalidValue(f"run {run_id} turns no domain on: nothing to validate; name one with "
                           f"--domain (its domains: {known})")
    return chosen


def engine_validate_run(run_id: str, target: str, target_model, requests_by_domain: dict,
                        store: Store, settings: Settings | None = None,
                        domains: list[str] | None = None, speculative_config: dict | None = None,
                        mended: bool = True, pool: ServerPool | None = None) -> dict:
    """`specdec engine validate`: the sampling test on vLLM of a run's configs alone (the domains
    it turns on, or `domains`). speculative_config: served instead of the run's (a power test:
    nothing is stored, the run's verdicts stay as they are). mended=False: vLLM as it ships.
    pool: the run's servers (tasks.steps.model_steps.serving_pool), left to the caller to close;
    else a pool of its own, closed at the end.
    Output: {"domains": {domain: EngineSamplingResult.to_dict()}, "servers": [...]}."""
    settings = settings or store.settings
    model_dir = serving_env.served_model_dir(target)
    planned = planned_domains(store, run_id)
    validation_domains(planned, run_id, domains, speculative_config)
    if speculative_config is not None:
        specs = {d: speculative_config for d in (domains or sorted(planned))}
    else:
        exported = served_export(run_id, store, target, model_dir)["speculative_config"]
        chosen = domains or sorted(d for d, row in planned.items() if row.enabled)
        specs = {d: exported[d] for d in chosen if exported.get(d)}
    own = pool is None
    if own:
        dtype = str(next(target_model.parameters()).dtype).removeprefix("torch.")
        pool = ServerPool(run_id, model_dir, dtype=dtype, settings=settings)
    try:
        results = validate_on_engine(run_id, store, pool, target_model, specs, requests_by_domain,
                                     planned, settings, mended=mended,
                                     save=speculative_config is None)
        servers = [{"server": s.name, "log": str(s.log_path), "start_s": s.start_s, "mends": s.mends()}
                   for s in pool.servers.values()]
    finally:
        if own:
            pool.close()
    return {"domains": {d: r.to_dict() for d, r in results.items()}, "servers": servers}


def engine_validate_in(context, domains: list[str] | None = None, speculative_config: dict | None = None,
                       mended: bool = True, pool: ServerPool | None = None) -> dict:
    """engine_validate_run with a RunContext (tasks.steps.context): the requests of `domains`
    (else of every planned domain) as the run's context gives them, its target, store and
    settings; pool: as engine_validate_run's."""
    planned = domain_names(context.store, context.run_id)
    chosen = [d for d in (domains or planned) if d in planned]
    return engine_validate_run(context.run_id, context.spec.target, context.model,
                               {d: context.domain_requests(d)[0] for d in chosen},
                               context.store, settings=context.settings, domains=domains,
                               speculative_config=speculative_config, mended=mended, pool=pool)
