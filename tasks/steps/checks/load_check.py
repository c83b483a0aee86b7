"""The load check: the speedup a promoted schedule claims at batch sizes above 1, measured on
vLLM's OpenAI server under concurrent streamed requests, and the schedule cut to what it measured.

The engine check replays a domain's requests one at a time; the exported
`num_speculative_tokens_per_batch_size` claims payoffs at batch 2-8 from a cost profile alone.
Here, for every domain the run's config turns on (after the engine check's gate) and that has a
vLLM config, at each concurrency level of `load_levels` where the domain's schedule drafts
(K > 0), the domain's requests (draw order, `load_requests` of them and at least the level,
each its logged prompt, sampling parameters and seed, its length cut at `load_max_tokens`)
are streamed through one vLLM server per drafter method, as production deploys it
(vllm_export.method_deployments: at the largest K of its domains), with K per request (the
project's plugin), in waves of the level's size, each wave twice: at K 0 (the plain control)
and at the K the domain's schedule gives the level, each request asking it, the
order alternating wave by wave, so that every ratio pairs the same requests on the same server a
wave apart (a machine that slows between two server starts no longer moves it). A suffix server
learns from what it serves: there the config's wave goes first, each level takes its own
requests, and before the domain's first level the server is served, at K 0, up to load_history
of the domain's logged requests outside the run's sample (the newest the estimate's suffix index
holds): a serving deployment's tree holds the domain's history, and so does the index the
estimate is priced on; measured on a tree without it, suffix decoding drafts little. A wave side a neighbour slowed (CPU of other processes read from /proc) is served again
(load_retries), and a level's interval leaves out the pairs a neighbour reached where at
least 5 clean ones remain (tasks.steps.checks.confirm.judged_pairs). A K 0 request
on that server still pays the drafter's host search (vLLM proposes for the whole batch; the cut
is made after), so the control is what the deployment serves its off domains with
(tasks.serving.load: asyncio + httpx). Per level and server: output tokens/s (over the level's
wall time), time to first token and inter-token latency p50/p95, failed requests; on the config's
server vLLM's vllm:spec_decode_* counter deltas from /metrics (E = 1 + accepted / drafts, and the
acceptance rate per position) beside the same requests' per-request metrics summed (they must be
equal). The measured speedup is the config's decode-phase tokens/s over the plain one on the same
requests, with its 95% interval by bootstrap over them (tasks.steps.checks.confirm.speedup_interval);
the predicted one is vLLM's cost profile at that batch size (the engine check's profile, the
estimate of these requests at that level's K).

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
from types import SimpleNamespace

import numpy as np

from ...db.queries_load import domains_on, engine_versions, load_checks, store_load_check
from ...errors import EngineTimeout, ServingEnvUnavailable, ServingProbeError
from ...registry.vllm_export import batch_schedule, deployment_specs
from ...serving import environment as serving_env
from ...serving.load import inter_token_latencies, merge_levels, run_level
from ...serving.server import ServerPool, log_dir
from ...settings import Settings
from ..estimate.acceptance import accepted_per_position, mean_accepted_length, position_rates
from .confirm import judged_pairs, offline_totals, speedup_interval, truncated
from ..costs.costs import CostTable
from .engine_check import _dtype, end_slot, local_spec, predicted_speedup
from ..costs.engine_costs import engine_profile
from .engine_validate import BLOCK_SIZE, served_export
from ..drafters.suffix_index import run_history

log = logging.getLogger(__name__)

# the servers the engine check's sampling test uses (tasks.steps.checks.engine_validate): with one pool
# for both, a config's server starts once for the sampling test and the load check
SERVER = {"block_size": BLOCK_SIZE}


def level_items(requests: list, count: int, max_tokens: int) -> list[dict]:
    """`count` streamed requests from the domain's (draw order, repeated when it has fewer; a
    repeat's id carries `#n`), each cut at max_tokens, seeded by its place."""
    usable = [r for r in requests if len(r.response_ids) >= 2]
    items = []
    for n in range(count if usable else 0):
        request = usable[n % len(usable)]
        sampling = request.sampling
        items.append({"id": request.request_id + (f"#{n // len(usable)}" if n >= len(usable) else ""),
                      "request_id": request.request_id,
                      "prompt_ids": [int(t) for t in request.prompt_ids],
                      "max_tokens": max(2, min(len(request.response_ids), max_tokens)),
                      "temperature": float(sampling.temperature), "top_k": int(sampling.top_k),
                      "top_p": float(sampling.top_p), "seed": n})
    return items


