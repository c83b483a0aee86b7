"""MLflow: tracked evaluations, the config registry (aliases challenger / champion), gated
compare-and-set promotion, rollback, and the vLLM export.

- Tracking URI: the argument, else $MLFLOW_TRACKING_URI, else sqlite:///$SPECDEC_HOME/mlflow.db
  (artifacts under $SPECDEC_HOME/mlartifacts). Never specdec's own database: both use Alembic.
- Every evaluation is one MLflow run in experiment `specdec/<target-slug>`, tagged
  `specdec.run_id`; a retried step finds and reuses it. Its `config/` artifact is registered as a
  version of `specdec-config-<target-slug>` (tag `run_id`: a retried registration reuses the
  version) and gets the alias `challenger`.
- Promotion checks the gates against the current champion, then moves `champion` only if the
  champion is still the version the gates compared against. Every registration, promotion,
  refusal, forced promotion and rollback is a row in specdec's `promotions` table.
Reports and descriptions name requests by id, never by prompt text.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import insert, select

from .config_schema import (DomainSetting, DrafterSpec, SpecdecConfig, config_model_name,
                            parse_config, target_slug)
from .db.engine import database_url, display_url, ensure_ready
from .db.models import (AcceptanceEstimate, DomainConfig, EvalRun, Promotion, QualityResult,
                        Validation)
from .errors import SpecdecTaskError
from .settings import Settings, load_settings, specdec_home

log = logging.getLogger(__name__)
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # no bars in logs and tables

RUN_TAG = "specdec.run_id"
CHAMPION, CHALLENGER = "champion", "challenger"


class RegistryError(SpecdecTaskError, RuntimeError):
    """The tracking server / registry refused or the requested version does not exist."""


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# ------------------------------------------------------------------------------------------------
# tracking store
def tracking_uri(uri: str | None = None, db_url: str | None = None) -> str:
    """The MLflow tracking URI to use; refuses specdec's own database."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(specdec_home() / 'mlflow.db').resolve()}"
    if db_url and uri == database_url(db_url):
        raise RegistryError(f"MLflow's tracking store {display_url(uri)} is specdec's own database; "
                            "give MLflow its own (default sqlite:///$SPECDEC_HOME/mlflow.db)")
    return uri


def client(uri: str | None = None):
    from mlflow import MlflowClient

    uri = tracking_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment_id(mlflow_client, target_id: str) -> str:
    name = f"specdec/{target_slug(target_id)}"
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if mlflow_client.tracking_uri.startswith("sqlite:"):   # a local store: artifacts beside it
        location = (specdec_home() / "mlartifacts" / target_slug(target_id)).resolve().as_uri()
    return mlflow_client.create_experiment(name, artifact_location=location)


def _find_run(mlflow_client, experiment_id: str, run_id: str):
    runs = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
                                     max_results=1)
    return runs[0] if runs else None


# ------------------------------------------------------------------------------------------------
# the config of a run
def _run_row(connection, run_id: str):
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
    engine = ensure_ready(database_url(db_url))
    with engine.connect() as connection:
        run = _run_row(connection, run_id)
        rows = connection.execute(select(DomainConfig).where(DomainConfig.run_id == run_id)
                                  .order_by(DomainConfig.domain)).mappings().all()
    domains: dict[str, DomainSetting] = {}
    for row in rows:
        if row["status"] != "ok":
            kept = champion.domains.get(row["domain"]) if champion else None
            domains[row["domain"]] = (kept.model_copy(update={"source": "champion"}) if kept
                                      else DomainSetting(enabled=False, samples=row["samples"] or 0,
                                                         source="off"))
            continue
        spec = row["drafter_spec"]
        drafter = None
        if spec:
            params = dict(spec.get("params") or {})
            model_uri = params.get("model") if str(params.get("model", "")).startswith("models:/") else None
            drafter = DrafterSpec(kind=spec["kind"], params=params, model_uri=model_uri)
        ci = None
        if row["predicted_speedup_lo"] is not None:
            ci = (row["predicted_speedup_lo"], row["predicted_speedup_hi"])
        domains[row["domain"]] = DomainSetting(
            enabled=bool(row["enabled"]), drafter=drafter, k=row["k"] or 0,
            max_batch_size=row["max_batch_size"] if row["enabled"] else None,
            conditional_acceptance=row["conditional_acceptance"] or [],
            mean_accepted_length=row["mean_accepted_length"], predicted_speedup=row["predicted_speedup"],
            predicted_speedup_ci95=ci, measured_speedup=row["measured_speedup"],
            samples=row["samples"] or 0, validation=row["validation"], source="run")
    return SpecdecConfig(target={"id": run["target_id"], "fingerprint": run["target_fingerprint"]},
                         hardware_profile=run["hardware_profile"], run_id=run_id,
                         created_at=run["updated_at"], domains=domains)


