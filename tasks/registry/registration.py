"""An evaluation tracked in MLflow and its config registered: the run's params, metrics, plots and
reports go to one MLflow run (reused when a step is retried), and its `config/` artifact becomes a
version of `specdec-config-<target-slug>` (tag `run_id`: a retried registration reuses the version)
with the alias `challenger`. Every registration is a row in specdec's `promotions` table.
"""

from __future__ import annotations

import json
import logging
import tempfile
from html import escape
from pathlib import Path

from mlflow.exceptions import MlflowException
from sqlalchemy import select

from ..db.engine import ensure_ready, resolve_database_url
from ..db.models import AcceptanceEstimate, DomainConfig, LiveMeasurement, QualityResult, Validation
from ..settings import Settings, load_settings
from .config_schema import config_model_name, parse_config
from .promotion import current_user, gates_for, record_promotion
from .run_config import (build_config, changes_markdown, domain_table_markdown, live_problems, live_text,
                         run_row, validation_status)
from .run_results import (data_docs_pages, domain_evidence, engine_checks, engine_markdown, low_acceptance,
                          profile_check)
from .tracking import (CHALLENGER, RUN_TAG, client, current_champion, experiment_for_target, find_run,
                       tracking_uri)
from .version_page import champion_audit, champion_line, gates_markdown

log = logging.getLogger(__name__)


def _plots(run_id: str, connection, directory: Path) -> list[Path]:
    """Per-position conditional acceptance per domain; predicted speedup vs K per domain/drafter."""
    # imported here: matplotlib costs ~1.4 s to import: only the plots pay it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = connection.execute(select(AcceptanceEstimate).where(AcceptanceEstimate.run_id == run_id)
                              .order_by(AcceptanceEstimate.domain, AcceptanceEstimate.drafter,
                                        AcceptanceEstimate.k)).mappings().all()
    chosen = dict(connection.execute(select(DomainConfig.domain, DomainConfig.drafter)
                                     .where(DomainConfig.run_id == run_id)).all())
    if not rows:
        return []
    from matplotlib.ticker import MaxNLocator

    domains = sorted({r["domain"] for r in rows})
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for domain in domains:
        best = [r for r in rows if r["domain"] == domain and r["drafter"] == chosen.get(domain)]
        if best:
            rates = max(best, key=lambda r: r["k"])["conditional_acceptance"] or []
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{domain} ({best[0]['drafter']})")
    ax.set(xlabel="draft position i", ylabel="conditional acceptance a_i", ylim=(0, 1),
           title=f"run {run_id}: per-position acceptance (planned drafter)")
    ax.legend(fontsize=8, loc="upper right")
    paths.append(directory / "conditional_acceptance.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    # at most 3 panels a row: the page shows images about 900 px wide, so every panel stays legible
    columns = min(3, len(domains))
    grid = (len(domains) + columns - 1) // columns
    fig, axes = plt.subplots(grid, columns, figsize=(4 * columns, 3.2 * grid), sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(domains):]:
        ax.set_visible(False)
    for ax, domain in zip(axes.flat, domains):
        for drafter in sorted({r["drafter"] for r in rows if r["domain"] == domain}):
            points = [(r["k"], r["predicted_speedup"]) for r in rows
                      if r["domain"] == domain and r["drafter"] == drafter and r["predicted_speedup"]]
            if points:
                ax.plot(*zip(*points), marker=".", label=drafter)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=domain, xlabel="K")
    for row in axes:
        row[0].set_ylabel("predicted speedup (batch 1)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[1:len(domains)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    paths.append(directory / "predicted_speedup_vs_k.png")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) + 1) // 2) / grid, 1, 1))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    live = connection.execute(select(LiveMeasurement.domain, LiveMeasurement.predicted_same_requests,
                                     LiveMeasurement.measured_speedup)
                              .where(LiveMeasurement.run_id == run_id)
                              .order_by(LiveMeasurement.domain)).all()
    live = [row for row in live if row.predicted_same_requests and row.measured_speedup]
    if live:   # the cost model's calibration: predicted vs measured on the same requests
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter([r.predicted_same_requests for r in live], [r.measured_speedup for r in live])
        for r in live:
            ax.annotate(r.domain, (r.predicted_same_requests, r.measured_speedup), fontsize=7)
        low = min(min(r.predicted_same_requests, r.measured_speedup) for r in live) * 0.9
        high = max(max(r.predicted_same_requests, r.measured_speedup) for r in live) * 1.1
        ax.plot([low, high], [low, high], color="grey", lw=0.8)
        ax.set(xlabel="predicted speedup (same requests)", ylabel="measured speedup",
               title=f"run {run_id}: cost-model calibration")
        paths.append(directory / "calibration.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def data_docs_index(run_id: str, pages: list[str], quality: list[dict]) -> str:
    """One HTML page: the run's data-quality verdicts per suite, linking GX's Data Docs pages."""
    verdict: dict[str, bool] = {}
    for row in quality:
        verdict[row["suite"]] = verdict.get(row["suite"], True) and bool(row["success"])
    items = "".join(f'<li><a href="data_docs/{escape(page)}">{escape(Path(page).stem)}</a></li>'
                    for page in pages)
    rows = "".join(f"<tr><td>{escape(suite)}</td><td>{'passed' if ok else 'FAILED'}</td></tr>"
                   for suite, ok in sorted(verdict.items()))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Data quality of run "
            f"{escape(run_id)}</title></head><body style='font-family: sans-serif'>"
            f"<h2>Data quality of run {escape(run_id)}</h2><table border='1' cellpadding='4'>"
            f"<tr><th>suite</th><th>result</th></tr>{rows}</table>"
            f"<p>Great Expectations Data Docs, one page per validation:</p><ul>{items}</ul>"
            f"<p>The same results as JSON: <code>reports/data_quality.json</code>.</p></body></html>")


