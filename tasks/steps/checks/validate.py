"""Losslessness of a run's config: the three checks of docs/design.md ("What output unchanged means"), stored by run id.

- sampling (per domain, with the domain's planned setting): specdec_core.validation.sampling_check
  from a context drawn from the domain's sample: K in {1, planned K}, 3-token continuations, at
  the sampling settings of the domain's traffic (its `validation_samplings` most frequent
  non-greedy ones; the engine's defaults -- plain, temperature 0.7, temperature 1.3 with top-p
  0.9 -- for all-greedy traffic), G-tests Bonferroni-corrected to a false-alarm rate of
  `validation_alpha` per check. The context is the sampled prompt plus the prefix of its logged
  response at which the target's next-token entropy is highest (a peaked distribution gives the
  test nothing to see). Unless `validation_per_domain`, a domain whose drafter, planned K and
  sampling settings all equal those of a domain already tested in the run shares that test
  ("shared_from" in its details); any difference runs a test of its own.
- greedy (once per run): speculative greedy output equals plain greedy output over sampled
  requests of every enabled domain; a divergence passes only at a near-tie (top-2 margin < 1e-4).
- fingerprint (once per run): the target's fingerprint; its canary log-probabilities must agree
  with the last run that measured the same weights, and the sample must hold traffic of this target.
A domain whose check fails is never promotable; the stored details name the domain, position and
test statistic.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch
from specdec_core import SamplingParams
from specdec_core.validation import (DEFAULT_VALIDATION_SAMPLING, compare_fingerprints, fingerprint_id,
                                     greedy_check, sampling_check, target_fingerprint)

from ...db.queries_runs import domain_config
from ...db.queries_validations import (fingerprint_run, other_sampling_tests, replace_validations,
                                       sampling_results, set_domain_verdict, set_run_target)
from ...db.store import Store
from ...serving import environment as serving_env
from ...settings import Settings

log = logging.getLogger(__name__)


DEFERRED = ("the sampling test on vLLM's OpenAI server gates this run (in the engine check); ours "
            "runs there only for a domain vLLM's cannot test")


def engine_sampling_gates(settings: Settings) -> bool:
    """Whether the sampling test on vLLM (tasks.steps.checks.engine_validate, run by the engine check)
    gates this run's promotion in place of the own-engine one: the engine check and its sampling
    test are on and a serving environment exists."""
    return settings.engine.check and settings.engine.sampling and serving_env.available(settings)


def validation_context(target, requests: list, candidates: int = 4):
    """(request id, token ids) of the highest-entropy context among the first `candidates`
    requests: prompt + response prefix, cut where the target's next-token entropy peaks."""
    device = next(target.parameters()).device
    best = (-1.0, None, None)
    with torch.inference_mode():
        for request in requests[:candidates]:
            ids = list(request.prompt_ids) + list(request.response_ids)
            logits = target(torch.tensor([ids], device=device)).logits[0, len(request.prompt_ids) - 1:]
            logp = logits.float().log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1)
            cut = int(entropy.argmax())
            if float(entropy[cut]) > best[0]:
                best = (float(entropy[cut]), request.request_id, ids[: len(request.prompt_ids) + cut])
    return best[1], best[2]


def validation_samplings(requests: list, limit: int) -> list[SamplingParams]:
    """The sampling settings a domain's sampling test runs at: the distinct non-greedy settings
    of its sampled requests (what it serves; greedy rows are the greedy check's), the `limit` most
    frequent, in a canonical order (so equal sets compare equal). A domain whose traffic is all
    greedy gets the engine's defaults (specdec_core.validation.DEFAULT_VALIDATION_SAMPLING)."""
    counts = Counter(request.sampling for request in requests if not request.sampling.greedy)
    chosen = [sampling for sampling, _ in sorted(counts.items(), key=lambda item: (
        -item[1], item[0].temperature, item[0].top_k, item[0].top_p))[:limit]]
    if not chosen:
        return list(DEFAULT_VALIDATION_SAMPLING)
    return sorted(chosen, key=lambda s: (s.temperature, s.top_k, s.top_p))


def _drafter_identity(label: str, drafter) -> str:
    """The drafter as this domain uses it (Drafter.identity: its label, and for one with an index
    a digest of the requests the index holds; a run's per-domain indexes share one label)."""
    return drafter.identity(label)