def validation_status(config: SpecdecConfig) -> str:
    """passed: every measured enabled domain passed; failed: one failed; incomplete otherwise."""
    verdicts = [s.validation for s in config.domains.values() if s.enabled and s.source == "run"]
    if any(v == "failed" for v in verdicts):
        return "failed"
    return "passed" if all(v == "passed" for v in verdicts) else "incomplete"


# ------------------------------------------------------------------------------------------------
# descriptions and plots
def _x(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def domain_table_markdown(config: SpecdecConfig) -> str:
    lines = ["| domain | on | drafter | K | max batch | E[tokens/round] | predicted (95% CI) | "
             "measured | samples | validation | source |", "|" + "---|" * 11]
    for name, s in sorted(config.domains.items()):
        drafter = "-" if s.drafter is None else s.drafter.kind + (
            "(" + ",".join(f"{k}={v}" for k, v in sorted(s.drafter.params.items())) + ")"
            if s.drafter.params else "")
        ci = "" if s.predicted_speedup_ci95 is None else (
            f" [{s.predicted_speedup_ci95[0]:.2f}, {s.predicted_speedup_ci95[1]:.2f}]")
        lines.append(f"| {name} | {'on' if s.enabled else 'off'} | {drafter} | {s.k or '-'} | "
                     f"{s.max_batch_size or '-'} | "
                     f"{'-' if s.mean_accepted_length is None else f'{s.mean_accepted_length:.2f}'} | "
                     f"{_x(s.predicted_speedup)}{ci} | {_x(s.measured_speedup)} | {s.samples} | "
                     f"{s.validation or '-'} | {s.source} |")
    return "\n".join(lines)


def _effective(setting: DomainSetting | None) -> float:
    """Decode speedup a domain gets from a setting: measured when on, plain (1.0) when off."""
    if setting is None or not setting.enabled:
        return 1.0
    return setting.measured_speedup or setting.predicted_speedup or 1.0


def changes_markdown(config: SpecdecConfig, champion: SpecdecConfig | None,
                     champion_version: str | None) -> str:
    if champion is None:
        return "No champion yet: this is the first config of this target."
    lines = [f"Against champion version {champion_version} (run {champion.run_id}):"]
    if champion.target.fingerprint != config.target.fingerprint:
        lines.append(f"- **target changed**: fingerprint {champion.target.fingerprint} -> "
                     f"{config.target.fingerprint}")
    for name in sorted(set(config.domains) | set(champion.domains)):
        new, old = config.domains.get(name), champion.domains.get(name)
        describe = lambda s: "absent" if s is None else (  # noqa: E731
            "off" if not s.enabled else f"{s.drafter.kind} K={s.k} max batch {s.max_batch_size}")
        if describe(new) != describe(old):
            lines.append(f"- {name}: {describe(old)} -> {describe(new)} (speedup {_effective(old):.2f}x "
                         f"-> {_effective(new):.2f}x)")
    if len(lines) == 1:
        lines.append("- no setting changed")
    return "\n".join(lines)


def _plots(run_id: str, connection, directory: Path) -> list[Path]:
    """Per-position conditional acceptance per domain; predicted speedup vs K per domain/drafter."""
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
    ax.legend(fontsize=7)
    paths.append(directory / "conditional_acceptance.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(domains), figsize=(3 * len(domains), 3), sharey=True, squeeze=False)
    for ax, domain in zip(axes[0], domains):
        for drafter in sorted({r["drafter"] for r in rows if r["domain"] == domain}):
            points = [(r["k"], r["predicted_speedup"]) for r in rows
                      if r["domain"] == domain and r["drafter"] == drafter and r["predicted_speedup"]]
            if points:
                ax.plot(*zip(*points), marker=".", label=drafter)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=domain, xlabel="K")
    axes[0][0].set_ylabel("predicted speedup (batch 1)")
    axes[0][-1].legend(fontsize=6)
    paths.append(directory / "predicted_speedup_vs_k.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


# ------------------------------------------------------------------------------------------------
# tracked evaluation
def track_evaluation(run_id: str, db_url: str | None = None, uri: str | None = None,
                     settings: Settings | None = None, champion=None) -> dict:
    """Log (or re-log into the same MLflow run) the evaluation's params, metrics and artifacts.
    champion: (version, config) of the current champion when the caller already read it."""
    settings = settings or load_settings()
    db_url = database_url(db_url or settings.database_url)
    mlflow_client = client(tracking_uri(uri, db_url))
    engine = ensure_ready(db_url)
    if champion is None:
        champion = current_champion(uri=uri, target_id=None, run_id=run_id, db_url=db_url)
    config = build_config(run_id, db_url, champion=champion[1])
    experiment_id = _experiment_id(mlflow_client, config.target.id)
    existing = _find_run(mlflow_client, experiment_id, run_id)
    if existing is None:
        run = mlflow_client.create_run(experiment_id, run_name=run_id, tags={RUN_TAG: run_id})
        mlflow_run_id = run.info.run_id
    else:
        mlflow_run_id = existing.info.run_id
    with engine.connect() as connection:
        eval_run = _run_row(connection, run_id)
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
    mlflow_client.set_tag(mlflow_run_id, "specdec.validation", validation_status(config))
    return {"mlflow_run_id": mlflow_run_id, "experiment_id": experiment_id, "reused": existing is not None,
            "config": json.loads(config.to_json())}


# ------------------------------------------------------------------------------------------------
# registry
def _record(db_url: str, **values) -> None:
    engine = ensure_ready(db_url)
    with engine.begin() as connection:
        connection.execute(insert(Promotion).values(created_at=_utcnow(), **values))


def _alias_version(mlflow_client, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow_client.get_model_version_by_alias(name, alias).version)
    except MlflowException as exc:   # no such model or alias: None; anything else (server down) raises
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def load_version_config(mlflow_client, name: str, version: str) -> SpecdecConfig:
    """The config.json a version was registered from (its run's config/ artifact)."""
    detail = mlflow_client.get_model_version(name, version)
    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow_client.download_artifacts(detail.run_id, "config", tmp)
        return parse_config(Path(path, "config.json").read_text("utf-8"))


def current_champion(uri: str | None = None, target_id: str | None = None, run_id: str | None = None,
                     db_url: str | None = None) -> tuple[str | None, SpecdecConfig | None]:
    """(version, config) of the champion of the target (of `run_id`'s target when target_id is None)."""
    if target_id is None:
        engine = ensure_ready(database_url(db_url))
        with engine.connect() as connection:
            target_id = _run_row(connection, run_id)["target_id"]
    mlflow_client = client(uri)
    name = config_model_name(target_id)
    version = _alias_version(mlflow_client, name, CHAMPION)
    if version is None:
        return None, None
    return version, load_version_config(mlflow_client, name, version)


def register_config(run_id: str, db_url: str | None = None, uri: str | None = None,
                    settings: Settings | None = None, actor: str | None = None) -> dict:
    """Track the run, register its config/ artifact as a version (reused on retry), alias challenger.

    Output: {"name", "version", "reused", "champion_version" (the gates' reference), "validation"}.
    """
    from mlflow.exceptions import MlflowException

    settings = settings or load_settings()
    db_url = database_url(db_url or settings.database_url)
    champion_version, champion = current_champion(uri, target_id=None, run_id=run_id, db_url=db_url)
    tracked = track_evaluation(run_id, db_url, uri, settings, champion=(champion_version, champion))
    config = parse_config(tracked["config"])
    mlflow_client = client(tracking_uri(uri, db_url))
    name = config_model_name(config.target.id)
    try:
        mlflow_client.get_registered_model(name)
    except MlflowException:
        mlflow_client.create_registered_model(
            name, description=f"specdec speculative-decoding configs of target {config.target.id}")
    existing = mlflow_client.search_model_versions(f"name='{name}' and tag.run_id='{run_id}'")
    description = (f"## specdec config of run {run_id}\n\ntarget `{config.target.id}` "
                   f"({config.target.fingerprint}), hardware profile `{config.hardware_profile}`, "
                   f"validation **{validation_status(config)}**\n\n{domain_table_markdown(config)}\n\n"
                   f"### What changed\n\n{changes_markdown(config, champion, champion_version)}\n\n"
                   "Plots: the run's `plots/` artifacts. Validation details: `reports/validation.json`.")
    tags = {"run_id": run_id, "domains_on": ",".join(config.domains_on) or "none",
            "validation": validation_status(config), "hardware_profile": config.hardware_profile,
            "target_fingerprint": config.target.fingerprint}
    if existing:
        version = str(existing[0].version)
        mlflow_client.update_model_version(name, version, description=description)
        for key, value in tags.items():
            mlflow_client.set_model_version_tag(name, version, key, value)
    else:
        version = str(mlflow_client.create_model_version(
            name, source=f"runs:/{tracked['mlflow_run_id']}/config", run_id=tracked["mlflow_run_id"],
            tags=tags, description=description).version)
    mlflow_client.set_registered_model_alias(name, CHALLENGER, version)
    _record(db_url, run_id=run_id, target_id=config.target.id, config_name=name, config_version=version,
            alias=CHALLENGER, action="register", forced=False, actor=actor or _actor(),
            gates=None, reason="retried registration: version reused" if existing else "registered")
    return {"name": name, "version": version, "reused": bool(existing),
            "champion_version": champion_version, "validation": tags["validation"],
            "mlflow_run_id": tracked["mlflow_run_id"]}


def _actor() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def check_gates(config: SpecdecConfig, champion: SpecdecConfig | None, settings: Settings,
                fingerprint_passed: bool | None = None) -> list[dict]:
    """Each gate: {name, passed, figure}. fingerprint_passed: the run's target-fingerprint check
    (None: not recorded)."""
    gates = []
    measured = {n: s for n, s in config.domains.items() if s.enabled and s.source == "run"}
    failed = sorted(n for n, s in measured.items() if s.validation != "passed")
    gates.append({"name": "validation", "passed": not failed and fingerprint_passed is not False,
                  "figure": f"{len(measured) - len(failed)}/{len(measured)} enabled domains passed"
                            + (f"; not passed: {failed}" if failed else "")
                            + ("; target fingerprint check FAILED" if fingerprint_passed is False else "")})
    tolerance = settings.promotion_regression_tolerance
    if champion is None:
        gates.append({"name": "no_regression", "passed": True, "figure": "no champion to compare"})
    else:
        ratios = {n: _effective(config.domains.get(n)) / _effective(champion.domains.get(n))
                  for n in champion.domains}
        worst = min(ratios.items(), key=lambda item: item[1], default=(None, 1.0))
        gates.append({"name": "no_regression", "passed": worst[1] >= 1 - tolerance,
                      "figure": f"worst domain {worst[0]}: {worst[1]:.2f}x the champion's speedup "
                                f"(minimum {1 - tolerance:.2f})"})
    short = sorted(n for n, s in measured.items() if s.samples < settings.min_per_domain)
    gates.append({"name": "min_samples", "passed": not short,
                  "figure": f"min samples {min((s.samples for s in measured.values()), default=0)} "
                            f"(required {settings.min_per_domain})" + (f"; short: {short}" if short else "")})
    same = champion is None or champion.target.fingerprint == config.target.fingerprint
    gates.append({"name": "same_target", "passed": same,
                  "figure": "no champion" if champion is None else
                  f"{config.target.fingerprint} vs champion {champion.target.fingerprint}"})
    return gates


def promote(name: str, version: str, db_url: str | None = None, uri: str | None = None,
            force: bool = False, actor: str | None = None, expected_champion: str | None = "current",
            settings: Settings | None = None) -> dict:
    """Gate and move `champion` to `version` (compare-and-set).

    expected_champion: the champion the caller's gates compared against ("current": whatever is
    champion now; None: there was none). Output: {"promoted", "forced", "gates", "reason", ...}.
    """
    settings = settings or load_settings()
    db_url = database_url(db_url or settings.database_url)
    mlflow_client = client(tracking_uri(uri, db_url))
    version = str(version)
    config = _version_config_or_error(mlflow_client, name, version)
    before = _alias_version(mlflow_client, name, CHAMPION)
    champion = load_version_config(mlflow_client, name, before) if before else None
    with ensure_ready(db_url).connect() as connection:
        fingerprint_passed = connection.execute(select(Validation.passed).where(
            (Validation.run_id == config.run_id) & (Validation.check_name == "fingerprint"))).scalar()
    gates = check_gates(config, champion, settings, fingerprint_passed)
    record = dict(run_id=config.run_id, target_id=config.target.id, config_name=name,
                  config_version=version, alias=CHAMPION, actor=actor or _actor())
    summary = {"gates": gates, "champion_before": before}

    def refuse(reason: str) -> dict:
        _record(db_url, action="reject", forced=force, gates=summary, reason=reason, **record)
        log.warning("promotion of %s version %s refused: %s", name, version, reason)
        return {"promoted": False, "forced": force, "version": version, "champion": before,
                "gates": gates, "reason": reason}

    if expected_champion != "current" and (expected_champion or None) != before:
        return refuse(f"the gates compared against champion {expected_champion or 'none'}, but the "
                      f"champion is now {before or 'none'}: re-run the gates")
    if before == version:
        return refuse(f"version {version} is already the champion")
    failed = [g for g in gates if not g["passed"]]
    if failed and not force:
        return refuse("gates failed: " + "; ".join(f"{g['name']} ({g['figure']})" for g in failed))
    now = _alias_version(mlflow_client, name, CHAMPION)   # compare-and-set: still the same champion?
    if now != before:
        return refuse(f"the champion moved from {before or 'none'} to {now} during the promotion")
    mlflow_client.set_registered_model_alias(name, CHAMPION, version)
    reason = ("FORCED past failed gates: " + "; ".join(g["name"] for g in failed)) if failed and force \
        else "all gates passed"
    _record(db_url, action="promote", forced=bool(force and failed), gates=summary, reason=reason, **record)
    return {"promoted": True, "forced": bool(force and failed), "version": version, "champion": version,
            "champion_before": before, "gates": gates, "reason": reason}


def _version_config_or_error(mlflow_client, name: str, version: str) -> SpecdecConfig:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_model_version(name, version)
    except MlflowException as exc:
        raise RegistryError(f"{name} has no version {version!r} ({exc.message if hasattr(exc, 'message') else exc}); "
                            "list them with `specdec config show`") from None
    return load_version_config(mlflow_client, name, version)


def rollback(name: str, db_url: str | None = None, uri: str | None = None,
             actor: str | None = None) -> dict:
    """Move `champion` back to the version it replaced (from the promotions table)."""
    db_url = database_url(db_url)
    mlflow_client = client(tracking_uri(uri, db_url))
    current = _alias_version(mlflow_client, name, CHAMPION)
    if current is None:
        raise RegistryError(f"{name} has no champion to roll back")
    engine = ensure_ready(db_url)
    with engine.connect() as connection:
        row = connection.execute(
            select(Promotion).where((Promotion.config_name == name) & (Promotion.alias == CHAMPION)
                                    & (Promotion.action == "promote")
                                    & (Promotion.config_version == current))
            .order_by(Promotion.id.desc()).limit(1)).mappings().first()
    previous = (row["gates"] or {}).get("champion_before") if row else None
    if not previous:
        raise RegistryError(f"{name} champion version {current} replaced no earlier champion (per the "
                            "promotions table): nothing to roll back to")
    config = load_version_config(mlflow_client, name, previous)
    mlflow_client.set_registered_model_alias(name, CHAMPION, previous)
    _record(db_url, run_id=config.run_id, target_id=config.target.id, config_name=name,
            config_version=previous, alias=CHAMPION, action="rollback", forced=False,
            actor=actor or _actor(), gates={"champion_before": current},
            reason=f"rolled back from version {current}")
    return {"champion": previous, "champion_before": current}


def show_version(name: str, which: str = CHAMPION, uri: str | None = None) -> dict:
    """{name, version, aliases, tags, description, config} of an alias or a version number."""
    mlflow_client = client(uri)
    version = which if which.isdigit() else _alias_version(mlflow_client, name, which)
    if version is None:
        raise RegistryError(f"{name} has no version with alias {which!r}")
    detail = mlflow_client.get_model_version(name, version)
    return {"name": name, "version": version, "aliases": list(detail.aliases or []),
            "tags": dict(detail.tags or {}), "description": detail.description,
            "config": json.loads(load_version_config(mlflow_client, name, version).to_json())}


# ------------------------------------------------------------------------------------------------
# vLLM
def vllm_export(config: SpecdecConfig) -> dict:
    """Per domain, the `speculative_config` a vLLM server takes (None: no speculation), and the
    domains whose drafter has no vLLM equivalent."""
    domains, unsupported = {}, {}
    for name, setting in sorted(config.domains.items()):
        if not setting.enabled or setting.drafter is None:
            domains[name] = None
            continue
        drafter = setting.drafter
        if drafter.kind == "prompt_lookup":
            spec = {"method": "ngram", "num_speculative_tokens": setting.k,
                    "prompt_lookup_max": int(drafter.params.get("max_ngram", 3)),
                    "prompt_lookup_min": int(drafter.params.get("min_ngram", 2))}
        elif drafter.kind == "draft_model":
            spec = {"method": "draft_model", "model": drafter.model_uri or drafter.params.get("model"),
                    "num_speculative_tokens": setting.k}
        else:
            unsupported[name] = (f"{drafter.kind} has no vLLM equivalent; serve this domain without "
                                 "speculation or with another drafter")
            domains[name] = None
            continue
        if setting.max_batch_size:
            spec["disable_by_batch_size"] = setting.max_batch_size
        domains[name] = spec
    return {"target": config.target.id, "run_id": config.run_id, "speculative_config": domains,
            "unsupported": unsupported, "default": None}


@contextmanager
def _fail_fast():
    """MLflow's HTTP client retries for minutes by default; a serving read must fail fast."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