def history_items(rows: list[tuple], max_tokens: int) -> list[dict]:
    """Streamed requests of a suffix server's history (suffix_index.run_history's rows), each cut
    at max_tokens, at its logged sampling, its id `history:<request id>`."""
    return [{"id": f"history:{row.id}", "request_id": row.id, "prompt_ids": [int(t) for t in prompt],
             "max_tokens": max(2, min(len(response), max_tokens)),
             "temperature": float(row.temperature or 0.0), "top_k": int(row.top_k or 0),
             "top_p": float(row.top_p if row.top_p is not None else 1.0), "seed": n}
            for n, (row, prompt, response) in enumerate(rows)]


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


def _side(level: dict) -> dict:
    ok = [r for r in level["requests"] if r["ok"]]
    ttft = _percentiles([r["ttft_s"] for r in ok])
    itl = _percentiles([gap for r in ok for gap in inter_token_latencies(r["chunks"])])
    tokens = sum(len(r["token_ids"]) for r in ok)
    return {"tokens_per_s": tokens / level["wall_s"] if level["wall_s"] > 0 and ok else None,
            "ttft": ttft, "itl": itl, "failed": len(level["requests"]) - len(ok)}


def level_row(concurrency: int, k: int, plain: dict, config: dict) -> dict:
    """One level's figures from the plain and the config's run_level outputs (see the module's
    docstring); `pays` and `predicted_speedup` are set by the caller."""
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
    return {"concurrency": concurrency, "k": k, "requests": len(config["requests"]),
            "failed": left["failed"] + right["failed"],
            "plain_tokens_per_s": left["tokens_per_s"], "spec_tokens_per_s": right["tokens_per_s"],
            "measured_speedup": interval["measured"], "measured_speedup_lo": interval["lo"],
            "measured_speedup_hi": interval["hi"],
            "plain_ttft_p50_s": left["ttft"][0], "plain_ttft_p95_s": left["ttft"][1],
            "spec_ttft_p50_s": right["ttft"][0], "spec_ttft_p95_s": right["ttft"][1],
            "plain_itl_p50_s": left["itl"][0], "plain_itl_p95_s": left["itl"][1],
            "spec_itl_p50_s": right["itl"][0], "spec_itl_p95_s": right["itl"][1],
            "engine_e": mean_accepted_length(counters["accepted_tokens"], drafts) if drafts else None,
            "engine_rates": position_rates(counters["accepted_per_pos"], drafts) if drafts else None,
            "counters": counters, "request_sums": sums,
            "counters_equal": counters_match(counters, sums) if not right["failed"] else None,
            "per_request": pairs}


def level_verdict(row: dict, settings: Settings, champion_on: bool) -> str:
    """What a measured level's interval says against the bar: "pays" (its lower end clears
    min_speedup, or 1.0 for a domain on in the champion with hysteresis, and its upper end
    min_speedup), "below" (its upper end under min_speedup, or a request failed, or no figure),
    else "unsure" (the interval straddles the bar: more requests may settle it)."""
    if row["failed"] or row["measured_speedup_lo"] is None:
        return "below"
    bar, lower = settings.plan.min_speedup, _lower_bar(settings, champion_on)
    if row["measured_speedup_lo"] >= lower and row["measured_speedup_hi"] >= bar:
        return "pays"
    return "below" if row["measured_speedup_hi"] < bar else "unsure"


def pays(row: dict, settings: Settings, champion_on: bool) -> bool:
    """Whether a measured level pays: its verdict, and where that is still "unsure" after the
    level's extra requests (load_more_requests), its point estimate against the bar."""
    said = level_verdict(row, settings, champion_on)
    if said != "unsure":
        return said == "pays"
    return row["measured_speedup"] >= _lower_bar(settings, champion_on)


