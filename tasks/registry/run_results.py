"""What the registry reads of a run's stored step results: the cost profile's check, the engine
check's rows and the Data Docs pages. Plain reads of specdec's tables, so that the registry needs
none of the steps (pyproject.toml: the registry does not import steps); the steps that write these
rows re-export their readers.
"""

from __future__ import annotations

from sqlalchemy import select

from ..db.engine import ensure_ready, resolve_database_url
from ..db.models import CostProfile, CostProfileCheck, DataDocsPage, EngineCheck, EvalRun


def profile_check(run_id: str, db_url: str | None = None) -> dict | None:
    """The check of the cost profile the run planned with: {hardware_profile, profile_run, status,
    reasons, attempts, max_spread}; None before the profile step (or for a profile without one).
    The profile's newest run is the one planned with (tasks.steps.costs.run_costs)."""
    engine = ensure_ready(resolve_database_url(db_url))
    with engine.connect() as connection:
        name = connection.execute(select(EvalRun.hardware_profile).where(EvalRun.run_id == run_id)).scalar()
        if not name:
            return None
        profile_run = connection.execute(
            select(CostProfile.run_id).where(CostProfile.hardware_profile == name)
            .order_by(CostProfile.created_at.desc(), CostProfile.id.desc()).limit(1)).scalar()
        if profile_run is None:
            return None
        check = connection.execute(
            select(CostProfileCheck.status, CostProfileCheck.reasons, CostProfileCheck.attempts,
                   CostProfileCheck.max_spread)
            .where((CostProfileCheck.hardware_profile == name)
                   & (CostProfileCheck.run_id == profile_run))).mappings().first()
    if check is None:
        return None
    return {"hardware_profile": name, "profile_run": profile_run, **dict(check)}


def engine_checks(run_id: str, db_url: str | None = None) -> list[dict]:
    """The run's stored engine_checks rows, by domain."""
    engine = ensure_ready(resolve_database_url(db_url))
    with engine.connect() as connection:
        return [dict(row) for row in connection.execute(select(EngineCheck).where(
            EngineCheck.run_id == run_id).order_by(EngineCheck.domain)).mappings()]


def engine_markdown(rows: list[dict]) -> str:
    """The version page's section: each domain's config on vLLM beside the estimate."""
    if not rows:
        return ("Not checked on vLLM (no serving environment, or no domain on): "
                "`specdec engine check RUN_ID` after `make serving-env`.")
    lines = ["| domain | status | K | requests | estimate E [95% CI] | vLLM E | greedy equal "
             "| vLLM tokens/s plain / config | reason |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        e = "-" if row.get("estimate_e") is None else f"{row['estimate_e']:.2f}" + (
            "" if row.get("estimate_e_lo") is None else
            f" [{row['estimate_e_lo']:.2f}, {row['estimate_e_hi']:.2f}]")
        greedy = "-" if not row.get("greedy_checked") else f"{row['greedy_equal']}/{row['greedy_checked']}"
        speed = ("-" if row.get("spec_tokens_per_s") is None or row.get("plain_tokens_per_s") is None
                 else f"{row['plain_tokens_per_s']:.1f} / {row['spec_tokens_per_s']:.1f}")
        reason = str(row.get("reason") or "").removeprefix("engine check: ").replace("|", "/")
        lines.append(f"| {row['domain']} | {row['status']} | {row.get('k') or '-'} | "
                     f"{row.get('requests') or '-'} | {e} | "
                     f"{'-' if row.get('engine_e') is None else format(row['engine_e'], '.2f')} | "
                     f"{greedy} | {speed} | {reason[:300]} |")
    version = next((row["engine_version"] for row in rows if row.get("engine_version")), None)
    return (f"vLLM {version or '?'}, each domain's exported config, the domain's requests one at a "
            "time; E = 1 + accepted / verify steps with drafts, the estimate's on the same requests "
            "at the same K.\n\n" + "\n".join(lines))


def data_docs_pages(run_id: str, db_url: str | None = None) -> dict[str, str]:
    """{page file name: HTML} of the run's Data Docs, from the database (any worker wrote them)."""
    engine = ensure_ready(resolve_database_url(db_url))
    with engine.connect() as connection:
        rows = connection.execute(select(DataDocsPage.page, DataDocsPage.html).where(
            DataDocsPage.run_id == run_id).order_by(DataDocsPage.page)).all()
    return {page: html for page, html in rows}
