"""`specdec engine check|validate|load RUN_ID`: a run's configs served by vLLM
(tasks.steps.checks.engine_check, tasks.steps.checks.engine_validate, tasks.steps.checks.load_check);
the parsers: tasks.cli.parsers.engine. `engine show` (tasks.cli.engine) reads what they stored
without loading the steps."""

from __future__ import annotations

import json

from rich.markup import escape
from rich.table import Table

from ..db.queries_engine_checks import planned_domains
from ..db.queries_load import load_checks
from ..db.queries_runs import run_target
from ..registry.run_results import engine_checks
from ..serving import environment as serving_env
from ..steps.checks.engine_validate import validation_domains
from ..steps.context import RunSpec
from ..steps.pipeline import step_engine_check, step_engine_validate, step_load_check
from .common import open_store, print_json
from .console import make_console
from .engine import decimals, engine_rich_table, load_json, load_rich_table, print_load_verdicts

console = make_console()


def cmd_check(args) -> int:
    store, target = _store_and_target(args)
    if target is None:
        return 2
    url = store.url
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
                          f"{record['status']}, start {decimals(record['start_s'], 1)} s, "
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
    store, target = _store_and_target(args)
    if target is None:
        return 2
    url = store.url
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
            console.print(f"  {escape(server['server'])} server: start {decimals(server['start_s'], 1)} s; "
                          f"{len(server['mends'])} mend(s); log {escape(server['log'])}")
    return 0 if all(row["passed"] for row in result["domains"].values()) else 1


def _store_and_target(args):
    """(the store args name, the run's target or --target); target None, with an error line, when
    the run does not exist."""
    store = open_store(args)
    found = args.target or run_target(store, args.run_id)
    if found is None:
        make_console(stderr=True).print(f"[red]error:[/red] run {escape(args.run_id)} does not exist in "
                                        f"{escape(store.display_url)}: evaluate it first")
    return store, found


def cmd_load(args) -> int:
    store, target = _store_and_target(args)
    if target is None:
        return 2
    url = store.url
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
