"""An evaluation tracked in MLflow and its config registered: the run's params, metrics, plots and
reports go to one MLflow run (reused when a step is retried), and its `config/` artifact becomes a
version of `specdec-config-<target-slug>` (tag `run_id`: a retried registration reuses the version)
with the alias `challenger`. Every registration is a row in specdec's `promotions` table.

The MLflow run starts when the evaluation started (its DAG run, else its sample step) and ends at
registration; its description (tag mlflow.note.content) says what ran and which domains are on.
The data-quality report is one self-contained HTML page; GX's Data Docs pages are attachments.
"""

from __future__ import annotations

import json
import logging
import tempfile
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from mlflow.exceptions import MlflowException
from sqlalchemy import select

from ..db.engine import ensure_ready, resolve_database_url
from ..db.models import AcceptanceEstimate, DomainConfig, LiveMeasurement, QualityResult, Validation
from ..db.queries_load import load_checks
from ..settings import Settings, load_settings
from .config_schema import config_model_name, parse_config
from .promotion import current_user, gates_for, record_promotion
from .run_config import (build_config, changes_markdown, domain_table_markdown, live_problems, live_text,
                         run_row, validation_status)
from .run_results import (data_docs_pages, domain_evidence, engine_checks, engine_markdown, low_acceptance,
                          profile_check)
from .load_results import load_markdown
from .plots import write_load_plot, write_plots
from .tracking import (CHALLENGER, RUN_TAG, client, current_champion, experiment_for_target, find_run,
                       tracking_uri)
from .version_page import champion_audit, champion_line, gates_markdown

log = logging.getLogger(__name__)
NOTE_TAG = "mlflow.note.content"     # MLflow's run description (markdown, shown on the run's page)


def _plots(run_id: str, connection, directory: Path, min_speedup: float) -> list[Path]:
    """The run's plots (tasks.registry.plots) from its estimates, plan and live checks."""
    estimates = [dict(r) for r in connection.execute(
        select(AcceptanceEstimate).where(AcceptanceEstimate.run_id == run_id)
        .order_by(AcceptanceEstimate.domain, AcceptanceEstimate.drafter, AcceptanceEstimate.k)).mappings()]
    configs = {r.domain: {"drafter": r.drafter, "k": r.k, "enabled": bool(r.enabled)}
               for r in connection.execute(select(DomainConfig.domain, DomainConfig.drafter,
                                                  DomainConfig.k, DomainConfig.enabled)
                                           .where(DomainConfig.run_id == run_id))}
    live = [{"domain": r.domain, "predicted": r.predicted_same_requests, "measured": r.measured_speedup}
            for r in connection.execute(
                select(LiveMeasurement.domain, LiveMeasurement.predicted_same_requests,
                       LiveMeasurement.measured_speedup).where(LiveMeasurement.run_id == run_id)
                .order_by(LiveMeasurement.domain))
            if r.predicted_same_requests and r.measured_speedup]
    paths = write_plots(run_id, estimates, configs, live, min_speedup, directory)
    return paths + write_load_plot(run_id, load_checks(connection.engine, run_id), min_speedup, directory)


def _cell(value) -> str:
    if isinstance(value, (dict, list)):
        return escape(json.dumps(value, default=str, sort_keys=True))
    return escape("" if value is None else str(value))