def _sampling_text(sampling: dict) -> str:
    text = f"T{sampling['temperature']:g}"
    if sampling.get("top_k"):
        text += f" top-k {sampling['top_k']}"
    if sampling.get("top_p", 1.0) < 1.0:
        text += f" top-p {sampling['top_p']:g}"
    return text

@dataclass
class _SamplingTest:
    """One domain's sampling test: what it runs, and the key another domain's test is shared by."""
    run_id: str
    domain: str
    label: str                 # the planned drafter's label
    drafter: object            # the planned drafter, as this domain uses it
    k: int
    ks: list[int]
    samplings: list[SamplingParams]
    key: dict
    what: str                  # what is tested, for the log


def _sampling_test(run_id: str, domain: str, config, drafters: dict, requests: list,
                   settings: Settings) -> _SamplingTest:
    """The sampling test of the domain's planned setting (its key: drafter as the domain uses it,
    planned K, K tested, sampling settings)."""
    drafter = drafters[config["drafter"]][1]
    k = int(config["k"])
    ks = sorted({1, k})
    samplings = validation_samplings(requests, settings.validation.samplings)
    key = {"drafter": _drafter_identity(config["drafter"], drafter), "k": k, "ks": ks,
           "samplings": [sampling.to_dict() for sampling in samplings]}
    what = (f"{config['drafter']} K={k} (tested at K {', '.join(map(str, ks))}) at "
            + ", ".join(_sampling_text(item) for item in key["samplings"]))
    return _SamplingTest(run_id, domain, config["drafter"], drafter, k, ks, samplings, key, what)


def _shared_test(store: Store, test: _SamplingTest):
    """The first stored sampling test of another domain of the run with the test's key (and itself
    not shared), or None."""
    for row in other_sampling_tests(store, test.run_id, test.domain):
        details = row["details"] or {}
        if not details.get("shared_from") and details.get("key") == test.key:
            return row
    return None


def _store_shared(store: Store, test: _SamplingTest, shared) -> dict:
    """Store another domain's test as this domain's (details name it in "shared_from")."""
    run_id, domain = test.run_id, test.domain
    row = {name: shared[name] for name in ("drafter", "k", "request_id", "passed", "statistic",
                                           "p_value")}
    row.update(domain=domain, details={"shared_from": shared["domain"], "key": test.key, "ks": test.ks,
                                       "samplings": test.key["samplings"],
                                       "failures": (shared["details"] or {}).get("failures", []),
                                       "first": (shared["details"] or {}).get("first")})
    with store.transaction() as tx:
        replace_validations(tx, run_id, "sampling", domain, [row])
    log.info("run %s, domain %s: sampling test of %s shared from %s (same drafter, K and sampling "
             "settings): %s", run_id, domain, test.what, shared["domain"],
             "passed" if row["passed"] else "FAILED")
    return {"domain": domain, "validation": "passed" if row["passed"] else "failed",
            "shared_from": shared["domain"], "failures": row["details"]["failures"], "key": test.key,
            "seconds": 0.0}


