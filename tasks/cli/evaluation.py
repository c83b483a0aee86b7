"""`specdec evaluate`: the evaluation command of the CLI, and its run's table (`specdec profile`:
tasks.cli.profile; the parsers: tasks.cli.parsers.evaluation)."""

from __future__ import annotations

import signal

from rich.markup import escape
from rich.table import Table

from ..paths import check_identifier
from ..registry.run_config import validation_text
from ..registry.run_view import (HEADERS, alert_markdown, below_bar_markdown, build_run_view, engine_state,
                                 reason_line, table_rows)
from ..settings import load_settings
from ..steps.costs.reuse import profile_check_text
from ..steps.evaluate import RunInterrupted, evaluate
from ..timeutil import default_run_id
from .common import open_registry, open_store, print_json
from .config import print_gates
from .console import make_console

console = make_console()


def evaluation_rich_table(view, seconds: float | None = None, hardware: str | None = None) -> Table:
    """The run's per-domain table in the terminal: the same rows as the version page and
    `reports/domains.md` (tasks.registry.run_view.table_rows of the run's RunView)."""
    config = view.config
    took = "" if seconds is None else f" ({seconds:.0f} s)"
    table = Table(title=escape(f"run {view.run_id}: {config.target.id} on "
                               f"{hardware or config.hardware_profile}{took}"), title_justify="left")
    right = {"K", "max batch", "E [tokens/round]", "proposal rate", "samples"}
    for column in HEADERS:
        table.add_column(column, justify="right" if column in right else "left")
    for row in table_rows(view):
        table.add_row(*[escape(cell) for cell in row])
    return table


def print_run(view, seconds: float | None = None, hardware: str | None = None) -> None:
    """The table, then why each domain is on or off and the engine check's state, as on the page."""
    console.print(evaluation_rich_table(view, seconds, hardware))
    notes = below_bar_markdown(view) + alert_markdown(view)
    if notes:
        console.print(escape(notes.replace("**", "").rstrip()), soft_wrap=True)
    if not view.config.domains_on:      # the one rule: a check that did not run says so
        console.print(f"no domain is on: this config is plain decoding everywhere; validation "
                      f"{escape(validation_text(view.config))}", soft_wrap=True)
    console.print(escape(f"engine check: {engine_state(view)}"), soft_wrap=True)
    for d in view.domains:
        console.print(escape(reason_line(d).replace("**", "")), soft_wrap=True)


def cmd_evaluate(args) -> int:
    run_id = default_run_id() if args.run_id is None else check_identifier(args.run_id, "run id")
    settings = load_settings(plan_hardware_profile=args.hardware_profile)
    try:
        store = open_store(args, settings)
        result = evaluate(run_id=run_id, target=args.model, store=store, settings=settings,
                          domains=args.domains.split(",") if args.domains else None,
                          window=args.days, candidates=args.candidate or None, k_max=args.k_max,
                          max_per_domain=args.max_per_domain, min_per_domain=args.min_per_domain,
                          device=args.device,
                          progress=not args.no_progress, register=not args.no_register,
                          promote=args.promote, registry=open_registry(args, store),
                          new_profile=args.new_profile)
    except (RunInterrupted, KeyboardInterrupt) as exc:
        name = getattr(exc, "signal_name", "SIGINT")
        make_console(stderr=True).print(
            f"[red]run {escape(run_id)} interrupted by {name}[/red]: marked interrupted (reports "
            "leave it out); run it again with the same --run-id to replace it")
        return 128 + int(getattr(signal, name))
    if args.json:
        print_json(result)
        return _failed_domains_status(result)
    print_run(build_run_view(result["run_id"], open_store(args, settings), settings), result["seconds"])
    console.print(escape(profile_check_text(result.get("profile_check"))))
    console.print(escape(f"cost profile {result['hardware_profile']}: {result['profile']['text']}"))
    fp = result["fingerprint"]
    console.print(f"target fingerprint {fp['id']}: {'ok' if fp['passed'] else 'FAILED: ' + '; '.join(fp['reasons'])}"
                  f"; steps (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["steps"].items()))
    if result["registered"]:
        reg = result["registered"]
        console.print(f"MLflow: {reg['name']} version {reg['version']} (alias challenger"
                      f"{', reused' if reg['reused'] else ''}); validation {reg['validation']}")
        audit = reg.get("champion_audit") or {}
        if audit.get("gated") is False:
            make_console(stderr=True).print(f"[red]WARNING:[/red] {escape(audit['detail'])}")
    if result["promoted"]:
        print_gates(result["promoted"])
    return _failed_domains_status(result)


FAILED_DOMAINS_STATUS = 3     # the run finished, but a domain's step failed (that domain is off)


def _failed_domains_status(result: dict) -> int:
    """0, or FAILED_DOMAINS_STATUS with one line on stderr naming each failed domain and why."""
    failed = [row for row in result["table"] if row["status"] == "failed"]
    if not failed:
        return 0
    make_console(stderr=True).print(
        f"[red]run {escape(result['run_id'])}: {len(failed)} domain(s) failed[/red] (off in this "
        "run's config; the champion's setting is kept): " + escape("; ".join(
            f"{row['domain']}: {str(row.get('reason') or '')[:300]}" for row in failed))
        + f" (exit status {FAILED_DOMAINS_STATUS})")
    return FAILED_DOMAINS_STATUS