def data_quality_report(run_id: str, quality: list[dict], pages: list[str]) -> str:
    """The run's data-quality report as one self-contained HTML page (no scripts, stylesheets,
    images or links: it renders inside MLflow's artifact pane and offline): per suite its verdict,
    then every expectation with its scope, column, result and what was observed. Great
    Expectations' own Data Docs pages are named as attachments (they load their scripts and
    styles from a CDN, so they are opened apart, from a browser with internet access)."""
    verdict: dict[str, bool] = {}
    for row in quality:
        verdict[row["suite"]] = verdict.get(row["suite"], True) and bool(row["success"])
    style = ("body{font-family:sans-serif;font-size:14px;margin:16px}table{border-collapse:collapse;"
             "margin-bottom:18px}th,td{border:1px solid #bbb;padding:4px 8px;text-align:left;"
             "vertical-align:top}th{background:#eee}.fail{color:#b00020;font-weight:bold}"
             ".pass{color:#1b5e20}td.observed{font-family:monospace;font-size:12px;max-width:640px;"
             "word-break:break-word}")
    summary = "".join(f"<tr><td>{escape(suite)}</td><td class='{'pass' if ok else 'fail'}'>"
                      f"{'passed' if ok else 'FAILED'}</td></tr>" for suite, ok in sorted(verdict.items()))
    sections = []
    for suite in sorted(verdict):
        rows = "".join(
            f"<tr><td>{_cell(r['scope'])}</td><td>{_cell(r['expectation'])}</td>"
            f"<td>{_cell(r['column_name'])}</td><td class='{'pass' if r['success'] else 'fail'}'>"
            f"{'passed' if r['success'] else 'FAILED'} ({_cell(r['status'])})</td>"
            f"<td class='observed'>{_cell(r['observed'])}</td></tr>"
            for r in sorted((r for r in quality if r["suite"] == suite),
                            key=lambda r: (str(r["scope"]), str(r["expectation"]), str(r["column_name"]))))
        sections.append(f"<h3>{escape(suite)}</h3><table><tr><th>scope</th><th>expectation</th>"
                        f"<th>column</th><th>result</th><th>observed</th></tr>{rows}</table>")
    attachments = "".join(f"<li><code>reports/data_docs/{escape(page)}</code></li>" for page in pages)
    attached = (f"<p>Great Expectations' own Data Docs pages are attached beside this report (they "
                f"load their scripts and styles from a CDN: open them from a browser with internet "
                f"access):</p><ul>{attachments}</ul>") if pages else ""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Data quality of run "
            f"{escape(run_id)}</title><style>{style}</style></head><body>"
            f"<h2>Data quality of run {escape(run_id)}</h2><table><tr><th>suite</th><th>result</th>"
            f"</tr>{summary}</table>{''.join(sections)}{attached}"
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