def _run_sampling_test(store: Store, target, requests: list, test: _SamplingTest, settings: Settings,
                       check_kwargs: dict | None) -> dict:
    """Run the domain's own sampling test from a high-entropy context of its requests; store it."""
    run_id, domain = test.run_id, test.domain
    started = time.perf_counter()
    request_id, context = validation_context(target, requests)
    stem = run_id if settings.validation.seed is None else f"seed-{settings.validation.seed}"
    seed = int.from_bytes(hashlib.sha256(f"{stem}/{domain}".encode()).digest()[:4], "big") % (2 ** 31)
    rows = settings.validation.rows
    first, report = None, _draw(target, test, context, rows, settings, seed, check_kwargs)
    if not report.passed and settings.validation.confirm_factor:
        # drawn again afresh at more rows, and that decides (validation_confirm_factor)
        rows *= settings.validation.confirm_factor
        log.warning("run %s, domain %s: the sampling test's first draw failed; drawing %d fresh rows "
                    "to confirm it", run_id, domain, rows)
        first, report = report, _draw(target, test, context, rows, settings, seed + 1, check_kwargs)
    seconds = time.perf_counter() - started
    failures = [{"domain": domain, **failure} for failure in _failures(report)]
    worst = min(report.tests, key=lambda t: t.p_value)
    row = {"domain": domain, "drafter": test.label, "k": test.k, "request_id": request_id,
           "passed": report.passed,
           "statistic": worst.statistic if worst.statistic != float("inf") else 1e308,
           "p_value": worst.p_value,
           "details": {"shared_from": None, "key": test.key, "ks": test.ks,
                       "samplings": test.key["samplings"], "context_tokens": len(context),
                       "seconds": seconds, "failures": failures, "report": report.to_dict(),
                       "first": None if first is None else _first_draw(first)}}
    with store.transaction() as tx:
        replace_validations(tx, run_id, "sampling", domain, [row])
    log.info("run %s, domain %s: sampling test of %s from request %s (%d context tokens): %s; %d "
             "G-tests of %d rows, smallest p %.3g (threshold %.3g); %.1f s", run_id, domain, test.what,
             request_id, len(context), ("passed" if report.passed else "FAILED") + (
                 "" if first is None else " on confirmation (the first draw failed)"), len(report.tests),
             report.rows_per_test, worst.p_value, worst.threshold, seconds)
    if failures:
        failed = failures[0]
        log.error("run %s, domain %s: sampling test FAILED at K=%d %s position %d: G=%.1f, p=%.2g < %.2g",
                  run_id, domain, failed["k"], failed["sampling"], failed["position"], failed["statistic"],
                  failed["p_value"], failed["threshold"])
    return {"domain": domain, "validation": "passed" if report.passed else "failed",
            "shared_from": None, "failures": failures, "key": test.key, "seconds": seconds}


def _draw(target, test: _SamplingTest, context, rows: int, settings: Settings, seed: int, check_kwargs):
    """One draw of the domain's sampling test: `rows` per (K, sampling)."""
    return sampling_check(target, test.drafter, context, ks=tuple(test.ks), samplings=tuple(test.samplings),
                          rows=rows, alpha=settings.validation.alpha, seed=seed,
                          chunk=settings.validation.rows, **(check_kwargs or {}))


def _failures(report) -> list[dict]:
    """A draw's failed G-tests as the stored details keep them."""
    return [{"k": t.k, "sampling": t.sampling, "position": t.position, "statistic": t.statistic,
             "p_value": t.p_value, "threshold": t.threshold} for t in report.failures]


def _first_draw(report) -> dict:
    """A failed first draw as the stored details keep it beside its confirmation."""
    return {"rows": report.rows_per_test, "passed": report.passed, "failures": _failures(report)}


def validate_domain(run_id: str, domain: str, target, drafters: dict, requests: list,
                    store: Store, settings: Settings | None = None,
                    check_kwargs: dict | None = None, defer: bool = False) -> dict:
    """Run (or share) the sampling test of the domain's planned setting; store it.

    The test is the domain's own: its planned drafter at K in {1, planned K} (K = 1 covers the
    bonus token), at the sampling settings of its traffic (validation_samplings), from a
    high-entropy context of its sampled requests. It is shared only with another domain of the
    run whose test has the same key -- drafter (as that domain uses it), planned K and sampling
    settings -- and never when `validation_per_domain`; the stored details say "shared_from".
    check_kwargs: extra arguments of sampling_check (fault injection: specdec_core.faults).
    defer: the sampling test on vLLM gates this run (engine_sampling_gates): a domain on gets
    none here ("deferred"; the engine check runs it where vLLM's cannot take the domain:
    tasks.steps.checks.engine_validate.own_sampling_fallback).
    Output: {"domain", "validation": passed | failed | not_needed | deferred, "shared_from",
    "failures", "key", "seconds"}; a stored test of the domain from an earlier try of the run
    is removed where none is run.
    """
    settings = settings or store.settings
    config = domain_config(store, run_id, domain)
    off = config is None or not config["enabled"]
    if off or defer:
        with store.transaction() as tx:
            replace_validations(tx, run_id, "sampling", domain, [])
        if off:
            log.info("run %s, domain %s: sampling test not needed (the domain is off)", run_id, domain)
        else:
            log.info("run %s, domain %s: sampling test on our engine not run: %s", run_id, domain, DEFERRED)
        return {"domain": domain, "validation": "not_needed" if off else "deferred", "shared_from": None,
                "failures": [], "key": None, "seconds": 0.0}
    test = _sampling_test(run_id, domain, config, drafters, requests, settings)
    shared = None if settings.validation.per_domain else _shared_test(store, test)
    if shared is not None:
        return _store_shared(store, test, shared)
    return _run_sampling_test(store, target, requests, test, settings, check_kwargs)


