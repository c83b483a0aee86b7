"""The per-domain plan: drafter, K, largest batch size at which speculation pays, on or off.

For each candidate drafter and K the offline estimate gives E(K) (tokens per round) with a 95%
interval, and the share of rounds drafting w = 0..K tokens (prompt lookup may draft fewer). On a
hardware profile at batch size b, one round costs, in target steps,
    cost_b = sum_w share_w * (draft_b(w) + v_b(w)),  v_b(w) = t_verify(w) / t_step  (v_b(0) = 1)
with draft_b(w) = w * t_draft / t_step for a model drafter and t_lookup / t_step per round for
prompt lookup. Predicted speedup = E(K) / cost_b; its interval is E's interval over the same cost
(the model of docs/design.md's E(K) / (K c + v(K)), with the widths the traffic actually drafts).
The best (drafter, K) at batch size 1 is chosen; the domain is on only when the lower end of its
interval clears the policy minimum and the sample is large enough; max_batch_size is the largest
profiled batch size up to which the lower end still clears it.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, insert, select, update

from .candidates import HOST_DRAFTERS
from .costs import CostTable
from .db.engine import database_url, ensure_ready
from .db.models import AcceptanceEstimate, DomainConfig
from .settings import Settings, load_settings
from .timeutil import utcnow

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


def speedups(estimate: dict, costs: CostTable, batch_size: int) -> tuple[float, float, float]:
    """(predicted, lo, hi) speedup of one acceptance_estimates row at a batch size."""
    # a host drafter (prompt lookup, suffix) pays one search per round, not one step per token
    per_round = (estimate["drafter_spec"] or {}).get("kind") in HOST_DRAFTERS
    cost = round_cost(estimate["draft_width_share"], costs.verify_ratios(batch_size),
                      costs.draft_ratio(estimate["drafter"], batch_size), per_round)
    return (estimate["mean_accepted_length"] / cost, estimate["mean_accepted_length_lo"] / cost,
            estimate["mean_accepted_length_hi"] / cost)


def plan_domain(run_id: str, domain: str, costs: CostTable, db_url: str | None = None,
                settings: Settings | None = None, status: str = "ok",
                min_speedup: float | None = None, samples: int | None = None) -> dict:
    """Choose and store the domain's setting (domain_configs) from the run's estimates.

    status: the sample's verdict for the domain ("ok" or "insufficient": the domain is off in this
    config and the champion's setting is kept). samples: usable requests of the domain (default:
    those the estimates scored). Output: the domain_configs row as a dict.
    """
    settings = settings or load_settings()
    min_speedup = settings.min_speedup if min_speedup is None else min_speedup
    engine = ensure_ready(database_url(db_url or settings.database_url))
    with engine.connect() as connection:
        estimates = [dict(row) for row in connection.execute(
            select(AcceptanceEstimate).where((AcceptanceEstimate.run_id == run_id)
                                             & (AcceptanceEstimate.domain == domain))
            .order_by(AcceptanceEstimate.drafter, AcceptanceEstimate.k)).mappings()]
    batch_sizes = costs.batch_sizes
    updates = []
    best = None
    for estimate in estimates:
        if estimate["k"] > costs.k_max(batch_sizes[0]):
            continue
        predicted, lo, hi = speedups(estimate, costs, batch_sizes[0])
        updates.append({"id": estimate["id"], "predicted_speedup": predicted,
                        "predicted_speedup_lo": lo, "predicted_speedup_hi": hi})
        if best is None or predicted > best[1]:
            best = (estimate, predicted, lo, hi)
    if samples is None:
        samples = max((e["requests"] for e in estimates), default=0)
    row = {"run_id": run_id, "domain": domain, "enabled": False, "drafter": None,
           "drafter_spec": None, "k": None, "max_batch_size": None, "predicted_speedup": None,
           "predicted_speedup_lo": None, "predicted_speedup_hi": None, "measured_speedup": None,
           "mean_accepted_length": None, "conditional_acceptance": None, "samples": samples,
           "status": status, "validation": None, "promotable": None, "reason": None}
    if best is not None:
        estimate, predicted, lo, hi = best
        row.update(drafter=estimate["drafter"], drafter_spec=estimate["drafter_spec"],
                   k=estimate["k"], predicted_speedup=predicted, predicted_speedup_lo=lo,
                   predicted_speedup_hi=hi, mean_accepted_length=estimate["mean_accepted_length"],
                   conditional_acceptance=estimate["conditional_acceptance"])
        max_batch = None
        for b in batch_sizes:
            if estimate["k"] > costs.k_max(b) or speedups(estimate, costs, b)[1] < min_speedup:
                break
            max_batch = b
        row["max_batch_size"] = max_batch
    if status == "insufficient":
        row["reason"] = (f"insufficient samples ({samples} usable requests of this target, fewer "
                         "than the minimum): off in this config; the champion's setting is kept")
    elif best is None:
        row["status"] = "insufficient"
        row["reason"] = "no usable estimate (no sampled request with a response of 2+ tokens)"
    elif row["max_batch_size"] is None:
        row["reason"] = (f"off: best {row['drafter']} K={row['k']} predicts {row['predicted_speedup']:.2f}x "
                         f"[{row['predicted_speedup_lo']:.2f}, {row['predicted_speedup_hi']:.2f}], whose "
                         f"lower end does not clear the minimum {min_speedup:.2f}x")
    else:
        row["enabled"] = True
        row["reason"] = (f"on: {row['drafter']} K={row['k']} predicts {row['predicted_speedup']:.2f}x "
                         f"[{row['predicted_speedup_lo']:.2f}, {row['predicted_speedup_hi']:.2f}] at batch "
                         f"1; pays up to batch {row['max_batch_size']} on {costs.hardware_profile}")
    now = utcnow()
    with engine.begin() as connection:
        for item in updates:
            connection.execute(update(AcceptanceEstimate).where(AcceptanceEstimate.id == item["id"])
                               .values(**{k: v for k, v in item.items() if k != "id"}))
        connection.execute(delete(DomainConfig).where((DomainConfig.run_id == run_id)
                                                      & (DomainConfig.domain == domain)))
        connection.execute(insert(DomainConfig).values(**row, created_at=now))
    log.info("run %s, domain %s: %s", run_id, domain, row["reason"])
    return row
