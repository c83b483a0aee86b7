"""The monitor's promises and check (tasks.steps.monitor.monitor): production's acceptance against
what the champion promised, drift alerts and automatic rollback.

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
"""

from __future__ import annotations

import logging
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from ...db import queries_monitor as q
from ...errors import RegistryError
from ...registry.compose_export import deployments
from ...registry.config_schema import SpecdecConfig
from ...registry.plots import _pyplot, production_figure
from ...registry.promotion import rollback
from ...registry.version_page import production_markdown, write_production
from ...timeutil import utcnow
from ..estimate.acceptance import mean_accepted_length
from ..costs.cost_table import CostProfileError, CostTable
from ..plan.plan import speedup_factor
from .monitor import MonitorContext, request_figures, show, window_figures

log = logging.getLogger(__name__)

ACTOR = "specdec monitor"


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
        figures = request_figures(sums.get(domain))
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