def validate_in(context, domain: str, defer: bool = False) -> dict:
    """validate_domain with a RunContext (tasks.steps.context): the domain's requests and
    candidates as the run's context gives them, its store and settings; defer: as
    validate_domain's."""
    requests, _ = context.domain_requests(domain)
    return validate_domain(context.run_id, domain, context.model, context.domain_drafters(domain),
                           requests, context.store, settings=context.settings,
                           **({"defer": True} if defer else {}))


@dataclass
class _FingerprintCheck:
    """The run's fingerprint check: its verdict, why it failed, the last run that measured the
    same weights, and the validations row to store."""
    passed: bool
    reasons: list[str]
    previous_run: str | None
    row: dict


def _fingerprint_check(fingerprint: dict, fid: str, target_id: str, previous, requests_by_domain: dict,
                       excluded: dict | None) -> _FingerprintCheck:
    """Canary log-probabilities against the last run of the same weights, and the sample holds
    traffic of this target."""
    comparison = None
    passed = True
    reasons = []
    if previous is not None and previous.details and "fingerprint" in previous.details:
        comparison = compare_fingerprints(previous.details["fingerprint"], fingerprint)
        if not comparison["same_model"]:
            passed = False
            reasons.append(f"same weights as run {previous.run_id} but canary log-probabilities differ "
                           f"by {comparison['canary_max_abs_diff']:.3g} > {comparison['tolerance']}")
    usable = sum(len(items) for items in requests_by_domain.values())
    if usable == 0:
        passed = False
        reasons.append("no sampled request was answered by this target "
                       f"({len((excluded or {}).get('other_fingerprint', []))} from other fingerprints)")
    previous_run = previous.run_id if previous else None
    row = {"domain": None, "drafter": None, "k": None, "request_id": None,
           "passed": passed, "statistic": comparison["canary_max_abs_diff"] if comparison else None,
           "p_value": None,
           "details": {"fingerprint": fingerprint, "id": fid, "target": target_id,
                       "previous_run": previous_run,
                       "comparison": comparison, "reasons": reasons,
                       "excluded_other_fingerprint": len((excluded or {}).get("other_fingerprint", []))}}
    return _FingerprintCheck(passed, reasons, previous_run, row)