def end_run(mlflow_client, mlflow_run_id: str, exc: BaseException | None = None) -> None:
    """Set the MLflow run's final status: FINISHED (no exc), KILLED (an interrupt or a task
    terminated by Airflow: not an Exception), FAILED (an error). Best effort: the original error,
    if any, is what the caller raises."""
    status = "FINISHED" if exc is None else ("FAILED" if isinstance(exc, Exception) else "KILLED")
    try:
        mlflow_client.set_terminated(mlflow_run_id, status)
    except Exception as error:     # the store may be what failed
        if exc is None:
            raise
        log.warning("MLflow run %s: could not set status %s (%s)", mlflow_run_id, status, error)


def track_evaluation(run_id: str, db_url: str | None = None, uri: str | None = None,
                     settings: Settings | None = None, champion=None) -> dict:
    """Log (or re-log into the same MLflow run) the evaluation's params, metrics and artifacts.
    champion: (version, config) of the current champion when the caller already read it."""
    settings = settings or load_settings()
    db_url = resolve_database_url(db_url or settings.database_url)
    mlflow_client = client(tracking_uri(uri, db_url))
    engine = ensure_ready(db_url)
    if champion is None:
        champion = current_champion(uri=uri, target_id=None, run_id=run_id, db_url=db_url)
    config = build_config(run_id, db_url, champion=champion[1])
    experiment_id = experiment_for_target(mlflow_client, config.target.id)
    existing = find_run(mlflow_client, experiment_id, run_id)
    if existing is None:
        run = mlflow_client.create_run(experiment_id, run_name=run_id, tags={RUN_TAG: run_id})
        mlflow_run_id = run.info.run_id
    else:
        mlflow_run_id = existing.info.run_id
    try:
        with engine.connect() as connection:
            eval_run = run_row(connection, run_id)
            params = dict(eval_run["params"] or {})
            validations = [dict(r) for r in connection.execute(
                select(Validation.domain, Validation.check_name, Validation.drafter, Validation.k,
                       Validation.request_id, Validation.passed, Validation.statistic,
                       Validation.p_value, Validation.details)
                .where(Validation.run_id == run_id)).mappings()]
            quality = [dict(r) for r in connection.execute(
                select(QualityResult.suite, QualityResult.scope, QualityResult.expectation,
                       QualityResult.column_name, QualityResult.success, QualityResult.status,
                       QualityResult.observed).where(QualityResult.run_id == run_id)).mappings()]
            estimates = connection.execute(select(AcceptanceEstimate.drafter).where(
                AcceptanceEstimate.run_id == run_id).distinct()).scalars().all()
            with tempfile.TemporaryDirectory() as tmp:
                plots = _plots(run_id, connection, Path(tmp))
                for path in plots:
                    mlflow_client.log_artifact(mlflow_run_id, str(path), artifact_path="plots")
        wanted = {"target": config.target.id, "target_fingerprint": config.target.fingerprint,
                  "hardware_profile": config.hardware_profile, "candidates": ",".join(sorted(estimates)),
                  "min_per_domain": params.get("min_per_domain"), "max_per_domain": params.get("max_per_domain"),
                  "k_max": settings.eval_k_max, "min_speedup": settings.min_speedup,
                  "validation_rows": settings.validation_rows, "domains": ",".join(sorted(config.domains))}
        logged = mlflow_client.get_run(mlflow_run_id).data.params
        for key, value in wanted.items():
            value = str(value)
            if key not in logged:
                mlflow_client.log_param(mlflow_run_id, key, value)
            elif logged[key] != value:   # params are immutable in MLflow: keep the first, say so
                log.warning("MLflow run %s: param %s was %r, now %r (kept; see tag)", mlflow_run_id, key,
                            logged[key], value)
                mlflow_client.set_tag(mlflow_run_id, f"specdec.rerun.{key}", value)
        for name, setting in config.domains.items():
            metrics = {"enabled": float(setting.enabled), "samples": float(setting.samples),
                       "k": float(setting.k), "mean_accepted_length": setting.mean_accepted_length,
                       "predicted_speedup": setting.predicted_speedup,
                       "measured_speedup": setting.measured_speedup}
            for metric, value in metrics.items():
                if value is not None:
                    mlflow_client.log_metric(mlflow_run_id, f"{name}.{metric}", float(value))
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            (directory / "config").mkdir()
            (directory / "config" / "config.json").write_text(config.to_json(), encoding="utf-8")
            (directory / "validation.json").write_text(json.dumps(validations, indent=1, default=str))
            (directory / "data_quality.json").write_text(json.dumps(quality, indent=1, default=str))
            (directory / "domains.md").write_text(domain_table_markdown(config) + "\n")
            mlflow_client.log_artifacts(mlflow_run_id, str(directory / "config"), artifact_path="config")
            for name in ("validation.json", "data_quality.json", "domains.md"):
                mlflow_client.log_artifact(mlflow_run_id, str(directory / name), artifact_path="reports")
            pages = data_docs_pages(run_id, db_url)   # Great Expectations' Data Docs, beside the JSON
            if pages:
                (directory / "data_docs").mkdir()
                for page, html in pages.items():
                    (directory / "data_docs" / page).write_text(html, encoding="utf-8")
                mlflow_client.log_artifacts(mlflow_run_id, str(directory / "data_docs"),
                                            artifact_path="reports/data_docs")
                index = directory / "data_quality.html"
                index.write_text(data_docs_index(run_id, list(pages), quality), encoding="utf-8")
                mlflow_client.log_artifact(mlflow_run_id, str(index), artifact_path="reports")
        mlflow_client.set_tag(mlflow_run_id, "specdec.validation", validation_status(config))
    except BaseException as exc:
        end_run(mlflow_client, mlflow_run_id, exc)
        raise
    return {"mlflow_run_id": mlflow_run_id, "experiment_id": experiment_id, "reused": existing is not None,
            "config": json.loads(config.to_json())}


