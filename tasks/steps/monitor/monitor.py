"""Production talks back: the serving deployments' own acceptance, beside what the champion promised.

- scrape: read a vLLM server's /metrics (prometheus-client's parser, via
  tasks.serving.server.spec_decode_counters) and store its spec-decode counters with their deltas
  since the deployment's previous scrape. A counter that falls means the server restarted: the
  scrape starts a new series and its deltas are the counters themselves (they count from zero
  since the restart), never negative. A deployment's first scrape is a baseline (deltas 0). A
  server that does not answer stores nothing (MonitorScrapeError, one line); nor does a body over
  `monitor_scrape_max_bytes`, one not read within `monitor_scrape_timeout_s` in total, a position
  beyond the largest K, or counters (or deltas) that cannot be (check_counters).
- promises: per domain of a deployment, the champion's estimate of E at the deployed K with its
  95% interval, and the break-even E: the E at which the config's predicted speedup is 1.0 on the
  cost profile it was planned with (at the profile's smallest batch size), i.e. 1 / the plan's
  speedup factor (tasks.steps.plan.plan.speedup_factor); without that profile, the config's own E over
  its predicted speedup. Stored once per deployment and version (monitor_promises).
- check: over the sustained window (the scrapes of the champion version in the last
  `monitor_window_s`, never before it became champion), with at least `monitor_min_drafts`
  drafts, production E = 1 + accepted / drafts. Below the lowest promise interval of the
  deployment's domains: a drift alert (once per deployment, version and series). Below the lowest
  break-even: the champion is rolled back through tasks.registry.promotion.rollback (the
  compare-and-set path of `specdec config rollback`, expecting the version the evidence is about),
  its audit row naming the evidence; setting `monitor_auto_rollback` off leaves the alert only.
  The same per domain (check_domains) from the per-request metrics of its imported traffic: one
  deployment serves several domains at their own K, and a domain whose acceptance fell must not
  hide behind a busier one in the deployment's counters.
- show: per deployment and domain over a window: drafts, draft tokens, accepted, E and
  per-position rates (the share of drafts whose i-th token was accepted), scraped and from the
  imported per-request metrics, beside the promise, with the monitor's events.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx

from ...db import queries_monitor as q
from ...db.store import Store
from ...errors import MonitorScrapeError, RegistryError
from ...masking import mask_text, mask_url, printable
from ...paths import check_identifier
from ...registry.compose_export import deployments
from ...registry.config_schema import SpecdecConfig, config_model_name
from ...registry.promotion import rollback
from ...registry.registry import Registry
from ...registry.tracking import CHAMPION, alias_version, load_version_config
from ...serving.server import PositionOutOfRange, spec_decode_counters
from ...settings import DEFAULT_MODEL, Settings
from ...timeutil import utcnow
from ..estimate.acceptance import accepted_per_position, mean_accepted_length, position_rates
from ..costs.cost_table import CostProfileError, CostTable
from ..plan.plan import speedup_factor

log = logging.getLogger(__name__)

COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


ACTOR = "specdec monitor"


@dataclass
class MonitorContext:
    """What the monitor works with: specdec's database, the registry and the settings."""

    store: Store                      # the queries and the registry take it
    registry: Registry                # the MLflow tracking store: the champion, rollback
    settings: Settings
    config_name: str

    @classmethod
    def open(cls, store: Store, registry: Registry | None = None, target: str | None = None,
             settings: Settings | None = None) -> "MonitorContext":
        """registry: default Registry.open(store=store) (nothing is contacted until it is used)."""
        return cls(store, registry or Registry.open(store=store), settings or store.settings,
                   config_model_name(target or DEFAULT_MODEL))

    def champion(self) -> tuple[str | None, SpecdecConfig | None]:
        mlflow_client = self.registry.client
        version = alias_version(mlflow_client, self.config_name, CHAMPION)
        return version, (load_version_config(mlflow_client, self.config_name, version)
                         if version else None)


# ------------------------------------------------------------------------------------------------
# scrape
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


