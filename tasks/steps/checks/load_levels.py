"""The load check's levels (tasks.steps.checks.load_check): the K a schedule drafts at a batch size,
one level's figures from its plain and config waves, whether it pays against the bar, and the
schedule cut to the largest level up to which every level pays."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ...db.load_records import LoadLevel
from ...registry.vllm_export import batch_schedule
from ...serving.load import inter_token_latencies
from ...settings import Settings
from ..estimate.acceptance import accepted_per_position, mean_accepted_length, position_rates
from .confirm import judged_pairs, speedup_interval
from ..costs.costs import CostTable
from .engine_compare import predicted_speedup


def k_at(spec: dict, size: int) -> int:
    """The K a vLLM config drafts at a batch size (its schedule's range, else its K)."""
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if not schedule:
        return int(spec["num_speculative_tokens"])
    return next((int(k) for first, last, k in schedule if first <= size <= last), 0)


def claimed_k(config: dict, size: int) -> int:
    """The K the run's config claims at a batch size (domain_configs: k_schedule, else K up to
    max_batch_size, else K)."""
    if config.get("k_schedule"):
        return next((int(k) for first, last, k in config["k_schedule"] if first <= size <= last), 0)
    if config.get("max_batch_size"):
        return int(config["k"] or 0) if size <= config["max_batch_size"] else 0
    return int(config["k"] or 0)


def exported_schedule(config: dict) -> list | None:
    """The config's exported num_speculative_tokens_per_batch_size (vllm_export.batch_schedule)."""
    return batch_schedule(SimpleNamespace(k_schedule=config.get("k_schedule"),
                                          max_batch_size=config.get("max_batch_size"), k=config.get("k")))


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return float(np.percentile(values, 50)), float(np.percentile(values, 95))


def request_sums(requests: list[dict]) -> dict | None:
    """The per-request speculative-decoding metrics of these requests summed (the acceptance
    histogram read as accepted-per-position: a step that accepted j drafts accepted positions
    0..j-1). None when a request carries none."""
    if not requests or any(r.get("spec") is None for r in requests):
        return None
    width = max(len(r["spec"]["histogram"]) for r in requests) - 1
    each = [accepted_per_position(r["spec"]["histogram"]) for r in requests]
    per_pos = [sum(p[j] for p in each if j < len(p)) for j in range(max(width, 0))]
    return {"drafts": sum(r["spec"]["drafts"] for r in requests),
            "draft_tokens": sum(r["spec"]["draft_tokens"] for r in requests),
            "accepted_tokens": sum(r["spec"]["accepted_tokens"] for r in requests),
            "accepted_per_pos": per_pos}


def counters_match(counters: dict | None, sums: dict | None) -> bool | None:
    """Whether /metrics deltas equal the per-request sums (positions compared up to the longer,
    zeros padded); None when either is missing."""
    if counters is None or sums is None:
        return None
    width = max(len(counters["accepted_per_pos"]), len(sums["accepted_per_pos"]))

    def padded(values):
        return list(values) + [0] * (width - len(values))
    return (all(counters[key] == sums[key] for key in ("drafts", "draft_tokens", "accepted_tokens"))
            and padded(counters["accepted_per_pos"]) == padded(sums["accepted_per_pos"]))


@dataclass(frozen=True)
class _Side:
    """One side's figures at a level (plain or config), for its LoadLevel: output tokens/s over
    the level's wall time, TTFT and ITL (p50, p95), failed requests."""

    tokens_per_s: float | None
    ttft: tuple[float | None, float | None]
    itl: tuple[float | None, float | None]
    failed: int


def _side(level: dict) -> _Side:
    ok = [r for r in level["requests"] if r["ok"]]
    ttft = _percentiles([r["ttft_s"] for r in ok])
    itl = _percentiles([gap for r in ok for gap in inter_token_latencies(r["chunks"])])
    tokens = sum(len(r["token_ids"]) for r in ok)
    return _Side(tokens / level["wall_s"] if level["wall_s"] > 0 and ok else None, ttft, itl,
                 len(level["requests"]) - len(ok))


def level_row(concurrency: int, k: int, plain: dict, config: dict) -> LoadLevel:
    """One level's figures from the plain and the config's run_level outputs (see the module's
    docstring); `pays`, `verdict` and `predicted_speedup` are set by the caller."""
    pairs = []
    for p, s in zip(plain["requests"], config["requests"]):
        if p["ok"] and s["ok"] and p["decode_s"] and s["decode_s"]:
            pairs.append({"request_id": s["id"], "plain_tokens": len(p["token_ids"]) - 1,
                          "plain_decode_s": p["decode_s"], "spec_tokens": len(s["token_ids"]) - 1,
                          "spec_decode_s": s["decode_s"], "plain_ttft_s": p["ttft_s"],
                          "spec_ttft_s": s["ttft_s"], "spec": s["spec"],
                          "contended": bool(p.get("contended") or s.get("contended"))})
    judged, _, _ = judged_pairs(pairs)
    interval = speedup_interval(judged)
    left, right = _side(plain), _side(config)
    counters = config.get("counters")
    sums = request_sums([r for r in config["requests"] if r["ok"]])
    drafts = (counters or {}).get("drafts") or 0
    return LoadLevel(
        concurrency=concurrency, k=k, requests=len(config["requests"]),
        failed=left.failed + right.failed,
        plain_tokens_per_s=left.tokens_per_s, spec_tokens_per_s=right.tokens_per_s,
        measured_speedup=interval["measured"], measured_speedup_lo=interval["lo"],
        measured_speedup_hi=interval["hi"],
        plain_ttft_p50_s=left.ttft[0], plain_ttft_p95_s=left.ttft[1],
        spec_ttft_p50_s=right.ttft[0], spec_ttft_p95_s=right.ttft[1],
        plain_itl_p50_s=left.itl[0], plain_itl_p95_s=left.itl[1],
        spec_itl_p50_s=right.itl[0], spec_itl_p95_s=right.itl[1],
        engine_e=mean_accepted_length(counters["accepted_tokens"], drafts) if drafts else None,
        engine_rates=position_rates(counters["accepted_per_pos"], drafts) if drafts else None,
        counters=counters, request_sums=sums,
        counters_equal=counters_match(counters, sums) if not right.failed else None,
        per_request=pairs)


def level_verdict(row: LoadLevel, settings: Settings, champion_on: bool) -> str:
    """What a measured level's interval says against the bar: "pays" (its lower end clears
    min_speedup, or 1.0 for a domain on in the champion with hysteresis, and its upper end
    min_speedup), "below" (its upper end under min_speedup, or a request failed, or no figure),
    else "unsure" (the interval straddles the bar: more requests may settle it)."""
    if row.failed or row.measured_speedup_lo is None:
        return "below"
    bar, lower = settings.plan.min_speedup, _lower_bar(settings, champion_on)
    if row.measured_speedup_lo >= lower and row.measured_speedup_hi >= bar:
        return "pays"
    return "below" if row.measured_speedup_hi < bar else "unsure"


def pays(row: LoadLevel, settings: Settings, champion_on: bool) -> bool:
    """Whether a measured level pays: its verdict, and where that is still "unsure" after the
    level's extra requests (load_more_requests), its point estimate against the bar."""
    said = level_verdict(row, settings, champion_on)
    if said != "unsure":
        return said == "pays"
    return row.measured_speedup >= _lower_bar(settings, champion_on)


def _lower_bar(settings: Settings, champion_on: bool) -> float:
    """What a level's lower end must clear: min_speedup, or 1.0 for a domain on in the champion
    (the planner's hysteresis)."""
    return 1.0 if champion_on and settings.plan.hysteresis else settings.plan.min_speedup


def level_text(row: LoadLevel) -> str:
    """"0.94x [0.88, 1.01] at 4 concurrent requests" (or why it has no figure)."""
    where = f"at {row.concurrency} concurrent request{'s' if row.concurrency != 1 else ''}"
    failed = f" ({row.failed} of {2 * row.requests} requests failed)" if row.failed else ""
    if row.measured_speedup is None:
        return f"no speedup measured {where}{failed}"
    unsure = (f", unsure after {row.requests} requests: the point estimate decides"
              if row.verdict == "unsure" else "")
    return (f"{row.measured_speedup:.2f}x [{row.measured_speedup_lo:.2f}, "
            f"{row.measured_speedup_hi:.2f}] {where}{failed}{unsure}")


@dataclass(frozen=True)
class ScheduleCut:
    """What a domain's measured levels do to its schedule (cut_schedule), for the load check's
    record of the domain: ok | cut | off, the largest level up to which every level pays (None:
    none), the reason, the domain_configs columns to set."""

    status: str
    largest: int | None
    reason: str
    changes: dict


def cut_schedule(config: dict, rows: list[LoadLevel], settings: Settings) -> ScheduleCut:
    """The schedule that follows the measurement. rows: the measured levels (with `pays`), by
    concurrency."""
    rows = sorted(rows, key=lambda r: r.concurrency)
    largest, failing = None, None
    for row in rows:
        if not row.pays:
            failing = row
            break
        largest = row.concurrency
    if failing is None:
        paid = ", ".join(level_text(r) for r in rows)
        return ScheduleCut("ok", largest, f"load check: pays at every level measured ({paid})" if rows else
                           "load check: no level measured", {})
    bar = (f"min_speedup {settings.plan.min_speedup:.2f}x" + (" (hysteresis: lower end 1.0, upper end "
                                                         "min_speedup)" if config.get("champion_on")
                                                         and settings.plan.hysteresis else ""))
    text = f"load check: {level_text(failing)} does not pay {bar}"
    if largest is None:
        return ScheduleCut("off", None, text, {
            "enabled": False, "max_batch_size": None, "k_schedule": None,
            "reason": (f"{text}; not promotable as on, the domain is off. "
                       f"Planner: {config.get('reason') or '-'}")[:2000]})
    schedule = [[int(first), min(int(last), largest), int(k)]
                for first, last, k in (config.get("k_schedule") or [[1, largest, config["k"]]])
                if int(first) <= largest]
    text = f"{text}: K > 0 up to batch size {largest} only"
    return ScheduleCut("cut", largest, text, {
        "k_schedule": schedule if config.get("k_schedule") else None,
        "max_batch_size": largest, "reason": f"{text}. {config.get('reason') or ''}"[:2000]})


def predicted_at(costs: CostTable | None, label: str, drafter_spec: dict | None, totals: list,
                 sampled: list[bool], batch_size: int) -> float | None:
    """The speedup vLLM's cost profile predicts for these requests (their estimate's rounds) at
    one batch size, as the engine check prices them at batch 1 (engine_compare.predicted_speedup)."""
    return predicted_speedup(costs, label, drafter_spec, totals, sampled, batch_size)