def _epoch_ms(moment: datetime) -> int:
    """Milliseconds since the epoch (MLflow's run times); a naive datetime is UTC (specdec's rows)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def run_note(run_id: str, config, quality_ok: bool | None) -> str:
    """The MLflow run's description (tag mlflow.note.content, shown on the run's page)."""
    on = ", ".join(f"{name} (K={s.k})" for name, s in sorted(config.domains.items()) if s.enabled)
    off = ", ".join(name for name, s in sorted(config.domains.items()) if not s.enabled)
    quality = {None: "not recorded", True: "passed", False: "FAILED"}[quality_ok]
    return (f"specdec evaluation `{run_id}` of target `{config.target.id}` on hardware profile "
            f"`{config.hardware_profile}`: the traffic sampled per domain, checked for data "
            f"quality ({quality}), acceptance estimated offline, K planned, confirmed live and "
            f"validated (validation **{validation_status(config)}**).\n\n"
            f"Domains on: {on or 'none'}. Off: {off or 'none'}.\n\n"
            "The run spans the evaluation (from the start of its DAG run, or of its sample step, "
            "to its registration). Artifacts: `config/` (the registered config), `plots/`, "
            "`reports/` (validation, data quality, the per-domain table).")


def track_evaluation(run_id: str, db_url: str | None = None, uri: str | None = None,
                     settings: Settings | None = None, champion=None,
                     started_at: datetime | None = None) -> dict:
    """Log (or re-log into the same MLflow run) the evaluation's params, metrics and artifacts.
    champion: (version, config) of the current champion when the caller already read it.
    started_at: when the evaluation started (its DAG run's start); default: when its sample step
    recorded the run. A new MLflow run starts then, so its duration is the evaluation's."""
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
        with engine.connect() as connection:
            recorded = run_row(connection, run_id)["created_at"]
        starts = [_epoch_ms(moment) for moment in (started_at, recorded) if moment is not None]
        run = mlflow_client.create_run(experiment_id, start_time=min(starts, default=None), run_name=run_id,
                                       tags={RUN_TAG: run_id})
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
                plots = _plots(run_id, connection, Path(tmp), settings.min_speedup)
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
            pages = data_docs_pages(run_id, db_url)   # Great Expectations' Data Docs, attached
            if pages:
                (directory / "data_docs").mkdir()
                for page, html in pages.items():
                    (directory / "data_docs" / page).write_text(html, encoding="utf-8")
                mlflow_client.log_artifacts(mlflow_run_id, str(directory / "data_docs"),
                                            artifact_path="reports/data_docs")
            if quality or pages:
                report = directory / "data_quality.html"
                report.write_text(data_quality_report(run_id, quality, sorted(pages)), encoding="utf-8")
                mlflow_client.log_artifact(mlflow_run_id, str(report), artifact_path="reports")
        mlflow_client.set_tag(mlflow_run_id, "specdec.validation", validation_status(config))
        mlflow_client.set_tag(mlflow_run_id, NOTE_TAG, run_note(
            run_id, config, all(bool(r["success"]) for r in quality) if quality else None))
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
    return ("**WARNING: on, but the live check measured them below the bar or slower than predicted** "
            "(see the live_check gate):\n\n" + "\n".join(lines) + "\n\n")


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
                    settings: Settings | None = None, actor: str | None = None,
                    started_at: datetime | None = None) -> dict:
    """Track the run, register its config/ artifact as a version (reused on retry), alias challenger.

    Output: {"name", "version", "reused", "champion_version" (the gates' reference), "validation"}.
    """
    settings = settings or load_settings()
    db_url = resolve_database_url(db_url or settings.database_url)
    champion_version, champion = current_champion(uri, target_id=None, run_id=run_id, db_url=db_url)
    tracked = track_evaluation(run_id, db_url, uri, settings, champion=(champion_version, champion),
                               started_at=started_at)
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
        under_load = [f"- **{name}**: {s.reason}" for name, s in sorted(config.domains.items())
                      if s.reason and s.reason.startswith("load check:")]
        veto_text += ("**Turned off or cut by the load check** (on vLLM's OpenAI server under "
                      "concurrent requests):\n\n" + "\n".join(under_load) + "\n\n") if under_load else ""
        evidence = domain_evidence(run_id, db_url)
        veto_text += below_bar_markdown(config, evidence, settings)
        veto_text += alert_markdown(low_acceptance(run_id, settings.acceptance_alert, db_url),
                                    evidence, settings.acceptance_alert)

        def describe(version: str) -> str:
            return (f"**Promote only with `specdec config promote {version}`** (it checks the gates below "
                    "and writes the audit row); MLflow's alias pencil moves `champion` past both, and "
                    "its \"Promote model\" button does not move `champion` at all (it copies the "
                    "version into another registered model).\n\n"
                    f"## specdec config of run {run_id}\n\n{warning}{noise}{veto_text}target "
                    f"`{config.target.id}` "
                    f"({config.target.fingerprint}), hardware profile `{config.hardware_profile}`"
                    f"{'' if check is None else ' (' + check['status'] + ')'}, "
                    f"validation **{validation_status(config)}**\n\n"
                    f"{domain_table_markdown(config, evidence, settings.min_speedup, settings.confirm_tolerance)}\n\n"
                    f"### On vLLM (engine check)\n\n{engine_markdown(engine_checks(run_id, db_url))}\n\n"
                    f"### Under load on vLLM (load check; plot `plots/load_check_speedup.png`)\n\n"
                    f"{load_markdown(load_checks(ensure_ready(db_url), run_id))}\n\n"
                    f"### What changed\n\n{changes_markdown(config, champion, champion_version)}\n\n"
                    + gates_markdown(gates, f"preview at registration against champion "
                                            f"{champion_version or 'none'}; `specdec config promote` "
                                            "checks them again") + "\n\n"
                    "Plots: the run's `plots/` artifacts. Validation details: `reports/validation.json`; "
                    "data quality: `reports/data_quality.html` (every expectation and its result; Great "
                    "Expectations' Data Docs attached under `reports/data_docs/`).\n\n"
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
