"""MLflow: where the tracking store is, the experiment and run of an evaluation, and reading the
registered config versions (aliases `challenger` and `champion`).

- Tracking URI: the argument, else $MLFLOW_TRACKING_URI, else sqlite:///$SPECDEC_HOME/mlflow.db
  (artifacts under $SPECDEC_HOME/mlartifacts). Never specdec's own database: both use Alembic.
- Every evaluation is one MLflow run in experiment `specdec/<target-slug>`, tagged
  `specdec.run_id`, so that a retried step finds and reuses it (tasks.registration logs it).
- A target's configs are versions of the registered model `specdec-config-<target-slug>`.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .config_schema import SpecdecConfig, config_model_name, parse_config, target_slug
from .db.engine import database_url, display_url, ensure_ready
from .errors import RegistryError
from .run_config import run_row
from .settings import specdec_home

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # no bars in logs and tables

RUN_TAG = "specdec.run_id"
CHAMPION, CHALLENGER = "champion", "challenger"


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


@contextmanager
def fail_fast():
    """Within it, MLflow's HTTP client neither retries nor waits long (by default it retries for
    minutes): for reads that must fail fast, such as serving's."""
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


def experiment_for_target(mlflow_client, target_id: str) -> str:
    """The id of the target's experiment `specdec/<target-slug>`, created on first use."""
    name = f"specdec/{target_slug(target_id)}"
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if mlflow_client.tracking_uri.startswith("sqlite:"):   # a local store: artifacts beside it
        location = (specdec_home() / "mlartifacts" / target_slug(target_id)).resolve().as_uri()
    return mlflow_client.create_experiment(name, artifact_location=location)


def find_run(mlflow_client, experiment_id: str, run_id: str):
    """The MLflow run tagged with specdec's run id, or None."""
    runs = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
                                     max_results=1)
    return runs[0] if runs else None


# ------------------------------------------------------------------------------------------------
# registered config versions
def alias_version(mlflow_client, name: str, alias: str) -> str | None:
    """The version an alias points at; None when the model or the alias does not exist."""
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


def version_config(mlflow_client, name: str, version: str) -> SpecdecConfig:
    """load_version_config, or a RegistryError naming the fix when there is no such version."""
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_model_version(name, version)
    except MlflowException as exc:
        raise RegistryError(f"{name} has no version {version!r} ({exc.message if hasattr(exc, 'message') else exc}); "
                            "list them with `specdec config show`") from None
    return load_version_config(mlflow_client, name, version)


def current_champion(uri: str | None = None, target_id: str | None = None, run_id: str | None = None,
                     db_url: str | None = None) -> tuple[str | None, SpecdecConfig | None]:
    """(version, config) of the champion of the target (of `run_id`'s target when target_id is None)."""
    if target_id is None:
        engine = ensure_ready(database_url(db_url))
        with engine.connect() as connection:
            target_id = run_row(connection, run_id)["target_id"]
    mlflow_client = client(uri)
    name = config_model_name(target_id)
    version = alias_version(mlflow_client, name, CHAMPION)
    if version is None:
        return None, None
    return version, load_version_config(mlflow_client, name, version)


def show_version(name: str, which: str = CHAMPION, uri: str | None = None) -> dict:
    """{name, version, aliases, tags, description, config} of an alias or a version number."""
    mlflow_client = client(uri)
    version = which if which.isdigit() else alias_version(mlflow_client, name, which)
    if version is None:
        raise RegistryError(f"{name} has no version with alias {which!r}")
    detail = mlflow_client.get_model_version(name, version)
    return {"name": name, "version": version, "aliases": list(detail.aliases or []),
            "tags": dict(detail.tags or {}), "description": detail.description,
            "config": json.loads(load_version_config(mlflow_client, name, version).to_json())}
