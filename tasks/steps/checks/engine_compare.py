"""The engine check's comparison (tasks.steps.checks.engine_check): vLLM's drafted and accepted
tokens of each replayed request against the estimate's on the same request, per position and
per domain, a domain's verdict, and the speedup vLLM's cost profile predicts for the requests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...db.domain_records import PlannedDomain
from ...db.engine_records import ComparedRequest, Comparison, EngineCheckRow
from ...serving.replay_answer import ReplayAnswer, ServedRequest
from ...settings import Settings
from ..estimate import acceptance
from .confirm import offline_totals
from .drawn import priced_totals
from ..costs.costs import CostProfileError, CostTable
from ..costs.cost_table import pays_sampled_steps
from ..plan.plan import speedup_factor
from .engine_replay import batch_one_k, end_slot


# vLLM proposes what our drafter proposes, token for token (eagle3: the same checkpoint, read
# the same way -- tests/test_vllm_serving.py holds our reading to speculators' and to vLLM's)
EXACT_METHODS = ("ngram", "draft_model", "eagle3")


def engine_walk(prompt_ids, output, drafted: list[int], accepted: list[int], drafter,
                k: int) -> list[int] | None:
    """Where each of vLLM's drafted steps started along its own output: walk the output with the
    same proposer (vLLM's per-request counts list only the steps that had drafts); a step with
    no proposal emits one token. None when the walk and vLLM's steps disagree (a proposal of
    another length, or steps left over)."""
    sequence = np.asarray(list(prompt_ids) + list(output), dtype=np.int64)
    starts, t, step = [], 1, 0
    while t < len(output):
        proposal = drafter.propose_tokens(sequence[: len(prompt_ids) + t], k)
        if len(proposal) == 0:
            t += 1
            continue
        if step >= len(drafted) or drafted[step] != len(proposal):
            return None
        starts.append(t)
        t += accepted[step] + 1
        step += 1
    return starts if step == len(drafted) else None


def contiguous_steps(length: int, drafted: list[int], accepted: list[int]) -> list[int] | None:
    """Where each of vLLM's drafted steps started along an output of `length` tokens when every
    decode step drafted (a model drafter: draft_model, eagle3): the first after the prefill's
    token, each next one after the last step's accepted drafts and its own token. None when the
    steps do not end inside the output (not every step drafted, or counts of another request)."""
    starts, t = [], 1
    for d, a in zip(drafted, accepted):
        if d <= 0 or t >= length:
            return None
        starts.append(t)
        t += a + 1
    return starts if starts and t >= length else None


def placed_steps(request, output, drafted: list[int], accepted: list[int], drafter, k: int | None,
                 exact: bool) -> list[int] | None:
    """Where vLLM's drafted steps started along its output, where they can be placed: only where
    vLLM proposes what our drafter does (exact), with a host drafter by walking the output
    (engine_walk), with a model drafter one step after the other (contiguous_steps)."""
    if drafter is None or not exact:
        return None
    if drafter.walks_text:
        return engine_walk(request.prompt_ids, output, drafted, accepted, drafter, k)
    return contiguous_steps(len(output), drafted, accepted)


def compare_request(request, engine_answer: ServedRequest, offline, exact: bool = True,
                    drafter=None, k: int | None = None) -> ComparedRequest:
    """One request: vLLM's per-step counts beside the estimate's expected rounds. exact: the
    engine's drafter proposes what ours does (not so for suffix decoding, whose tree vLLM builds
    from the requests it served), so a greedy request whose output equals the log must have equal
    counts. vLLM drafts K tokens in its last rounds whatever max_tokens leaves, and counts drafts
    accepted past the end (then cut), which the estimate, walking the response, never sees: where
    its steps can be placed along its output (placed_steps) the drafts accepted inside the output
    are counted too (engine_accepted_in_output and per position), and those are what E and the
    greedy counts compare."""
    logged = [int(t) for t in request.response_ids]
    output = engine_answer.token_ids
    drafted = engine_answer.drafted or []
    accepted = engine_answer.accepted or []
    first_difference = next((i for i, (a, b) in enumerate(zip(output, logged)) if a != b),
                            None if len(output) == len(logged) else min(len(output), len(logged)))
    steps = sum(1 for d in drafted if d > 0)
    width = max(drafted, default=0)

    def per_position(counts: list[int]) -> list[int]:
        """Per draft position i, the drafted steps that accepted draft i."""
        return [sum(1 for a, d in zip(counts, drafted) if d > 0 and a > i) for i in range(width)]

    starts = placed_steps(request, output, drafted, accepted, drafter, k, exact)
    inside = None if starts is None else [min(a, len(output) - t) for a, t in zip(accepted, starts)]
    row = ComparedRequest(request_id=request.request_id, greedy=bool(request.sampling.greedy),
                          tokens=len(output), seconds=engine_answer.seconds, decode_s=engine_answer.decode_s,
                          equal_to_log=first_difference is None, first_difference=first_difference,
                          engine_steps=steps, engine_accepted=int(sum(accepted)),
                          engine_accepted_per_pos=per_position(accepted),
                          engine_accepted_in_output=None if inside is None else int(sum(inside)),
                          engine_accepted_per_pos_in_output=None if inside is None else per_position(inside))
    if offline is None:
        return row
    row = replace(row, estimate_steps=float(offline.rounds - offline.widths[0]),
                  estimate_accepted=float(offline.accepted.sum()),
                  estimate_accepted_per_pos=[float(a) for a in offline.accepted])
    if not (exact and row.greedy and row.equal_to_log):
        return row
    if drafter is not None and drafter.walks_text and starts is None:
        return replace(row, counts_equal=False)      # vLLM's steps are not the ones our proposer walks
    in_log = row.engine_accepted_inside
    return replace(row, engine_accepted_in_log=int(in_log),
                   counts_equal=(round(row.estimate_accepted) == in_log and round(row.estimate_steps) == steps))


def inside_output(row: dict, key: str):
    """A request's engine count inside its output where its steps were placed, else vLLM's own,
    from its JSON (a ComparedRequest's to_json, as the step returns it; the record itself:
    engine_accepted_inside, engine_per_pos_inside)."""
    placed = row.get(f"{key}_in_output")
    return row[key] if placed is None else placed


def position_rates(rows: list[ComparedRequest], which: str, k: int) -> list[float]:
    """Per position, accepted / drafted steps over the rows ("engine": inside the outputs where
    the steps were placed, see ComparedRequest.engine_per_pos_inside; "estimate"); zeros without
    drafted steps."""
    engine = which == "engine"
    steps = sum((r.engine_steps if engine else r.estimate_steps) or 0 for r in rows)
    per_pos = np.zeros(k)
    for r in rows:
        values = ((r.engine_per_pos_inside if engine else r.estimate_accepted_per_pos) or [])[:k]
        per_pos[:len(values)] += values
    return acceptance.position_rates(per_pos, steps) or [0.0] * k


def estimate_interval(rows: list[ComparedRequest], samples: int = 2000, seed: int = 0) -> tuple:
    """The estimate's E over the requests and its 95% interval by bootstrap over them."""
    rows = [r for r in rows if r.estimate_steps is not None]
    return acceptance.mean_length_interval([r.estimate_accepted for r in rows],
                                           [r.estimate_steps for r in rows], samples, seed)


