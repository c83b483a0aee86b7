"""The per-domain plan: drafter, K, largest batch size at which speculation pays, on or off.

For each candidate drafter and K the offline estimate gives E(K) (tokens per round) with a 95%
interval, and the share of rounds drafting w = 0..K tokens (prompt lookup may draft fewer). On a
hardware profile at batch size b, one round costs, in target steps,
    cost_b = sum_w share_w * (draft_b(w) + v_b(w)),  v_b(w) = t_verify(w) / t_step  (v_b(0) = 1)
with draft_b(w) = w * t_draft / t_step for a model drafter and t_lookup / t_step per round for
prompt lookup. Each round also pays o_b, the host work outside the forward passes and the
proposal (sampling, acceptance, write-back, rollback, bookkeeping), and plain decoding pays its own
o_plain per step; both measured by the cost profile (profile.measure_round_overhead) in target
steps. Predicted speedup = E(K) (1 + o_plain) / (cost_b + o_b); its interval is E's interval over
the same cost (the model of docs/design.md's E(K) / (K c + v(K)), with the widths the traffic
actually drafts and the overhead a GPU does not hide).
The drafter with the best prediction at batch size 1 among those whose interval's lower end
clears the policy minimum is chosen (the best prediction overall when none does), at its smallest
K whose prediction is within settings.plan.k_tolerance of its best (a suffix or prompt-lookup
drafter's curve is flat past a few tokens, and its argmax K there is the profile's noise); the domain
turns on only when that lower end clears the minimum and the sample is large enough; max_batch_size is the
largest profiled batch size up to which the lower end still clears it.

Hysteresis (settings.plan.hysteresis): a domain that is on in the champion config stays on while its
interval's upper end clears the minimum and its lower end clears 1.0 (speculation still does not
lose), with max_batch_size the largest batch size where that holds; the reason says "kept on:
within hysteresis". Without it a domain near the minimum flips on and off from run to run on
sampling noise alone, and every flip is a new config version to review.

A noisy cost profile (CostTable.noisy: it failed its consistency or spread checks, see
tasks.steps.costs.costs.check_costs) turns no domain on that the champion has off: its reason says "cost
profile too noisy: ..." and how to plan with a stored profile instead. The live check after the
plan can veto an "on" as well (tasks.steps.checks.confirm.live_verdict).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...db.queries_plans import domain_estimates, store_plan
from ...db.store import Store
from ...settings import Settings
from ...registry.figures import interval_at_bar
from ..drafters.candidates import HOST_DRAFTERS
from ..costs.cost_table import CostProfileError, CostTable, pays_sampled_steps

log = logging.getLogger(__name__)


def round_cost(width_share: list[float], verify_ratios: list[float], draft_ratio: float,
               per_round_draft: bool) -> float:
    """Expected cost of one round in target steps (see the module docstring)."""
    cost = 0.0
    for width, share in enumerate(width_share):
        if share <= 0:
            continue
        verify = 1.0 if width == 0 else verify_ratios[width - 1]
        draft = draft_ratio if per_round_draft else width * draft_ratio
        cost += share * (draft + verify)
    return cost


def speedup_factor(drafter: str, drafter_spec: dict | None, width_share: list[float],
                   costs: CostTable, batch_size: int) -> float:
    """Speedup per token of E: (1 + o_plain) / (round cost + o_round), all in target steps, so
    predicted speedup = E x this (see the module docstring)."""
    # a host drafter (prompt lookup, suffix) pays one search per round, not one step per token
    per_round = (drafter_spec or {}).get("kind") in HOST_DRAFTERS
    own = costs.round_ratios(drafter, batch_size)
    if own is not None:     # its whole rounds, timed in its own engine: the search is inside them
        cost = round_cost(width_share, own, 0.0, per_round)
    else:
        cost = round_cost(width_share, costs.verify_ratios(batch_size),
                          costs.draft_ratio(drafter, batch_size), per_round)
    plain, overhead = costs.overhead_ratios(drafter, batch_size)
    return (1.0 + plain) / (cost + overhead)


def speedups(estimate: dict, costs: CostTable, batch_size: int) -> tuple[float, float, float]:
    """(predicted, lo, hi) speedup of one acceptance_estimates row at a batch size. The interval
    is acceptance's, widened by the cost's where the profile has one (a paired profile's verify
    ratio at that K: CostTable.cost_halfwidth)."""
    factor = speedup_factor(estimate["drafter"], estimate["drafter_spec"],
                            estimate["draft_width_share"], costs, batch_size)
    cost = min(costs.cost_halfwidth(int(estimate.get("k") or 0), batch_size, estimate["drafter"]), 0.9)
    return (estimate["mean_accepted_length"] * factor,
            estimate["mean_accepted_length_lo"] * factor * (1 - cost),
            estimate["mean_accepted_length_hi"] * factor * (1 + cost))


def smallest_near_best(candidates: list[tuple[int, float]], tolerance: float) -> int:
    """The smallest K among (K, predicted) whose prediction is within `tolerance` (a share) of the
    best one's: a larger K that buys less than that is noise in the costs, not a gain (setting
    plan_k_tolerance). 0 for none."""
    if not candidates:
        return 0
    best = max(predicted for _, predicted in candidates)
    return min(k for k, predicted in candidates if predicted >= best * (1.0 - tolerance))


def k_schedule(estimates: list[dict], costs: CostTable, pays, tolerance: float = 0.0) -> list[list[int]]:
    """K by batch size for one drafter: [[first, last, K], ...] over the profiled batch sizes. Each
    range ends at a profiled size b and starts after the previous one, and its K is the smallest
    within `tolerance` of the best predicted speedup at b among those that pay there (pays(lo,
    hi); smallest_near_best): costs grow with the batch, so what pays at b pays below it. 0 from
    the first size where none pays; the largest profiled size ends the schedule (beyond it
    nothing was measured: serving stays off)."""
    sizes = costs.batch_sizes
    schedule, stopped = [], False
    for index, b in enumerate(sizes):
        paying = []
        if not stopped:
            for estimate in estimates:
                if estimate["k"] > costs.k_max(b):
                    continue
                predicted, lo, hi = speedups(estimate, costs, b)
                if pays(lo, hi):
                    paying.append((estimate["k"], predicted))
        k = smallest_near_best(paying, tolerance)
        stopped = stopped or k == 0
        schedule.append([1 if index == 0 else sizes[index - 1] + 1, b, k])
    return schedule


def _max_batch(estimate: dict, costs: CostTable, pays) -> int | None:
    """The largest profiled batch size up to which pays(lo, hi) holds at every size (None: not at 1)."""
    best = None
    for b in costs.batch_sizes:
        if estimate["k"] > costs.k_max(b):
            break
        _, lo, hi = speedups(estimate, costs, b)
        if not pays(lo, hi):
            break
        best = b
    return best


@dataclass
class _Priced:
    """One acceptance estimate with its predicted speedup and 95% interval at the smallest
    profiled batch size."""
    estimate: dict
    predicted: float
    lo: float
    hi: float


@dataclass
class _Pricing:
    """The domain's estimates priced on the cost profile: the predicted speedups to store on the
    estimates, the chosen candidate (None: no usable estimate) and the drafters the profile does
    not price."""
    updates: list[dict]
    best: _Priced | None
    unpriced: set[str]


@dataclass
class _Policy:
    """What the domain's plan is judged by."""
    min_speedup: float
    status: str           # the sample's verdict for the domain: "ok" or "insufficient"
    currently_on: bool    # on in the champion config
    keeps: bool           # settings.plan.hysteresis and on in the champion: the wider band applies
    k_tolerance: float = 0.0    # settings.plan.k_tolerance: the smallest K within it of the best

    def pays(self, lo: float, hi: float) -> bool:
        """The interval's lower end clears the minimum."""
        return lo >= self.min_speedup

    def within_band(self, lo: float, hi: float) -> bool:
        """Hysteresis: the upper end clears the minimum and the lower end clears 1.0."""
        return hi >= self.min_speedup and lo >= 1.0


