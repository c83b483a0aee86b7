"""`specdec db|traffic|report`: the data commands of the CLI (parsers: tasks.cli.parsers.data)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..db import current_revision, display_url, head_revision, resolve_database_url, upgrade
from ..settings import load_settings
from ..steps.traffic.reports import cell_text, format_report, list_reports, run_report
from ..steps.traffic.traffic_import import (EXIT_QUARANTINED, import_traffic, purge_request, purge_traffic,
                                            sample_traffic_path)
from ..steps.traffic.traffic_sample import sample_traffic
from .common import open_store, print_json
from .console import emit, make_console

console = make_console()


# ------------------------------------------------------------------------------------------------
def cmd_db_upgrade(args) -> int:
    result = upgrade(args.url)
    console.print(f"database {escape(result['url'])}: schema {result['from'] or '(none)'} -> {result['to']}")
    return 0


def cmd_db_current(args) -> int:
    current, head = current_revision(args.url), head_revision()
    state = "up to date" if current == head else "run `specdec db upgrade`"
    console.print(f"database {escape(display_url(resolve_database_url(args.url)))}: "
                  f"revision {current or '(none)'}, head {head} ({state})")
    return 0 if current == head else 1


def cmd_traffic_import(args) -> int:
    if args.sample == (args.file is not None):
        raise SystemExit("specdec traffic import: give FILE or --sample (the shipped sample), not both")
    path = sample_traffic_path() if args.sample else args.file
    settings = load_settings(traffic_import_batch_size=args.batch_size)
    report = import_traffic(path, open_store(args, settings), settings=settings, file_format=args.format,
                            progress=not args.no_progress)
    status = EXIT_QUARANTINED if report["quarantined"] else 0
    if args.json:
        print_json(report)
        return status
    console.print(f"{escape(str(path))} -> {escape(report['database'])}: {report['rows_read']} rows read, "
                  f"{report['inserted']} inserted, {report['skipped_existing']} already stored, "
                  f"{report['quarantined']} quarantined ({report['quarantined_new']} new), "
                  f"{report['rows_per_s']:.0f} rows/s")
    if report["domains_by_rule"]:
        console.print("domain taken from: " + ", ".join(
            f"{escape(source)} {count}" for source, count in sorted(report["domains_by_rule"].items())))
    if report["redacted_rows"]:
        console.print(f"redacted rows: {report['redacted_rows']}")
    if report["superseded"]:
        console.print(f"superseded {report['superseded']} quarantine entries that an earlier, broken "
                      "read of this file left (no longer counted by `specdec report quarantined_by_reason`)")
    if report["quarantined"]:
        table = Table(title=f"quarantined rows by reason (first {len(report['quarantine_examples'])} shown)")
        for column in ("line", "reason", "detail"):
            table.add_column(column)
        for example in report["quarantine_examples"]:
            table.add_row(str(example["line"]), example["reason"], escape(example["detail"]))
        console.print(table)
        console.print("by reason: " + ", ".join(f"{reason} {count}" for reason, count
                                                in sorted(report["quarantined_by_reason"].items())))
    return status


def cmd_traffic_purge(args) -> int:
    verb = "would delete" if args.dry_run else "deleted"
    if args.request_id is not None:
        purge_request(args.request_id, open_store(args), dry_run=args.dry_run)
        console.print(f"{verb} traffic row {escape(repr(args.request_id))}")
        return 0
    result = purge_traffic(args.older_than, open_store(args), dry_run=args.dry_run)
    console.print(f"{verb} {result['traffic_requests']} traffic rows and "
                  f"{result['quarantined_requests']} quarantined rows older than {result['cutoff']}")
    return 0


def cmd_traffic_sample(args) -> int:
    window = (args.start, args.end) if args.start or args.end else args.days
    if (args.start is None) != (args.end is None):
        raise SystemExit("specdec traffic sample: give both --start and --end, or --days")
    domains = [d.strip() for d in args.domains.split(",") if d.strip()] if args.domains else None
    print_json(sample_traffic(args.run_id, open_store(args), domains=domains, window=window,
                              min_per_domain=args.min_per_domain, max_per_domain=args.max_per_domain,
                              model=args.model))
    return 0


def cmd_traffic_check(args) -> int:
    # imported here: Great Expectations (about 11 s) for this command only, not for db, report or
    # the other traffic commands
    from ..steps.traffic.quality import check_traffic_sample

    result = check_traffic_sample(args.run_id, open_store(args))
    table = Table(title=f"run {escape(args.run_id)}: traffic sample passed {result['expectations']} "
                        f"table-level expectations ({result['rows']} rows)")
    for column in ("domain", "rows", "min rows", "status"):
        table.add_column(column)
    for domain, info in result["domains"].items():
        table.add_row(domain, str(info["rows"]), str(info["min_rows"]), info["status"])
    console.print(table)
    return 0


def cmd_report(args) -> int:
    if args.list or not args.name:
        for name, question in list_reports().items():
            console.print(f"[bold]{name}[/bold]: {escape(question)}")
        return 0
    report = run_report(args.name, open_store(args))
    if args.format != "table":
        emit(format_report(report, args.format), end="")
        return 0
    cells = [[cell_text(value) for value in row] for row in report["rows"]]
    table = Table(title=escape(f"{report['name']}: {report['question']}"), title_justify="left")
    for column in report["columns"]:
        table.add_column(column, overflow="fold")
    for row in cells:
        table.add_row(*(escape(cell) for cell in row))
    # as wide as the content needs (reports have many columns; a pipe would otherwise get 80)
    widths = [max([len(name)] + [len(row[i]) for row in cells]) for i, name in enumerate(report["columns"])]
    make_console(width=max(console.width, min(400, sum(widths) + 3 * len(widths) + 1))).print(table)
    if not report["rows"]:
        console.print("(no rows)")
    return 0
