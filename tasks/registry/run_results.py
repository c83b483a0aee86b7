"""What the registry reads of a run's stored step results: the cost profile's check, the engine
check's rows, each domain's evidence (live check, proposal rate, sampling tests on our engine and
on vLLM), the domains below
the low-acceptance alert and the Data Docs pages. Plain reads of specdec's tables, so that the registry needs
none of the steps (pyproject.toml: the registry does not import steps); the steps that write these
rows re-export their readers.
"""

from __future__ import annotations

from ..db import queries_registry as q
from ..db.store import Store


def profile_check(run_id: str, store: Store) -> dict | None:
    """The check of the cost profile the run planned with: {hardware_profile, profile_run, status,
    reasons, attempts, max_spread, reused_from, measured_at}; None before the profile step (or for
    a profile without one). The profile's newest run is the one planned with
    (tasks.steps.costs.costs.run_costs); reused_from: the run that measured costs this run reused
    (None: measured by profile_run itself), measured_at: when (ISO, UTC; None: not recorded)."""
    return profile_check_of(q.profile_check_row(store, run_id))


def profile_check_of(found: tuple[str, str, dict] | None) -> dict | None:
    """profile_check from its row (tasks.db.queries_registry.profile_check_row)."""
    if found is None:
        return None
    name, profile_run, check = found
    check = dict(check)
    if check["measured_at"] is not None:
        check["measured_at"] = check["measured_at"].isoformat()
    return {"hardware_profile": name, "profile_run": profile_run, **check}


def engine_checks(run_id: str, store: Store) -> list[dict]:
    """The run's stored engine_checks rows, by domain."""
    return q.engine_check_rows(store, run_id)


def engine_speedup_text(row: dict) -> str:
    """vLLM's decode-phase speedup measured on the checked requests / the one its own cost profile
    predicts for them ("-" where neither was taken)."""
    measured, predicted = row.get("measured_speedup"), row.get("predicted_speedup")
    if measured is None and predicted is None:
        return "-"
    text = (("-" if measured is None else f"{measured:.2f}x") + " / "
            + ("no vLLM profile" if predicted is None else f"{predicted:.2f}x"))
    if measured is not None and predicted:
        text += f" ({100 * (measured / predicted - 1):+.0f}%)"
    return text


def data_docs_pages(run_id: str, store: Store) -> dict[str, str]:
    """{page file name: HTML} of the run's Data Docs, from the database (any worker wrote them)."""
    return {page: html for page, html in q.data_docs_rows(store, run_id)}


def domain_evidence(run_id: str, store: Store) -> dict[str, dict]:
    """{domain: {"live", "proposal_rate", "validation"}} of a run, what the version page shows
    beside the config:

    - live: the confirm step's measurement of the planned (drafter, K) ({measured, lo, hi,
      predicted_same (the prediction for the same requests), predicted, cost_model_error, error_lo,
      error_hi (its interval), gap,
      requests, verdict, weak, reason, min_speedup, tolerance, enforced}; from live_measurements
      and domain_configs.live_check), None when the domain was not measured live;
    - proposal_rate: the share of the planned drafter's rounds at the planned K that drafted at
      least one token (1 - the estimate's share of rounds of width 0), None without an estimate;
      E counts every round, so a drafter that rarely proposes has a low E beside high per-position
      rates;
    - validation: the domain's sampling test on our engine ({shared_from, k, ks, samplings,
      request_id, passed, min_p}), None when none is stored;
    - engine_sampling: its sampling test on vLLM's OpenAI server (engine_sampling_tests), None
      when none is stored.
    """
    return evidence_of(q.evidence_rows(store, run_id))


def evidence_of(rows: dict) -> dict[str, dict]:
    """domain_evidence from its rows (tasks.db.queries_registry.evidence_rows)."""
    configs, lives, shares, tests = rows["configs"], rows["lives"], rows["shares"], rows["tests"]
    on_engine = _engine_sampling(rows["engine_sampling"])
    out = {}
    for config in configs:
        domain = config["domain"]
        live = None
        row = lives.get(domain)
        if row is not None and row["measured_speedup"] is not None:
            verdict = dict(config["live_check"] or {})
            live = {"measured": row["measured_speedup"], "lo": row["measured_speedup_lo"],
                    "hi": row["measured_speedup_hi"], "predicted_same": row["predicted_same_requests"],
                    "predicted": row["predicted_speedup"], "cost_model_error": row["cost_model_error"],
                    "gap": row["gap"], "requests": row["requests"],
                    # the cost-model error's interval (confirm's verdict; None on older rows)
                    "error_lo": verdict.get("error_lo"), "error_hi": verdict.get("error_hi"),
                    "verdict": verdict.get("verdict"), "weak": verdict.get("weak"),
                    "reason": verdict.get("reason"), "min_speedup": verdict.get("min_speedup"),
                    "tolerance": verdict.get("tolerance"), "enforced": verdict.get("live_veto")}
        share = shares.get((domain, config["drafter"], config["k"]))
        test = tests.get(domain)
        details = (test.details or {}) if test is not None else {}
        out[domain] = {
            "live": live,
            "proposal_rate": None if not share else max(0.0, 1.0 - float(share[0])),
            "validation": None if test is None else {
                "shared_from": details.get("shared_from"), "k": test.k, "ks": details.get("ks"),
                "samplings": details.get("samplings"), "request_id": test.request_id,
                "passed": test.passed, "min_p": test.p_value, "first": _first(details)},
            "engine_sampling": on_engine.get(domain)}
    return out


