"""Stratified per-domain sample of stored traffic for one evaluation run (recorded in eval_samples).

Each request gets a key, and a domain's sample is the max_per_domain requests with the smallest
keys in the window. By default (settings.sample.draw "stable") the key is sha256 of the request id
alone: a uniform draw of the window that every run over the same traffic repeats, and that a
later window changes only by the requests that entered or left it. Two runs over the same
traffic then measure the same requests, so their decisions differ only where the costs differ:
drawn anew each run ("per_run", the key sha256(run_id, request_id)), a domain whose speedup is
near the bar turned on in one run and off in the next on the draw alone (30 of the shipped
sample's 110 requests a domain: four runs planned on one stored profile turned on three different
sets of domains; docs/evaluation.md). Either way the
draw does not depend on the database's row order, and streaming the candidate ids through a
bounded heap keeps memory at O(max_per_domain) whatever the traffic volume.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from ...db.queries_samples import domains_where, record_sample, request_ids_where, window_condition
from ...db.queries_window import newest_request_at
from ...db.store import Store
from ...errors import SampleError
from ...paths import check_identifier
from ...settings import Settings
from ...timeutil import utcnow

log = logging.getLogger(__name__)

SAMPLE_SUITE = "traffic_sample"


def selection_key(run_id: str, request_id: str) -> bytes:
    """The order in which a run draws requests: smaller keys first."""
    return hashlib.sha256(f"{run_id}\x00{request_id}".encode("utf-8")).digest()


STABLE_DRAW = "stable-draw"     # the key's prefix in a stable draw, in place of a run id


def draw_seed(run_id: str, draw: str) -> str:
    """What keys a run's draw (selection_key's first argument): the run id where every run draws
    anew ("per_run"), else one fixed seed, so that runs over the same traffic draw alike."""
    return run_id if draw == "per_run" else STABLE_DRAW


def _as_datetime(value, name: str) -> datetime:
    if isinstance(value, datetime):
        parsed = value
    else:
        try:
            parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            raise SampleError(f"window {name} {value!r} is not an ISO 8601 time "
                              "(e.g. 2025-11-03 or 2025-11-03T12:00:00Z)") from None
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(timezone.utc).replace(tzinfo=None)
    return parsed


def resolve_window(store: Store, window, settings: Settings) -> tuple[datetime, datetime, int]:
    """(start, end, future rows left out) in naive UTC, end inclusive.

    window None or a number of days: that many days ending at the newest stored request (not at
    "now", so a fixed data set such as the shipped sample is always covered), leaving out rows
    stamped more than settings.sample.future_tolerance_hours after now (counted: the third value); a
    (start, end) pair of datetimes or ISO strings: taken as given (0 left out).
    """
    if window is None or isinstance(window, (int, float)):
        days = settings.sample.window_days if window is None else float(window)
        if days <= 0:
            raise SampleError(f"window of {days} days: give a positive number of days")
        cutoff = utcnow() + timedelta(hours=settings.sample.future_tolerance_hours)
        newest, future = newest_request_at(store, cutoff)
        if future:
            log.warning("%d stored request(s) are stamped more than %g h in the future (after %s "
                        "UTC; setting sample_future_tolerance_hours): the default window ignores them",
                        future, settings.sample.future_tolerance_hours, cutoff.isoformat(timespec="seconds"))
        if newest is None:
            raise SampleError("traffic_requests is empty: import traffic first "
                              "(`specdec traffic import FILE`)" if not future else
                              f"every stored request ({future}) is stamped in the future: give the "
                              "window as a (start, end) pair, or fix the clock that stamped them")
        return newest - timedelta(days=days), newest, future
    try:
        start, end = window
    except (TypeError, ValueError):
        raise SampleError(f"window {window!r}: give a number of days or a (start, end) pair") from None
    start, end = _as_datetime(start, "start"), _as_datetime(end, "end")
    if start > end:
        raise SampleError(f"window start {start} is after its end {end}")
    return start, end, 0


@dataclass
class Draw:
    """A run's draw: per domain {"available", "sampled", "status"}, and the eval_samples rows."""
    per_domain: dict[str, dict] = field(default_factory=dict)
    sample_rows: list[dict] = field(default_factory=list)


