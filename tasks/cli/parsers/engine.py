"""`specdec engine check|validate|load|show`'s parsers (run by tasks.cli.engine_checks and
tasks.cli.engine)."""

from __future__ import annotations

from ..common import url_arg
from . import Command


def register(sub) -> None:
    parser = sub.add_parser("engine", help="the serving engine: a run's configs served by vLLM")
    engine_sub = parser.add_subparsers(dest="engine_command", required=True)
    check = engine_sub.add_parser("check", help="serve each domain the run turns on with its exported "
                                                "config on vLLM; compare vLLM's acceptance with the "
                                                "estimate; a domain that falls short is turned off")
    check.add_argument("run_id")
    check.add_argument("--target", default=None, help="default: the run's target")
    check.add_argument("--required", action="store_true",
                       help="fail when there is no serving environment (default: skip with a line)")
    check.add_argument("--format", choices=["table", "json"], default="table")
    url_arg(check)
    check.set_defaults(func=Command("tasks.cli.engine_checks:cmd_check"))
    validate = engine_sub.add_parser(
        "validate", help="the sampling test on vLLM's OpenAI server alone: continuations drawn from "
                         "the server with each config the run turns on, G-tested against the "
                         "target's exact distributions (the plain server as control)")
    validate.add_argument("run_id")
    validate.add_argument("--domain", action="append", default=None,
                          help="a domain to test (repeatable; default: every domain the run turns on)")
    validate.add_argument("--rows", type=int, default=None,
                          help="continuations per sampling setting (default: engine_sampling_rows)")
    validate.add_argument("--speculative-config", default=None, metavar="JSON",
                          help="serve this config instead of the run's (power tests; nothing stored)")
    validate.add_argument("--unmended", action="store_true",
                          help="serve vLLM as it ships, without the project's mends of its CPU build")
    validate.add_argument("--target", default=None, help="default: the run's target")
    validate.add_argument("--json", action="store_true", help="one JSON object on stdout")
    url_arg(validate)
    validate.set_defaults(func=Command("tasks.cli.engine_checks:cmd_validate"))
    load = engine_sub.add_parser("load", help="the load check alone: each domain's requests streamed "
                                              "through the plain and the config's OpenAI servers at "
                                              "the concurrency levels its schedule claims; the "
                                              "schedule is cut to the levels that pay")
    load.add_argument("run_id")
    load.add_argument("--target", default=None, help="default: the run's target")
    load.add_argument("--format", choices=["table", "json"], default="table")
    url_arg(load)
    load.set_defaults(func=Command("tasks.cli.engine_checks:cmd_load"))
    show = engine_sub.add_parser("show", help="a run's stored engine checks")
    show.add_argument("run_id")
    show.add_argument("--format", choices=["table", "json"], default="table")
    url_arg(show)
    show.set_defaults(func=Command("tasks.cli.engine:cmd_show"))