ENGINE_SAMPLING = q.ENGINE_SAMPLING      # check_name of the vLLM sampling test (steps.checks.engine_validate)


def _engine_sampling(rows) -> dict[str, dict]:
    out = {}
    for row in rows:
        details = row.details or {}
        summary = details.get("config") or {}
        control = details.get("control")
        out[row.domain] = {
            "engine": details.get("engine") or "vllm", "status": details.get("status"),
            "passed": row.passed, "rows": summary.get("rows"), "positions": summary.get("positions"),
            "min_p": row.p_value, "reason": details.get("reason"),
            "control": None if control is None else ("passed" if control.get("passed") else "failed"),
            "shared_from": details.get("shared_from"), "first": _first(details)}
    return out


def _first(details: dict) -> str | None:
    """"first draw of 300 rows failed" where the test's deciding draws were a confirmation
    (validation_confirm_factor), else None."""
    first = details.get("first")
    return None if not first else f"first draw of {first.get('rows')} rows failed"


def engine_sampling_tests(run_id: str, store: Store) -> dict[str, dict]:
    """{domain: the run's sampling test on vLLM's OpenAI server} (validations rows with check_name
    "engine_sampling", written by tasks.steps.checks.engine_validate): {engine, status (passed | failed |
    engine_differs | error), passed, rows (per test), positions (G-tests), min_p (the smallest p
    over them), reason, control (the plain server's verdict, "passed" | "failed", None where it
    did not run), shared_from, first ("first draw of N rows failed" where a confirmation
    decided, else None)}. A test that could not run ("error") has no rows, positions nor
    min_p."""
    return _engine_sampling(q.engine_sampling_rows(store, run_id))


ENGINE_SAMPLING_STATUS = {"passed": "passed", "failed": "FAILED", "engine_differs": "ENGINE DIFFERS",
                          "error": "ERROR"}


def engine_sampling_text(test: dict | None) -> str:
    """One domain's sampling test on vLLM in a cell: "passed (300 rows, 6 tests, p>=0.021)",
    "passed on confirmation (1200 rows, ..., first draw of 300 rows failed)", "FAILED (...,
    plain server passed)", "ERROR (could not run)"; "-" when there is none."""
    if not test:
        return "-"
    status = test.get("status") or ("passed" if test.get("passed") else "failed")
    word = ENGINE_SAMPLING_STATUS.get(status, status)
    if test.get("positions") is None:
        return f"{word} (could not run)"
    figures = [f"{test['rows']} rows", f"{test['positions']} tests"]
    if test.get("min_p") is not None:
        figures.append(f"p>={test['min_p']:.2g}")
    if test.get("first"):
        figures.append(test["first"])
    if test.get("control"):
        figures.append(f"plain server {test['control']}")
    if test.get("shared_from"):
        figures.append(f"shared from {test['shared_from']}")
    return f"{word}{' on confirmation' if test.get('first') and test.get('passed') else ''} ({', '.join(figures)})"


def own_sampling_text(test: dict | None) -> str:
    """One domain's sampling test on our engine (domain_evidence's "validation") in the same
    words: "passed (p>=0.41)", "FAILED (...)"; "not run" when there is none."""
    if not test:
        return "not run"
    figures = [] if test.get("min_p") is None else [f"p>={test['min_p']:.2g}"]
    if test.get("first"):
        figures.append(test["first"])
    if test.get("shared_from"):
        figures.append(f"shared from {test['shared_from']}")
    word = ("passed" if test.get("passed") else "FAILED") + (" on confirmation" if test.get("first") and test.get("passed") else "")
    return word + (f" ({', '.join(figures)})" if figures else "")


def low_acceptance(run_id: str, threshold: float, store: Store) -> list[dict]:
    """Domains (planned, status ok) whose planned drafter's expected tokens per round fell below
    `threshold`: [{domain, drafter, k, mean_accepted_length, enabled}] by domain. What the
    low-acceptance alert publishes and the version page states."""
    return low_acceptance_of(q.planned_acceptance(store, run_id), threshold)


def low_acceptance_of(rows, threshold: float) -> list[dict]:
    """low_acceptance from the planned rows (tasks.db.queries_registry.planned_acceptance)."""
    return [{"domain": r.domain, "drafter": r.drafter, "k": r.k, "mean_accepted_length": r.mean_accepted_length,
             "enabled": bool(r.enabled)}
            for r in rows if r.mean_accepted_length is not None and r.mean_accepted_length < threshold]