def _lower_bar(settings: Settings, champion_on: bool) -> float:
    """What a level's lower end must clear: min_speedup, or 1.0 for a domain on in the champion
    (the planner's hysteresis)."""
    return 1.0 if champion_on and settings.plan.hysteresis else settings.plan.min_speedup


def level_text(row: dict) -> str:
    """"0.94x [0.88, 1.01] at 4 concurrent requests" (or why it has no figure)."""
    where = f"at {row['concurrency']} concurrent request{'s' if row['concurrency'] != 1 else ''}"
    failed = f" ({row['failed']} of {2 * row['requests']} requests failed)" if row["failed"] else ""
    if row["measured_speedup"] is None:
        return f"no speedup measured {where}{failed}"
    unsure = (f", unsure after {row['requests']} requests: the point estimate decides"
              if row.get("verdict") == "unsure" else "")
    return (f"{row['measured_speedup']:.2f}x [{row['measured_speedup_lo']:.2f}, "
            f"{row['measured_speedup_hi']:.2f}] {where}{failed}{unsure}")


def cut_schedule(config: dict, rows: list[dict], settings: Settings) -> dict:
    """The schedule that follows the measurement. rows: the measured levels (with "pays"), by
    concurrency. Output: {status: ok | cut | off, largest: the largest level up to which every
    level pays (None: none), reason, changes: the domain_configs columns to set}."""
    rows = sorted(rows, key=lambda r: r["concurrency"])
    largest, failing = None, None
    for row in rows:
        if not row["pays"]:
            failing = row
            break
        largest = row["concurrency"]
    if failing is None:
        paid = ", ".join(level_text(r) for r in rows)
        return {"status": "ok", "largest": largest, "changes": {},
                "reason": f"load check: pays at every level measured ({paid})" if rows else
                          "load check: no level measured"}
    bar = (f"min_speedup {settings.plan.min_speedup:.2f}x" + (" (hysteresis: lower end 1.0, upper end "
                                                         "min_speedup)" if config.get("champion_on")
                                                         and settings.plan.hysteresis else ""))
    text = f"load check: {level_text(failing)} does not pay {bar}"
    if largest is None:
        return {"status": "off", "largest": None, "reason": text, "changes": {
            "enabled": False, "max_batch_size": None, "k_schedule": None,
            "reason": (f"{text}; not promotable as on, the domain is off. "
                       f"Planner: {config.get('reason') or '-'}")[:2000]}}
    schedule = [[int(first), min(int(last), largest), int(k)]
                for first, last, k in (config.get("k_schedule") or [[1, largest, config["k"]]])
                if int(first) <= largest]
    text = f"{text}: K > 0 up to batch size {largest} only"
    return {"status": "cut", "largest": largest, "reason": text, "changes": {
        "k_schedule": schedule if config.get("k_schedule") else None,
        "max_batch_size": largest, "reason": f"{text}. {config.get('reason') or ''}"[:2000]}}


def predicted_at(costs: CostTable | None, label: str, drafter_spec: dict | None, totals: list,
                 sampled: list[bool], batch_size: int) -> float | None:
    """The speedup vLLM's cost profile predicts for these requests (their estimate's rounds) at
    one batch size, as the engine check prices them at batch 1 (engine_check.predicted_speedup)."""
    return predicted_speedup(costs, label, drafter_spec, totals, sampled, batch_size)


def _failure(which: str, server, level: int, result: dict | None, exc: Exception | None,
             settings: Settings) -> tuple[str, str]:
    """(status, reason) of a server that did not start, hung or died at a level (which: "plain"
    while it served the level's K 0 requests, "history" a suffix server's history, else
    "config")."""
    if exc is not None:
        return "failed", f"load check: the config server did not start: {exc}"
    unfinished = sum(1 for r in result["requests"] if not r["ok"])
    where = f"at {level} concurrent request{'s' if level != 1 else ''}"
    serving = {"plain": " serving its K 0 (plain) requests",
               "history": " serving the domain's history at K 0"}.get(which, "")
    if result["timed_out"]:
        return "timeout", (f"load check: the config server hung {where}{serving}: {unfinished} of "
                           f"{len(result['requests'])} requests not finished within "
                           f"{settings.load.timeout_s:.0f} s (load_timeout_s); its log: "
                           f"{server.log_path}")
    return "died", (f"load check: the config server died {where}{serving} ({unfinished} of "
                    f"{len(result['requests'])} requests failed): {server.last_line()}; its log: "
                    f"{server.log_path}")


