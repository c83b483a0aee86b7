"""The monitor's scrape (tasks.steps.monitor.monitor): read a vLLM server's /metrics
(prometheus-client's parser, via tasks.serving.server.spec_decode_counters) and store its
spec-decode counters with their deltas since the deployment's previous scrape. A counter that falls
means the server restarted: the scrape starts a new series and its deltas are the counters
themselves (they count from zero since the restart), never negative. A deployment's first scrape is
a baseline (deltas 0). A server that does not answer stores nothing (MonitorScrapeError, one line);
nor does a body over `monitor_scrape_max_bytes`, one not read within `monitor_scrape_timeout_s` in
total, a position beyond the largest K, or counters (or deltas) that cannot be (check_counters).
"""

from __future__ import annotations

import logging
import math
import threading
from datetime import datetime

import httpx

from ...db import queries_monitor as q
from ...errors import MonitorScrapeError, RegistryError
from ...masking import mask_text, mask_url, printable
from ...paths import check_identifier
from ...registry.compose_export import deployments
from ...registry.config_schema import SpecdecConfig
from ...registry.tracking import load_version_config
from ...serving.server import PositionOutOfRange, spec_decode_counters
from ...settings import Settings
from ...timeutil import utcnow
from .drift import ensure_promises
from .monitor import MonitorContext

log = logging.getLogger(__name__)

COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


SPEC_PREFIX = b"vllm:spec_decode_"     # the families a scrape reads; every other line is skipped
MAX_COUNTER = 2**31 - 1                # what monitor_scrapes' integer columns hold on every backend


def _fetch(target: str, timeout_s: float, max_bytes: int, out: dict) -> None:
    """GET `target` streamed, keeping only the lines of the spec-decode families (and noting
    whether any vllm: family was seen), reading at most max_bytes: the body is never held whole.
    Results (or the exception) go into `out`; out["abandoned"] set by the caller stops it."""
    try:
        with httpx.stream("GET", target, timeout=timeout_s) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                return
            kept, partial, size, vllm = [], b"", 0, False
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    out["too_large"] = size
                    return
                if out.get("abandoned"):
                    return
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                for line in lines:
                    vllm = vllm or b"vllm:" in line
                    if line.startswith(SPEC_PREFIX) or (line.startswith(b"#") and SPEC_PREFIX in line):
                        kept.append(line)
            vllm = vllm or b"vllm:" in partial
            if partial.startswith(SPEC_PREFIX):
                kept.append(partial)
            out["lines"], out["vllm"] = kept, vllm
    except Exception as exc:        # handed to the caller, which names it
        out["error"] = exc


def read_counters(url: str, deployment: str, settings: Settings) -> dict:
    """vLLM's spec-decode counters at `url`, read within monitor_scrape_timeout_s in total and
    monitor_scrape_max_bytes, and checked (check_counters); MonitorScrapeError (one line, naming
    the deployment, the URL and the fix) when the server does not answer, answers too much or too
    slowly, does not serve vLLM's metrics or serves impossible counters."""
    target = metrics_url(url)
    shown = mask_url(target)            # what messages name: the URL without its password
    timeout_s, max_bytes = settings.monitor.scrape_timeout_s, settings.monitor.scrape_max_bytes
    out: dict = {}
    reader = threading.Thread(target=_fetch, args=(target, timeout_s, max_bytes, out), daemon=True,
                              name=f"scrape {deployment}")
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():            # the reader ends on its own at its next read or timeout
        out["abandoned"] = True
        raise MonitorScrapeError(f"deployment {deployment}: {shown} did not finish within "
                                 f"{timeout_s:g} s (setting monitor_scrape_timeout_s); nothing stored")
    if "error" in out:
        exc = out["error"]
        raise MonitorScrapeError(f"deployment {deployment}: no answer from {shown} "
                                 f"({type(exc).__name__}: {printable(mask_text(str(exc))[:200]) or 'no detail'}); nothing "
                                 "stored. Check that the server is up and the URL is right") from None
    if out["status"] != 200:
        raise MonitorScrapeError(f"deployment {deployment}: {shown} answered HTTP "
                                 f"{out['status']}; nothing stored")
    if "too_large" in out:
        raise MonitorScrapeError(f"deployment {deployment}: the body of {shown} is over {max_bytes} "
                                 "bytes (setting monitor_scrape_max_bytes); nothing stored")
    if not out["vllm"]:
        raise MonitorScrapeError(f"deployment {deployment}: {shown} serves no vLLM metrics "
                                 "(no vllm:* family); nothing stored. Give the vLLM server's URL")
    try:
        text = b"\n".join(out["lines"]).decode("utf-8") + "\n"
        counters = spec_decode_counters(text, max_positions=settings.quality.k_max)
    except (ValueError, KeyError) as exc:
        raise MonitorScrapeError(f"deployment {deployment}: {shown} is not a Prometheus text "
                                 f"exposition ({exc}); nothing stored") from None
    except PositionOutOfRange as exc:
        raise MonitorScrapeError(f"deployment {deployment}: {shown}: {exc}; nothing stored") from None
    problem = check_counters(counters)
    if problem:
        raise MonitorScrapeError(f"deployment {deployment}: {shown} serves impossible counters "
                                 f"({problem}); nothing stored")
    return counters


