"""The config of an evaluated run: built from its domain_configs rows (a domain without a usable
result keeps the champion's setting), and described for people (the per-domain table, what
changed against the champion). Descriptions name requests by id, never by prompt text.
"""

from __future__ import annotations

from sqlalchemy import select

from ..db.engine import ensure_ready, resolve_database_url
from ..db.models import DomainConfig, EvalRun
from ..errors import RegistryError
from .config_schema import DomainSetting, DrafterSpec, SpecdecConfig
from .run_results import engine_sampling_text, own_sampling_text
from .version_page import cell, html_table


def run_row(connection, run_id: str):
    """The run's eval_runs row; RegistryError unless it exists and has finished its evaluation."""
    row = connection.execute(select(EvalRun).where(EvalRun.run_id == run_id)).mappings().first()
    if row is None:
        raise RegistryError(f"run {run_id!r} does not exist in specdec's database; evaluate it first")
    if not row["target_fingerprint"] or not row["hardware_profile"]:
        raise RegistryError(f"run {run_id!r} has not finished its evaluation (status {row['status']}); "
                            "run the evaluation steps before registering it")
    return row


def build_config(run_id: str, db_url: str | None = None,
                 champion: SpecdecConfig | None = None) -> SpecdecConfig:
    """The run's config from domain_configs; insufficient domains keep the champion's setting."""
    engine = ensure_ready(resolve_database_url(db_url))
    with engine.connect() as connection:
        run = run_row(connection, run_id)
        rows = connection.execute(select(DomainConfig).where(DomainConfig.run_id == run_id)
                                  .order_by(DomainConfig.domain)).mappings().all()
    domains: dict[str, DomainSetting] = {}
    for row in rows:
        if row["status"] != "ok":
            kept = champion.domains.get(row["domain"]) if champion else None
            why = (row["reason"] or row["status"])[:400].split("; the champion's setting is kept")[0]
            domains[row["domain"]] = (
                kept.model_copy(update={"source": "champion",
                                        "reason": f"{why}; the champion's setting is kept"})
                if kept else DomainSetting(enabled=False, samples=row["samples"] or 0, source="off",
                                           reason=f"{why}; there is no champion setting to keep"))
            continue
        spec = row["drafter_spec"]
        drafter = None
        if spec:
            params = dict(spec.get("params") or {})
            source = params.get("index" if spec["kind"] == "suffix" else "model", "")
            model_uri = source if str(source).startswith("models:/") else None
            drafter = DrafterSpec(kind=spec["kind"], params=params, model_uri=model_uri)
        ci = None
        if row["predicted_speedup_lo"] is not None:
            ci = (row["predicted_speedup_lo"], row["predicted_speedup_hi"])
        domains[row["domain"]] = DomainSetting(
            enabled=bool(row["enabled"]), drafter=drafter, k=row["k"] or 0,
            max_batch_size=row["max_batch_size"] if row["enabled"] else None,
            k_schedule=[tuple(r) for r in row["k_schedule"] or []] if row["enabled"] else [],
            conditional_acceptance=row["conditional_acceptance"] or [],
            mean_accepted_length=row["mean_accepted_length"], predicted_speedup=row["predicted_speedup"],
            predicted_speedup_ci95=ci, measured_speedup=row["measured_speedup"],
            samples=row["samples"] or 0, validation=row["validation"], source="run",
            note="kept on: within hysteresis" if str(row["reason"] or "").startswith("kept on")
            else None, reason=_with_validation(row["reason"], row["validation"]))
    return SpecdecConfig(target={"id": run["target_id"], "fingerprint": run["target_fingerprint"]},
                         hardware_profile=run["hardware_profile"], run_id=run_id,
                         created_at=run["updated_at"], domains=domains)


def _with_validation(reason: str | None, validation: str | None) -> str | None:
    """The planner's reason, with a failed validation said first (it keeps the domain from
    promotion)."""
    if validation == "failed":
        reason = "validation FAILED: the output distribution check did not pass" + (
            f"; planner: {reason}" if reason else "")
    return None if reason is None else reason[:600]


def validation_status(config: SpecdecConfig) -> str:
    """passed: every measured enabled domain passed; failed: one failed; incomplete otherwise."""
    verdicts = [s.validation for s in config.domains.values() if s.enabled and s.source == "run"]
    if any(v == "failed" for v in verdicts):
        return "failed"
    return "passed" if all(v == "passed" for v in verdicts) else "incomplete"