def below_bar_markdown(config, evidence: dict, settings: Settings) -> str:
    """The page's warning about domains that are on although the live check measured them below
    min_speedup or off the prediction beyond the tolerance ("" when none is)."""
    lines = []
    for name, s in sorted(config.domains.items()):
        live = (evidence.get(name) or {}).get("live")
        problems = live_problems(live, settings.min_speedup, settings.confirm_tolerance)
        if s.enabled and s.source == "run" and problems:
            lines.append(f"- **{name}**: {live_text(live)}: {'; '.join(problems)}")
    if not lines:
        return ""
    return ("**WARNING: on, but the live check measured them below the bar** (see the live_check "
            "gate):\n\n" + "\n".join(lines) + "\n\n")


def alert_markdown(low: list[dict], evidence: dict, threshold: float) -> str:
    """The page's line for the low-acceptance alert ("" when no domain is below it)."""
    if not low:
        return ""
    parts = []
    for row in low:
        rate = (evidence.get(row["domain"]) or {}).get("proposal_rate")
        parts.append(f"{row['domain']} ({'on' if row['enabled'] else 'off'}, {row['drafter']} K={row['k']}: "
                     f"E = {row['mean_accepted_length']:.2f}"
                     + ("" if rate is None else f", proposal rate {100 * rate:.0f}%") + ")")
    return (f"**Low-acceptance alert** (expected tokens per round below {threshold:.2f}; published as "
            f"`specdec://alerts/low-acceptance`, which triggers draft retraining): "
            + ", ".join(parts) + ".\n\n")