# ------------------------------------------------------------------------------------------------
# promises
def break_even(estimate: dict | None, setting, costs: CostTable | None) -> float | None:
    """The E at which the config's predicted speedup is 1.0 (see the module's docstring)."""
    if estimate is not None and costs is not None and costs.batch_sizes:
        share = estimate.get("draft_width_share") or [0.0] * estimate["k"] + [1.0]
        try:
            return 1.0 / speedup_factor(estimate["drafter"], estimate.get("drafter_spec"), share,
                                        costs, costs.batch_sizes[0])
        except (CostProfileError, KeyError, IndexError, ZeroDivisionError):
            pass
    if setting is not None and setting.mean_accepted_length and setting.predicted_speedup:
        return setting.mean_accepted_length / setting.predicted_speedup
    return None


def ensure_promises(ctx: MonitorContext, version: str, config: SpecdecConfig, deployment: dict) -> list[dict]:
    """The deployment's promises under `version`, read from the run and stored once."""
    stored = q.promises(ctx.store, deployment["name"], ctx.config_name, version)
    if stored or deployment["speculative_config"] is None:
        return stored
    planned = q.planned_estimates(ctx.store, config.run_id, deployment["domains"])
    rows = q.cost_rows(ctx.store, config.hardware_profile, config.run_id)
    costs = CostTable.from_rows(config.hardware_profile, config.run_id, rows) if rows else None
    out = []
    for domain in deployment["domains"]:
        setting = config.domains.get(domain)
        estimate = (planned.get(domain) or {}).get("estimate")
        out.append({"deployment": deployment["name"], "config_name": ctx.config_name,
                    "config_version": str(version), "domain": domain, "run_id": config.run_id,
                    "k": setting.k if setting else None,
                    "speculative_config": deployment["speculative_config"],
                    "promise_e": (estimate or {}).get("mean_accepted_length")
                    or (setting.mean_accepted_length if setting else None),
                    "promise_lo": (estimate or {}).get("mean_accepted_length_lo"),
                    "promise_hi": (estimate or {}).get("mean_accepted_length_hi"),
                    "break_even": break_even(estimate, setting, costs),
                    "profile": config.hardware_profile if rows else None, "created_at": utcnow()})
    q.save_promises(ctx.store, out)
    return out


# ------------------------------------------------------------------------------------------------
# check: drift alert and automatic rollback
def window_figures(rows: list[dict]) -> dict:
    """Drafts, draft tokens, accepted, E and per-position rates over scrapes' deltas."""
    drafts = sum(r["delta_drafts"] for r in rows)
    accepted = sum(r["delta_accepted"] for r in rows)
    per_pos: list[int] = []
    for r in rows:
        per_pos = [a + b for a, b in zip(*(_pad(per_pos, r["delta_per_pos"] or [])))]
    return {"drafts": drafts, "draft_tokens": sum(r["delta_draft_tokens"] for r in rows),
            "accepted": accepted, "e": mean_accepted_length(accepted, drafts),
            "position_rates": position_rates(per_pos, drafts, digits=6) or [],
            "scrapes": len(rows)}