def domain_verdict(rows: list[ComparedRequest], k: int, tolerance: float,
                   gated: str | None = None) -> EngineCheckRow:
    """E, interval, rates, greedy counts and the gate of one domain's replayed requests
    (compare_request's).
    gated: None, or why E is reported but not gated (passed stays None)."""
    estimate_e, lo, hi = estimate_interval(rows)
    engine_e = acceptance.mean_accepted_length(sum(r.engine_accepted_inside for r in rows),
                                               sum(r.engine_steps for r in rows))
    greedy = [r for r in rows if r.counts_equal is not None]
    comparison = Comparison(requests=len(rows), k=k, estimate_e=estimate_e, estimate_e_lo=lo,
                            estimate_e_hi=hi, engine_e=engine_e,
                            estimate_rates=position_rates(rows, "estimate", k),
                            engine_rates=position_rates(rows, "engine", k), greedy_checked=len(greedy),
                            greedy_equal=sum(1 for r in greedy if r.counts_equal))
    if engine_e is None or lo is None:
        return EngineCheckRow(status="ok", passed=None, comparison=comparison,
                              reason="no drafts on these requests: nothing to compare")
    floor = lo * (1.0 - tolerance)
    text = (f"vLLM E {engine_e:.2f} vs estimate {estimate_e:.2f} [{lo:.2f}, {hi:.2f}] on "
            f"{len(rows)} requests at K={k}")
    if engine_e < floor:
        out = EngineCheckRow(status="below", passed=False, comparison=comparison, reason=(
            f"engine check: {text}: below the interval by more than "
            f"{100 * tolerance:.0f}% (engine_check_tolerance)"))
    else:
        out = EngineCheckRow(status="ok", passed=True, comparison=comparison, reason=f"engine check: {text}")
    if gated is not None:
        out = replace(out, passed=None, reason=f"{out.reason} (reported, not gated: {gated})")
    return out