def waves(items: list[dict], level: int) -> list[list[dict]]:
    """The level's requests in waves of `level` (the last may be shorter)."""
    size = max(1, level)
    return [items[i:i + size] for i in range(0, len(items), size)]


def level_slices(items: list[dict], levels: list[tuple[int, int]], requests: int,
                 disjoint: bool) -> list[list[dict]]:
    """Each level's requests: the first max(requests, level) of `items`, or with `disjoint` (a
    server whose drafter learns from what it serves: suffix decoding) the next ones after the
    levels before, so that no level is served requests whose responses the server already
    holds (wrapping round only where the domain has too few)."""
    out, at = [], 0
    for level, _ in levels:
        count = max(requests, level)
        if not disjoint:
            out.append(items[:count])
            continue
        out.append([items[(at + n) % len(items)] for n in range(count)] if items else [])
        at += count
    return out


def _serve_wave(server, wave: list[dict], level: int, asked: int | None, settings: Settings,
                limit: float) -> dict:
    """One wave at one K (None: the server's own), its requests marked contended when other
    processes took more than `limit` cores meanwhile."""
    result = run_level(server, [dict(item, k=asked) for item in wave], level, settings.load.timeout_s)
    for request in result["requests"]:
        request["contended"] = result.get("other_cores", 0.0) > limit
    return result


def _serve_waves(server, batch: list[dict], level: int, k: int, learns: bool, limit: float,
                 settings: Settings, sides: dict, first: int) -> tuple | None:
    """Serve `batch` in waves of `level`, each at K 0 and at K `k` (the config's there), the order
    alternating from wave number `first` (a suffix server: the config's first), each side a
    neighbour slowed served again (see measure_domain); the results appended to sides["plain"]
    and sides["config"]. Output: (which, result) of a server that hung or died, else None."""
    for index, wave in enumerate(waves(batch, level), start=first):
        order = (("plain", 0), ("config", k))
        if learns or index % 2:
            order = order[::-1]
        served = {}
        for which, asked in order:
            served[which] = _serve_wave(server, wave, level, asked, settings, limit)
            if served[which]["timed_out"] or not served[which]["alive"]:
                return which, served[which]
        for _ in range(settings.load.retries):
            again = [(which, asked) for which, asked in order if served[which]["other_cores"] > limit
                     and not (learns and which == "config")]
            for which, asked in again:
                retry = _serve_wave(server, wave, level, asked, settings, limit)
                if retry["timed_out"] or not retry["alive"]:
                    return which, retry
                if retry["other_cores"] < served[which]["other_cores"]:
                    served[which] = retry
        for which in sides:
            sides[which].append(served[which])
    return None


def _more(items: list[dict], used: set[str], count: int) -> list[dict]:
    """The next `count` of `items` whose request none of `used` names (one per request)."""
    out, seen = [], set(used)
    for item in items:
        if len(out) == count:
            break
        if item["request_id"] not in seen:
            seen.add(item["request_id"])
            out.append(item)
    return out


def _serve_history(server, history: list[dict], settings: Settings) -> dict | None:
    """A suffix server's history served at K 0, all at once (see the module's docstring); the
    result of a server that hung or died on it, else None."""
    if not history:
        return None
    log.info("load check: %d history requests first, at K 0 (the suffix tree grows from them)",
             len(history))
    result = run_level(server, [dict(item, k=0) for item in history], len(history),
                       settings.load.timeout_s)
    return result if result["timed_out"] or not result["alive"] else None


