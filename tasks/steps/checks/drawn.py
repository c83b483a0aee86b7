"""The rounds a check prices a few requests with, as a serving engine will serve them.

A greedy request is served the tokens it logged (the engine check finds them equal), so the
estimate along its logged response is the one its serving walks. A request that samples
(temperature > 0) draws a new response on the engine: its logged response is one draw, and the
acceptance along it says little about the next (a json request at temperature 0.7 read E 1.33
along its log and 3.10 as vLLM served it). Priced along its one draw, a level of eight requests,
six of them sampled, missed its measured speedup by 15-20% run after run (the same seeds draw the
same responses). Here such a request is priced at the mean rounds per token of the domain's
logged requests that sample the same way (temperature, top-k, top-p), each cut at the same
length, scaled to its own tokens: the acceptance its draw has on average. Acceptance falls as the
temperature rises (json: E 2.29 at 0.3, 1.25 at 1.0), so the way of sampling is kept apart; one
with fewer than MIN_CLASS requests in the sample (one or two draws are no mean) takes every
sampled request of the domain. Re-priced on six stored runs (benchmarks/load_repredict.py), the
load check's predictions came within 15% of the measured speedup at 36 of 41 levels, against 25
along the logged draws; MIN_CLASS was set on those same runs (1 and 3 gave 36, 5 and 8 31-32).
"""

from __future__ import annotations

from collections import defaultdict

from specdec_core.estimate import RoundTotals

from .confirm import offline_totals, truncated
from .engine_replay import end_slot

MIN_CLASS = 3       # logged requests of one way of sampling below which all sampled ones are pooled


def priced_totals(target, drafter, requests: list, domain_requests: list, k: int, max_tokens: int,
                  cache: dict | None = None, own: dict | None = None) -> dict:
    """{request id: RoundTotals} of the planned drafter at K to price these requests with (each
    cut where it is served, its end slot added): a greedy one's along its logged response, a
    sampled one's the mean of the domain's sampled logged requests (domain_requests, each cut at
    max_tokens) of its way of sampling, scaled to its tokens (see the module's docstring).
    cache: a dict kept by the caller across calls on one domain and drafter (the pools by K);
    own: the estimate along the requests as given, where the caller has it (offline_totals)."""
    own = offline_totals(target, drafter, requests, k) if own is None else own
    drawn = [r for r in requests if r.request_id in own and not r.sampling.greedy]
    if not drawn:
        return own
    cache = {} if cache is None else cache
    if (k, max_tokens) not in cache:
        cache[(k, max_tokens)] = _pools(target, drafter, domain_requests, k, max_tokens)
    pools = cache[(k, max_tokens)]
    out = dict(own)
    for request in drawn:
        pool = pools.get(request.sampling) or pools.get(None)
        if pool is not None:
            out[request.request_id] = _scaled(pool, own[request.request_id].tokens)
    return out


def _pools(target, drafter, domain_requests: list, k: int, max_tokens: int) -> dict:
    """{sampling: summed RoundTotals} of the domain's sampled requests by way of sampling, those
    of fewer than MIN_CLASS requests left out, and under None all of them."""
    sampled = [end_slot(truncated(r, min(len(r.response_ids), max_tokens))) for r in domain_requests
               if not r.sampling.greedy and len(r.response_ids) >= 2]
    totals = offline_totals(target, drafter, sampled, k)
    by_way: dict = defaultdict(list)
    for request in sampled:
        if request.request_id in totals:
            by_way[request.sampling].append(totals[request.request_id])
            by_way[None].append(totals[request.request_id])
    return {way: sum(rows[1:], rows[0]) for way, rows in by_way.items()
            if way is None or len(rows) >= MIN_CLASS}


def _scaled(pool: RoundTotals, tokens: float) -> RoundTotals:
    """The pool's rounds per token (and draft counts) at `tokens` tokens."""
    share = tokens / pool.tokens if pool.tokens else 0.0
    return RoundTotals(tokens, pool.rounds * share, pool.reached * share, pool.accepted * share,
                       pool.widths * share)