def domain_row(picked: list, answer: ReplayAnswer, spec: dict, drafter, target_model, history: int,
                log_path: str, settings: Settings, planned: PlannedDomain | None = None,
                costs: CostTable | None = None, domain_requests: list | None = None) -> EngineCheckRow:
    """One domain's comparison of what its engine served with the estimate of the same requests
    at the engine's batch-1 K; a domain the engine died on (or left unserved) fails, with its
    figures on the requests that were served. The speedup predicted for them prices a sampled
    request at the mean of the domain's logged requests sampled as it is (domain_requests, the
    run's sample of the domain; tasks.steps.checks.drawn), where they are given."""
    k = batch_one_k(spec)
    slotted = [end_slot(r) for r in picked]
    offline = offline_totals(target_model, drafter, slotted, k)
    priced = offline if domain_requests is None else priced_totals(
        target_model, drafter, slotted, domain_requests, k, settings.live.max_new_tokens, own=offline)
    served = [r for r in picked if r.request_id in offline and r.request_id in answer.requests]
    compared = [compare_request(r, answer.requests[r.request_id], offline.get(r.request_id),
                                exact=spec["method"] in EXACT_METHODS, drafter=drafter, k=k)
                for r in picked if r.request_id in answer.requests]
    ungated = None
    if spec["method"] == "suffix":
        ungated = (f"vLLM's suffix tree held the {history} requests served before the replay, the "
                   "estimate's index the run's whole history; a serving vLLM grows its tree from "
                   "all it serves")
    row = domain_verdict(compared, k, settings.engine.check_tolerance, ungated)
    row = replace(row, comparison=replace(
        row.comparison, per_request=compared, spec_tokens_per_s=rows_tokens_per_s(compared),
        spec_decode_tokens_per_s=rows_decode_tokens_per_s(compared),
        predicted_speedup=predicted_speedup(
            costs, None if planned is None else planned.drafter,
            None if planned is None else planned.drafter_spec,
            [priced[r.request_id] for r in served], [pays_sampled(r.sampling) for r in served])))
    ids = {r.request_id for r in picked}
    spent = [i for i in answer.left_out if i in ids]
    if spent:
        row = left_out(row, len(spent), len(picked), settings)
    failed = [d for d in answer.died if d["request"] in ids]
    unserved = [i for i in answer.unserved if i in ids]
    if failed or unserved:
        first = failed[0] if failed else None
        row = replace(row, status="died", passed=False, reason=(
            f"engine check: the engine died on {len(failed)} of {len(picked)} requests"
            + (f" ({len(unserved)} left unserved)" if unserved else "")
            + (f", first on request {first['request']}: {first['error']}" if first else "")
            + f"; its log: {log_path}. On the {len(compared)} it served: "
            + row.reason.removeprefix("engine check: "))[:2000])
    return row