def register_config(run_id: str, db_url: str | None = None, uri: str | None = None,
                    settings: Settings | None = None, actor: str | None = None) -> dict:
    """Track the run, register its config/ artifact as a version (reused on retry), alias challenger.

    Output: {"name", "version", "reused", "champion_version" (the gates' reference), "validation"}.
    """
    settings = settings or load_settings()
    db_url = resolve_database_url(db_url or settings.database_url)
    champion_version, champion = current_champion(uri, target_id=None, run_id=run_id, db_url=db_url)
    tracked = track_evaluation(run_id, db_url, uri, settings, champion=(champion_version, champion))
    config = parse_config(tracked["config"])
    mlflow_client = client(tracking_uri(uri, db_url))
    try:
        name = config_model_name(config.target.id)
        try:
            mlflow_client.get_registered_model(name)
        except MlflowException:
            mlflow_client.create_registered_model(
                name, description=f"specdec speculative-decoding configs of target {config.target.id}")
        existing = mlflow_client.search_model_versions(f"name='{name}' and tag.run_id='{run_id}'")
        audit = champion_audit(db_url, name, champion_version)
        warning = "" if audit["gated"] else f"**WARNING: {audit['detail']}.**\n\n"
        gates = gates_for(config, champion, settings, db_url)
        check = profile_check(run_id, db_url)
        noise = ("" if check is None or check["status"] != "noisy" else
                 f"**Cost profile too noisy**: {'; '.join(check.get('reasons') or [])}. No domain "
                 "was turned on from it that the champion has off.\n\n")
        vetoes = [f"- **{name}**: {s.reason}" for name, s in sorted(config.domains.items())
                  if s.reason and s.reason.startswith("live check:")]
        veto_text = ("**Vetoed by the live check** (planned on, measured too slow; off):\n\n"
                     + "\n".join(vetoes) + "\n\n") if vetoes else ""
        held = [f"- **{name}**: {s.reason}" for name, s in sorted(config.domains.items())
                if s.reason and s.reason.startswith("engine check:")]
        veto_text += ("**Turned off by the engine check** (planned on; on vLLM it refused, died or "
                      "accepted less than estimated):\n\n" + "\n".join(held) + "\n\n") if held else ""
        evidence = domain_evidence(run_id, db_url)
        veto_text += below_bar_markdown(config, evidence, settings)
        veto_text += alert_markdown(low_acceptance(run_id, settings.acceptance_alert, db_url),
                                    evidence, settings.acceptance_alert)

        def describe(version: str) -> str:
            return (f"**Promote only with `specdec config promote {version}`** (it checks the gates below "
                    "and writes the audit row); MLflow's \"Promote model\" button and alias pencil move "
                    "`champion` past both.\n\n"
                    f"## specdec config of run {run_id}\n\n{warning}{noise}{veto_text}target "
                    f"`{config.target.id}` "
                    f"({config.target.fingerprint}), hardware profile `{config.hardware_profile}`"
                    f"{'' if check is None else ' (' + check['status'] + ')'}, "
                    f"validation **{validation_status(config)}**\n\n"
                    f"{domain_table_markdown(config, evidence, settings.min_speedup, settings.confirm_tolerance)}\n\n"
                    f"### On vLLM (engine check)\n\n{engine_markdown(engine_checks(run_id, db_url))}\n\n"
                    f"### What changed\n\n{changes_markdown(config, champion, champion_version)}\n\n"
                    + gates_markdown(gates, f"preview at registration against champion "
                                            f"{champion_version or 'none'}; `specdec config promote` "
                                            "checks them again") + "\n\n"
                    "Plots: the run's `plots/` artifacts. Validation details: `reports/validation.json`; "
                    "data quality: `reports/data_quality.html` (Great Expectations).\n\n"
                    + champion_line(champion_version, "as of this registration"))
        tags = {"run_id": run_id, "domains_on": ",".join(config.domains_on) or "none",
                "validation": validation_status(config), "hardware_profile": config.hardware_profile,
                "target_fingerprint": config.target.fingerprint}
        if existing:
            version = str(existing[0].version)
            for key, value in tags.items():
                mlflow_client.set_model_version_tag(name, version, key, value)
        else:     # the page names its own version number: written once the version exists
            version = str(mlflow_client.create_model_version(
                name, source=f"runs:/{tracked['mlflow_run_id']}/config", run_id=tracked["mlflow_run_id"],
                tags=tags, description=describe("N")).version)
        mlflow_client.update_model_version(name, version, description=describe(version))
        mlflow_client.set_registered_model_alias(name, CHALLENGER, version)
        record_promotion(db_url, run_id=run_id, target_id=config.target.id, config_name=name,
                         config_version=version, alias=CHALLENGER, action="register", forced=False,
                         actor=actor or current_user(), gates=None,
                         reason="retried registration: version reused" if existing else "registered")
        if not audit["gated"]:       # for the ops report (sql/ungated_champions.sql)
            log.warning("%s: %s", name, audit["detail"])
            record_promotion(db_url, run_id=run_id, target_id=config.target.id, config_name=name,
                             config_version=champion_version, alias="champion", action="ungated",
                             forced=False, actor=actor or current_user(), gates=None,
                             reason=audit["detail"])
    except BaseException as exc:
        end_run(mlflow_client, tracked["mlflow_run_id"], exc)
        raise
    end_run(mlflow_client, tracked["mlflow_run_id"])
    return {"name": name, "version": version, "reused": bool(existing),
            "champion_version": champion_version, "validation": tags["validation"],
            "champion_audit": audit, "gates": gates,
            "mlflow_run_id": tracked["mlflow_run_id"]}
