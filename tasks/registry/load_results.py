"""The load check's results as people read them (tasks.steps.checks.load_check measures them): a short
text per domain for `specdec evaluate`'s table, and the markdown section of the version page."""

from __future__ import annotations

from ..db.load_records import DomainLoad, LoadLevel


def speedup_cell(level: LoadLevel) -> str:
    """"1.32x [1.10, 1.51]" (or "-")."""
    if level.measured_speedup is None:
        return "-"
    return f"{level.measured_speedup:.2f}x [{level.measured_speedup_lo:.2f}, {level.measured_speedup_hi:.2f}]"


def load_check_text(check: DomainLoad | None) -> str:
    """One domain's load check in a table cell: speedup per concurrency level (x: does not pay),
    then where the schedule was cut ("c1 1.32x, c2 0.94x x; K>0 up to 1")."""
    if check is None:
        return "-"
    levels = ", ".join(f"c{level.concurrency} "
                       + ("-" if level.measured_speedup is None else f"{level.measured_speedup:.2f}x")
                       + ("" if level.pays else " x") for level in check.levels)
    status = check.status
    tail = {"cut": f"K>0 up to {check.max_level_paying}", "off": "off",
            "ok": "pays"}.get(status, f"{status}: not promotable")
    return f"{levels}; {tail}" if levels else tail


def load_markdown(loads: dict[str, DomainLoad], not_run: str | None = None) -> str:
    """The version page's section: per domain and level, plain and config tokens/s, the measured
    speedup with its interval, the predicted one (on the logged responses, and on what vLLM
    served), ITL p50/p95, E from vLLM's /metrics; then the
    exported schedule before and after the cut. not_run: why it did not run (the one reason,
    tasks.registry.run_view.load_not_run)."""
    if not loads:
        return f"Not run: {not_run or 'no load check was recorded for this run'}."
    lines = ["| domain | concurrent requests | K | tokens/s plain | tokens/s config | speedup [95% CI] "
             "| predicted | predicted on what vLLM served | ITL p50/p95 ms plain | ITL p50/p95 ms config "
             "| E (/metrics) | failed | pays |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def num(value, digits=1, scale=1.0):
        return "-" if value is None else f"{scale * value:.{digits}f}"
    for domain, check in sorted(loads.items()):
        for level in check.levels:
            lines.append(
                f"| {domain} | {level.concurrency} | {level.k} | {num(level.plain_tokens_per_s)} "
                f"| {num(level.spec_tokens_per_s)} | {speedup_cell(level)} "
                f"| {num(level.predicted_speedup, 2)} | {num(level.predicted_served_speedup, 2)} "
                f"| {num(level.plain_itl_p50_s, 0, 1000)}/{num(level.plain_itl_p95_s, 0, 1000)} "
                f"| {num(level.spec_itl_p50_s, 0, 1000)}/{num(level.spec_itl_p95_s, 0, 1000)} "
                f"| {num(level.engine_e, 2)} | {level.failed} | {'yes' if level.pays else 'no'} |")
    lines.append("")
    for domain, check in sorted(loads.items()):
        lines.append(f"- **{domain}** ({check.status}): schedule `{check.schedule_before}` -> "
                     f"`{check.schedule_after}`; {check.reason}")
    return "\n".join(lines)