def left_out(row: EngineCheckRow, count: int, picked: int, settings: Settings) -> EngineCheckRow:
    """A domain some of whose pairs the replay's budget left out (the machine's other processes
    left the engine too little CPU): decided on the requests served, saying how many were left
    out; with none served it is not gated ("contended": neither passed nor failed, the estimate
    and the load check decide), the reason naming the contention."""
    budget = (f"the replay's budget (engine_check_budget_s, {settings.engine.check_budget_s:.0f} s "
              f"shared over its engine's domains) ran out: other processes left the engine too "
              f"little CPU")
    if count >= picked:
        return replace(row, status="contended", passed=None,
                       reason=f"engine check: not measured, all {picked} requests left out: {budget}")
    return replace(row, reason=f"{row.reason}; {count} of {picked} requests left out: {budget}"[:2000])


def pays_sampled(sampling) -> bool:
    """Whether a request (its SamplingParams) pays a serving engine's sampled steps
    (tasks.steps.costs.cost_table.pays_sampled_steps: it samples with top-p)."""
    return pays_sampled_steps(sampling.temperature, sampling.top_k, sampling.top_p)


def predicted_speedup(costs: CostTable | None, label: str | None, drafter_spec: dict | None,
                      totals: list, sampled: list[bool] | None = None, batch_size: int = 1) -> float | None:
    """The speedup the serving engine's cost profile predicts for these requests (their
    estimate's rounds, RoundTotals; sampled: whether each pays the profile's sampled steps,
    pays_sampled, priced with them where the profile has them) at one batch size: their plain decoding time over their
    rounds' time, as the planner prices them. None without a profile that prices the drafter at
    that batch size."""
    if costs is None or label is None or not totals or batch_size not in costs.target_step:
        return None
    if label not in costs.draft_step and (drafter_spec or {}).get("kind") == "prompt_lookup":
        # vLLM's ngram search is inside the profile's verify steps, whatever its n
        costs.draft_step[label] = {b: 0.0 for b in costs.batch_sizes}
    if batch_size > 1 and sampled and any(sampled):
        # one request that samples with top-p makes its whole batch pay the sampled steps
        # (CostTable.for_sampling): above batch 1 every request is priced at the batches' mix
        mixed = costs.for_sampling(sum(map(bool, sampled)) / len(sampled))
        tables = {False: mixed, True: mixed}
    else:
        tables = {False: costs, True: costs.for_sampling(1.0)}
    plain = spec = 0.0
    try:
        for t, is_sampled in zip(totals, sampled or [False] * len(totals)):
            if not t.rounds:
                continue
            table = tables[bool(is_sampled)]
            step = table.target_step[batch_size]
            plain += t.tokens * step
            spec += t.rounds / speedup_factor(label, drafter_spec, t.width_share, table, batch_size) * step
    except (CostProfileError, KeyError):
        return None
    return plain / spec if spec > 0 else None


def rows_decode_tokens_per_s(rows: list[ComparedRequest]) -> float | None:
    """Decode-phase tokens/s of compared requests (compare_request's rows: first token to last,
    vLLM's own timestamps; prefill left out)."""
    return _per_s([(r.tokens - 1, r.decode_s) for r in rows if r.decode_s])


def rows_tokens_per_s(rows: list[ComparedRequest]) -> float | None:
    """Tokens/s of compared requests, wall time."""
    return _per_s([(r.tokens, r.seconds) for r in rows])


def served_decode_tokens_per_s(served: list[ServedRequest]) -> float | None:
    """Decode-phase tokens/s of requests as vLLM served them (see rows_decode_tokens_per_s)."""
    return _per_s([(s.tokens - 1, s.decode_s) for s in served if s.decode_s])


def served_tokens_per_s(served: list[ServedRequest]) -> float | None:
    return _per_s([(s.tokens, s.seconds) for s in served])


def _per_s(counts: list[tuple[int, float]]) -> float | None:
    seconds = sum(s for _, s in counts)
    return sum(t for t, _ in counts) / seconds if seconds > 0 else None