def measure_domain(pool: ServerPool, spec: dict, levels: list[tuple[int, int]], items: list[dict],
                   settings: Settings, settle=None, history: list[dict] | None = None) -> dict:
    """The levels of one domain on the server of `spec` (its method's deployment, or a running
    one of that method at a larger K: ServerPool.get's share), K per request: at each (level, K)
    the requests in waves of the level's size, each wave served twice, at K 0 (plain) and at K,
    the order alternating wave by wave (a suffix server, which
    learns from every response it serves, the config's first and each level its own requests:
    level_slices), so that each ratio pairs the same requests served moments apart. A side
    during which other processes took CPU (tasks.serving.load.run_level's other_cores over
    profile_contention_cores and the cores the server left them) is served again, up to
    load_retries times, its least contended result kept (a suffix server's config side
    never: it would draft its own responses). settle(level row) -> "pays" | "below" | "unsure"
    (level_verdict): while a level is "unsure", up to load_more_requests more of `items`
    are served at it, load_requests at a time, none of a request the level (a suffix
    server: any level) served or will serve. history (a suffix server only): requests served at
    K 0 before the first level (history_items). Output: {levels: [(level, K, plain, config,
    requests)], failure: (status, reason) or None, logs: {plain, config}, history: how many
    history requests were served}."""
    out: dict = {"levels": [], "failure": None, "logs": {}, "history": 0}
    try:
        server = pool.get(spec, **SERVER, share=True)
    except (EngineTimeout, ServingProbeError) as exc:
        out["failure"] = _failure("config", None, 0, None, exc, settings)
        return out
    out["logs"] = {"plain": str(server.log_path), "config": str(server.log_path)}
    if not server.k_per_request():
        out["failure"] = ("failed", "load check: the config server has no K per request (the specdec "
                                    "plugin is not in the serving environment: run `make serving-env`); "
                                    f"its log: {server.log_path}")
        return out
    learns = spec.get("method") == "suffix"
    limit = settings.profile.contention_cores + server.spare_cores
    history = history if learns else []
    failed = _serve_history(server, history or [], settings)
    if failed is not None:
        out["failure"] = _failure("history", server, len(history), failed, None, settings)
        server.stop()
        return out
    out["history"] = len(history or [])
    bases = level_slices(items, levels, settings.load.requests, learns)
    held = {item["request_id"] for chosen in bases for item in chosen}   # a suffix server's, in the end
    for (level, k), chosen in zip(levels, bases):
        sides: dict = {"plain": [], "config": []}
        log.info("load check: %d requests at %d concurrent, K 0 and K %d alternating in waves",
                 len(chosen), level, k)
        served_items, batch = list(chosen), chosen
        while batch:
            failed = _serve_waves(server, batch, level, k, learns, limit, settings, sides,
                                  first=len(sides["plain"]))
            if failed is not None:
                which, result = failed
                out["failure"] = _failure(which, server, level, result, None, settings)
                server.stop()       # a hung server is not left running; the pool restarts it
                return out
            batch = []
            extra = len(served_items) - len(chosen)
            if settle is None or extra >= settings.load.more_requests:
                break
            row = level_row(level, k, merge_levels(sides["plain"]), merge_levels(sides["config"]))
            if settle(row) != "unsure":
                break
            step = min(max(settings.load.requests, level), settings.load.more_requests - extra)
            batch = _more(items, held if learns else {i["request_id"] for i in served_items}, step)
            if batch:
                log.info("load check: %s straddles the bar: %d more requests", level_text(row),
                         len(batch))
                served_items += batch
                held |= {item["request_id"] for item in batch}
        out["levels"].append((level, k, merge_levels(sides["plain"]), merge_levels(sides["config"]),
                              served_items))
    return out


def _predictions(context, domain: str, config: dict, items: list[dict], ks: set[int],
                 costs: CostTable | None) -> dict[int, tuple]:
    """{K: (totals, sampled)} of the domain's streamed requests at each measured K (only with a
    vLLM cost profile to price them)."""
    if costs is None:
        return {}
    drafter = context.domain_drafters(domain)[config["drafter"]][1]
    by_id = {r.request_id: r for r in context.domain_requests(domain)[0]}
    requests = [end_slot(truncated(by_id[i], n)) for i, n in
                dict.fromkeys((item["request_id"], item["max_tokens"]) for item in items)]
    out = {}
    for k in sorted(k for k in ks if k > 0):
        offline = offline_totals(context.model, drafter, requests, k)
        served = [r for r in requests if r.request_id in offline]
        out[k] = ([offline[r.request_id] for r in served], [not r.sampling.greedy for r in served])
    return out