# ------------------------------------------------------------------------------------------------
# descriptions
def _x(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _drafter_text(s: DomainSetting) -> str:
    if s.drafter is None:
        return "-"
    return s.drafter.kind + ("(" + ",".join(f"{k}={v}" for k, v in sorted(s.drafter.params.items())) + ")"
                             if s.drafter.params else "")


FASTER = "faster_than_predicted"


def live_findings(live: dict | None, min_speedup: float, tolerance: float) -> list[tuple[str, str]]:
    """What the live check found about a domain's measurement, as (kind, words): kind "slow"
    (slower than plain decoding), "below" (below min_speedup), "slower_than_predicted" or
    "faster_than_predicted" (off the prediction for the same requests by more than `tolerance`,
    worded by its direction). Empty: nothing."""
    if not live or live.get("measured") is None:
        return []
    minimum = live.get("min_speedup") or min_speedup
    limit = live.get("tolerance") or tolerance
    found = []
    if live["measured"] < 1.0:
        found.append(("slow", "slower than plain decoding"))
    elif live["measured"] < minimum:
        found.append(("below", f"below min_speedup {minimum:.2f}x"))
    error = live.get("cost_model_error")
    if error is not None and abs(error) > limit:
        direction = "faster" if error > 0 else "slower"
        found.append((f"{direction}_than_predicted",
                      f"{100 * abs(error):.0f}% {direction} than predicted for the same requests "
                      f"(tolerance {100 * limit:.0f}%)"))
    return found


def live_problems(live: dict | None, min_speedup: float, tolerance: float) -> list[str]:
    """What the live check found against a domain's measurement, in words (empty: nothing):
    below plain decoding or min_speedup, or slower than predicted beyond the tolerance. Faster than
    predicted is not a problem of the domain (live_findings reports it)."""
    return [text for kind, text in live_findings(live, min_speedup, tolerance) if kind != FASTER]


def live_text(live: dict | None) -> str:
    """A live check in words: measured [interval] vs predicted on the same requests, over N requests."""
    if not live or live.get("measured") is None:
        return "not measured live"
    interval = "" if live.get("lo") is None else f" [{live['lo']:.2f}, {live['hi']:.2f}]"
    predicted = live.get("predicted_same") or live.get("predicted")
    requests = live.get("requests") or 0
    return (f"{live['measured']:.2f}x measured{interval}"
            + ("" if predicted is None else f" vs {predicted:.2f}x predicted")
            + f" on the same {requests} request{'s' if requests != 1 else ''}")


def _state_free(reason: str, enabled: bool) -> str:
    """The planner's reason without its leading "on: " / "off: " (the page states on/off itself)."""
    for prefix in ("on: ", "off: ") if enabled else ("off: ",):
        if reason.startswith(prefix):
            return reason[len(prefix):]
    return reason


def domain_table_markdown(config: SpecdecConfig, evidence: dict | None = None,
                          min_speedup: float = 1.1, tolerance: float = 0.25) -> str:
    """The per-domain table (HTML, see version_page.html_table) and why each domain is on or off.

    evidence: tasks.registry.run_results.domain_evidence of the run (live check, proposal rate,
    sampling test per domain); min_speedup, tolerance: the live check's bar and the cost model's
    tolerance where the stored verdict does not carry them.
    """
    evidence = evidence or {}
    headers = ["domain", "on", "drafter", "K", "max batch", "E [tokens/round]",
               "proposal rate", "predicted (95% CI)", "live check (same requests)", "samples",
               "validation", "source"]
    rows, reasons, sampling = [], [], []
    for name, s in sorted(config.domains.items()):
        found = (evidence.get(name) or {}) if s.source == "run" else {}
        live = found.get("live")
        problems = live_problems(live, min_speedup, tolerance)
        faster = [text for kind, text in live_findings(live, min_speedup, tolerance) if kind == FASTER]
        ci = "" if s.predicted_speedup_ci95 is None else (
            f" [{s.predicted_speedup_ci95[0]:.2f}, {s.predicted_speedup_ci95[1]:.2f}]")
        if live:
            predicted = live.get("predicted_same") or live.get("predicted")
            live_cell = cell(f"{live['measured']:.2f}x vs "
                             + ("-" if predicted is None else f"{predicted:.2f}x"))
            if problems:
                live_cell += " " + cell("WARNING: " + "; ".join(problems), bold=True)
            if faster:      # the cost model under-predicts: not a problem of the domain
                live_cell += " " + cell("; ".join(faster))
        else:
            live_cell = cell("-" if s.source != "run" or not s.enabled else "not measured")
        rate = found.get("proposal_rate")
        test = found.get("validation") or {}
        validation = s.validation or "-"
        if test.get("shared_from") and s.validation not in (None, "not_needed"):
            validation += f", shared from {test['shared_from']}"
        rows.append([cell(name), cell("on" if s.enabled else "off", bold=s.enabled),
                     cell(_drafter_text(s)), cell(s.k or "-"), cell(s.max_batch_size or "-"),
                     cell("-" if s.mean_accepted_length is None else f"{s.mean_accepted_length:.2f}"),
                     cell("-" if rate is None else f"{100 * rate:.0f}%"),
                     cell(f"{_x(s.predicted_speedup)}{ci}"), live_cell, cell(s.samples),
                     cell(validation), cell(s.source)])
        why = _state_free(s.reason or s.note or "no reason recorded", s.enabled)
        if live and not (s.reason or "").startswith("live check:"):
            why += (f". Live check: {live_text(live)}"
                    + (f": **{'; '.join(problems)}**" if problems else "")
                    + (f" ({'; '.join(faster)})" if faster else "")
                    + (f" (weak evidence: {live['requests']} requests)" if live.get("weak") else ""))
        if test.get("shared_from") and s.enabled:
            why += (f". Sampling test shared from {test['shared_from']} (same drafter, K and "
                    "sampling settings)")
        reasons.append(f"- **{name}** ({'on' if s.enabled else 'off'}): {why}")
        on_engine = found.get("engine_sampling")
        if on_engine:
            line = (f"- **{name}**: sampling test on vLLM: {engine_sampling_text(on_engine)}; "
                    f"own engine: {own_sampling_text(found.get('validation'))}")
            if not on_engine.get("passed") and on_engine.get("reason"):
                line += f". {on_engine['reason']}"
            sampling.append(line)
    if sampling:
        sampling = ["", "Sampling tests (does speculation change what users receive?), on vLLM's "
                        "OpenAI server with the exported config, and on our engine; p: the smallest "
                        "p-value over the G-tests:", "", *sampling]
    return "\n".join([html_table(headers, rows), "",
                      "E counts every round, with or without a proposal; the proposal rate is the "
                      "share of rounds in which the drafter proposed at least one token. The live "
                      "check decodes a few requests plain and speculative and compares the measured "
                      "speedup with the prediction for the same requests.", "",
                      "Why each domain is on or off:", "", *reasons, *sampling])


def effective_speedup(setting: DomainSetting | None) -> float:
    """Decode speedup a domain gets from a setting: measured when on, plain (1.0) when off."""
    if setting is None or not setting.enabled:
        return 1.0
    return setting.measured_speedup or setting.predicted_speedup or 1.0


def changes_markdown(config: SpecdecConfig, champion: SpecdecConfig | None,
                     champion_version: str | None) -> str:
    """Markdown: each domain whose setting differs from the champion's, with both speedups."""
    if champion is None:
        return "There was no champion when this version was registered: nothing to compare with."
    lines = [f"Against champion version {champion_version} (run {champion.run_id}):"]
    if champion.target.fingerprint != config.target.fingerprint:
        lines.append(f"- **target changed**: fingerprint {champion.target.fingerprint} -> "
                     f"{config.target.fingerprint}")
    for name in sorted(set(config.domains) | set(champion.domains)):
        new, old = config.domains.get(name), champion.domains.get(name)
        describe = lambda s: "absent" if s is None else (  # noqa: E731
            "off" if not s.enabled else f"{s.drafter.kind} K={s.k} max batch {s.max_batch_size}")
        if describe(new) != describe(old):
            lines.append(f"- {name}: {describe(old)} -> {describe(new)} (speedup "
                         f"{effective_speedup(old):.2f}x -> {effective_speedup(new):.2f}x)")
    if len(lines) == 1:
        lines.append("- no setting changed")
    return "\n".join(lines)
