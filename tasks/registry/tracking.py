"""MLflow: where the tracking store is, the experiment and run of an evaluation, and reading the
registered config versions (aliases `challenger` and `champion`).

- Tracking URI: the argument, else $MLFLOW_TRACKING_URI, else sqlite:///$SPECDEC_HOME/mlflow.db
  (artifacts under $SPECDEC_HOME/mlartifacts). Never specdec's own database: both use Alembic.
- The Registry (`Registry.open(uri, store)`): that store resolved once where a process starts
  working on it, as tasks.db.store.Store is; steps and the registry's functions take it, never
  a URI, and reach MLflow through its `client`.
- Every evaluation is one MLflow run in experiment `specdec/<target-slug>`, tagged
  `specdec.run_id`, so that a retried step finds and reuses it (tasks.registry.registration logs it).
- A target's configs are versions of the registered model `specdec-config-<target-slug>`.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from sqlalchemy import create_engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError

from ..db.engine import is_disk_full, missing_driver
from ..errors import DiskFull, RegistryError, RegistryUnavailable
from ..masking import mask_text, mask_url, printable
from ..settings import specdec_home
from .config_schema import SpecdecConfig, parse_config, target_slug
from .mlflow_scope import FAIL_FAST_SETTINGS, attach, mlflow_settings
from .registry import Registry, registry_of, tracking_uri  # noqa: F401 - re-exported

SQL_STORE_CONNECT_TIMEOUT_S = 3
# An HTTP tracking server is probed once per process before MLflow's first call: (connect, read)
# seconds, so one that accepts connections and never answers fails within their sum.
HTTP_PROBE_TIMEOUT_S = (3.0, 5.0)

RUN_TAG = "specdec.run_id"
# MLflow's UI opens an experiment in its runs/metrics/artifacts view for this kind (not GenAI's)
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
CHAMPION, CHALLENGER = "champion", "challenger"


def client(uri: str | None = None) -> "RegistryClient":
    """An MlflowClient for the tracking URI whose calls fail fast and clearly (RegistryClient)."""
    uri = tracking_uri(uri)
    _check_sqlite_store(uri)
    _check_sql_store(uri)
    _check_http_store(uri)
    attach()      # MLflow reads specdec's settings (tasks.registry.mlflow_scope), not os.environ
    with _sqlite_store_lock(uri) as first:
        registry = RegistryClient(MlflowClient(tracking_uri=uri, registry_uri=uri), uri)
        if first:   # MlflowClient made the tracking tables; the registry's on its first call
            registry.search_registered_models(max_results=1)
    return registry


_SQLITE_STORES_READY: set[str] = set()


@contextmanager
def _sqlite_store_lock(uri: str):
    """A sqlite:/// store's tables made by one process at a time: MLflow creates (or migrates) them
    when a process makes its first client, and two processes starting on a new home at once both
    try (`table experiments already exists`, or an Alembic row not found). Within it, this
    process holds an exclusive lock on the file `<store>.lock` beside the store, so that a second
    process waits, then finds the tables made. Yields whether this is the process's first use of
    the store (the lock is taken only then). Where the lock file cannot be made (a read-only
    directory), nothing can be created either: no lock is taken."""
    path = _sqlite_store_path(uri)
    if path is None or uri in _SQLITE_STORES_READY:
        yield False
        return
    try:
        lock = open(f"{path}.lock", "a")
    except OSError:
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield True
    finally:
        if lock is not None:
            lock.close()        # releases the lock
    _SQLITE_STORES_READY.add(uri)


def unreachable(uri: str, exc: BaseException) -> RegistryUnavailable:
    """The one-line error for a tracking store that cannot be reached: URI (credentials masked),
    the cause, the fix."""
    text = " ".join(str(exc).split())
    causes = {"Connection refused": "connection refused", "timed out": "timed out",
              "Name or service not known": "unknown host", "nodename nor servname": "unknown host",
              "Temporary failure in name resolution": "unknown host"}
    reason = next((short for marker, short in causes.items() if marker in text),
                  printable(mask_text(text)[:300]))
    return RegistryUnavailable(
        f"MLflow tracking store {mask_url(uri)} is unreachable ({reason}). Start the tracking server "
        "(or the database behind it), or set MLFLOW_TRACKING_URI to the right one; nothing was "
        "changed in the registry")


def is_unreachable(exc: BaseException) -> bool:
    """Whether an exception of an MLflow call means the store is down or unreachable (as opposed to
    a refusal such as a missing version, which callers handle)."""
    chain = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                          OperationalError)) for e in chain):
        return True
    return isinstance(exc, MlflowException) and str(exc.message).startswith("API request to") and (
        "failed with" in str(exc.message) or exc.error_code in ("TEMPORARILY_UNAVAILABLE",))


class RegistryClient:
    """The MLflow calls specdec makes, each of which raises one RegistryError line (URI masked, the
    fix) instead of MLflow's traceback when it finds the store unreachable, with specdec's MLflow
    settings (tasks.registry.mlflow_scope: bounded retries, no bars, no run links). Refusals (no
    such version or alias) pass through as MlflowException for the callers that expect them.
    Arguments and results are MlflowClient's."""

    def __init__(self, inner: MlflowClient, uri: str):
        self._inner, self._uri = inner, uri

    @property
    def tracking_uri(self) -> str:
        return self._inner.tracking_uri

    def _call(self, method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            path = _sqlite_store_path(self._uri)
            if is_disk_full(exc):                           # not an outage either
                raise DiskFull(
                    f"disk full: MLflow's tracking store {mask_url(self._uri)} cannot grow "
                    f"({printable(' '.join(_first_line(exc).split()))}); what specdec's database "
                    "holds is kept. Free space on the store's disk (or set MLFLOW_TRACKING_URI to "
                    "another store), then run the command again: a run registers again by its "
                    "id") from None
            if path is not None and _is_read_only(exc):     # not an outage: no server to start
                raise not_writable_store(path, _why_not_writable(path, exc)) from None
            if is_unreachable(exc):
                raise unreachable(self._uri, exc) from None
            raise

    # experiments and runs
    def get_experiment_by_name(self, name: str):
        return self._call(self._inner.get_experiment_by_name, name)

    def create_experiment(self, name: str, artifact_location: str | None = None,
                          tags: dict | None = None) -> str:
        return self._call(self._inner.create_experiment, name, artifact_location=artifact_location,
                          tags=tags)

    def set_experiment_tag(self, experiment_id: str, key: str, value) -> None:
        return self._call(self._inner.set_experiment_tag, experiment_id, key, value)

    def search_runs(self, experiment_ids: list[str], filter_string: str = "",
                    max_results: int = 1000, order_by: list[str] | None = None):
        return self._call(self._inner.search_runs, experiment_ids, filter_string=filter_string,
                          max_results=max_results, order_by=order_by)

    def create_run(self, experiment_id: str, start_time: int | None = None, tags: dict | None = None,
                   run_name: str | None = None):
        return self._call(self._inner.create_run, experiment_id, start_time=start_time, tags=tags,
                          run_name=run_name)

    def get_run(self, run_id: str):
        return self._call(self._inner.get_run, run_id)

    def set_terminated(self, run_id: str, status: str | None = None) -> None:
        return self._call(self._inner.set_terminated, run_id, status=status)

    def log_param(self, run_id: str, key: str, value):
        return self._call(self._inner.log_param, run_id, key, value)

    def log_metric(self, run_id: str, key: str, value: float, step: int | None = None):
        return self._call(self._inner.log_metric, run_id, key, value, step=step)

    def set_tag(self, run_id: str, key: str, value):
        return self._call(self._inner.set_tag, run_id, key, value)

    # artifacts
    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        return self._call(self._inner.log_artifact, run_id, local_path, artifact_path=artifact_path)

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        return self._call(self._inner.log_artifacts, run_id, local_dir, artifact_path=artifact_path)

    def list_artifacts(self, run_id: str, path: str | None = None):
        return self._call(self._inner.list_artifacts, run_id, path)

    def download_artifacts(self, run_id: str, path: str, dst_path: str | None = None) -> str:
        return self._call(self._inner.download_artifacts, run_id, path, dst_path)

    # registered models and their versions
    def get_registered_model(self, name: str):
        return self._call(self._inner.get_registered_model, name)

    def create_registered_model(self, name: str, tags: dict | None = None,
                                description: str | None = None):
        return self._call(self._inner.create_registered_model, name, tags=tags,
                          description=description)

    def search_registered_models(self, filter_string: str | None = None, max_results: int = 100):
        return self._call(self._inner.search_registered_models, filter_string=filter_string,
                          max_results=max_results)

    def search_model_versions(self, filter_string: str | None = None, max_results: int = 10000,
                              order_by: list[str] | None = None):
        return self._call(self._inner.search_model_versions, filter_string=filter_string,
                          max_results=max_results, order_by=order_by)

    def create_model_version(self, name: str, source: str, run_id: str | None = None,
                             tags: dict | None = None, description: str | None = None):
        return self._call(self._inner.create_model_version, name, source, run_id=run_id, tags=tags,
                          description=description)

    def get_model_version(self, name: str, version: str):
        return self._call(self._inner.get_model_version, name, version)

    def get_model_version_by_alias(self, name: str, alias: str):
        return self._call(self._inner.get_model_version_by_alias, name, alias)

    def update_model_version(self, name: str, version: str, description: str | None = None):
        return self._call(self._inner.update_model_version, name, version, description=description)

    def set_model_version_tag(self, name: str, version: str, key: str, value) -> None:
        return self._call(self._inner.set_model_version_tag, name, version, key, value)

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        return self._call(self._inner.set_registered_model_alias, name, alias, version)


_SQL_STORES_CHECKED: set[str] = set()


def _sqlite_store_path(uri: str) -> Path | None:
    """The file of a sqlite:/// tracking URI (None: another kind of store, or in memory)."""
    if not uri.lower().startswith("sqlite:"):
        return None
    try:
        database = make_url(uri).database
    except ArgumentError:
        return None
    if database in (None, "", ":memory:"):
        return None
    if database.startswith("file:"):
        database = database[len("file:"):].split("?", 1)[0]
    return Path(database)


def not_writable_store(path: Path, reason: str) -> RegistryError:
    """The one-line error for a SQLite tracking store that cannot be created or written: the file,
    why, and the fix (MLflow itself retries it for about 100 s, then prints its traceback)."""
    return RegistryError(
        f"MLflow's tracking store {path} cannot be written ({reason}); nothing was changed. Set "
        "SPECDEC_HOME to a writable directory (the default store is $SPECDEC_HOME/mlflow.db), "
        "make that directory writable, or set MLFLOW_TRACKING_URI to a store this user can write")


def _check_sqlite_store(uri: str) -> None:
    """A sqlite:/// tracking URI whose file does not exist yet: its directory must exist or be
    creatable, and be writable, before MLflow tries to create it. An existing file must be
    readable. Checked once per process and URI."""
    path = _sqlite_store_path(uri)
    if path is None or uri in _SQL_STORES_CHECKED:
        return
    if path.exists():
        if not os.access(path, os.R_OK):
            raise not_writable_store(path, "the file cannot be read")
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise not_writable_store(path, f"its directory {path.parent} cannot be created: "
                                           f"{exc.strerror or exc}") from None
        if not os.access(path.parent, os.W_OK):
            raise not_writable_store(path, f"its directory {path.parent} is not writable"
                                           + (": read-only file system" if _read_only_fs(path.parent) else ""))
    _SQL_STORES_CHECKED.add(uri)


def _is_read_only(exc: BaseException) -> bool:
    """SQLite's refusals of a write to a file or directory this user cannot write (its journal
    cannot be made beside it: "unable to open database file")."""
    text = " ".join(str(getattr(e, "orig", e)) for e in (exc, exc.__cause__, exc.__context__) if e)
    return any(marker in text.lower() for marker in
               ("readonly database", "read-only file system", "unable to open database file"))


def _first_line(exc: BaseException) -> str:
    original = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__ or exc
    return mask_text((str(getattr(original, "orig", original)).strip().splitlines() or [""])[0][:200])


def _why_not_writable(path: Path, exc: BaseException) -> str:
    if not os.access(path.parent, os.W_OK):
        return f"its directory {path.parent} is not writable" + (
            ": read-only file system" if _read_only_fs(path.parent) else "")
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    return mask_text(str(getattr(exc, "orig", exc)).strip().splitlines()[0][:200])


def _read_only_fs(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_sql_store(uri: str) -> None:
    """A database-backed tracking URI: one quick connection first (MLflow itself retries a
    database that is down for about 100 s). Checked once per process and URI."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in ("postgresql", "mysql", "mssql") or uri in _SQL_STORES_CHECKED:
        return

    connect_args = {"connect_timeout": SQL_STORE_CONNECT_TIMEOUT_S} if scheme == "postgresql" else {}
    try:
        url = make_url(uri)
        if url.drivername == "postgresql":      # psycopg 3 is the driver we install
            url = url.set(drivername="postgresql+psycopg")
        engine = create_engine(url, connect_args=connect_args)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except ImportError as exc:      # not an outage: a retry cannot help
        raise RegistryError(f"MLflow tracking URI {mask_url(uri)}: {missing_driver(uri, exc)}") from None
    except (DBAPIError, ArgumentError, ValueError) as exc:
        raise unreachable(uri, getattr(exc, "orig", exc)) from None
    _SQL_STORES_CHECKED.add(uri)


def _check_http_store(uri: str) -> None:
    """An http(s) tracking URI: one request first, bounded by HTTP_PROBE_TIMEOUT_S (MLflow's own
    client waits MLFLOW_HTTP_REQUEST_TIMEOUT per try, over every retry). Any HTTP answer, even an
    error status, or a TLS handshake MLflow may accept under its own settings, means the server
    answers. Checked once per process and URI."""
    if urlsplit(uri).scheme.lower() not in ("http", "https") or uri in _HTTP_STORES_CHECKED:
        return
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=HTTP_PROBE_TIMEOUT_S, allow_redirects=False)
    except requests.exceptions.SSLError:
        pass
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        raise unreachable(uri, exc) from None
    _HTTP_STORES_CHECKED.add(uri)


_HTTP_STORES_CHECKED: set[str] = set()


@contextmanager
def fail_fast():
    """Within it, in this thread only, MLflow's HTTP client neither retries nor waits long (by
    default it retries for minutes), whatever the environment says: for reads that must fail fast,
    such as serving's (FAIL_FAST_SETTINGS; tasks.registry.mlflow_scope). os.environ is not
    written: other threads keep their own settings."""
    with mlflow_settings(forced=FAIL_FAST_SETTINGS):
        yield


def experiment_for_target(mlflow_client, target_id: str) -> str:
    """The id of the target's experiment `specdec/<target-slug>`, created on first use."""
    name = f"specdec/{target_slug(target_id)}"
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        if (experiment.tags or {}).get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            mlflow_client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id
    location = None
    if mlflow_client.tracking_uri.startswith("sqlite:"):   # a local store: artifacts beside it
        location = (specdec_home() / "mlartifacts" / target_slug(target_id)).resolve().as_uri()
    return mlflow_client.create_experiment(name, artifact_location=location,
                                           tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})


def find_run(mlflow_client, experiment_id: str, run_id: str):
    """The MLflow run tagged with specdec's run id, or None."""
    runs = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
                                     max_results=1)
    return runs[0] if runs else None


# ------------------------------------------------------------------------------------------------
# registered config versions
def alias_version(mlflow_client, name: str, alias: str) -> str | None:
    """The version an alias points at; None when the model or the alias does not exist."""
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
    try:
        mlflow_client.get_model_version(name, version)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise RegistryError(f"{name} has no version {version!r} ({exc.message if hasattr(exc, 'message') else exc}); "
                            "list them with `specdec config show`") from None
    return load_version_config(mlflow_client, name, version)