def _load_estimates(store: Store, run_id: str, domain: str, costs: CostTable) -> tuple[list[dict], CostTable]:
    """The run's acceptance_estimates rows of the domain (by drafter, K), and the cost table to
    plan it with (a profile that prices sampled requests apart: at the domain's mix)."""
    estimates, sampling = domain_estimates(store, run_id, domain, with_sampling=costs.sampled_timed)
    if costs.sampled_timed and sampling:
        # a profile that prices sampled requests apart (a serving engine's): the domain's mix of
        # requests that pay its sampled steps (top-p) and those that cost as greedy ones
        costs = costs.for_sampling(sum(pays_sampled_steps(*row) for row in sampling) / len(sampling))
    return estimates, costs


def _price_estimates(estimates: list[dict], costs: CostTable, policy: _Policy) -> _Pricing:
    """Predicted speedups of every estimate at the smallest profiled batch size, and the choice:
    among those whose interval clears the bar (else among those hysteresis keeps on, else all),
    the drafter with the best prediction and, of its Ks there, the smallest within
    policy.k_tolerance of its best (smallest_near_best): a K whose wide interval misses the bar
    must not turn the domain off when a smaller K clears it, and a larger K that buys less than
    the tolerance is not taken for the cost profile's noise."""
    batch_size = costs.batch_sizes[0]
    updates, unpriced, priced = [], set(), []
    for estimate in estimates:
        if estimate["k"] > costs.k_max(batch_size):
            continue
        try:
            candidate = _Priced(estimate, *speedups(estimate, costs, batch_size))
        except CostProfileError:
            if not costs.sampled_timed:
                raise
            # a serving engine's profile prices only the drafters that engine serves
            unpriced.add(estimate["drafter"])
            continue
        updates.append({"id": estimate["id"], "predicted_speedup": candidate.predicted,
                        "predicted_speedup_lo": candidate.lo, "predicted_speedup_hi": candidate.hi})
        priced.append(candidate)
    paying = [c for c in priced if policy.pays(c.lo, c.hi)]
    kept = [c for c in priced if policy.keeps and policy.within_band(c.lo, c.hi)]
    return _Pricing(updates, _choose(paying or kept or priced, policy.k_tolerance), unpriced)


