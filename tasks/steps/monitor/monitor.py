"""Production talks back: the serving deployments' own acceptance, beside what the champion promised.

The monitor's steps, one module each: the scrape (tasks.steps.monitor.scrape), the promises and
the check (tasks.steps.monitor.drift), and the show, here with what they share: the monitor's
context (MonitorContext) and a window's figures (window_figures, request_figures).

- show: per deployment and domain over a window: drafts, draft tokens, accepted, E and
  per-position rates (the share of drafts whose i-th token was accepted), scraped and from the
  imported per-request metrics, beside the promise, with the monitor's events.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from ...db import queries_monitor as q
from ...db.store import Store
from ...registry.config_schema import SpecdecConfig, config_model_name
from ...registry.registry import Registry
from ...registry.tracking import CHAMPION, alias_version, load_version_config
from ...settings import DEFAULT_MODEL, Settings
from ...timeutil import utcnow
from ..estimate.acceptance import accepted_per_position, mean_accepted_length, position_rates


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
# a window's figures
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


def request_figures(sums: dict | None) -> dict:
    """Requests, drafts, draft tokens, accepted, E and per-position rates of imported per-request
    metrics (a domain's sums over a window)."""
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
                            "per_request": request_figures(requests.get(domain))})
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
