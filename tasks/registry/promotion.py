"""Promotion of a registered config: the gates, the compare-and-set move of the `champion` alias,
rollback, and the audit rows.

Promotion checks the gates against the current champion, then moves `champion` only if the
champion is still the version the gates compared against. Every registration, promotion, refusal,
forced promotion and rollback (a refused one too) is a row in specdec's `promotions` table; a row is
forced only when --force carried a promotion past a failing gate.
"""

from __future__ import annotations

import getpass
import logging

from ..db.queries_promotions import alias_lock, promotion_of, record_promotion, registered_run
from ..db.store import Store, Unit
from ..errors import RegistryError
from ..settings import Settings, load_settings
from ..timeutil import utcnow
from .config_schema import SpecdecConfig
from .gate import Gate, gates_json
from .live_check import LiveVerdict, judge_live, live_text
from .run_config import NOT_RUN, effective_speedup, nothing_on_reason, turns_nothing_on
from .run_view import RunView, build_run_view, engine_gate
from .registry import Registry, registry_of
from .tracking import CHAMPION, alias_version, load_version_config, version_config
from .version_page import gate_counts, refresh_champion_lines, write_gates

log = logging.getLogger(__name__)


def current_user() -> str:
    """Who acts, for the audit rows: the login name, or "unknown"."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def live_gate(config: SpecdecConfig, evidence: dict, settings: Settings,
              profile_noisy: bool = False) -> Gate:
    """The live_check gate over the domains this run turns on: what confirm measured for the
    planned setting on a few requests, against min_speedup and the prediction for the same
    requests, judged by the live check's one rule (tasks.registry.live_check.judge_live, the rule
    confirm's veto uses): FAIL when it shows a problem (or confirm's stored verdict flagged or
    vetoed it), UNSURE when an interval only reaches past a bar or a domain was not measured live
    (it does not stop a promotion; the figure names each such domain), PASS otherwise. With
    `live_veto` off (the run's live timings are declared noise) a failure is "not enforced".
    """
    lines, failed, unsure, passed = [], [], [], []
    enforced = settings.live.veto
    for name, s in sorted(config.domains.items()):
        if not s.enabled or s.source != "run":
            continue
        live = (evidence.get(name) or {}).get("live")
        if not live:
            unsure.append(name)
            lines.append(f"{name}: not measured live")
            continue
        if live.get("enforced") is not None:
            enforced = enforced and bool(live["enforced"])
        judged = judge_live(live, settings.plan.min_speedup, settings.live.tolerance)
        text = f"{name} {live_text(live)}"
        if judged.verdict.found_problem or LiveVerdict.read(live.get("verdict")).found_problem:
            failed.append(name)
            lines.append(f"{text}: {'; '.join(judged.problems) or live.get('reason')}")
        elif judged.verdict is LiveVerdict.UNSURE:
            unsure.append(name)
            lines.append(f"{text}: unsure, {'; '.join(judged.doubts)}")
        else:
            passed.append(name)
            if judged.notes:      # at or above the bar; the cost model under-predicts it
                lines.append(f"{text}: at or above the bar, {'; '.join(judged.notes)}")
            if live.get("weak"):
                lines.append(f"{name} {live['measured']:.2f}x (weak evidence: {live['requests']} requests)")
    total = len(failed) + len(unsure) + len(passed)
    if total == 0:
        return Gate("live_check", True, f"{NOT_RUN}: {nothing_on_reason(config)}", result=NOT_RUN)
    figure = (f"{len(passed)}/{total} enabled domains measured at or above their bar"
              + (f"; FAILED: {', '.join(failed)}" if failed else "")
              + (f"; unsure: {', '.join(unsure)}" if unsure else "")
              + ("" if not lines else ". " + ". ".join(lines))
              + (". The cost profile is noisy: predictions are not evidence" if profile_noisy else ""))
    if failed and not enforced:
        return Gate("live_check", True, figure + " (setting live_veto off: live timings are treated as "
                    "noise)", result="not enforced")
    result = "fail" if failed else ("unsure" if unsure or profile_noisy else "pass")
    return Gate("live_check", not failed, figure, result=result)


def _validation_gate(config: SpecdecConfig, measured: dict, fingerprint_passed: bool | None) -> Gate:
    """The validation gate: every measured domain on passed its tests and the target fingerprint
    check did not fail; "not run" (never "pass") when no measured domain is on."""
    failed = sorted(n for n, s in measured.items() if s.validation != "passed")
    fingerprint = {False: "; target fingerprint check FAILED", True: "; target fingerprint check passed",
                   None: ""}[fingerprint_passed]
    if not measured:
        return Gate("validation", fingerprint_passed is not False,
                    f"{NOT_RUN}: {nothing_on_reason(config)} (the sampling and greedy tests run "
                    f"only for a domain on){fingerprint}",
                    result="fail" if fingerprint_passed is False else NOT_RUN)
    return Gate("validation", not failed and fingerprint_passed is not False,
                f"{len(measured) - len(failed)}/{len(measured)} enabled domains passed"
                + (f"; not passed: {', '.join(failed)}" if failed else "")
                + ("; target fingerprint check FAILED" if fingerprint_passed is False else ""))


def _champion_gates(config: SpecdecConfig, champion: SpecdecConfig | None, settings: Settings) -> list[Gate]:
    """no_regression and same_target: against the champion; "not run" when there is none."""
    if champion is None:
        return [Gate(name, True, f"{NOT_RUN}: no champion to compare", result=NOT_RUN)
                for name in ("no_regression", "same_target")]
    tolerance = settings.registry.regression_tolerance
    ratios = {n: effective_speedup(config.domains.get(n)) / effective_speedup(champion.domains.get(n))
              for n in champion.domains}
    worst = min(ratios.items(), key=lambda item: item[1], default=(None, 1.0))
    same = champion.target.fingerprint == config.target.fingerprint
    return [Gate("no_regression", worst[1] >= 1 - tolerance,
                 f"worst domain {worst[0]}: {worst[1]:.2f}x the champion's speedup "
                 f"(minimum {1 - tolerance:.2f})"),
            Gate("same_target", same,
                 f"{config.target.fingerprint} vs champion {champion.target.fingerprint}")]


def _samples_gate(config: SpecdecConfig, measured: dict, settings: Settings) -> Gate:
    """min_samples over the measured domains on; "not run" when none is on (the figure gives the
    run's own domains' fewest samples, so a reader sees they were not short)."""
    required = settings.sample.min_per_domain
    if not measured:
        counts = [s.samples for s in config.domains.values() if s.source == "run"]
        return Gate("min_samples", True, f"{NOT_RUN}: {nothing_on_reason(config)}"
                    + (f" (the run's domains had {min(counts)} samples or more; required {required})"
                       if counts else ""), result=NOT_RUN)
    short = sorted(n for n, s in measured.items() if s.samples < required)
    return Gate("min_samples", not short,
                f"min samples {min(s.samples for s in measured.values())} (required {required})"
                + (f"; short: {', '.join(short)}" if short else ""))


def check_gates(config: SpecdecConfig, champion: SpecdecConfig | None, settings: Settings,
                fingerprint_passed: bool | None = None, evidence: dict | None = None,
                profile_noisy: bool = False) -> list[Gate]:
    """Each gate a Gate (tasks.registry.gate: name, passed, figure, and `result` where a gate can
    be unsure, not enforced or not run). A gate with nothing to check (no domain on, no
    champion) is "not run" with its reason, never "pass". fingerprint_passed: the run's
    target-fingerprint check (None: not recorded). evidence: the run's
    run_results.domain_evidence; with it, the live_check gate (live_gate) follows validation."""
    measured = {n: s for n, s in config.domains.items() if s.enabled and s.source == "run"}
    gates = [_validation_gate(config, measured, fingerprint_passed)]
    if evidence is not None:
        gates.append(live_gate(config, evidence, settings, profile_noisy))
    no_regression, same_target = _champion_gates(config, champion, settings)
    return gates + [no_regression, _samples_gate(config, measured, settings), same_target]


def gates_for(config: SpecdecConfig, champion: SpecdecConfig | None, settings: Settings,
              store: Store, view: RunView | None = None) -> list[Gate]:
    """check_gates with the run's recorded target-fingerprint check, live checks and profile
    check, and the engine_check gate (run_view.engine_gate: whether the config ran on the serving
    engine). view: the run's RunView when the caller built it already."""
    view = view or build_run_view(config.run_id, store, settings, config=config)
    return view_gates(config, champion, settings, view)


def view_gates(config: SpecdecConfig, champion: SpecdecConfig | None, settings: Settings,
               view: RunView) -> list[Gate]:
    """gates_for from the run's view already built (its evidence read), without the store."""
    gates = check_gates(config, champion, settings, view.fingerprint_passed,
                        evidence={d.name: {"live": d.live} for d in view.domains},
                        profile_noisy=view.profile is not None and view.profile["status"] == "noisy")
    return gates + [engine_gate(view)]


def promotion_reason(config: SpecdecConfig, version: str, gates: list[Gate], forced: bool) -> str:
    """The audit row's reason of a promotion: "all gates passed" only when every gate ran and
    passed; else the gates counted by result ("no gate failed: 1 passed, 5 not run (...)"), and
    a version that turns no domain on says so first."""
    if forced:
        return "FORCED past failed gates: " + "; ".join(g.name for g in gates if not g.passed)
    ran = all(g.outcome == "pass" for g in gates)
    reason = "all gates passed" if ran else f"no gate failed: {gate_counts(gates)}; see the figures"
    if turns_nothing_on(config):
        reason = (f"version {version} turns no domain on (served, every domain decodes plain); "
                  + reason)
    return reason


def promote(name: str, version: str, store: Store, registry: Registry | None = None,
            force: bool = False, actor: str | None = None, expected_champion: str | None = "current",
            settings: Settings | None = None, *, uri: str | None = None) -> dict:
    """Gate and move `champion` to `version` (compare-and-set).

    expected_champion: the champion the caller's gates compared against ("current": whatever is
    champion now; None: there was none). store: specdec's database; registry: the MLflow
    tracking store (tasks.registry.registry.Registry; both opened by the caller; default:
    Registry.open()). uri: deprecated, a tracking URI to open the Registry from (so is a URI
    string passed by position).
    Output: {"promoted", "forced", "gates" (their JSON, Gate.to_json), "reason", ...}.
    """
    settings = settings or load_settings()
    mlflow_client = registry_of(registry, uri, store).client
    version = str(version)
    config = version_config(mlflow_client, name, version)
    before = alias_version(mlflow_client, name, CHAMPION)
    champion = load_version_config(mlflow_client, name, before) if before else None
    gates = gates_for(config, champion, settings, store)
    record = dict(run_id=config.run_id, target_id=config.target.id, config_name=name,
                  config_version=version, alias=CHAMPION, actor=actor or current_user())
    summary = {"gates": gates_json(gates), "champion_before": before}

    def page_gates(outcome: str) -> None:
        try:
            write_gates(mlflow_client, name, version, gates, f"`specdec config promote` against "
                        f"champion {before or 'none'}, {utcnow():%Y-%m-%d %H:%M} UTC: {outcome}")
        except Exception as exc:     # the page is documentation; the decision stands
            log.warning("%s version %s: gates not written on the page (%s)", name, version, exc)

    def refuse(reason: str, tx: Unit | None = None, champion: str | None = before) -> dict:
        # forced: only a promotion that --force carried past a failing gate; a refusal overrode
        # nothing (that --force was asked is kept in the row's gates)
        values = dict(action="reject", forced=False, gates={**summary, "force_requested": force},
                      reason=reason, **record)
        if tx is None:       # outside the alias lock: the audit row in a transaction of its own
            with store.transaction() as own:
                record_promotion(own, **values)
        else:
            record_promotion(tx, **values)
        log.warning("promotion of %s version %s refused: %s", name, version, reason)
        page_gates(f"NOT promoted: {reason}"[:300])
        return {"promoted": False, "forced": False, "version": version, "champion": champion,
                "gates": gates_json(gates), "reason": reason}

    if expected_champion != "current" and (expected_champion or None) != before:
        return refuse(f"the gates compared against champion {expected_champion or 'none'}, but the "
                      f"champion is now {before or 'none'}: re-run the gates")
    failed = [g for g in gates if not g.passed]
    if failed and not force and before != version:
        return refuse("gates failed: " + "; ".join(f"{g.name} ({g.figure})" for g in failed))
    with alias_lock(store, name) as tx:
        now = alias_version(mlflow_client, name, CHAMPION)   # compare-and-set: still the same?
        if now == version:      # read under the lock: a rollback that just ran is seen
            return refuse(f"version {version} is already the champion", tx, champion=now)
        if now != before:
            return refuse(f"the champion moved from {before or 'none'} to {now} while the gates "
                          "ran: re-run the gates", tx, champion=now)
        mlflow_client.set_registered_model_alias(name, CHAMPION, version)
        reason = promotion_reason(config, version, gates, bool(failed and force))
        record_promotion(tx, action="promote", forced=bool(force and failed),
                         gates=summary, reason=reason, **record)
    page_gates(("promoted FORCED past failed gates: " if failed and force else "promoted: ")
               + gate_counts(gates))
    refresh_champion_lines(mlflow_client, name, version, "promoted with `specdec config promote`"
                           + (" FORCED past failed gates" if force and failed else ""), also=(before,),
                           replaced=before)
    return {"promoted": True, "forced": bool(force and failed), "version": version, "champion": version,
            "champion_before": before, "gates": gates_json(gates), "reason": reason}


def rollback(name: str, store: Store, registry: Registry | None = None,
             actor: str | None = None, expected_champion: str | None = "current",
             evidence: dict | None = None, *, uri: str | None = None) -> dict:
    """Move `champion` back to the version it replaced (from the promotions table), compare-and-set
    inside alias_lock. expected_champion: the champion the caller means to roll back ("current":
    whatever it is when the lock is taken); a different champion refuses with RegistryError.
    A refusal (no champion, another champion than expected, nothing to roll back to) is an audit
    row too (action "reject", gates {"command": "rollback", ...}), committed before the error.
    evidence: why (the production monitor's window, tasks.steps.monitor.drift): kept in the audit row's
    gates and its reason. store: specdec's database; registry: the MLflow tracking store
    (tasks.registry.registry.Registry; both opened by the caller; default: Registry.open()).
    uri: deprecated, a tracking URI to open the Registry from (so is a URI string passed by
    position)."""
    mlflow_client = registry_of(registry, uri, store).client
    actor = actor or current_user()
    with alias_lock(store, name) as tx:
        current = alias_version(mlflow_client, name, CHAMPION)
        refusal = None
        previous = None
        if current is None:
            refusal = f"{name} has no champion to roll back"
        elif expected_champion != "current" and str(expected_champion) != current:
            refusal = (f"{name}: asked to roll back champion {expected_champion}, but the champion "
                       f"is now {current}; nothing was changed (check `specdec config show` and run "
                       "the rollback again)")
        else:
            row = promotion_of(tx, name, CHAMPION, current)
            previous = (row["gates"] or {}).get("champion_before") if row else None
            if not previous:
                refusal = (f"{name} champion version {current} replaced no earlier champion (per the "
                           "promotions table): nothing to roll back to")
        if refusal is not None:
            # the champion's run and target, from its registration row (none without a champion)
            known = registered_run(tx, name, current) if current else None
            record_promotion(tx, run_id=known[0] if known else None,
                             target_id=known[1] if known else None, config_name=name,
                             config_version=current, alias=CHAMPION, action="reject", forced=False,
                             actor=actor, reason=f"rollback refused: {refusal}"[:2000],
                             gates={"command": "rollback", "champion_before": current,
                                    "expected_champion": None if expected_champion == "current"
                                    else str(expected_champion),
                                    **({"evidence": evidence} if evidence else {})})
        else:
            restored = promotion_of(tx, name, CHAMPION, previous)    # what it replaced
            restored_before = (restored["gates"] or {}).get("champion_before") if restored else None
            config = load_version_config(mlflow_client, name, previous)
            mlflow_client.set_registered_model_alias(name, CHAMPION, previous)
            record_promotion(tx, run_id=config.run_id, target_id=config.target.id,
                             config_name=name, config_version=previous, alias=CHAMPION,
                             action="rollback", forced=False, actor=actor,
                             gates={"champion_before": current,
                                    **({"evidence": evidence} if evidence else {})},
                             reason=f"rolled back from version {current}"
                             + (f": {evidence['reason']}" if evidence and evidence.get("reason") else ""))
    if refusal is not None:          # raised once the refusal's audit row is committed
        log.info("rollback of %s refused: %s", name, refusal)   # the error says it once
        raise RegistryError(refusal)
    refresh_champion_lines(mlflow_client, name, previous,
                           f"restored by `specdec config rollback` from version {current}", also=(current,),
                           replaced=restored_before)
    return {"champion": previous, "champion_before": current}
