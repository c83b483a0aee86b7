"""`specdec engine show RUN_ID`: a run's stored engine and load checks, and their tables (shared
with `engine check|validate|load`, tasks.cli.engine_checks, which run them on vLLM); the parsers:
tasks.cli.parsers.engine."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..db.load_records import DomainLoad
from ..db.queries_load import load_checks
from ..registry.run_results import engine_checks, engine_speedup_text
from .common import open_store, print_json
from .console import make_console

console = make_console()


def decimals(value, digits: int = 2) -> str:
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
                      str(row.get("requests") or "-"), interval, decimals(row.get("engine_e")), rates,
                      greedy, decimals(row.get("plain_tokens_per_s"), 1),
                      decimals(row.get("spec_tokens_per_s"), 1), escape(engine_speedup_text(row)),
                      escape(str(row.get("reason") or "").removeprefix("engine check: ")[:160]))
    return table


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
                          decimals(level.plain_tokens_per_s, 1), decimals(level.spec_tokens_per_s, 1),
                          "-" if level.measured_speedup is None else
                          f"{level.measured_speedup:.2f}x [{level.measured_speedup_lo:.2f}, "
                          f"{level.measured_speedup_hi:.2f}]",
                          decimals(level.predicted_speedup),
                          f"{_ms(level.plain_itl_p50_s)}/{_ms(level.plain_itl_p95_s)}",
                          f"{_ms(level.spec_itl_p50_s)}/{_ms(level.spec_itl_p95_s)}",
                          decimals(level.engine_e), str(level.failed),
                          {True: "yes", False: "no"}.get(level.pays, "-"))
    return table


def print_load_verdicts(loads: dict[str, DomainLoad]) -> None:
    """Per domain: its verdict, the exported schedule before and after the cut, the reason."""
    for domain, check in sorted(loads.items()):
        console.print(escape(f"  {domain} ({check.status}): schedule {check.schedule_before} "
                             f"-> {check.schedule_after}; {check.reason}"))