def _domain_result(context, domain: str, config: dict, spec: dict, measured: dict, costs,
                   items: list[dict]) -> tuple[dict, list[dict], dict]:
    """(load_check_domains row, level rows, domain_configs changes) of one measured domain."""
    settings = context.settings
    rows = []
    for level, k, plain, served, chosen in measured["levels"]:
        row = level_row(level, k, plain, served)
        totals, sampled = _predictions(context, domain, config, chosen, {k}, costs).get(k, ([], []))
        row["predicted_speedup"] = predicted_at(costs, config["drafter"], config.get("drafter_spec"),
                                                totals, sampled, level)
        row["verdict"] = level_verdict(row, settings, bool(config.get("champion_on")))
        row["pays"] = pays(row, settings, bool(config.get("champion_on")))
        rows.append(row)
    before = exported_schedule(config)
    record = {"speculative_config": spec, "schedule_before": before,
              "plain_log": measured["logs"].get("plain"), "spec_log": measured["logs"].get("config")}
    if measured["failure"] is not None:
        status, reason = measured["failure"]
        measured_text = "; ".join(level_text(r) for r in rows)
        reason = f"{reason}{'; measured before: ' + measured_text if rows else ''}"[:2000]
        changes = {"enabled": False, "max_batch_size": None, "k_schedule": None,
                   "reason": f"{reason}; not promotable as on, the domain is off. "
                             f"Planner: {config.get('reason') or '-'}"[:2000]}
        record.update(status=status, passed=False, reason=reason, schedule_after=None,
                      max_level_paying=None)
        return record, rows, changes
    verdict = cut_schedule(config, rows, settings)
    after = dict(config, **verdict["changes"])
    primed = (f" (the suffix server first served {measured['history']} of the domain's logged "
              f"requests outside the sample)" if measured.get("history") else "")
    record.update(status=verdict["status"], passed=verdict["status"] != "off",
                  reason=(verdict["reason"] + primed)[:2000], max_level_paying=verdict["largest"],
                  schedule_after=exported_schedule(after) if after.get("enabled") else None)
    return record, rows, verdict["changes"]


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
             history: list[dict]) -> dict:
    try:
        served = local_spec(server)
    except Exception as exc:  # noqa: BLE001 - the registry's or the download's own error
        return {"levels": [], "logs": {}, "failure": (
            "failed", f"load check: the drafter's checkpoint {server.get('model')} could not be "
                      f"fetched for the server: {type(exc).__name__}: {exc}")}
    champion_on = bool(config.get("champion_on"))
    return measure_domain(pool, served, levels, items, context.settings,
                          settle=lambda row: level_verdict(row, context.settings, champion_on),
                          history=history)


def load_check(context, pool: ServerPool | None = None) -> dict:
    """Run the load check of one run (see the module's docstring) with a RunContext (pool: the
    servers to use, else a pool of the run's own, closed at the end). Output: {"skipped": line
    or None, "domains": {domain: its load_check_domains row with "levels"}}."""
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
    records, level_rows, changes = {}, {}, {}
    own = pool is None
    pool = pool or ServerPool(run_id, model_dir, dtype=_dtype(context.model), settings=settings,
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
            records[domain], level_rows[domain], changes[domain] = _domain_result(
                context, domain, on[domain], spec, measured, profiles.get(version), items)
            (log.warning if records[domain]["passed"] is False else log.info)(
                "run %s, domain %s: %s", run_id, domain, records[domain]["reason"])
    finally:
        if own:
            pool.close()
    if records:
        store_load_check(context.store, run_id, records, level_rows, changes)
    return {"skipped": None, "domains": load_checks(context.store, run_id)}
