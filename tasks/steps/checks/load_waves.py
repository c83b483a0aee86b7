"""The load check's serving (tasks.steps.checks.load_check): the domain's requests as streamed items
(a suffix server's history first), each level's requests in waves served at K 0 and at the
level's K on its method's one server, a wave a neighbour slowed served again, more requests
while a level straddles the bar."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ...errors import EngineTimeout, ServingProbeError
from ...serving.load import merge_levels, run_level
from ...serving.server import ServerPool
from ...settings import Settings
from .engine_validate import BLOCK_SIZE
from .load_levels import level_row, level_text

log = logging.getLogger(__name__)


# the servers the engine check's sampling test uses (tasks.steps.checks.engine_validate): with one
# pool for both, a method's server starts once for the sampling test and the load check
SERVER = {"block_size": BLOCK_SIZE}


@dataclass
class DomainMeasurement:
    """What measure_domain served for one domain, for the load check's record of it
    (load_check._domain_result): per level (level, K, plain, config, requests) both sides' merged
    run_level outputs and the requests served; the failure ((status, reason) of a server that did
    not start, hung or died, else None); the server's log ({plain, config}); how many history
    requests a suffix server was served first. Filled level by level as measure_domain serves."""

    levels: list[tuple] = field(default_factory=list)
    failure: tuple[str, str] | None = None
    logs: dict = field(default_factory=dict)
    history: int = 0


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
                   settings: Settings, settle=None, history: list[dict] | None = None) -> DomainMeasurement:
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
    K 0 before the first level (history_items)."""
    out = DomainMeasurement()
    try:
        server = pool.get(spec, **SERVER, share=True)
    except (EngineTimeout, ServingProbeError) as exc:
        out.failure = _failure("config", None, 0, None, exc, settings)
        return out
    out.logs = {"plain": str(server.log_path), "config": str(server.log_path)}
    if not server.k_per_request():
        out.failure = ("failed", "load check: the config server has no K per request (the specdec "
                                    "plugin is not in the serving environment: run `make serving-env`); "
                                    f"its log: {server.log_path}")
        return out
    learns = spec.get("method") == "suffix"
    limit = settings.profile.contention_cores + server.spare_cores
    history = history if learns else []
    failed = _serve_history(server, history or [], settings)
    if failed is not None:
        out.failure = _failure("history", server, len(history), failed, None, settings)
        server.stop()
        return out
    out.history = len(history or [])
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
                out.failure = _failure(which, server, level, result, None, settings)
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
        out.levels.append((level, k, merge_levels(sides["plain"]), merge_levels(sides["config"]),
                           served_items))
    return out
