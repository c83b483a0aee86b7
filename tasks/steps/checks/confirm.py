"""Live confirmation: real speculative decoding with the planned config against plain decoding.

Which requests: `live_requests` of the domain's sample, stratified on their offline E (the
planned drafter at the planned K): ranked by E and taken at evenly spaced quantiles, so a few
requests stand for the domain instead of happening to be its easiest or hardest.

How: batch 1, each request with its own logged sampling params and up to its logged response
length (at most confirm_max_new_tokens); plain and speculative decoding alternate request by
request (the order flips every request, so drift of the machine hits both alike). Speedup is
decode-phase tokens/s over plain's; end-to-end latency (prefill included) is stored beside it.

Two errors, kept apart:
- cost-model error: the measured speedup against the prediction for the SAME requests (their own
  offline estimate -- rounds and draft widths of the truncated responses -- through the planner's
  cost formula). This is what the live run can check, and what the gap flag fires on.
- sampling error: the subset's offline E against the domain's E (a few requests are not the
  domain); reported, never flagged.
Greedy rows are checked for consistency: where the live output equals the logged response, the
live accepted count and rounds must equal the offline estimate's exactly; any difference is an
engine/estimator inconsistency and is logged and stored with the request.
Runs under the timing lock.

Hardware: live timings check costs only on the hardware class they were measured on (device and
dtype). When the run measured its own cost profile (its profile task), confirm on a worker of
another class is refused (HardwareMismatch, naming both: route profile and confirm to one class
of worker). A stored profile (`--hardware-profile`) plans for its hardware from anywhere; on a
worker of another class, confirm is skipped with a warning (nothing to compare).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from specdec_core import SpecDecoder, SpecStats
from specdec_core.estimate import LoggedRequest, estimate_acceptance

from ...db.queries_live import run_hardware, store_live_measurement
from ...db.queries_runs import domain_config
from ...db.store import Store
from ...registry.live_check import LiveVerdict, judge_live
from ...settings import Settings, worker_name
from ..costs.costs import (CostProfileError, HardwareMismatch, describe_hardware, hardware_text, run_costs,
                           same_hardware, timing_lock)
from ..plan.plan import speedup_factor

log = logging.getLogger(__name__)

WEAK_EVIDENCE = 5     # confirm requests below which a live verdict says its evidence is weak


def _stratified(requests: list, values: list[float], count: int) -> list:
    """`count` requests at evenly spaced quantiles of `values` (ties keep the sample's order)."""
    if count >= len(requests):
        return list(requests)
    order = sorted(range(len(requests)), key=lambda i: values[i])
    picks = sorted({order[min(len(order) - 1, int((j + 0.5) * len(order) / count))]
                    for j in range(count)})
    return [requests[i] for i in picks]


def truncated(request, new_tokens: int):
    return LoggedRequest(request.request_id, request.prompt_ids, list(request.response_ids)[:new_tokens],
                         request.sampling, request.domain)


def offline_totals(target, drafter, requests: list, k: int) -> dict:
    """{request id: RoundTotals} of the planned drafter at K (requests of 2+ response tokens)."""
    usable = [r for r in requests if len(r.response_ids) >= 2]
    if not usable:
        return {}
    pooled = [truncated(r, len(r.response_ids)) for r in usable]
    for request in pooled:
        request.domain = "all"
    estimate = estimate_acceptance(target, drafter, pooled, [k], progress=False, n_boot=100)
    return {r.request_id: totals for r, totals in zip(usable, estimate["all"][k].per_request)}


def _round_costs(run_id: str, store: Store, drafter_label: str, drafter_spec: dict | None):
    """f(RoundTotals) -> expected cost of its rounds in target steps at batch 1; None without a
    cost profile."""
    costs = run_costs(run_id, store)
    if costs is None:
        return None
    try:
        costs.draft_ratio(drafter_label, 1)     # the profile has this drafter's step
    except CostProfileError:
        return None

    def cost(totals) -> float:   # in plain-decoding steps (overheads included)
        return totals.rounds / speedup_factor(drafter_label, drafter_spec, totals.width_share, costs, 1)
    return cost


def confirm_hardware(run_id: str, domain: str, store: Store, target) -> dict | None:
    """This worker's hardware description (stored with the live measurement), or None when the
    run plans with a stored profile of another hardware class (confirm is skipped). Raises
    HardwareMismatch when the run's own profile was measured on another class."""
    here = dict(describe_hardware(target), worker=worker_name())
    run, stored = run_hardware(store, run_id)
    profile = None if run is None else run["hardware_profile"]
    if profile is None:
        return here          # no cost profile: nothing is compared
    worker = run["worker_hardware"] or {}
    if worker.get("measured"):
        if not same_hardware(here, worker):
            raise HardwareMismatch(
                f"run {run_id}, domain {domain}: its cost profile {profile!r} was measured on "
                f"{hardware_text(worker)}, but confirm runs on {hardware_text(here)}: live timings "
                "on one hardware class cannot check costs measured on another. Route the profile "
                "and confirm tasks to workers of one hardware class (both take the queue "
                "`queues_gpu`; give each class of GPU worker its own queue), or plan with a stored "
                "profile of the serving hardware (`plan_hardware_profile`).")
        return here
    if stored is not None and not same_hardware(here, dict(stored)):
        log.warning("run %s, domain %s: confirm skipped: the plan is for hardware profile %r (%s), "
                    "this worker is %s; live timings here cannot check it (run confirm on that "
                    "hardware class to compare)", run_id, domain, profile, hardware_text(dict(stored)),
                    hardware_text(here))
        return None
    return here


@dataclass
class _Planned:
    """The domain's planned setting that confirm measures."""
    run_id: str
    domain: str
    config: Mapping            # its domain_configs row
    drafter: object            # the planned drafter, built on the target
    k: int
    hardware: dict             # this worker's hardware description


@dataclass
class _Selection:
    """The confirm requests and their offline estimates."""
    subset: list
    lengths: dict              # request id -> new tokens to decode
    whole: dict                # request id -> RoundTotals of the whole logged response
    decoded: dict              # request id -> RoundTotals of what is decoded


@dataclass
class _LiveRun:
    """Plain and speculative decoding of the confirm requests, summed, and each request's record."""
    plain: SpecStats
    spec: SpecStats
    plain_latency: float
    spec_latency: float
    per_request: list[dict]


def _planned(run_id: str, domain: str, store: Store, target, drafters: dict, requests: list) -> _Planned | None:
    """The domain's planned setting, or None without a plan, requests or comparable hardware."""
    config = domain_config(store, run_id, domain)
    if config is None or config["drafter"] is None or config["status"] != "ok" or not requests:
        return None
    hardware = confirm_hardware(run_id, domain, store, target)
    if hardware is None:
        return None
    return _Planned(run_id, domain, config, drafters[config["drafter"]][1], int(config["k"]), hardware)


def _select(target, planned: _Planned, requests: list, settings: Settings) -> _Selection:
    """Stratify on the requests' own offline E, then estimate exactly what will be decoded."""
    whole = offline_totals(target, planned.drafter, requests, planned.k)
    candidates = [r for r in requests if r.request_id in whole] or list(requests)
    subset = _stratified(candidates, [whole[r.request_id].expected_tokens_per_round
                                      if r.request_id in whole else 0.0 for r in candidates],
                         settings.live.requests)
    lengths = {r.request_id: min(len(r.response_ids), settings.live.max_new_tokens) for r in subset}
    # only a response cut at confirm_max_new_tokens needs an estimate of its own
    cut = [r for r in subset if lengths[r.request_id] < len(r.response_ids)]
    cut_ids = {r.request_id for r in cut}
    decoded = {r.request_id: whole[r.request_id] for r in subset
               if r.request_id in whole and r.request_id not in cut_ids}
    decoded.update(offline_totals(target, planned.drafter,
                                  [truncated(r, lengths[r.request_id]) for r in cut], planned.k))
    return _Selection(subset, lengths, whole, decoded)


def _decode_live(target, planned: _Planned, selection: _Selection, cost_of, progress: bool) -> _LiveRun:
    """Plain and speculative decoding request by request, alternating which goes first, under the
    timing lock."""
    device = next(target.parameters()).device
    spec_decoder = SpecDecoder(target, planned.drafter, k=planned.k)
    live = _LiveRun(SpecStats.empty(0), SpecStats.empty(planned.k), 0.0, 0.0, [])
    with timing_lock():
        for index, request in enumerate(tqdm(selection.subset, desc=f"confirm {planned.domain}",
                                             disable=not progress)):
            ids = torch.tensor([list(request.prompt_ids)], dtype=torch.long, device=device)
            new_tokens = selection.lengths[request.request_id]
            kwargs = dict(max_new_tokens=new_tokens, sampling=request.sampling, seed=index)
            order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
            results = {}
            for which in order:
                if which == "plain":
                    results[which] = spec_decoder.generate_plain(ids, **kwargs)
                    live.plain = live.plain.merge(results[which].stats)
                    live.plain_latency += results[which].stats.total_s
                else:
                    results[which] = spec_decoder.generate(ids, **kwargs)
                    live.spec = live.spec.merge(results[which].stats)
                    live.spec_latency += results[which].stats.total_s
            live.per_request.append(_request_record(request, results,
                                                    selection.decoded.get(request.request_id),
                                                    cost_of, new_tokens))
    return live


def _predicted_same(selection: _Selection, cost_of) -> float | None:
    """The cost model's speedup for exactly the decoded requests (None without a cost profile)."""
    scored = [selection.decoded[r.request_id] for r in selection.subset
              if r.request_id in selection.decoded]
    if cost_of is None or not scored:
        return None
    spent = sum(cost_of(t) for t in scored)
    return sum(t.tokens for t in scored) / spent if spent > 0 else None


def _subset_expected_tokens(selection: _Selection) -> float | None:
    """Offline E of the confirm requests (their whole logged responses)."""
    chosen = [selection.whole[r.request_id] for r in selection.subset if r.request_id in selection.whole]
    return (sum(t.tokens for t in chosen) / sum(t.rounds for t in chosen)
            if chosen and sum(t.rounds for t in chosen) else None)


def _measurement(planned: _Planned, selection: _Selection, live: _LiveRun, cost_of,
                 settings: Settings) -> tuple[dict, dict]:
    """(the live_measurements row, the live verdict)."""
    config, subset = planned.config, selection.subset
    plain_tps, spec_tps = live.plain.decode_tokens_per_s, live.spec.decode_tokens_per_s
    measured = spec_tps / plain_tps if plain_tps > 0 else None
    same = _predicted_same(selection, cost_of)
    cost_error = measured / same - 1.0 if measured is not None and same else None
    subset_e = _subset_expected_tokens(selection)
    domain_e = config["mean_accepted_length"]
    sampling_error = subset_e / domain_e - 1.0 if subset_e and domain_e else None
    greedy = [item for item in live.per_request if item["greedy_comparable"]]
    gap = None if cost_error is None else abs(cost_error) > settings.live.tolerance
    verdict = live_verdict(live.per_request, config, settings, same)
    row = {"run_id": planned.run_id, "domain": planned.domain, "drafter": config["drafter"],
           "k": planned.k, "batch_size": 1,
           "requests": len(subset), "tokens": int(live.spec.new_tokens),
           "acceptance_rate": live.spec.acceptance_rate,
           "mean_accepted_length": live.spec.mean_accepted_length,
           "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
           "predicted_speedup": config["predicted_speedup"], "measured_speedup": measured,
           "plain_latency_s": live.plain_latency / len(subset),
           "spec_latency_s": live.spec_latency / len(subset),
           "gap": gap, "predicted_same_requests": same, "cost_model_error": cost_error,
           "subset_expected_tokens": subset_e, "domain_expected_tokens": domain_e,
           "sampling_error": sampling_error, "greedy_checked": len(greedy),
           "greedy_consistent": sum(1 for item in greedy if item["consistent"]),
           "per_request": live.per_request, "hardware": planned.hardware,
           "measured_speedup_lo": verdict.get("lo"), "measured_speedup_hi": verdict.get("hi")}
    return row, verdict


def _store_measurement(store: Store, planned: _Planned, row: dict, verdict: dict) -> None:
    """One transaction: the live measurement replaced, and the measured speedup and live check on
    the domain's config (a veto turns it off: the champion's setting)."""
    values = {"measured_speedup": row["measured_speedup"], "live_check": verdict}
    if LiveVerdict.read(verdict["verdict"]) is LiveVerdict.VETO:     # the domain stays at the champion's setting: off
        values.update(enabled=False, max_batch_size=None, k_schedule=None,
                      reason=f"{verdict['reason']}; the champion's setting is kept (off). "
                             f"Planner: {planned.config['reason']}"[:2000])
    store_live_measurement(store, planned.run_id, planned.domain, row, values)


def _log_measurement(planned: _Planned, row: dict, verdict: dict, settings: Settings) -> None:
    """A veto, each greedy request whose live rounds differ from the estimate's, a cost-model gap."""
    run_id, domain = planned.run_id, planned.domain
    if LiveVerdict.read(verdict["verdict"]) is LiveVerdict.VETO:
        log.warning("run %s, domain %s: %s; it stays off (the champion's setting)", run_id, domain,
                    verdict["reason"])
    for item in row["per_request"]:
        if item["greedy_comparable"] and not item["consistent"]:
            log.error("run %s, domain %s, request %s: engine/estimator inconsistency -- live greedy "
                      "output equals the log but accepted %d drafts in %d rounds, the estimate %s in %s",
                      run_id, domain, item["request_id"], item["live_accepted"], item["live_rounds"],
                      item["offline_accepted"], item["offline_rounds"])
    if row["gap"]:
        log.warning("run %s, domain %s: measured speedup %.2fx vs %.2fx predicted for the same requests "
                    "(cost-model error %+.0f%%, tolerance %.0f%%)", run_id, domain,
                    row["measured_speedup"], row["predicted_same_requests"],
                    100 * row["cost_model_error"], 100 * settings.live.tolerance)


def confirm_domain(run_id: str, domain: str, target, drafters: dict, requests: list,
                   store: Store, settings: Settings | None = None,
                   progress: bool = True) -> dict | None:
    """Measure the domain's planned (drafter, K) live; store live_measurements and the measured
    speedup in domain_configs. A domain that is off still has its best candidate measured (the
    prediction is checked either way). Returns the measurement, or None without a plan/requests.
    """
    settings = settings or store.settings
    planned = _planned(run_id, domain, store, target, drafters, requests)
    if planned is None:
        return None
    selection = _select(target, planned, requests, settings)
    cost_of = _round_costs(run_id, store, planned.config["drafter"], planned.config["drafter_spec"])
    live = _decode_live(target, planned, selection, cost_of, progress)
    row, verdict = _measurement(planned, selection, live, cost_of, settings)
    _store_measurement(store, planned, row, verdict)
    _log_measurement(planned, row, verdict, settings)
    return row


def confirm_in(context, domain: str, progress: bool = False) -> dict | None:
    """confirm_domain with a RunContext (tasks.steps.context): the domain's requests and
    candidates as the run's context gives them, its store and settings."""
    requests, _ = context.domain_requests(domain)
    return confirm_domain(context.run_id, domain, context.model, context.domain_drafters(domain),
                          requests, context.store, settings=context.settings, progress=progress)


def _request_record(request, results: dict, offline, cost_of, new_tokens: int) -> dict:
    """Predicted and measured speedup of one confirm request side by side, and for a greedy row
    whether its live rounds equal the offline estimate's."""
    plain, spec = results["plain"].stats, results["spec"].stats
    measured = (spec.decode_tokens_per_s / plain.decode_tokens_per_s
                if plain.decode_tokens_per_s > 0 else None)
    predicted = None
    if offline is not None and cost_of is not None and cost_of(offline) > 0:
        predicted = offline.tokens / cost_of(offline)
    logged = list(request.response_ids)[:new_tokens]
    live = results["spec"].tokens[0, : results["spec"].num_tokens[0]].tolist()
    comparable = bool(request.sampling.greedy) and offline is not None and live == logged
    first_difference = next((i for i, (a, b) in enumerate(zip(live, logged)) if a != b),
                            None if len(live) == len(logged) else min(len(live), len(logged)))
    offline_accepted = None if offline is None else int(round(float(offline.accepted.sum())))
    offline_rounds = None if offline is None else int(round(float(offline.rounds)))
    return {"request_id": request.request_id, "predicted": predicted, "measured": measured,
            "plain_tokens": int(plain.emitted), "plain_decode_s": plain.decode_s,
            "spec_tokens": int(spec.emitted), "spec_decode_s": spec.decode_s,
            "offline_tokens": None if offline is None else float(offline.tokens),
            "offline_cost": None if offline is None or cost_of is None else float(cost_of(offline)),
            "offline_expected_tokens": None if offline is None else offline.expected_tokens_per_round,
            "live_accepted": int(spec.accepted), "live_rounds": int(spec.rounds),
            "offline_accepted": offline_accepted, "offline_rounds": offline_rounds,
            "greedy_comparable": comparable,
            "consistent": (comparable and offline_accepted == spec.accepted
                           and offline_rounds == spec.rounds) if comparable else None,
            "first_difference_from_log": first_difference}


def speedup_interval(per_request: list[dict], samples: int = 2000, seed: int = 0) -> dict:
    """The measured speedup over confirm requests and its 95% interval by bootstrap over them:
    {measured, lo, hi, error_lo, error_hi} where measured = spec tokens/s over plain tokens/s of the
    decode phases summed over the requests, and error_* bound measured / predicted - 1 on the same
    requests (None where the requests carry no prediction)."""
    rows = [r for r in per_request if r.get("plain_decode_s") and r.get("spec_decode_s")]
    if not rows:
        return {"measured": None, "lo": None, "hi": None, "error_lo": None, "error_hi": None}
    columns = {key: np.array([float(r[key]) for r in rows]) for key in
               ("plain_tokens", "plain_decode_s", "spec_tokens", "spec_decode_s")}

    def speedup(index):
        plain = columns["plain_tokens"][index].sum(-1) / columns["plain_decode_s"][index].sum(-1)
        spec = columns["spec_tokens"][index].sum(-1) / columns["spec_decode_s"][index].sum(-1)
        return spec / plain

    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(rows), size=(samples, len(rows)))
    boot = speedup(draws)
    out = {"measured": float(speedup(np.arange(len(rows)))),
           "lo": float(np.percentile(boot, 2.5)), "hi": float(np.percentile(boot, 97.5)),
           "error_lo": None, "error_hi": None}
    if all(r.get("offline_tokens") and r.get("offline_cost") for r in rows):
        tokens = np.array([r["offline_tokens"] for r in rows])
        cost = np.array([r["offline_cost"] for r in rows])
        error = boot / (tokens[draws].sum(-1) / cost[draws].sum(-1)) - 1.0
        out["error_lo"], out["error_hi"] = (float(np.percentile(error, 2.5)),
                                            float(np.percentile(error, 97.5)))
    return out