def check_counters(counters: dict, since: str = "") -> str | None:
    """What makes a scrape's counters (or deltas) impossible, or None: each a whole number in
    0..MAX_COUNTER, accepted <= draft tokens, drafts <= draft tokens, no position accepted more
    often than there were drafts."""
    values = {name: counters[name] for name in COUNTERS}
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value == int(value)
                and 0 <= value <= MAX_COUNTER):
            return f"{since}{name} {value:g} is not a count (a whole number in 0..{MAX_COUNTER})"
    drafts, drafted, accepted = (int(values[name]) for name in COUNTERS)
    if accepted > drafted:
        return f"{since}{accepted} accepted of {drafted} draft tokens"
    if drafts > drafted:
        return f"{since}{drafts} drafts of {drafted} draft tokens"
    for position, value in enumerate(counters["accepted_per_pos"]):
        if not (math.isfinite(value) and value == int(value) and 0 <= value <= drafts):
            return f"{since}position {position} counts {value:g} accepted of {drafts} drafts"
    return None


def _minus(now: list[int], before: list[int]) -> list[int]:
    width = max(len(now), len(before))
    now, before = now + [0] * (width - len(now)), before + [0] * (width - len(before))
    return [a - b for a, b in zip(now, before)]


def series_deltas(previous: dict | None, counters: dict) -> dict:
    """{series, start, delta_*} of a scrape after `previous` (see the module's docstring)."""
    per_pos = list(counters["accepted_per_pos"])
    if previous is None:
        return {"series": 1, "start": "baseline", "delta_drafts": 0, "delta_draft_tokens": 0,
                "delta_accepted": 0, "delta_per_pos": [0] * len(per_pos)}
    before = [previous["drafts"], previous["draft_tokens"], previous["accepted_tokens"]]
    now = [counters[name] for name in COUNTERS]
    pos_delta = _minus(per_pos, list(previous["accepted_per_pos"] or []))
    if any(a < b for a, b in zip(now, before)) or any(d < 0 for d in pos_delta):
        return {"series": previous["series"] + 1, "start": "restart", "delta_drafts": now[0],
                "delta_draft_tokens": now[1], "delta_accepted": now[2], "delta_per_pos": per_pos}
    return {"series": previous["series"], "start": None, "delta_drafts": now[0] - before[0],
            "delta_draft_tokens": now[1] - before[1], "delta_accepted": now[2] - before[2],
            "delta_per_pos": pos_delta}


def scrape(ctx: MonitorContext, url: str, deployment: str, at: datetime | None = None,
           config: tuple[str, SpecdecConfig] | None | bool = None) -> dict:
    """Read `url`'s counters and store them with their deltas (see the module's docstring).
    config: (version, config) the deployment serves; None: the version of the server's series, or
    the champion at a baseline or restart (_served_config); False: stored without a version."""
    check_identifier(deployment, "deployment name", "it names the scrapes, alerts and rollbacks "
                                                    "of one server")
    counters = read_counters(url, deployment, ctx.settings)
    previous = q.last_scrape(ctx.store, deployment)
    step = series_deltas(previous, counters)
    problem = check_counters({"drafts": step["delta_drafts"], "draft_tokens": step["delta_draft_tokens"],
                              "accepted_tokens": step["delta_accepted"],
                              "accepted_per_pos": step["delta_per_pos"]}, "since the previous scrape: ")
    if problem:
        raise MonitorScrapeError(f"deployment {deployment}: {mask_url(metrics_url(url))} serves "
                                 f"impossible counters ({problem}); nothing stored")
    if config is None:
        config = _served_config(ctx, previous, step)
    version, spec_config = config if config else (None, None)
    domains = None
    if spec_config is not None:
        mine = [d for d in deployments(spec_config) if d["name"] == deployment]
        domains = mine[0]["domains"] if mine else None
        if mine:
            ensure_promises(ctx, version, spec_config, mine[0])
    row = {"deployment": deployment, "url": mask_url(url)[:500], "scraped_at": at or utcnow(),
           "config_name": ctx.config_name if version else None, "config_version": version,
           "run_id": spec_config.run_id if spec_config else None, "domains": domains,
           "drafts": counters["drafts"], "draft_tokens": counters["draft_tokens"],
           "accepted_tokens": counters["accepted_tokens"],
           "accepted_per_pos": counters["accepted_per_pos"],
           **step}
    row["id"] = q.insert_scrape(ctx.store, row)
    return row


def _served_config(ctx: MonitorContext, previous: dict | None, step: dict):
    """(version, config) the server serves: a server keeps the config it started with, so within
    a series the version of the series' scrapes (a rollback changes what runs only when the
    server is restarted); at a baseline or a restart, the champion. None when unknown (no
    champion, or the registry does not answer: stored without a version)."""
    try:
        if previous is not None and step["start"] is None and previous["config_version"] \
                and previous["config_name"] == ctx.config_name:
            mlflow_client = ctx.registry.client
            version = previous["config_version"]
            return version, load_version_config(mlflow_client, ctx.config_name, version)
        version, config = ctx.champion()
    except RegistryError as exc:
        log.warning("scrape stored without a config version: the registry did not answer (%s)", exc)
        return None
    return (version, config) if version else None
