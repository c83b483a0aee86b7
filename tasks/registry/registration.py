"""An evaluation tracked in MLflow and its config registered: the run's params, metrics, plots and
reports go to one MLflow run (reused when a step is retried), and its `config/` artifact becomes a
version of `specdec-config-<target-slug>` (tag `run_id`: a retried registration reuses the version)
with the alias `challenger`. Every registration is a row in specdec's `promotions` table.

The MLflow run starts when the evaluation started (its DAG run, else its sample step) and ends at
registration; its description (tag mlflow.note.content) says what ran and which domains are on.
The data-quality report is one self-contained HTML page; GX's Data Docs pages are attachments.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from mlflow.exceptions import MlflowException

from ..db.queries_promotions import last_champion_move
from ..db.queries_registry import registration_rows
from ..db.store import Store
from ..errors import DiskFull
from ..settings import Settings, load_settings
from .config_schema import SpecdecConfig, config_model_name
from .gate import gates_json
from .promotion import current_user, record_promotion, view_gates
from .run_config import config_of, finished_run, turns_nothing_on, validation_text
from .run_view import RunView, alert_markdown, engine_state, run_markdown, run_view_of
from .plots import write_load_plot, write_plots
from .registry import Registry, registry_of
from .tracking import CHALLENGER, RUN_TAG, experiment_for_target, find_run
from .version_page import champion_audit_of, version_page_markdown

log = logging.getLogger(__name__)
NOTE_TAG = "mlflow.note.content"     # MLflow's run description (markdown, shown on the run's page)


def _plots(view: RunView, read: dict, directory: Path) -> list[Path]:
    """The run's plots (tasks.registry.plots) from its estimates, plan and live checks (read:
    tasks.db.queries_registry.registration_rows) and its view's load check."""
    paths = write_plots(view.run_id, read["estimates"], read["configs"], read["live"], view.min_speedup,
                        directory)
    return paths + write_load_plot(view.run_id, view.loads, view.min_speedup, directory)


def _cell(value) -> str:
    if isinstance(value, (dict, list)):
        return escape(json.dumps(value, default=str, sort_keys=True))
    return escape("" if value is None else str(value))


@contextmanager
def _disk_full_said(run_id: str, what: str):
    """A full disk while writing `what` of the run (its plots, its reports) said as such: what was
    being written, where, the fix."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFull(
            f"disk full while writing run {run_id}'s {what} to MLflow ("
            + (f"writing {exc.filename}: " if exc.filename else "")
            + f"{exc.strerror or exc}); its stored results are kept. Free space on that disk "
            f"(temporary files go to {tempfile.gettempdir()}, set TMPDIR to move them; MLflow's "
            "artifacts to the tracking store's), then run the command again: the run registers "
            "again by its id") from None


def _log_reports(mlflow_client, mlflow_run_id: str, view: RunView, validations: list[dict],
                   quality: list[dict], pages: dict[str, str]) -> None:
    """The run's artifacts: `config/` (config.json and its MLmodel), `reports/` (domains.md: the
    run's view in Markdown, validation.json, data_quality.json and .html) and GX's Data Docs
    pages (made self-contained) under `reports/data_docs/`."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "config").mkdir()
        (directory / "config" / "config.json").write_text(view.config.to_json(), encoding="utf-8")
        (directory / "config" / "MLmodel").write_text(mlmodel_text(view.run_id), encoding="utf-8")
        (directory / "validation.json").write_text(json.dumps(validations, indent=1, default=str))
        (directory / "data_quality.json").write_text(json.dumps(quality, indent=1, default=str))
        (directory / "domains.md").write_text(run_markdown(view), encoding="utf-8")
        mlflow_client.log_artifacts(mlflow_run_id, str(directory / "config"), artifact_path="config")
        for name in ("validation.json", "data_quality.json", "domains.md"):
            mlflow_client.log_artifact(mlflow_run_id, str(directory / name), artifact_path="reports")
        if pages:
            (directory / "data_docs").mkdir()
            for page, html in pages.items():
                (directory / "data_docs" / page).write_text(offline_html(html), encoding="utf-8")
            mlflow_client.log_artifacts(mlflow_run_id, str(directory / "data_docs"),
                                        artifact_path="reports/data_docs")
        if quality or pages:
            report = directory / "data_quality.html"
            report.write_text(data_quality_report(view.run_id, quality, sorted(pages)), encoding="utf-8")
            mlflow_client.log_artifact(mlflow_run_id, str(report), artifact_path="reports")