def _greedy_check_domain(run_id: str, domain: str, config: dict, target, drafter, requests: list,
                         pad: int, settings: Settings) -> dict:
    """Greedy check of one enabled domain on its first requests (left-padded); its validations row."""
    device = next(target.parameters()).device
    subset = requests[: settings.validation.greedy_check_requests]
    width = max(len(r.prompt_ids) for r in subset)
    ids = torch.full((len(subset), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, request in enumerate(subset):
        ids[i, width - len(request.prompt_ids):] = torch.tensor(list(request.prompt_ids))
        mask[i, width - len(request.prompt_ids):] = 1
    report = greedy_check(target, drafter, int(config["k"]), ids.to(device),
                          mask.to(device), max_new_tokens=settings.validation.greedy_check_tokens)
    divergences = [dict(d.__dict__, request_id=subset[d.row].request_id) for d in report.divergences]
    failed = [d for d in divergences if not d["acceptable"]]
    if failed:
        log.error("run %s, domain %s: greedy output differs from plain decoding at request %s step "
                  "%d (margin %.3g)", run_id, domain, failed[0]["request_id"], failed[0]["step"],
                  failed[0]["margin"])
    return {"domain": domain, "drafter": config["drafter"], "k": config["k"],
            "request_id": failed[0]["request_id"] if failed else None,
            "passed": report.passed, "statistic": None, "p_value": None,
            "details": {"rows": report.rows, "tokens": report.tokens,
                        "exact_rows": report.exact_rows, "divergences": divergences}}


def _greedy_checks(run_id: str, configs: dict, target, tokenizer, drafters: dict,
                   drafters_by_domain: dict | None, requests_by_domain: dict,
                   settings: Settings) -> list[dict]:
    """The greedy check of every enabled domain with requests, by domain: its validations rows."""
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    rows = []
    for domain, config in sorted(configs.items()):
        if not config["enabled"] or not requests_by_domain.get(domain):
            continue
        candidates = (drafters_by_domain or {}).get(domain, drafters)
        rows.append(_greedy_check_domain(run_id, domain, config, target, candidates[config["drafter"]][1],
                                         requests_by_domain[domain], pad, settings))
    return rows


def _store_verdicts(store: Store, run_id: str, configs: dict, fingerprint: _FingerprintCheck,
                    greedy_rows: list[dict], target_id: str, fid: str, vllm_gates: bool) -> dict:
    """One transaction: the fingerprint and greedy rows, each domain's verdict and promotability,
    and the run's target. Output: {domain: verdict}."""
    greedy = {row["domain"]: row["passed"] for row in greedy_rows}
    with store.transaction() as tx:
        sampling = sampling_results(tx, run_id)
        replace_validations(tx, run_id, "fingerprint", None, [fingerprint.row])
        replace_validations(tx, run_id, "greedy", None, greedy_rows)
        verdicts = {}
        for domain, config in configs.items():
            if not config["enabled"]:
                verdict, promotable = "not_needed", fingerprint.passed
            else:
                # where the sampling test on vLLM gates (the engine check, after this step), the
                # own-engine one is reported, not gated (our sampler is exact by construction)
                own = True if vllm_gates else sampling.get(domain)
                checks = [own, greedy.get(domain), fingerprint.passed]
                verdict = "passed" if all(c is True for c in checks) else (
                    "failed" if any(c is False for c in checks) else "incomplete")
                promotable = verdict == "passed"
            verdicts[domain] = verdict
            set_domain_verdict(tx, run_id, domain, verdict, promotable)
        set_run_target(tx, run_id, target_id, fid)
    return verdicts


def validate_run(run_id: str, target, tokenizer, drafters: dict, requests_by_domain: dict,
                 target_id: str, store: Store, settings: Settings | None = None,
                 excluded: dict | None = None, fingerprint: dict | None = None,
                 drafters_by_domain: dict | None = None) -> dict:
    """Fingerprint and greedy checks once per run, then each domain's verdict and promotability.

    fingerprint: the target's target_fingerprint() when already computed (it digests every weight).
    drafters_by_domain: {domain: candidates} where a domain's drafters differ from `drafters`
    (a suffix candidate's per-domain index).
    Output: {"fingerprint": {...}, "greedy": {domain: passed}, "domains": {domain: validation}}.
    """
    settings = settings or store.settings
    fingerprint = fingerprint or target_fingerprint(target)
    fid = fingerprint_id(fingerprint)
    previous, configs = fingerprint_run(store, run_id, fid)
    checked = _fingerprint_check(fingerprint, fid, target_id, previous, requests_by_domain, excluded)
    greedy_rows = _greedy_checks(run_id, configs, target, tokenizer, drafters, drafters_by_domain,
                                 requests_by_domain, settings)
    vllm_gates = engine_sampling_gates(settings)
    verdicts = _store_verdicts(store, run_id, configs, checked, greedy_rows, target_id, fid, vllm_gates)
    return {"fingerprint": {"id": fid, "passed": checked.passed, "reasons": checked.reasons,
                            "previous_run": checked.previous_run},
            "greedy": {row["domain"]: row["passed"] for row in greedy_rows}, "domains": verdicts}


def validate_run_in(context, domains: list[str]) -> tuple[dict, dict]:
    """validate_run with a RunContext (tasks.steps.context) over `domains` (the run's ok ones):
    their sample as the context reads it, the run's candidates and each domain's, the target's
    fingerprint. Output: (validate_run's output, the sample's excluded rows by reason)."""
    requests, excluded = ({}, {}) if not domains else context.sample_requests(domains)
    verdicts = validate_run(context.run_id, context.model, context.tokenizer, context.drafters,
                            requests, target_id=context.spec.target, store=context.store,
                            settings=context.settings, excluded=excluded,
                            fingerprint=context.target_fingerprint,
                            drafters_by_domain={d: context.domain_drafters(d) for d in domains})
    return verdicts, excluded