def _choose(candidates: list[_Priced], tolerance: float) -> _Priced | None:
    """The best candidate's drafter, at its smallest K within `tolerance` of its best."""
    if not candidates:
        return None
    drafter = max(candidates, key=lambda c: c.predicted).estimate["drafter"]
    own = {c.estimate["k"]: c for c in candidates if c.estimate["drafter"] == drafter}
    return own[smallest_near_best([(k, c.predicted) for k, c in own.items()], tolerance)]


def _empty_row(run_id: str, domain: str, samples: int, policy: _Policy) -> dict:
    """The domain_configs row of a domain that is off, before a candidate is filled in."""
    return {"run_id": run_id, "domain": domain, "enabled": False, "drafter": None,
            "drafter_spec": None, "k": None, "max_batch_size": None, "predicted_speedup": None,
            "predicted_speedup_lo": None, "predicted_speedup_hi": None, "measured_speedup": None,
            "k_schedule": None,
            "mean_accepted_length": None, "conditional_acceptance": None, "samples": samples,
            "status": policy.status, "validation": None, "promotable": None, "reason": None,
            "champion_on": policy.currently_on, "live_check": None}


def _fill_choice(row: dict, choice: _Priced, estimates: list[dict], costs: CostTable,
                 policy: _Policy) -> bool:
    """Fill the row with the chosen candidate, the largest batch size where it pays and its K
    schedule. True when only hysteresis keeps it on (its lower end misses the bar at batch 1)."""
    estimate = choice.estimate
    row.update(drafter=estimate["drafter"], drafter_spec=estimate["drafter_spec"],
               k=estimate["k"], predicted_speedup=choice.predicted, predicted_speedup_lo=choice.lo,
               predicted_speedup_hi=choice.hi, mean_accepted_length=estimate["mean_accepted_length"],
               conditional_acceptance=estimate["conditional_acceptance"])
    row["max_batch_size"] = _max_batch(estimate, costs, policy.pays)
    pays, kept = policy.pays, None
    if policy.keeps and row["max_batch_size"] is None:
        kept = _max_batch(estimate, costs, policy.within_band)
    if kept:
        row["max_batch_size"] = kept
        pays = policy.within_band
    if row["max_batch_size"] is not None:      # on: the schedule says up to which batch size
        row["k_schedule"] = k_schedule(
            [e for e in estimates if e["drafter"] == estimate["drafter"]], costs, pays,
            policy.k_tolerance)
        row["max_batch_size"] = max(last for _, last, k in row["k_schedule"] if k > 0)
    return bool(kept)


