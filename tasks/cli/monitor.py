"""`specdec monitor scrape|check|show`: production acceptance from the serving engines, beside the
champion's promise (tasks.steps.monitor; docs/monitoring.md); the parsers: tasks.cli.parsers.monitor."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..steps.monitor.drift import check
from ..steps.monitor.monitor import MonitorContext, show
from ..steps.monitor.scrape import scrape
from .common import open_registry, open_store, print_json
from .console import make_console

console = make_console()
errors = make_console(stderr=True)


def _context(args):
    store = open_store(args)
    return MonitorContext.open(store, open_registry(args, store), args.target)


def _e(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_events(events: list[dict]) -> None:
    for event in events:
        console.print(f"[red]{event['kind'].upper()}[/red] {escape(event['deployment'])} version "
                      f"{event['config_version']}: {escape(event['reason'] or '')}")


def cmd_scrape(args) -> int:
    ctx = _context(args)
    row = scrape(ctx, args.url_to_scrape, args.deployment)
    result = {"scrape": row}
    if not args.no_check and row["config_version"]:
        result["check"] = check(ctx)
    if args.json:
        print_json(result)
        return 0
    start = {"baseline": " (baseline: the first scrape of this deployment)",
             "restart": " (the counters fell: the server restarted, a new series)"}.get(row["start"], "")
    console.print(f"{escape(args.deployment)}: +{row['delta_drafts']} drafts, "
                  f"+{row['delta_draft_tokens']} draft tokens, +{row['delta_accepted']} accepted "
                  f"(series {row['series']}, version {row['config_version'] or 'unknown'}){start}")
    _print_events((result.get("check") or {}).get("events", []))
    return 0


def cmd_check(args) -> int:
    result = check(_context(args))
    if args.json:
        print_json(result)
        return 0
    if result["champion"] is None:
        console.print("no champion: nothing to check")
    for status in result["deployments"]:
        console.print(f"{escape(status['deployment'])}: E {_e(status['e'])} over {status['drafts']} "
                      f"drafts; promise from {_e(status['promise_lo'])}, break-even "
                      f"{_e(status['break_even'])}: {status['state']}")
    _print_events(result["events"])
    return 0


def cmd_show(args) -> int:
    store = open_store(args)
    result = show(store, store.settings, args.deployment, since=args.since, until=args.until)
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"production vs promised, {result['since']:%Y-%m-%d %H:%M} to "
                        f"{result['until']:%H:%M} UTC", title_justify="left")
    for column in ("deployment", "version", "domain", "promised E [interval]", "break-even",
                   "drafts", "scraped E", "per-position", "requests", "per-request E"):
        table.add_column(column)
    for d in result["deployments"]:
        if not d["domains"]:       # what was scraped, though no domain is known (d["note"] says why)
            s = d["scraped"]
            table.add_row(escape(d["deployment"]), str(d["config_version"] or "-"), "(unknown)", "-", "-",
                          str(s["drafts"]), _e(s["e"]), " ".join(f"{x:.2f}" for x in s["position_rates"]),
                          "-", "-")
        for row in d["domains"]:
            s, r = row["scraped"], row["per_request"]
            table.add_row(escape(d["deployment"]), str(d["config_version"] or "-"), row["domain"],
                          f"{_e(row['promise_e'])} [{_e(row['promise_lo'])}, {_e(row['promise_hi'])}]",
                          _e(row["break_even"]), str(s["drafts"]), _e(s["e"]),
                          " ".join(f"{x:.2f}" for x in s["position_rates"]), str(r["requests"]),
                          _e(r["e"]))
    console.print(table)
    for d in result["deployments"]:
        if d.get("note"):
            console.print(escape(f"{d['deployment']}: {d['note']}"))
    for event in result["events"]:
        console.print(f"{event['window_end']:%H:%M:%S} {event['kind']}: {escape(event['reason'] or '')}")
    return 0
