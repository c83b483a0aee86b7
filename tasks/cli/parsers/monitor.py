"""`specdec monitor scrape|check|show`'s parsers (run by tasks.cli.monitor)."""

from __future__ import annotations

from specdec_core.home import DEFAULT_MODEL

from ..common import tracking_uri_arg, url_arg, utc_time
from . import Command


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
    scrape.set_defaults(func=Command("tasks.cli.monitor:cmd_scrape"))
    check = m_sub.add_parser("check", help="drift alert and automatic rollback over the window")
    common(check)
    check.set_defaults(func=Command("tasks.cli.monitor:cmd_check"))
    show = m_sub.add_parser("show", help="per deployment and domain: production vs promised")
    show.add_argument("--deployment", default=None)
    show.add_argument("--since", type=utc_time("--since"), default=None, help="ISO time (UTC); default: the monitor window")
    show.add_argument("--until", type=utc_time("--until"), default=None, help="ISO time (UTC); default: now")
    common(show)
    show.set_defaults(func=Command("tasks.cli.monitor:cmd_show"))