def _pad(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    width = max(len(a), len(b))
    return a + [0] * (width - len(a)), b + [0] * (width - len(b))


def check_deployment(ctx: MonitorContext, version: str, config: SpecdecConfig, deployment: dict,
                     at: datetime) -> dict:
    """The window's figures of one deployment of the champion and the events they raised."""
    settings = ctx.settings
    moved = q.champion_moved_at(ctx.store, ctx.config_name, version)
    since = at - timedelta(seconds=settings.monitor.window_s)
    since = max(since, moved) if moved else since
    rows = q.scrapes(ctx.store, deployment["name"], since, at, version)
    promises = ensure_promises(ctx, version, config, deployment)
    by_domain = check_domains(ctx, version, deployment, promises, since, at)
    figures = window_figures(rows)
    lows = [p["promise_lo"] for p in promises if p["promise_lo"] is not None]
    evens = [p["break_even"] for p in promises if p["break_even"] is not None]
    status = {"deployment": deployment["name"], "domains": deployment["domains"], **figures,
              "window_start": rows[0]["scraped_at"] if rows else None, "window_end": at,
              "promise_lo": min(lows) if lows else None, "break_even": min(evens) if evens else None,
              "state": "ok", "domain_checks": by_domain,
              "events": [e for d in by_domain for e in d["events"]]}
    min_drafts = settings.monitor.min_drafts
    if figures["e"] is None or figures["drafts"] < min_drafts:
        status["state"] = f"insufficient ({figures['drafts']} drafts < {min_drafts})"
        return status
    series = rows[-1]["series"]
    event = {"deployment": deployment["name"], "config_name": ctx.config_name,
             "config_version": version, "series": series, "domains": deployment["domains"],
             "window_start": rows[0]["scraped_at"], "window_end": rows[-1]["scraped_at"],
             "drafts": figures["drafts"], "production_e": figures["e"],
             "promise_lo": status["promise_lo"], "promise_hi": max(
                 (p["promise_hi"] for p in promises if p["promise_hi"] is not None), default=None),
             "break_even": status["break_even"],
             "evidence": {**figures, "scrape_ids": [r["id"] for r in rows], "window_s":
                          settings.monitor.window_s, "min_drafts": min_drafts}}
    alerted = q.has_event(ctx.store, "alert", deployment["name"], ctx.config_name, version, series)
    # a domain's own rollback (check_domains) goes first: the champion has moved already
    rolled = any(e["kind"] == "rollback" for e in status["events"])
    _judge(ctx, version, status, event, f"production E {figures['e']:.3f} over {figures['drafts']} "
                                        "drafts", alerted, rolled)
    return status


def _judge(ctx: MonitorContext, version: str, status: dict, event: dict, what: str, alerted: bool,
           rolled: bool = False) -> None:
    """The verdict on one window's E (event["production_e"]) against status' promise_lo and
    break_even: a drift alert below the promise (unless `alerted` already), an automatic rollback
    below the break-even (unless `rolled`); status' state and events follow."""
    e = event["production_e"]
    if status["promise_lo"] is not None and e < status["promise_lo"]:
        status["state"] = "below promise"
        if not alerted:
            status["events"].append(q.insert_event(ctx.store, dict(
                event, kind="alert", created_at=utcnow(),
                reason=f"{what} is below the promise's interval (lowest end {status['promise_lo']:.3f})")))
    if status["break_even"] is not None and e < status["break_even"]:
        status["state"] = "below break-even"
        if not rolled:
            status["events"] += _auto_rollback(ctx, version, event)


def check_domains(ctx: MonitorContext, version: str, deployment: dict, promises: list[dict],
                  since: datetime, at: datetime) -> list[dict]:
    """Each domain of one deployment on its own, from the per-request metrics of its imported
    traffic in the window (the requests of `version`, and those logged without a version): one
    server serves several domains, each at its own K, so a domain whose acceptance fell can hide
    in the deployment's counters behind a busier one. With at least monitor_min_drafts drafts,
    E below the domain's promise interval raises a drift alert for that domain, below its
    break-even an automatic rollback (once per domain and version). Output: [{domain, requests,
    drafts, e, promise_lo, break_even, state, events}]."""
    sums = q.request_metrics_by_domain(ctx.store, since, at, config_version=version, unversioned=True)
    min_drafts, out = ctx.settings.monitor.min_drafts, []
    for promise in promises:
        domain = promise["domain"]
        figures = _request_figures(sums.get(domain))
        status = {"domain": domain, "requests": figures["requests"], "drafts": figures["drafts"],
                  "e": figures["e"], "promise_lo": promise["promise_lo"],
                  "break_even": promise["break_even"], "state": "ok", "events": []}
        out.append(status)
        if figures["e"] is None or figures["drafts"] < min_drafts:
            status["state"] = f"insufficient ({figures['drafts']} drafts < {min_drafts})"
            continue
        event = {"deployment": deployment["name"], "config_name": ctx.config_name,
                 "config_version": version, "series": None, "domains": [domain],
                 "window_start": since, "window_end": at, "drafts": figures["drafts"],
                 "production_e": figures["e"], "promise_lo": promise["promise_lo"],
                 "promise_hi": promise["promise_hi"], "break_even": promise["break_even"],
                 "evidence": {**figures, "source": "per-request metrics", "domain": domain,
                              "window_s": ctx.settings.monitor.window_s, "min_drafts": min_drafts}}
        _judge(ctx, version, status, event, f"domain {domain}: production E {figures['e']:.3f} over "
                                            f"{figures['drafts']} drafts of {figures['requests']} requests",
               q.has_domain_event(ctx.store, "alert", deployment["name"], ctx.config_name, version, domain))
    return out


def _auto_rollback(ctx: MonitorContext, version: str, event: dict) -> list[dict]:
    """Roll the champion back (compare-and-set on `version`) with the evidence; an event either way."""
    if not ctx.settings.monitor.auto_rollback:
        return []
    per_request = event["series"] is None           # one domain's, from per-request metrics
    for kind in ("rollback", "rollback_refused"):
        if q.has_event(ctx.store, kind, event["deployment"], ctx.config_name, version, event["series"]) \
                if not per_request else q.has_domain_event(ctx.store, kind, event["deployment"],
                                                           ctx.config_name, version, event["domains"][0]):
            return []
    source = (f"{event['evidence']['requests']} requests' own metrics" if per_request
              else f"{event['evidence']['scrapes']} scrapes")
    why = (f"deployment {event['deployment']} (domain{'s' * (len(event['domains']) > 1)} "
           f"{', '.join(event['domains'])}): production E {event['production_e']:.3f} over "
           f"{event['drafts']} drafts in {source} ({event['window_start']:%Y-%m-%d %H:%M:%S} to "
           f"{event['window_end']:%H:%M:%S} UTC) is below the break-even {event['break_even']:.3f} "
           f"of the deployed K")
    evidence = {**event["evidence"], "deployment": event["deployment"], "production_e": event["production_e"],
                "break_even": event["break_even"], "promise_lo": event["promise_lo"],
                "window_start": event["window_start"].isoformat(),
                "window_end": event["window_end"].isoformat(), "reason": why}
    try:
        moved = rollback(ctx.config_name, ctx.store, registry=ctx.registry, actor=ACTOR,
                         expected_champion=version, evidence=evidence)
    except RegistryError as exc:
        log.info("automatic rollback of %s version %s refused: %s", ctx.config_name, version, exc)
        return [q.insert_event(ctx.store, dict(event, kind="rollback_refused", created_at=utcnow(),
                                                reason=f"{why}; rollback refused: {exc}"[:4000]))]
    log.info("champion of %s rolled back %s -> %s: %s", ctx.config_name, version,
                moved["champion"], why)
    return [q.insert_event(ctx.store, dict(event, kind="rollback", created_at=utcnow(),
                                            reason=f"{why}; champion {version} -> {moved['champion']}"))]


def check(ctx: MonitorContext, at: datetime | None = None) -> dict:
    """check_deployment for each speculative deployment of the champion:
    {champion, deployments: [...], events: [...]} (no champion: nothing to check)."""
    at = at or utcnow()
    version, config = ctx.champion()
    if config is None:
        return {"champion": None, "deployments": [], "events": []}
    statuses = [check_deployment(ctx, version, config, d, at) for d in deployments(config)
                if d["speculative_config"] is not None]
    try:
        publish(ctx, version, at)
    except Exception as exc:      # the page is documentation; the check's decisions stand
        log.warning("%s version %s: production section not written on the page (%s)",
                    ctx.config_name, version, exc)
    return {"champion": version, "config_name": ctx.config_name, "deployments": statuses,
            "events": [e for s in statuses for e in s["events"]]}


def publish(ctx: MonitorContext, version: str, at: datetime) -> str | None:
    """The version page's Production section (per deployment and domain, promised beside scraped
    and per-request E; the alerts and rollbacks) and its plot over time (`plots/production_e.png`
    of the version's run). Returns the plot's artifact path; None without scrapes."""
    import tempfile
    from pathlib import Path

    from ...registry.plots import _pyplot, production_figure
    from ...registry.version_page import production_markdown, write_production

    rows = [r for r in q.scrapes(ctx.store, config_version=version, until=at)
            if r["config_name"] == ctx.config_name]
    if not rows:
        return None
    points = [{"deployment": r["deployment"], "at": r["scraped_at"],
               "e": mean_accepted_length(r["delta_accepted"], r["delta_drafts"])}
              for r in rows]
    promised = q.promises(ctx.store, config_name=ctx.config_name, config_version=version)
    bands = {}
    for p in promised:
        band = bands.setdefault(p["deployment"], {"lo": [], "hi": [], "break_even": []})
        for key, column in (("lo", "promise_lo"), ("hi", "promise_hi"), ("break_even", "break_even")):
            if p[column] is not None:
                band[key].append(p[column])
    bands = {d: {"lo": min(b["lo"], default=None), "hi": max(b["hi"], default=None),
                 "break_even": min(b["break_even"], default=None)} for d, b in bands.items()}
    events = [dict(e, at=e["window_end"]) for e in q.events(ctx.store)
              if e["config_name"] == ctx.config_name and e["config_version"] == version]
    shown = show(ctx.store, ctx.settings, since=rows[0]["scraped_at"] - timedelta(seconds=1), until=at)
    table = [{"deployment": d["deployment"], "domain": r["domain"], "promise_e": r["promise_e"],
              "promise_lo": r["promise_lo"], "promise_hi": r["promise_hi"], "break_even": r["break_even"],
              "drafts": r["scraped"]["drafts"], "scraped_e": r["scraped"]["e"],
              "request_e": r["per_request"]["e"]}
             for d in shown["deployments"] if d["config_version"] == version for r in d["domains"]]
    mlflow_client = ctx.registry.client
    run_id = mlflow_client.get_model_version(ctx.config_name, version).run_id
    plt = _pyplot()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "production_e.png"
        fig = production_figure(points, bands, events, f"Production E, version {version}")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        mlflow_client.log_artifact(run_id, str(path), "plots")
    write_production(mlflow_client, ctx.config_name, version, production_markdown(
        table, events, f"`specdec monitor`, scrapes {rows[0]['scraped_at']:%Y-%m-%d %H:%M} to "
                       f"{rows[-1]['scraped_at']:%Y-%m-%d %H:%M} UTC", "plots/production_e.png"))
    return "plots/production_e.png"


def champion_deployment_names(ctx: MonitorContext) -> list[str]:
    """The champion's deployments that speculate (the ones with counters to scrape)."""
    _, config = ctx.champion()
    return [] if config is None else [d["name"] for d in deployments(config)
                                      if d["speculative_config"] is not None]


# ------------------------------------------------------------------------------------------------
# show
def _request_figures(sums: dict | None) -> dict:
    if not sums or not sums["drafts"]:
        return {"requests": (sums or {}).get("requests", 0), "drafts": 0, "e": None, "position_rates": []}
    per_pos = accepted_per_position(sums["histogram"])
    return {"requests": sums["requests"], "drafts": sums["drafts"], "draft_tokens": sums["draft_tokens"],
            "accepted": sums["accepted"], "e": mean_accepted_length(sums["accepted"], sums["drafts"]),
            "position_rates": position_rates(per_pos, sums["drafts"], digits=6)}


def show(store: Store, settings: Settings, deployment: str | None = None,
         since: datetime | None = None, until: datetime | None = None) -> dict:
    """Per deployment and domain over [since, until] (default: the last monitor_window_s):
    scraped figures of the deployment's latest config version (also per deployment, "scraped":
    kept where no domain is known, e.g. a scrape without a config version, "note" saying so),
    per-request figures of the domain's imported traffic, the promise, and the monitor's events."""
    until = until or utcnow()
    since = since or until - timedelta(seconds=settings.monitor.window_s)
    names = [deployment] if deployment else q.deployments_seen(store, since)
    requests = q.request_metrics_by_domain(store, since, until)
    out = []
    for name in names:
        rows = q.scrapes(store, name, since, until)
        if not rows:
            continue
        version = rows[-1]["config_version"]
        rows = [r for r in rows if r["config_version"] == version]
        scraped = window_figures(rows)
        promised = {p["domain"]: p for p in q.promises(store, name, rows[-1]["config_name"], version)} \
            if version else {}
        domains = []
        for domain in rows[-1]["domains"] or sorted(promised):
            p = promised.get(domain, {})
            domains.append({"domain": domain, "promise_e": p.get("promise_e"),
                            "promise_lo": p.get("promise_lo"), "promise_hi": p.get("promise_hi"),
                            "break_even": p.get("break_even"), "scraped": scraped,
                            "per_request": _request_figures(requests.get(domain))})
        out.append({"deployment": name, "config_name": rows[-1]["config_name"],
                    "config_version": version, "window_start": rows[0]["scraped_at"],
                    "window_end": rows[-1]["scraped_at"], "series": sorted({r["series"] for r in rows}),
                    "scraped": scraped, "domains": domains,
                    "note": None if domains else (
                        "config version unknown: the scrapes name no domain and no promise; the "
                        "figures are the deployment's" if not version else
                        f"config version {version} names no domain of this deployment")})
    return {"since": since, "until": until, "deployments": out,
            "events": q.events(store, since - timedelta(seconds=1), deployment)}
