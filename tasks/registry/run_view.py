"""One rendering of an evaluated run: a typed record of the run built from the store (RunView),
and the Markdown every reader gets from it.

The version page (tasks.registry.registration), the run artifact `reports/domains.md`, the MLflow
run's description, `specdec evaluate`'s table and `specdec config show` all read a run through
this module, so they show the same figures: per domain on/off, drafter, K, max batch, E with the
proposal rate, the prediction with its interval, the live check judged by its one rule
(tasks.registry.live_check), validation, the engine check on vLLM, and why. Tables are plain
Markdown (MLflow renders them; `|` inside a cell is escaped), never HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..db.load_records import DomainLoad
from ..db.queries_registry import view_rows
from ..db.store import Store
from ..settings import Settings
from .config_schema import DomainSetting, SpecdecConfig
from .live_check import LiveJudgement, LiveVerdict, judge_live, judgement_words, live_text
from .figures import interval_at_bar
from .gate import Gate
from .load_results import load_check_text, load_markdown
from .run_config import NOT_RUN, build_config, nothing_on_reason
from .run_results import (engine_sampling_text, engine_speedup_text, evidence_of, low_acceptance_of,
                          own_sampling_text, profile_check_of)


@dataclass(frozen=True)
class DomainView:
    """One domain of the run: its setting, and the evidence stored for it."""

    name: str
    setting: DomainSetting
    live: dict | None = None              # run_results.domain_evidence's "live" (source "run" only)
    judgement: LiveJudgement = field(default_factory=lambda: LiveJudgement(LiveVerdict.NONE))
    proposal_rate: float | None = None
    validation_test: dict | None = None   # the sampling test on our engine
    engine_sampling: dict | None = None   # ... and on vLLM
    engine: dict | None = None            # the engine_checks row
    load: DomainLoad | None = None        # the load check on vLLM's server (its levels)


@dataclass(frozen=True)
class RunView:
    """The run as every reader shows it."""

    run_id: str
    config: SpecdecConfig
    domains: list[DomainView]
    engine_rows: list[dict]
    engine_skipped: str | None            # why the engine check did not run (None: it ran)
    low_acceptance: list[dict]
    profile: dict | None
    min_speedup: float
    tolerance: float
    acceptance_alert: float
    loads: dict[str, DomainLoad] = field(default_factory=dict)   # by domain (queries_load.load_checks)
    fingerprint_passed: bool | None = None      # the run's target-fingerprint check (None: not recorded)
    load_check_on: bool = True                  # the setting load_check

    @property
    def engine_checked(self) -> bool:
        return bool(self.engine_rows)


def build_run_view(run_id: str, store: Store, settings: Settings,
                   champion: SpecdecConfig | None = None, config: SpecdecConfig | None = None,
                   read: dict | None = None) -> RunView:
    """The run's view from the store; config: the run's config when the caller built it already;
    read: the run's rows when the caller read them already (tasks.db.queries_registry.view_rows)."""
    config = config or build_config(run_id, store, champion=champion)
    return run_view_of(run_id, config, read or view_rows(store, run_id), settings)


def run_view_of(run_id: str, config: SpecdecConfig, read: dict, settings: Settings) -> RunView:
    """build_run_view from what was read already, without the store: the run's config and its
    rows (tasks.db.queries_registry.view_rows, or registration_rows' "view")."""
    evidence = evidence_of(read["evidence"])
    rows = {row["domain"]: row for row in read["engine_checks"]}
    loads = read["loads"]
    domains = []
    for name, setting in sorted(config.domains.items()):
        found = (evidence.get(name) or {}) if setting.source == "run" else {}
        live = found.get("live")
        domains.append(DomainView(
            name=name, setting=setting, live=live,
            judgement=judge_live(live, settings.plan.min_speedup, settings.live.tolerance),
            proposal_rate=found.get("proposal_rate"), validation_test=found.get("validation"),
            engine_sampling=found.get("engine_sampling"), engine=rows.get(name), load=loads.get(name)))
    return RunView(run_id=run_id, config=config, domains=domains, engine_rows=list(rows.values()),
                   engine_skipped=read["engine_skipped"],
                   low_acceptance=low_acceptance_of(read["planned"], settings.plan.acceptance_alert),
                   profile=profile_check_of(read["profile"]), min_speedup=settings.plan.min_speedup,
                   tolerance=settings.live.tolerance, acceptance_alert=settings.plan.acceptance_alert,
                   loads=loads, fingerprint_passed=read["fingerprint_passed"],
                   load_check_on=settings.load.check)