def sample_traffic(run_id: str, store: Store, domains: list[str] | None = None,
                   window=None, min_per_domain: int | None = None,
                   max_per_domain: int | None = None, model: str | None = None,
                   settings: Settings | None = None) -> dict:
    """Draw and record the run's sample: per domain up to max_per_domain requests in the window.

    Inputs: run id (the sample's key; it seeds the draw where settings.sample.draw is "per_run"), the Store, domains (default: every domain with traffic in
    the window), window (see resolve_window), min/max per domain (default: settings), model (only
    requests answered by this target; default: all). A domain with fewer than min_per_domain
    requests is "insufficient" (still recorded; the quality step and the planner decide).
    Re-running a run id replaces that run's sample (and its sample-quality results) and nothing else.
    Output: {"run_id", "window", "domains": {name: {"available", "sampled", "status"}},
             "sampled", "insufficient"}.
    """
    check_identifier(run_id, "run id")      # the run's files under $SPECDEC_HOME are named by it
    settings = settings or store.settings
    min_rows, max_rows = _sample_limits(settings, min_per_domain, max_per_domain, domains)

    seed = draw_seed(run_id, settings.sample.draw)
    start, end, future = resolve_window(store, window, settings)
    with store.transaction() as tx:
        # production traffic only: rows the target generated for training are never sampled
        in_window = window_condition(start, end, model)
        if domains is None:
            domains = domains_where(tx, in_window)
        draw = Draw()
        for domain in sorted(set(domains)):
            available, chosen = _draw_domain(tx, in_window, seed, domain, max_rows)
            draw.sample_rows += [{"run_id": run_id, "request_id": request_id, "domain": domain,
                                  "position": position}
                                 for position, request_id in enumerate(chosen)]
            draw.per_domain[domain] = {"available": available, "sampled": len(chosen),
                                       "status": "ok" if len(chosen) >= min_rows else "insufficient"}
        _record_sample(tx, run_id, draw, start, end,
                       {"domains": sorted(draw.per_domain), "min_per_domain": min_rows,
                        "max_per_domain": max_rows, "model": model, "draw": settings.sample.draw})

    per_domain = draw.per_domain
    insufficient = sorted(d for d, info in per_domain.items() if info["status"] == "insufficient")
    log.info("run %s: sampled %d requests over %d domains in [%s, %s]; insufficient: %s", run_id,
             len(draw.sample_rows), len(per_domain), start, end, insufficient or "none")
    return {"run_id": run_id, "window": {"start": start.isoformat(), "end": end.isoformat(),
                                         "future_rows_ignored": future},
            "domains": per_domain, "sampled": len(draw.sample_rows), "insufficient": insufficient,
            "min_per_domain": min_rows, "max_per_domain": max_rows}


def _sample_limits(settings: Settings, min_per_domain: int | None, max_per_domain: int | None,
                   domains: list[str] | None) -> tuple[int, int]:
    """(min, max) requests per domain (the settings' where not given), checked, and the domains
    asked for checked against the known set."""
    min_rows = settings.sample.min_per_domain if min_per_domain is None else int(min_per_domain)
    max_rows = settings.sample.max_per_domain if max_per_domain is None else int(max_per_domain)
    if not 1 <= min_rows <= max_rows:
        raise SampleError(f"min_per_domain {min_rows} / max_per_domain {max_rows}: need 1 <= min <= max")
    if domains is not None:
        unknown = sorted(set(domains) - set(settings.known_domains))
        if unknown:
            raise SampleError(f"domains {unknown} are not in the known set {list(settings.known_domains)}")
    return min_rows, max_rows


def _draw_domain(tx, in_window, seed: str, domain: str,
                 max_rows: int) -> tuple[int, list[str]]:
    """One domain's draw: (requests available in the window, the max_rows request ids with the
    smallest selection keys under `seed` (draw_seed), in ascending key order), streamed through a
    bounded heap."""
    heap: list[tuple[bytes, str]] = []    # max-heap by key (negated): the smallest keys stay
    available = 0
    for request_id in request_ids_where(tx, in_window, domain):
        available += 1
        key = bytes(255 - b for b in selection_key(seed, request_id))
        if len(heap) < max_rows:
            heapq.heappush(heap, (key, request_id))
        elif key > heap[0][0]:
            heapq.heapreplace(heap, (key, request_id))
    chosen = sorted(heap, reverse=True)   # ascending selection key
    return available, [request_id for _, request_id in chosen]


def _record_sample(tx, run_id: str, draw: Draw, start: datetime, end: datetime,
                   params: dict) -> None:
    """In the draw's transaction: the run's eval_runs row written (created or updated), its
    earlier sample and sample-quality results replaced by this draw."""
    now = utcnow()
    values = {"updated_at": now, "status": "sampled", "window_start": start, "window_end": end,
              "params": params}
    record_sample(tx, run_id, values, draw.sample_rows, SAMPLE_SUITE, now)
