"""`specdec db|traffic|report`'s parsers (run by tasks.cli.data)."""

from __future__ import annotations

from ..common import days, per_domain_args, url_arg
from . import Command


def register(sub) -> None:
    """Add the db, traffic and report commands to the `specdec` subparsers."""
    db = sub.add_parser("db", help="specdec's database: migrate, show the schema revision")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="create or migrate the schema (Alembic, own version table)")
    url_arg(upgrade)
    upgrade.set_defaults(func=Command("tasks.cli.data:cmd_db_upgrade"))
    current = db_sub.add_parser("current", help="the schema revision of the database vs this code")
    url_arg(current)
    current.set_defaults(func=Command("tasks.cli.data:cmd_db_current"))

    traffic = sub.add_parser("traffic", help="import, sample, check and purge logged traffic")
    t_sub = traffic.add_subparsers(dest="traffic_command", required=True)
    imp = t_sub.add_parser(
        "import", help="import a JSONL or CSV file (optionally .gz); idempotent",
        description="Import a JSONL or CSV traffic file (optionally .gz). Rows already stored are "
                    "skipped; bad rows are quarantined with their line and reason.",
        epilog="exit status: 0 every row stored or already there; 3 rows were quarantined (the "
               "others are stored; `specdec report quarantined_by_reason` counts them by reason); 2 "
               "the file or the database cannot be used (rows before a break in the file are stored).")
    imp.add_argument("file", nargs="?", default=None)
    imp.add_argument("--sample", action="store_true", help="import the shipped sample traffic")
    imp.add_argument("--format", choices=["jsonl", "csv"], default=None,
                     help="default: from the file name")
    imp.add_argument("--batch-size", type=int, default=None, help="rows per transaction")
    imp.add_argument("--no-progress", action="store_true")
    imp.add_argument("--json", action="store_true", help="print the import report as JSON")
    url_arg(imp)
    imp.set_defaults(func=Command("tasks.cli.data:cmd_traffic_import"))

    purge = t_sub.add_parser("purge", help="retention: delete traffic older than N days (UTC now), "
                                           "or one request by id")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=days("--older-than"), metavar="DAYS")
    which.add_argument("--id", dest="request_id", metavar="REQUEST_ID",
                       help="delete this one request (e.g. one a quality gate names)")
    purge.add_argument("--dry-run", action="store_true", help="count only")
    url_arg(purge)
    purge.set_defaults(func=Command("tasks.cli.data:cmd_traffic_purge"))

    sample = t_sub.add_parser("sample", help="draw a run's stratified per-domain sample (JSON out)")
    sample.add_argument("run_id")
    sample.add_argument("--domains", default=None, help="comma-separated (default: all with traffic)")
    sample.add_argument("--days", type=days("--days"), default=None,
                        help="window length ending at the newest stored request (default: settings)")
    sample.add_argument("--start", default=None, help="explicit window start (ISO 8601)")
    sample.add_argument("--end", default=None, help="explicit window end (ISO 8601)")
    per_domain_args(sample, min_help="minimum rows per domain", max_help="maximum rows per domain")
    sample.add_argument("--model", default=None, help="only requests answered by this target")
    url_arg(sample)
    sample.set_defaults(func=Command("tasks.cli.data:cmd_traffic_sample"))

    check = t_sub.add_parser("check", help="Great Expectations gates on a run's sample")
    check.add_argument("run_id")
    url_arg(check)
    check.set_defaults(func=Command("tasks.cli.data:cmd_traffic_check"))

    report = sub.add_parser("report", help="run an ops SQL report from sql/")
    report.add_argument("name", nargs="?", default=None)
    report.add_argument("--format", choices=["table", "csv", "json"], default="table")
    report.add_argument("--list", action="store_true", help="list the reports and their questions")
    url_arg(report)
    report.set_defaults(func=Command("tasks.cli.data:cmd_report"))