def outcome_text(success: bool, status: str | None) -> str:
    """An expectation's outcome: "passed" or "FAILED", with its status only where it says more
    ("FAILED (insufficient)"; not "passed (pass)" beside "passed (ok)")."""
    word = "passed" if success else "FAILED"
    return word if str(status or "") in ("", "pass", "ok", "fail", "failed") else f"{word} ({escape(str(status))})"


EXTERNAL = re.compile(r"""(?:https?:)?//(?!127\.0\.0\.1[:/])[A-Za-z0-9.-]+\.[A-Za-z]{2,}[^\s"'<>)]*""")


def offline_html(html: str) -> str:
    """A Great Expectations Data Docs page that requests nothing from outside hosts: the
    stylesheets, scripts and fonts it loads from CDNs are dropped (the page keeps its text and
    tables, unstyled) and every other outside URL (links, images, CSS url()) is emptied."""
    html = re.sub(r"<script\b[^>]*\bsrc=[\"'][^\"']*[\"'][^>]*>\s*</script>", "", html, flags=re.IGNORECASE)
    html = re.sub(r"<link\b[^>]*>", lambda m: "" if EXTERNAL.search(m.group(0)) else m.group(0), html,
                  flags=re.IGNORECASE)
    html = re.sub(r"@import[^;]*;", lambda m: "" if EXTERNAL.search(m.group(0)) else m.group(0), html)
    return EXTERNAL.sub("#", html)


def rounded(value, digits: int = 4) -> float:
    """A metric with `digits` significant digits (1.2346, not 1.2345678901234567)."""
    value = float(value)
    return value if value == 0 or not math.isfinite(value) else float(f"{value:.{digits}g}")


def mlmodel_text(run_id: str) -> str:
    """The `MLmodel` file of the config artifact: MLflow's version page reads one (for a model's
    signature) and asked for a file that did not exist. A specdec config is no model: no flavors."""
    return ("# a specdec speculative-decoding config (config.json), not a model: no flavors\n"
            f"artifact_path: config\nflavors: {{}}\nrun_id: {json.dumps(run_id)}\n"
            "metadata:\n  specdec: config.json\n")


def data_quality_report(run_id: str, quality: list[dict], pages: list[str]) -> str:
    """The run's data-quality report as one self-contained HTML page (no scripts, stylesheets,
    images or links: it renders inside MLflow's artifact pane and offline): per suite its verdict,
    then every expectation with its scope, column, result and what was observed. Great
    Expectations' own Data Docs pages are named as attachments (offline_html: they load nothing
    from outside hosts, so they render unstyled)."""
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
            f"{outcome_text(r['success'], r['status'])}</td>"
            f"<td class='observed'>{_cell(r['observed'])}</td></tr>"
            for r in sorted((r for r in quality if r["suite"] == suite),
                            key=lambda r: (str(r["scope"]), str(r["expectation"]), str(r["column_name"]))))
        sections.append(f"<h3>{escape(suite)}</h3><table><tr><th>scope</th><th>expectation</th>"
                        f"<th>column</th><th>result</th><th>observed</th></tr>{rows}</table>")
    attachments = "".join(f"<li><code>reports/data_docs/{escape(page)}</code></li>" for page in pages)
    attached = (f"<p>Great Expectations' own Data Docs pages are attached beside this report "
                f"(self-contained: their CDN styles and scripts removed, so they show unstyled):"
                f"</p><ul>{attachments}</ul>") if pages else ""
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


def run_note(view: RunView, quality_ok: bool | None) -> str:
    """The MLflow run's description (tag mlflow.note.content, shown on the run's page), with the
    low-acceptance alert and the engine check's state, as on the version page."""
    config = view.config
    on = ", ".join(f"{name} (K={s.k})" for name, s in sorted(config.domains.items()) if s.enabled)
    off = ", ".join(name for name, s in sorted(config.domains.items()) if not s.enabled)
    quality = {None: "not recorded", True: "passed", False: "FAILED"}[quality_ok]
    checked = ("no domain is on, so no sampling or greedy test ran" if turns_nothing_on(config)
               else "the domains on confirmed live and validated")
    return (f"specdec evaluation `{view.run_id}` of target `{config.target.id}` on hardware profile "
            f"`{config.hardware_profile}`: the traffic sampled per domain, checked for data "
            f"quality ({quality}), acceptance estimated offline, K planned; {checked} (validation "
            f"**{validation_text(config)}**); engine check: {engine_state(view)}.\n\n"
            f"Domains on: {on or 'none'}. Off: {off or 'none'}.\n\n" + alert_markdown(view)
            + "The run spans the evaluation (from the start of its DAG run, or of its sample step, "
            "to its registration). Artifacts: `config/` (the registered config), `plots/`, "
            "`reports/` (`domains.md`: the run's per-domain table with its reasons and the engine "
            "and load checks; the gates and what changed against the champion are on the config "
            "version's page; validation, data quality).")


