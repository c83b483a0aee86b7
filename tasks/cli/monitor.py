"""`specdec monitor scrape|check|show`: production acceptance from the serving engines, beside the
champion's promise (tasks.steps.monitor; docs/monitoring.md)."""

from __future__ import annotations


from rich.markup import escape
from rich.table import Table

from specdec_core.home import DEFAULT_MODEL

from .common import open_registry, open_store, print_json, tracking_uri_arg, url_arg, utc_time
from .console import make_console

console = make_console()
errors = make_console(stderr=True)


def _context(args):
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.monitor.monitor import MonitorContext

    store = open_store(args)
    return MonitorContext.open(store, open_registry(args, store), args.target)


def _e(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_events(events: list[dict]) -> None:
    for event in events:
        console.print(f"[red]{event['kind'].upper()}[/red] {escape(event['deployment'])} version "
                      f"{event['config_version']}: {escape(event['reason'] or '')}")


def cmd_scrape(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.monitor.drift import check
    from ..steps.monitor.scrape import scrape

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
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.monitor.drift import check

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
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.monitor.monitor import show

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


def register(sub) -> None:
    monitor = sub.add_parser("monitor", help="production acceptance from the serving engines")
    m_sub = monitor.add_subparsers(dest="monitor_command", required=True)

    def common(parser, database: str = "--url"):
        parser.add_argument("--target", default=DEFAULT_MODEL, help="target id (names the registered model)")
        tracking_uri_arg(parser)
        if database == "--url":
            url_arg(parser)
        else:        # `monitor scrape --url` names the server
            parser.add_argument(database, dest="url", default=None,
                                help="specdec's database URL (default: $SPECDEC_DATABASE_URL, else "
                                     "sqlite:///$SPECDEC_HOME/specdec.db)")
        parser.add_argument("--json", action="store_true")

    scrape = m_sub.add_parser("scrape", help="store a vLLM server's spec-decode counter deltas, then check")
    scrape.add_argument("--url", dest="url_to_scrape", required=True, metavar="URL",
                        help="the server (http://host:port) or its /metrics")
    scrape.add_argument("--deployment", required=True,
                        help="the deployment's name (`specdec config export --format compose` names them)")
    scrape.add_argument("--no-check", action="store_true", help="store only: no drift check")
    common(scrape, database="--db-url")
    scrape.set_defaults(func=cmd_scrape)
    check = m_sub.add_parser("check", help="drift alert and automatic rollback over the window")
    common(check)
    check.set_defaults(func=cmd_check)
    show = m_sub.add_parser("show", help="per deployment and domain: production vs promised")
    show.add_argument("--deployment", default=None)
    show.add_argument("--since", type=utc_time("--since"), default=None, help="ISO time (UTC); default: the monitor window")
    show.add_argument("--until", type=utc_time("--until"), default=None, help="ISO time (UTC); default: now")
    common(show)
    show.set_defaults(func=cmd_show)
