"""`specdec engine check|validate|load|show RUN_ID`: a run's configs served by vLLM
(tasks.steps.checks.engine_check, tasks.steps.checks.engine_validate, tasks.steps.checks.load_check)."""

from __future__ import annotations

import json

from rich.markup import escape
from rich.table import Table

from ..db.load_records import DomainLoad
from ..db.queries_engine_checks import planned_domains
from ..db.queries_load import load_checks
from ..db.queries_runs import run_target
from ..registry.run_results import engine_checks, engine_speedup_text
from ..serving import environment as serving_env
from .common import open_store, print_json, url_arg
from .console import make_console

console = make_console()


def _x(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def engine_rich_table(run_id: str, rows: list[dict]) -> Table:
    table = Table(title=escape(f"run {run_id}: engine check on vLLM (same requests, same K)"),
                  title_justify="left")
    for column in ("domain", "status", "K", "requests", "estimate E [95% CI]", "vLLM E",
                   "rates per position: estimate / vLLM", "greedy equal", "tokens/s plain",
                   "tokens/s config", "speedup measured / predicted", "reason"):
        table.add_column(column, justify="left" if column in ("domain", "status", "reason")
                         else "right")
    for row in rows:
        interval = ("-" if row.get("estimate_e") is None else
                    f"{row['estimate_e']:.2f}" + ("" if row.get("estimate_e_lo") is None else
                                                  f" [{row['estimate_e_lo']:.2f}, {row['estimate_e_hi']:.2f}]"))
        rates = "-" if not row.get("engine_rates") else " ".join(
            f"{a:.2f}/{b:.2f}" for a, b in zip(row["estimate_rates"], row["engine_rates"]))
        greedy = "-" if not row.get("greedy_checked") else f"{row['greedy_equal']}/{row['greedy_checked']}"
        table.add_row(escape(row["domain"]), row["status"], str(row.get("k") or "-"),
                      str(row.get("requests") or "-"), interval, _x(row.get("engine_e")), rates,
                      greedy, _x(row.get("plain_tokens_per_s"), 1),
                      _x(row.get("spec_tokens_per_s"), 1), escape(engine_speedup_text(row)),
                      escape(str(row.get("reason") or "").removeprefix("engine check: ")[:160]))
    return table


def cmd_check(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.context import RunSpec
    from ..steps.pipeline import step_engine_check

    store = open_store(args)
    url = store.url
    target = _run_target(args.run_id, store, args.target)
    if target is None:
        return 2
    overrides = {"engine_check": True}       # asked for by name: on whatever the environment says
    if args.required:
        overrides["engine_check_required"] = True
    spec = RunSpec(run_id=args.run_id, target=target, db_url=url, overrides=overrides)
    result = step_engine_check(spec)
    if result["skipped"]:
        console.print(escape(result["skipped"]))
        return 1 if args.required else 0
    rows = engine_checks(args.run_id, store)
    if args.format == "json":
        print_json({"run_id": args.run_id, "engines": result["engines"], "domains": rows,
                    "load_check": result.get("load_check")})
    else:
        console.print(engine_rich_table(args.run_id, rows))
        for record in result["engines"]:
            console.print(f"  {record['engine']} engine ({', '.join(record['domains'])}): "
                          f"{record['status']}, start {_x(record['start_s'], 1)} s, "
                          f"{record['seconds']:.0f} s in all; log {escape(record['log'])}")
    return 0 if all(row["passed"] is not False for row in rows) else 1


def engine_sampling_table(run_id: str, rows: dict) -> Table:
    table = Table(title=escape(f"run {run_id}: sampling test on vLLM's OpenAI server"),
                  title_justify="left")
    for column in ("domain", "verdict", "rows", "positions", "smallest p", "reason"):
        table.add_column(column, justify="right" if column in ("rows", "positions", "smallest p") else "left")
    for domain, row in sorted(rows.items()):
        table.add_row(escape(domain), row["status"] + (f" (shared from {row['shared_from']})"
                                                       if row.get("shared_from") else ""),
                      str(row.get("rows") or "-"), str(row.get("positions") or "-"),
                      "-" if row.get("min_p") is None else f"{row['min_p']:.3g}",
                      escape(str(row.get("reason") or "")[:200]))
    return table


def cmd_validate(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.context import RunSpec
    from ..steps.checks.engine_validate import validation_domains
    from ..steps.pipeline import step_engine_validate

    store = open_store(args)
    url = store.url
    target = _run_target(args.run_id, store, args.target)
    if target is None:
        return 2
    spec_config = None
    if args.speculative_config is not None:
        try:
            spec_config = json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            make_console(stderr=True).print(f"[red]error:[/red] --speculative-config is not JSON ({exc}): "
                                            "give the object `vllm serve --speculative-config` takes")
            return 2
        if not isinstance(spec_config, dict) or "method" not in spec_config:
            make_console(stderr=True).print("[red]error:[/red] --speculative-config must be a JSON object "
                                            "with a \"method\" (as `vllm serve` takes it)")
            return 2
    # the domains checked before the target is loaded: a bad --domain is one line at once
    validation_domains(planned_domains(store, args.run_id), args.run_id, args.domain or None, spec_config)
    overrides = {} if args.rows is None else {"engine_sampling_rows": args.rows}
    spec = RunSpec(run_id=args.run_id, target=target, db_url=url, overrides=overrides)
    result = step_engine_validate(spec, domains=args.domain or None, speculative_config=spec_config,
                                  mended=not args.unmended)
    if args.json:
        print_json({"run_id": args.run_id, **result})
    else:
        console.print(engine_sampling_table(args.run_id, result["domains"]))
        for server in result["servers"]:
            console.print(f"  {escape(server['server'])} server: start {_x(server['start_s'], 1)} s; "
                          f"{len(server['mends'])} mend(s); log {escape(server['log'])}")
    return 0 if all(row["passed"] for row in result["domains"].values()) else 1


def _run_target(run_id: str, store, target: str | None) -> str | None:
    """The run's target (or `target`); None, with an error line, when the run does not exist."""
    found = target or run_target(store, run_id)
    if found is None:
        make_console(stderr=True).print(f"[red]error:[/red] run {escape(run_id)} does not exist in "
                                        f"{escape(store.display_url)}: evaluate it first")
    return found


def cmd_show(args) -> int:
    store = open_store(args)
    rows = engine_checks(args.run_id, store)
    loads = load_checks(store, args.run_id)
    if args.format == "json":
        for row in rows:      # each domain's load check beside its engine check (None: not run)
            row["load_check"] = load_json(loads.get(row["domain"]))
        print_json(rows)
    else:
        console.print(engine_rich_table(args.run_id, rows))
        if loads:
            console.print(load_rich_table(args.run_id, loads))
            print_load_verdicts(loads)
    return 0


LOAD_FIELDS = ("concurrency", "k", "requests", "failed", "plain_tokens_per_s", "spec_tokens_per_s",
               "measured_speedup", "measured_speedup_lo", "measured_speedup_hi", "predicted_speedup",
               "pays", "engine_e", "engine_rates", "counters_equal", "plain_ttft_p50_s",
               "plain_ttft_p95_s", "spec_ttft_p50_s", "spec_ttft_p95_s", "plain_itl_p50_s",
               "plain_itl_p95_s", "spec_itl_p50_s", "spec_itl_p95_s", "counters")


def load_json(check: DomainLoad | None) -> dict | None:
    """One domain's load check as `engine show --format json` prints it: its verdict, schedules
    and one row per concurrency level."""
    if check is None:
        return None
    return {"status": check.status, "passed": check.passed, "reason": check.reason,
            "schedule_before": check.schedule_before, "schedule_after": check.schedule_after,
            "max_level_paying": check.max_level_paying, "plain_log": check.plain_log,
            "spec_log": check.spec_log,
            "levels": [{key: getattr(level, key) for key in LOAD_FIELDS} for level in check.levels]}


def _ms(value) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def load_rich_table(run_id: str, loads: dict[str, DomainLoad]) -> Table:
    table = Table(title=escape(f"run {run_id}: load check on vLLM's OpenAI server (streamed, "
                               "plain vs config, same requests)"), title_justify="left")
    for column in ("domain", "conc.", "K", "tokens/s plain", "tokens/s config", "speedup [95% CI]",
                   "predicted", "ITL p50/p95 ms plain", "ITL p50/p95 ms config", "vLLM E", "failed",
                   "pays"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    for domain, check in sorted(loads.items()):
        for level in check.levels:
            table.add_row(escape(domain), str(level.concurrency), str(level.k),
                          _x(level.plain_tokens_per_s, 1), _x(level.spec_tokens_per_s, 1),
                          "-" if level.measured_speedup is None else
                          f"{level.measured_speedup:.2f}x [{level.measured_speedup_lo:.2f}, "
                          f"{level.measured_speedup_hi:.2f}]",
                          _x(level.predicted_speedup),
                          f"{_ms(level.plain_itl_p50_s)}/{_ms(level.plain_itl_p95_s)}",
                          f"{_ms(level.spec_itl_p50_s)}/{_ms(level.spec_itl_p95_s)}",
                          _x(level.engine_e), str(level.failed),
                          {True: "yes", False: "no"}.get(level.pays, "-"))
    return table


def print_load_verdicts(loads: dict[str, DomainLoad]) -> None:
    """Per domain: its verdict, the exported schedule before and after the cut, the reason."""
    for domain, check in sorted(loads.items()):
        console.print(escape(f"  {domain} ({check.status}): schedule {check.schedule_before} "
                             f"-> {check.schedule_after}; {check.reason}"))


def cmd_load(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.context import RunSpec
    from ..steps.pipeline import step_load_check

    store = open_store(args)
    url = store.url
    target = _run_target(args.run_id, store, args.target)
    if target is None:
        return 2
    serving_env.working_python()    # asked for by name: no serving python is an error, not a skip
    result = step_load_check(RunSpec(run_id=args.run_id, target=target, db_url=url,
                                     overrides={"load_check": True}))
    if result["skipped"]:
        console.print(escape(result["skipped"]))
        return 0
    loads = load_checks(store, args.run_id)
    if args.format == "json":
        print_json({"run_id": args.run_id, "domains": {d: load_json(c) for d, c in loads.items()}})
    else:
        console.print(load_rich_table(args.run_id, loads))
        print_load_verdicts(loads)
    return 0 if all(c.passed is not False for c in loads.values()) else 1


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
    check.set_defaults(func=cmd_check)
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
    validate.set_defaults(func=cmd_validate)
    load = engine_sub.add_parser("load", help="the load check alone: each domain's requests streamed "
                                              "through the plain and the config's OpenAI servers at "
                                              "the concurrency levels its schedule claims; the "
                                              "schedule is cut to the levels that pay")
    load.add_argument("run_id")
    load.add_argument("--target", default=None, help="default: the run's target")
    load.add_argument("--format", choices=["table", "json"], default="table")
    url_arg(load)
    load.set_defaults(func=cmd_load)
    show = engine_sub.add_parser("show", help="a run's stored engine checks")
    show.add_argument("run_id")
    show.add_argument("--format", choices=["table", "json"], default="table")
    url_arg(show)
    show.set_defaults(func=cmd_show)