def judged_pairs(per_request: list[dict], least: int = WEAK_EVIDENCE) -> tuple[list[dict], int, str]:
    """The timed pairs a speedup is judged on: those neither of whose twins ran while other
    processes took CPU, or was slowed ("contended": vLLM's replay marks both), where at least
    `least` are left, else all of them. Output:
    (pairs, how many were contended, "; 2 of 8 pairs contended, left out" or "")."""
    timed = [r for r in per_request if r.get("plain_decode_s") and r.get("spec_decode_s")]
    clean = [r for r in timed if not r.get("contended")]
    if len(clean) == len(timed):
        return timed, 0, ""
    judged = clean if len(clean) >= least else timed
    return judged, len(timed) - len(clean), (
        f"; {len(timed) - len(clean)} of {len(timed)} pairs contended, "
        + ("left out" if judged is clean else "all used: too few clean ones"))


def live_verdict(per_request: list[dict], config: dict, settings: Settings,
                 predicted_same: float | None) -> dict:
    """Whether the live measurement lets a domain the plan turns on actually turn on.

    Only a domain that would turn on (on in the plan, off in the champion config) can be vetoed:
    the live check's one rule (tasks.registry.live_check.judge_live) finds a problem: slower than
    plain decoding (the interval below 1), the speedup's 95% interval below min_speedup, or the cost-model
    error's interval below -confirm_tolerance (slower than predicted, whatever the noise).
    The bootstrap interval is over the confirm requests: with few of them it is wide, so a quiet
    machine's correct "on" (measured well above the minimum) stands; the verdict says how many
    requests it rests on ("weak": fewer than 5). A request whose plain or config twin ran while
    other processes took CPU (per_request "contended", vLLM's replay) is left out where at least 5
    clean ones remain, and the reason says how many were.
    Output: {verdict: the word of a LiveVerdict decision (tasks.registry.live_check): pass | flag
    (a problem, in a domain that is not turning on) | veto | none,
    weak, measured, lo, hi, error_lo, error_hi, predicted, requests, contended, reason, and the settings it
    was judged by: min_speedup, tolerance, live_veto}.
    """
    judged, contended, contention = judged_pairs(per_request)
    interval = speedup_interval(judged)
    requests = len(judged)
    predicted = predicted_same or config.get("predicted_speedup")
    out = {**interval, "predicted": predicted, "requests": requests, "contended": contended,
           "verdict": LiveVerdict.NONE.value,
           "reason": "no live measurement", "min_speedup": settings.plan.min_speedup,
           "tolerance": settings.live.tolerance, "live_veto": settings.live.veto}
    measured = interval["measured"]
    if measured is None:
        return out
    text = (f"live check: {measured:.2f}x measured [{interval['lo']:.2f}, {interval['hi']:.2f}] over "
            f"{requests} request{'s' if requests != 1 else ''}" + (
                f" vs {predicted:.2f}x predicted" if predicted else "") + contention)
    turning_on = (settings.live.veto and bool(config.get("enabled"))
                  and not config.get("champion_on"))
    error = None if interval["error_lo"] is None else (
        measured / predicted_same - 1.0 if predicted_same else (interval["error_lo"] + interval["error_hi"]) / 2)
    judged = judge_live({**interval, "cost_model_error": error}, settings.plan.min_speedup,
                        settings.live.tolerance)
    why = judged.problems[0] if judged.problems else None     # the one rule (registry.live_check)
    weak = requests < WEAK_EVIDENCE
    out.update(verdict=judged.verdict.decision(turning_on).value, weak=weak,
               reason=text + (f": {why}" if why else "") + (
                   f" (weak evidence: {requests} request{'s' if requests != 1 else ''})" if weak else ""))
    return out
