"""`specdec engine check|show RUN_ID`: a run's configs served by vLLM (tasks.steps.engine_check)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..registry.run_results import engine_speedup_text
from .common import print_json, url_arg
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
    from sqlalchemy import select

    from ..db.engine import display_url, ensure_ready, resolve_database_url
    from ..db.models import EvalRun
    from ..registry.run_results import engine_checks
    from ..steps.context import RunSpec
    from ..steps.pipeline import step_engine_check

    url = resolve_database_url(args.url)
    with ensure_ready(url).connect() as connection:
        target = args.target or connection.execute(select(EvalRun.target_id).where(
            EvalRun.run_id == args.run_id)).scalar()
    if target is None:
        make_console(stderr=True).print(f"[red]error:[/red] run {escape(args.run_id)} does not exist in "
                                        f"{escape(display_url(url))}: evaluate it first")
        return 2
    overrides = {"engine_check": True}       # asked for by name: on whatever the environment says
    if args.required:
        overrides["engine_check_required"] = True
    spec = RunSpec(run_id=args.run_id, target=target, db_url=url, overrides=overrides)
    result = step_engine_check(spec)
    if result["skipped"]:
        console.print(escape(result["skipped"]))
        return 1 if args.required else 0
    rows = engine_checks(args.run_id, url)
    if args.format == "json":
        print_json({"run_id": args.run_id, "engines": result["engines"], "domains": rows})
    else:
        console.print(engine_rich_table(args.run_id, rows))
        for record in result["engines"]:
            console.print(f"  {record['engine']} engine ({', '.join(record['domains'])}): "
                          f"{record['status']}, start {_x(record['start_s'], 1)} s, "
                          f"{record['seconds']:.0f} s in all; log {escape(record['log'])}")
    return 0 if all(row["passed"] is not False for row in rows) else 1


def cmd_show(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..registry.run_results import engine_checks

    rows = engine_checks(args.run_id, args.url)
    if args.format == "json":
        print_json(rows)
    else:
        console.print(engine_rich_table(args.run_id, rows))
    return 0


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
    show = engine_sub.add_parser("show", help="a run's stored engine checks")
    show.add_argument("run_id")
    show.add_argument("--format", choices=["table", "json"], default="table")
    url_arg(show)
    show.set_defaults(func=cmd_show)