def readable_run_name(run_id: str) -> str:
    """The MLflow run's name: an Airflow run id ("manual__2026-12-05T21:03:12.345+00:00", cut in
    MLflow's runs table to "manual__2026-12-05T2...") as "evaluate 2026-12-05 21:03 manual"; any
    other run id as it is (the tag specdec.run_id keeps the id)."""
    match = re.fullmatch(r"(\w+?)__(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}).*", run_id)
    return f"evaluate {match.group(2)} {match.group(3)} {match.group(1)}" if match else run_id


@dataclass(frozen=True)
class TrackedRun:
    """The evaluation's MLflow run (track_evaluation) and the run's view it logged, for
    register_config to register and describe without building it again."""

    mlflow_run_id: str
    experiment_id: str
    reused: bool               # the MLflow run existed (a retried step)
    view: RunView              # its config: view.config

    @property
    def config(self) -> SpecdecConfig:
        return self.view.config


def track_evaluation(run_id: str, store: Store, registry: Registry,
                     settings: Settings | None = None, champion=None,
                     started_at: datetime | None = None, read: dict | None = None) -> TrackedRun:
    """Log (or re-log into the same MLflow run) the evaluation's params, metrics and artifacts.
    champion: (version, config) of the current champion when the caller already read it.
    started_at: when the evaluation started (its DAG run's start); default: when its sample step
    recorded the run. A new MLflow run starts then, so its duration is the evaluation's.
    store: specdec's database, registry: the tracking store (both opened by the caller). read:
    the run's rows when the caller read them already (tasks.db.queries_registry.registration_rows)."""
    settings = settings or load_settings()
    mlflow_client = registry.client
    read = read or registration_rows(store, run_id)
    eval_run = finished_run(read["run"], run_id)
    if champion is None:
        champion = registry.current_champion(target_id=eval_run["target_id"])
    config = config_of(eval_run, read["domain_configs"], champion=champion[1])
    view = run_view_of(run_id, config, read["view"], settings)       # read: no second read
    experiment_id = experiment_for_target(mlflow_client, config.target.id)
    existing = find_run(mlflow_client, experiment_id, run_id)
    if existing is None:
        recorded = eval_run["created_at"]
        starts = [_epoch_ms(moment) for moment in (started_at, recorded) if moment is not None]
        run = mlflow_client.create_run(experiment_id, start_time=min(starts, default=None),
                                       run_name=readable_run_name(run_id), tags={RUN_TAG: run_id})
        mlflow_run_id = run.info.run_id
    else:
        mlflow_run_id = existing.info.run_id
    try:
        params = dict(eval_run["params"] or {})
        validations, quality, estimates = read["validations"], read["quality"], read["estimate_drafters"]
        with _disk_full_said(run_id, "plots"), tempfile.TemporaryDirectory() as tmp:
            for path in _plots(view, read, Path(tmp)):
                mlflow_client.log_artifact(mlflow_run_id, str(path), artifact_path="plots")
        wanted = {"target": config.target.id, "target_fingerprint": config.target.fingerprint,
                  "hardware_profile": config.hardware_profile, "candidates": ",".join(sorted(estimates)),
                  "min_per_domain": params.get("min_per_domain"), "max_per_domain": params.get("max_per_domain"),
                  "k_max": settings.plan.k_max, "min_speedup": settings.plan.min_speedup,
                  "validation_rows": settings.validation.rows, "domains": ",".join(sorted(config.domains)),
                  "window_days": params.get("window_days"),
                  "acceptance_alert": params.get("acceptance_alert", settings.plan.acceptance_alert),
                  "promote": params.get("promote")}
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
                if value is not None:      # 4 significant digits: the figures' own precision
                    mlflow_client.log_metric(mlflow_run_id, f"{name}.{metric}", rounded(value))
        with _disk_full_said(run_id, "reports"):
            _log_reports(mlflow_client, mlflow_run_id, view, validations, quality, dict(read["data_docs"]))
        mlflow_client.set_tag(mlflow_run_id, "specdec.validation", validation_text(config))
        mlflow_client.set_tag(mlflow_run_id, NOTE_TAG, run_note(
            view, all(bool(r["success"]) for r in quality) if quality else None))
    except BaseException as exc:
        end_run(mlflow_client, mlflow_run_id, exc)
        raise
    return TrackedRun(mlflow_run_id, experiment_id, existing is not None, view)


