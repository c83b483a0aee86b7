"""`specdec evaluate|profile`'s parsers (run by tasks.cli.evaluation and tasks.cli.profile)."""

from __future__ import annotations

from specdec_core.home import DEFAULT_MODEL

from ..common import days, k_value, per_domain_args, tracking_uri_arg, url_arg
from . import Command


def register(sub) -> None:
    ev = sub.add_parser("evaluate", help="sample -> check -> profile -> estimate -> plan -> confirm "
                                         "-> validate, then a per-domain table")
    ev.add_argument("--run-id", default=None, help="default: manual__<UTC time>; re-running replaces it")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="target (default: the embedded default)")
    ev.add_argument("--device", default=None)
    ev.add_argument("--domains", default=None, help="comma-separated (default: all with traffic)")
    ev.add_argument("--days", type=days("--days"), default=None, help="window ending at the newest request")
    ev.add_argument("--candidate", action="append", default=None,
                    help="repeatable drafter KIND[:NAME=VALUE...] (default: settings.plan.candidates)")
    ev.add_argument("--hardware-profile", default=None,
                    help="plan with this stored (imported) cost profile instead of measuring here")
    ev.add_argument("--new-profile", action="store_true",
                    help="measure a new cost profile here even where a stored one of this hardware, "
                         "engine and target, younger than profile_max_age_days, could be reused")
    ev.add_argument("--k-max", type=k_value("--k-max"), default=None)
    per_domain_args(ev, min_help="minimum requests per domain", max_help="requests sampled per domain")
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--no-register", action="store_true",
                    help="do not track the run in MLflow nor register its config")
    ev.add_argument("--promote", action="store_true",
                    help="after registering, gate the config and move the champion alias")
    tracking_uri_arg(ev)
    url_arg(ev)
    ev.set_defaults(func=Command("tasks.cli.evaluation:cmd_evaluate"))

    prof = sub.add_parser("profile", help="cost profiles: measure, show, export, import")
    p_sub = prof.add_subparsers(dest="profile_command", required=True)
    measure = p_sub.add_parser("measure", help="time target step, verify(K), draft steps here "
                                               "(always afresh; stored for later runs to reuse)")
    measure.add_argument("--name", default=None, help="profile name (default: from device and dtype)")
    measure.add_argument("--run-id", default=None)
    measure.add_argument("--model", default=DEFAULT_MODEL)
    measure.add_argument("--device", default=None)
    measure.add_argument("--candidate", action="append", default=None)
    measure.add_argument("--k-max", type=k_value("--k-max"), default=None)
    measure.add_argument("--batch-sizes", default=None, help="comma-separated (default: settings)")
    measure.add_argument("--engine", choices=["specdec", "vllm"], default="specdec",
                         help="whose decode steps to time: our engine here (default), or vLLM's in "
                              "the serving environment (`make serving-env`): a profile the planner "
                              "uses to predict speedups on vLLM")
    measure.add_argument("--ks", default=None,
                         help="--engine vllm: comma-separated K values given an engine of their own "
                              "(default 1, 2, 4, 8, ... and --k-max; the rest interpolated)")
    measure.add_argument("--draft-k", type=int, default=3,
                         help="--engine vllm: the K at which each --candidate's draft step is timed")
    url_arg(measure)
    measure.set_defaults(func=Command("tasks.cli.profile:cmd_profile_measure"))
    show = p_sub.add_parser("show", help="a stored profile as ratios to one target step")
    show.add_argument("name")
    show.add_argument("--run", default=None, help="default: the newest run of that profile")
    url_arg(show)
    show.set_defaults(func=Command("tasks.cli.profile:cmd_profile_show"))
    export = p_sub.add_parser("export", help="write a stored profile to a JSON file")
    export.add_argument("name")
    export.add_argument("file")
    export.add_argument("--run", default=None)
    url_arg(export)
    export.set_defaults(func=Command("tasks.cli.profile:cmd_profile_export"))
    imp = p_sub.add_parser("import", help="store a profile from a JSON file (from `profile export`)")
    imp.add_argument("file")
    imp.add_argument("--name", default=None, help="store it under another name")
    url_arg(imp)
    imp.set_defaults(func=Command("tasks.cli.profile:cmd_profile_import"))