# ------------------------------------------------------------------------------------------------
# the per-domain table
HEADERS = ["domain", "on", "drafter", "K", "max batch", "E [tokens/round]", "proposal rate",
           "predicted (95% CI)", "live check (same requests)", "samples", "validation",
           "vLLM sampling", "on vLLM", "under load (vLLM)", "source"]


def _x(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def drafter_text(s: DomainSetting) -> str:
    if s.drafter is None:
        return "-"
    return s.drafter.kind + ("(" + ",".join(f"{k}={v}" for k, v in sorted(s.drafter.params.items())) + ")"
                             if s.drafter.params else "")


def live_cell(domain: DomainView) -> str:
    s, live = domain.setting, domain.live
    if not live:
        return "-" if s.source != "run" or not s.enabled else "not measured"
    predicted = live.get("predicted_same") or live.get("predicted")
    words = judgement_words(domain.judgement)
    return f"{live['measured']:.2f}x vs {_x(predicted)}" + (f" {words}" if words else "")


def engine_cell(view: RunView, domain: DomainView) -> str:
    """The domain on vLLM: the engine check's status and E beside the estimate's; "not checked"
    for a domain on whose run skipped the check."""
    row = domain.engine
    if row is not None:
        e = "" if row.get("engine_e") is None else f", E {row['engine_e']:.2f}" + (
            "" if row.get("estimate_e") is None else f" vs {row['estimate_e']:.2f} est.")
        return f"{row['status']}{e}"
    if domain.setting.enabled and domain.setting.source == "run":
        return "NOT CHECKED" if view.engine_skipped or not view.engine_rows else "-"
    return "-"


def validation_cell(domain: DomainView) -> str:
    s, test = domain.setting, domain.validation_test or {}
    if s.validation == "not_needed":      # the tests run only for a domain on
        return f"{NOT_RUN} (off)"
    text = s.validation or "-"
    if test.get("shared_from") and s.validation not in (None, "not_needed"):
        text += f", shared from {test['shared_from']}"
    return text


def profile_note(view: RunView) -> str:
    """The cost profile's state beside a prediction: its interval is over requests only, so a
    noisy (or unchecked) profile is said there; "" for an ok one or none recorded."""
    if view.profile is None or view.profile["status"] == "ok":
        return ""
    return f" (cost profile {view.profile['status'].upper()})"


def table_rows(view: RunView) -> list[list[str]]:
    """The per-domain table's rows (strings, one per domain, HEADERS' order)."""
    rows = []
    for d in view.domains:
        s = d.setting
        ci = "" if s.predicted_speedup_ci95 is None else (
            " " + interval_at_bar(*s.predicted_speedup_ci95, bars=(view.min_speedup, 1.0)))
        rows.append([d.name, "on" if s.enabled else "off", drafter_text(s), str(s.k or "-"),
                     str(s.max_batch_size or "-"),
                     "-" if s.mean_accepted_length is None else f"{s.mean_accepted_length:.2f}",
                     "-" if d.proposal_rate is None else f"{100 * d.proposal_rate:.0f}%",
                     f"{_x(s.predicted_speedup)}{ci}{profile_note(view) if s.predicted_speedup else ''}",
                     live_cell(d), str(s.samples),
                     validation_cell(d), engine_sampling_text(d.engine_sampling),
                     engine_cell(view, d), load_check_text(d.load), s.source])
    return rows


# the page's tables fit 1280 px (MLflow's page and artifact pane): the decision in the first,
# the rest below, each row named by its domain; the terminal shows HEADERS in one table
MAIN_HEADERS = ["domain", "on", "drafter", "K", "E [tokens/round]", "predicted (95% CI)",
                "live check (same requests)", "validation", "on vLLM"]
MORE_HEADERS = ["domain", "max batch", "proposal rate", "samples", "vLLM sampling",
                "under load (vLLM)", "source"]


def split_tables(view: RunView) -> str:
    """The per-domain table as two Markdown tables: MAIN_HEADERS, then MORE_HEADERS."""
    rows = table_rows(view)

    def pick(headers: list[str]) -> list[list[str]]:
        return [[row[HEADERS.index(h)] for h in headers] for row in rows]
    return (markdown_table(MAIN_HEADERS, pick(MAIN_HEADERS)) + "\n\nMore per domain:\n\n"
            + markdown_table(MORE_HEADERS, pick(MORE_HEADERS)))


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table ("|" inside a cell escaped; newlines become spaces)."""
    def cell(text) -> str:
        return str(text).replace("\n", " ").replace("|", "\\|")
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _state_free(reason: str, enabled: bool) -> str:
    """The planner's reason without its leading "on: " / "off: " (the page states on/off itself)."""
    for prefix in ("on: ", "off: ") if enabled else ("off: ",):
        if reason.startswith(prefix):
            return reason[len(prefix):]
    return reason


def reason_line(d: DomainView) -> str:
    s, live = d.setting, d.live
    why = _state_free(s.reason or s.note or "no reason recorded", s.enabled)
    if live and not (s.reason or "").startswith("live check:"):
        j = d.judgement
        why += (f". Live check: {live_text(live)}"
                + (f": **{'; '.join(j.problems)}**" if j.problems else "")
                + (f" (unsure: {'; '.join(j.doubts)})" if j.doubts else "")
                + (f" ({'; '.join(j.notes)})" if j.notes else "")
                + (f" (weak evidence: {live['requests']} requests)" if live.get("weak") else ""))
    test = d.validation_test or {}
    if test.get("shared_from") and s.enabled:
        why += f". Sampling test shared from {test['shared_from']} (same drafter, K and sampling settings)"
    return f"- **{d.name}** ({'on' if s.enabled else 'off'}): {why}"


def sampling_lines(view: RunView) -> list[str]:
    lines = []
    for d in view.domains:
        if d.engine_sampling:
            own = (own_sampling_text(d.validation_test) if d.validation_test
                   else "not run (the test on vLLM gates)")
            line = (f"- **{d.name}**: sampling test on vLLM: {engine_sampling_text(d.engine_sampling)}; "
                    f"own engine: {own}")
            if not d.engine_sampling.get("passed") and d.engine_sampling.get("reason"):
                line += f". {d.engine_sampling['reason']}"
            lines.append(line)
    if lines:
        lines = ["", "Sampling tests (does speculation change what users receive?), on vLLM's OpenAI "
                     "server with the exported config, and on our engine; p: the smallest p-value "
                     "over the G-tests:", "", *lines]
    return lines


def domains_markdown(view: RunView) -> str:
    """The per-domain table, what its columns mean, and why each domain is on or off."""
    return "\n".join([
        split_tables(view), "",
        "E counts every round, with or without a proposal; the proposal rate is the share of rounds "
        "in which the drafter proposed at least one token. The predicted speedup's 95% interval is "
        "over the sampled requests, widened by the cost's own interval only where the profile is a "
        "serving engine's paired one (not the cost profile's timing noise otherwise): a profile "
        "that is not ok is named beside each prediction. The live check decodes a few requests "
        "plain and speculative and compares the measured speedup with the prediction for the same "
        "requests (WARNING: its interval shows a problem; unsure: its interval reaches past a bar). "
        "On vLLM: the engine check's status of the domain's config on the serving engine "
        "(NOT CHECKED: the domain is on and the check did not run; see the engine check below). "
        "In the vLLM columns \"-\" is a check not run: the domain is off"
        + ("" if view.config.domains_on else " (here every domain is off)") + ".", "",
        "Why each domain is on or off:", "", *[reason_line(d) for d in view.domains],
        *sampling_lines(view)])


# ------------------------------------------------------------------------------------------------
# the engine check, the warnings
def engine_state(view: RunView) -> str:
    """The engine check in a few words: checked on vLLM, or NOT checked and why."""
    if view.engine_rows:
        version = next((r["engine_version"] for r in view.engine_rows if r.get("engine_version")), None)
        return f"checked on vLLM {version or '?'}"
    if not view.config.domains_on:
        return f"{NOT_RUN}: {nothing_on_reason(view.config)}"
    why = view.engine_skipped or "no engine check was recorded for this run"
    return f"NOT checked on the serving engine: {why}"


def load_not_run(view: RunView) -> str:
    """The one reason the load check did not run: no domain on, the engine check not run (no
    serving environment, or off), the load check off, or no domain on with a vLLM config."""
    if not view.config.domains_on:
        return nothing_on_reason(view.config)
    if not view.engine_rows:
        return f"the engine check did not run ({view.engine_skipped or 'none was recorded'})"
    if not view.load_check_on:
        return "the load check is off (setting load_check)"
    return "no domain on has a vLLM config"


def engine_markdown(view: RunView) -> str:
    """The page's section: each domain's config on vLLM beside the estimate, or why it was not
    checked (and how to check it)."""
    if not view.engine_rows:
        text = f"**{engine_state(view)[0].upper()}{engine_state(view)[1:]}.**"
        if view.config.domains_on:
            text += (f" The config of the domains on ({', '.join(view.config.domains_on)}) is not "
                     "checked on the serving engine; to check it: `make serving-env`, then "
                     f"`specdec engine check {view.run_id}`.")
        return text
    lines = []
    for row in view.engine_rows:
        e = "-" if row.get("estimate_e") is None else f"{row['estimate_e']:.2f}" + (
            "" if row.get("estimate_e_lo") is None else
            f" [{row['estimate_e_lo']:.2f}, {row['estimate_e_hi']:.2f}]")
        greedy = "-" if not row.get("greedy_checked") else f"{row['greedy_equal']}/{row['greedy_checked']}"
        speed = ("-" if row.get("spec_tokens_per_s") is None or row.get("plain_tokens_per_s") is None
                 else f"{row['plain_tokens_per_s']:.1f} / {row['spec_tokens_per_s']:.1f}")
        reason = str(row.get("reason") or "").removeprefix("engine check: ")
        lines.append([row["domain"], row["status"], str(row.get("k") or "-"),
                      str(row.get("requests") or "-"), e,
                      "-" if row.get("engine_e") is None else f"{row['engine_e']:.2f}", greedy, speed,
                      engine_speedup_text(row), reason[:300]])
    return (f"{engine_state(view)}: each domain's exported config, the domain's requests one at a "
            "time; E = 1 + accepted / verify steps with drafts, the estimate's on the same requests "
            "at the same K.\n\n" + markdown_table(
                ["domain", "status", "K", "requests", "estimate E [95% CI]", "vLLM E", "greedy equal",
                 "vLLM tokens/s plain / config", "vLLM speedup measured / predicted", "reason"], lines))


def below_bar_markdown(view: RunView) -> str:
    """The warning about domains that are on although their live check shows a problem (the one
    rule: judge_live); "" when none does."""
    lines = [f"- **{d.name}**: {live_text(d.live)}: {'; '.join(d.judgement.problems)}"
             for d in view.domains
             if d.setting.enabled and d.setting.source == "run" and d.judgement.problems]
    if not lines:
        return ""
    return ("**WARNING: on, but the live check measured them below the bar or slower than predicted** "
            "(see the live_check gate):\n\n" + "\n".join(lines) + "\n\n")


def alert_markdown(view: RunView) -> str:
    """The low-acceptance alert's line ("" when no domain is below it)."""
    if not view.low_acceptance:
        return ""
    rates = {d.name: d.proposal_rate for d in view.domains}
    parts = []
    for row in view.low_acceptance:
        rate = rates.get(row["domain"])
        parts.append(f"{row['domain']} ({'on' if row['enabled'] else 'off'}, {row['drafter']} K={row['k']}: "
                     f"E = {row['mean_accepted_length']:.2f}"
                     + ("" if rate is None else f", proposal rate {100 * rate:.0f}%") + ")")
    return (f"**Low-acceptance alert** (expected tokens per round below {view.acceptance_alert:.2f}; "
            "published as `specdec://alerts/low-acceptance`, which triggers draft retraining): "
            + ", ".join(parts) + ".\n\n")


def engine_gate(view: RunView) -> Gate:
    """The engine_check gate: reports whether the config was checked on the serving engine. It
    never blocks (the engine check already turned off what vLLM refused or accepted less of); a
    config not checked is said so in the Gates table ("not checked")."""
    if view.engine_rows:
        failed = sorted(r["domain"] for r in view.engine_rows if r.get("passed") is False)
        return Gate("engine_check", True, f"{len(view.engine_rows)} domains {engine_state(view)}"
                    + (f"; turned off: {', '.join(failed)}" if failed else ""), result="pass")
    if not view.config.domains_on:
        return Gate("engine_check", True, engine_state(view), result=NOT_RUN)
    return Gate("engine_check", True, f"{engine_state(view)}; promoted, it serves a config the serving "
                "engine never ran", result="not checked")


def run_markdown(view: RunView) -> str:
    """The run on its own (the artifact `reports/domains.md`): its warnings, the per-domain table
    with its reasons, and the engine check: every figure the version page has of the run."""
    config = view.config
    engine_line = "" if view.engine_rows or not config.domains_on else f"**{engine_state(view)}.**\n\n"
    return (f"# Run {view.run_id}: per-domain settings\n\n"
            f"Target `{config.target.id}` ({config.target.fingerprint}), hardware profile "
            f"`{config.hardware_profile}`"
            + ("" if view.profile is None else f" ({view.profile['status']})") + ".\n\n"
            + below_bar_markdown(view) + alert_markdown(view) + engine_line
            + domains_markdown(view) + "\n\n## On vLLM (engine check)\n\n" + engine_markdown(view)
            + "\n\n## Under load on vLLM (load check)\n\n" + load_markdown(view.loads, load_not_run(view)) + "\n")