def register_config(run_id: str, store: Store, registry: Registry | None = None,
                    settings: Settings | None = None, actor: str | None = None,
                    started_at: datetime | None = None, *, uri: str | None = None) -> dict:
    """Track the run, register its config/ artifact as a version (reused on retry), alias challenger.

    store: specdec's database; registry: the MLflow tracking store (tasks.registry.registry.
    Registry; both opened by the caller; default: Registry.open()). uri: deprecated, for callers
    outside this repository: a tracking URI to open the Registry from (DeprecationWarning; so is
    a URI string passed by position, where the Registry now goes).
    Output: {"name", "version", "reused", "champion_version" (the gates' reference), "validation",
    "gates" (their JSON, Gate.to_json), ...}.
    """
    registry = registry_of(registry, uri, store)
    settings = settings or load_settings()
    read = registration_rows(store, run_id)       # the run's rows, read once
    target_id = finished_run(read["run"], run_id)["target_id"]
    champion_version, champion = registry.current_champion(target_id=target_id)
    tracked = track_evaluation(run_id, store, registry, settings, champion=(champion_version, champion),
                               started_at=started_at, read=read)
    view, config = tracked.view, tracked.config
    mlflow_client = registry.client
    try:
        name = config_model_name(config.target.id)
        try:
            mlflow_client.get_registered_model(name)
        except MlflowException:
            mlflow_client.create_registered_model(
                name, description=f"specdec speculative-decoding configs of target {config.target.id}")
        existing = mlflow_client.search_model_versions(f"name='{name}' and tag.run_id='{run_id}'")
        last_move = None if champion_version is None else last_champion_move(store, name)
        audit = champion_audit_of(champion_version, last_move)
        gates = view_gates(config, champion, settings, view)      # the view tracked: not read again

        def describe(version: str) -> str:
            return version_page_markdown(view, version, gates, audit, champion, champion_version)
        tags = {"run_id": run_id, "domains_on": ",".join(config.domains_on) or "none",
                "validation": validation_text(config), "hardware_profile": config.hardware_profile,
                "target_fingerprint": config.target.fingerprint}
        if existing:
            version = str(existing[0].version)
            for key, value in tags.items():
                mlflow_client.set_model_version_tag(name, version, key, value)
        else:     # the page names its own version number: written once the version exists
            version = str(mlflow_client.create_model_version(
                name, source=f"runs:/{tracked.mlflow_run_id}/config", run_id=tracked.mlflow_run_id,
                tags=tags, description=describe("N")).version)
        mlflow_client.update_model_version(name, version, description=describe(version))
        mlflow_client.set_registered_model_alias(name, CHALLENGER, version)
        with store.transaction() as tx:
            record_promotion(tx, run_id=run_id, target_id=config.target.id, config_name=name,
                             config_version=version, alias=CHALLENGER, action="register", forced=False,
                             actor=actor or current_user(), gates=None,
                             reason="retried registration: version reused" if existing else "registered")
        if not audit["gated"]:       # for the ops report (sql/ungated_champions.sql)
            log.warning("%s: %s", name, audit["detail"])
            with store.transaction() as tx:
                record_promotion(tx, run_id=run_id, target_id=config.target.id, config_name=name,
                                 config_version=champion_version, alias="champion", action="ungated",
                                 forced=False, actor=actor or current_user(), gates=None,
                                 reason=audit["detail"])
    except BaseException as exc:
        end_run(mlflow_client, tracked.mlflow_run_id, exc)
        raise
    end_run(mlflow_client, tracked.mlflow_run_id)
    return {"name": name, "version": version, "reused": bool(existing),
            "champion_version": champion_version, "validation": tags["validation"],
            "champion_audit": audit, "gates": gates_json(gates), "domains_on": config.domains_on,
            "mlflow_run_id": tracked.mlflow_run_id}
