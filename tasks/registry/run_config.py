"""The config of an evaluated run: built from its domain_configs rows (a domain without a usable
result keeps the champion's setting), and what changed against the champion. The per-domain
table and its reasons are rendered by tasks.registry.run_view. Descriptions name requests by id,
never by prompt text.
"""

from __future__ import annotations

from ..db import queries_registry as q
from ..db.store import Store
from ..errors import RegistryError
from .config_schema import DomainSetting, DrafterSpec, SpecdecConfig


def run_row(store: Store, run_id: str):
    """The run's eval_runs row; RegistryError unless it exists and has finished its evaluation."""
    return finished_run(q.eval_run(store, run_id), run_id)


def finished_run(row, run_id: str):
    """run_row's check of the run's eval_runs row (None: there is none)."""
    if row is None:
        raise RegistryError(f"run {run_id!r} does not exist in specdec's database; evaluate it first")
    if not row["target_fingerprint"] or not row["hardware_profile"]:
        raise RegistryError(f"run {run_id!r} has not finished its evaluation (status {row['status']}); "
                            "run the evaluation steps before registering it")
    return row


def build_config(run_id: str, store: Store,
                 champion: SpecdecConfig | None = None) -> SpecdecConfig:
    """The run's config from domain_configs; insufficient domains keep the champion's setting.
    store: specdec's database (opened by the caller)."""
    return config_of(run_row(store, run_id), q.domain_configs(store, run_id), champion)


def config_of(run, rows, champion: SpecdecConfig | None = None) -> SpecdecConfig:
    """build_config from the run's eval_runs row (finished_run) and its domain_configs rows."""
    run_id = run["run_id"]
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


# One rule for a check that did not run, wherever it is shown (the version page, its tags, the
# MLflow run, the gates, the CLI): it reads "not run" with its reason, never "passed" or "pass".
NOT_RUN = "not run"


def nothing_on_reason(config: SpecdecConfig) -> str:
    """Why a check of the domains this run turns on had nothing to check."""
    if config.domains_on:
        return "no domain this run measured is on (the domains on keep the champion's setting)"
    return "no domain is on"


def validation_status(config: SpecdecConfig) -> str:
    """passed: every measured enabled domain passed; failed: one failed; not run: no measured
    domain is on (the sampling and greedy tests run only for a domain on); incomplete otherwise."""
    verdicts = [s.validation for s in config.domains.values() if s.enabled and s.source == "run"]
    if not verdicts:
        return NOT_RUN
    if any(v == "failed" for v in verdicts):
        return "failed"
    return "passed" if all(v == "passed" for v in verdicts) else "incomplete"


def validation_text(config: SpecdecConfig) -> str:
    """validation_status with its reason where validation did not run: "not run: no domain is on"
    (the version's tag, the MLflow run's tag, the page)."""
    status = validation_status(config)
    return f"{status}: {nothing_on_reason(config)}" if status == NOT_RUN else status


def turns_nothing_on(config: SpecdecConfig) -> bool:
    """A version that turns no domain on: served, every domain decodes plain."""
    return not config.domains_on


# ------------------------------------------------------------------------------------------------
# descriptions
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