def _prediction_text(row: dict, verb: str = "predicts", bars: tuple[float, ...] = ()) -> str:
    """'DRAFTER K=k predicts S.SSx [LO, HI]' of the row's chosen candidate; an end near one of
    `bars` (the minimum, 1.0) with the digits that decide it (tasks.registry.figures)."""
    return (f"{row['drafter']} K={row['k']} {verb} {row['predicted_speedup']:.2f}x "
            + interval_at_bar(row["predicted_speedup_lo"], row["predicted_speedup_hi"], bars))


def _decide(row: dict, policy: _Policy, costs: CostTable, chosen: bool, kept: bool) -> None:
    """Set the row's enabled, status and reason: insufficient sample, no usable estimate, off
    below the bar, kept on by hysteresis, off on a noisy profile, or on."""
    bars = (policy.min_speedup, 1.0)
    if policy.status == "insufficient":
        row["reason"] = (f"insufficient samples ({row['samples']} usable requests of this target, "
                         "fewer than the minimum): off in this config; the champion's setting is kept")
    elif not chosen:
        row["status"] = "insufficient"
        row["reason"] = "no usable estimate (no sampled request with a response of 2+ tokens)"
    elif row["max_batch_size"] is None:
        row["reason"] = (f"off: best {_prediction_text(row, bars=bars)}, whose lower end does "
                         f"not clear the minimum {policy.min_speedup:.2f}x")
    elif kept:
        row["enabled"] = True
        row["reason"] = (f"kept on: within hysteresis -- {_prediction_text(row, bars=bars)}: "
                         f"on in the champion, upper end still >= {policy.min_speedup:.2f}x and "
                         f"lower end >= 1.00x (up to batch {row['max_batch_size']})")
    elif costs.noisy and not policy.currently_on:
        row.update(max_batch_size=None, k_schedule=None)
        row["reason"] = (f"off: cost profile too noisy: {costs.noise_text()}. "
                         f"{_prediction_text(row, 'would predict')}, but no domain turns on from a "
                         "noisy profile that the champion has off. Measure on a quiet machine, or "
                         "plan with a stored profile (`specdec evaluate --hardware-profile NAME`, "
                         "setting `plan_hardware_profile`)")
    else:
        row["enabled"] = True
        row["reason"] = (f"on: {_prediction_text(row, bars=bars)} at batch 1; pays up to batch "
                         f"{row['max_batch_size']} on {costs.hardware_profile}")
        if costs.noisy:
            row["reason"] += (f" (on in the champion; the cost profile is noisy: {costs.noise_text(1)})")


def plan_domain(run_id: str, domain: str, costs: CostTable, store: Store,
                settings: Settings | None = None, status: str = "ok",
                min_speedup: float | None = None, samples: int | None = None,
                currently_on: bool = False) -> dict:
    """Choose and store the domain's setting (domain_configs) from the run's estimates.

    status: the sample's verdict for the domain ("ok" or "insufficient": the domain is off in this
    config and the champion's setting is kept). samples: usable requests of the domain (default:
    those the estimates scored). currently_on: the domain is on in the champion config (with
    settings.plan.hysteresis it then stays on within the wider band, see the module docstring).
    Output: the domain_configs row as a dict.
    """
    settings = settings or store.settings
    policy = _Policy(min_speedup=settings.plan.min_speedup if min_speedup is None else min_speedup,
                     status=status, currently_on=bool(currently_on),
                     keeps=bool(settings.plan.hysteresis and currently_on),
                     k_tolerance=settings.plan.k_tolerance)
    estimates, costs = _load_estimates(store, run_id, domain, costs)
    pricing = _price_estimates(estimates, costs, policy)
    if samples is None:
        samples = max((e["requests"] for e in estimates), default=0)
    row = _empty_row(run_id, domain, samples, policy)
    kept = pricing.best is not None and _fill_choice(row, pricing.best, estimates, costs, policy)
    _decide(row, policy, costs, pricing.best is not None, kept)
    if pricing.unpriced:       # said where a reviewer reads the domain, not only in the log
        unserved = (f"not planned with {', '.join(sorted(pricing.unpriced))}: "
                    f"{costs.hardware_profile} does not serve it (no draft step in its profile)")
        row["reason"] = f"{row['reason']}; {unserved}" if row["reason"] else unserved
        log.info("run %s, domain %s: %s", run_id, domain, unserved)
    store_plan(store, run_id, domain, pricing.updates, row)
    log.info("run %s, domain %s: %s", run_id, domain, row["reason"])
    return row
