"""What the three DAG files share: the names they agree on (connection, pool, assets, queues),
the specdec database from the Airflow connection, and which errors fail a task at once and which
are left to the task's retries.

Importing this module loads no Airflow, engine (torch) or database code (tasks.db; of SQLAlchemy,
which Airflow loads anyway, only its exceptions), so a DAG file's parse stays light; Airflow is
imported inside the functions that need it. DEFAULT_MODEL is the engine's (specdec_core.home,
which imports no torch).

Errors, by what a retry can change:
- an outage of specdec's database or of the tracking server (DatabaseUnavailable; SQLAlchemy
  connect / disconnect errors; requests and urllib3 connection errors; any of these found in an
  exception's cause or context, e.g. an MlflowException or RegistryError raised from a refused
  connection) is raised as is, so the task's `retries` apply;
- the other user-facing errors (SpecdecTaskError: bad input, a failed data-quality gate, a
  missing cost profile, a version that does not exist) raise AirflowFailException: failed at
  once, no retry;
- anything else (a bug, out of memory) is raised as is and retried too.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager

from sqlalchemy import exc as sa

from ..errors import DatabaseUnavailable, RegistryUnavailable, SampleError, SpecdecTaskError
from ..masking import mask_text
from ..settings import DEFAULT_MODEL, QualitySettings, load_settings, setting_default
from ..steps.run_order import RUN_ORDER, domains_failed_text  # noqa: F401 - domains_failed_text: for the DAG

log = logging.getLogger(__name__)

DATABASE_CONNECTION = "specdec_db"      # the Airflow connection holding specdec's database URL
TIMING_POOL = "specdec_timing"          # one slot: timing work never overlaps other timing work

# asset URIs
CHAMPION_URI = "specdec://config/champion"             # a new champion config
LOW_ACCEPTANCE_URI = "specdec://alerts/low-acceptance"  # domains below the acceptance alert
EVALUATIONS_URI = "specdec://evaluations"              # an evaluation run has finished
NEW_DRAFT_URI = "specdec://drafts/new"                 # a new draft was registered
DRIFT_URI = "specdec://alerts/production-drift"        # production E below the champion's promise
# the monitor's targets: an Airflow Variable holding {"deployment": "http://host:port", ...}, or
# one connection per deployment (MONITOR_CONNECTION_PREFIX + the name, dashes as underscores)
MONITOR_VARIABLE = "specdec_monitor_targets"
MONITOR_CONNECTION_PREFIX = "specdec_vllm_"

# the candidates a run evaluates unless its conf names others (the settings' default)
DEFAULT_CANDIDATES = setting_default("plan_candidates")
DEPRECATED_PARAMS = {"samples_per_domain": "max_per_domain"}   # old Param name -> current name

__all__ = ["CHAMPION_URI", "DATABASE_CONNECTION", "DEFAULT_MODEL", "DEPRECATED_PARAMS", "DRIFT_URI",
           "MONITOR_VARIABLE", "monitor_targets",
           "EVALUATIONS_URI", "LOW_ACCEPTANCE_URI", "NEW_DRAFT_URI", "TIMING_POOL", "check_per_domain_range", "current_params",
           "connection_database_url", "connection_registry", "connection_store", "domain_step_failed", "evaluate_spec", "is_outage", "queues", "run_spec",
           "setting_default", "task_errors"]


def _airflow_sdk():
    """airflow.sdk, its exceptions (airflow.sdk.exceptions) loaded, imported by the first function
    that needs it: Airflow costs ~0.9 s and reads its configuration when imported, and
    `specdec main-job` imports this module before it sets AIRFLOW_HOME."""
    import airflow.sdk.exceptions

    return airflow.sdk


def queues() -> tuple[str, str]:
    """(cpu queue, gpu queue): the Airflow queues of database/registry tasks and of the tasks that
    run the model, from the settings ($SPECDEC_QUEUES_CPU, $SPECDEC_QUEUES_GPU; defaults `default`
    and `gpu`). Read when a DAG file is parsed; the LocalExecutor ignores queues."""
    settings = load_settings()
    return settings.queues.cpu, settings.queues.gpu


def connection_database_url() -> str | None:
    """The URL of the Airflow connection `specdec_db`; None when it is not defined. The steps
    resolve None as everywhere else (tasks.db.engine.resolve_database_url: $SPECDEC_DATABASE_URL,
    else the SQLite default)."""
    sdk = _airflow_sdk()
    try:
        return sdk.BaseHook.get_connection(DATABASE_CONNECTION).get_uri()
    except sdk.exceptions.AirflowNotFoundException:
        return None


def connection_store():
    """The Store of the Airflow connection `specdec_db` (tasks.db.store.Store.open; without the
    connection, the default database): where a DAG task opens the database, once."""
    # imported here: the database loads for the tasks that use it, not at DAG parse
    from ..db.store import Store

    return Store.open(connection_database_url())


def connection_registry(store=None):
    """The MLflow tracking store of a task (tasks.registry.registry.Registry.open:
    $MLFLOW_TRACKING_URI, else the default under $SPECDEC_HOME), never `store`'s database: where a
    DAG task opens the registry, once. Nothing is contacted until it is used."""
    # imported here: the registry loads for the tasks that use it, not at DAG parse
    from ..registry.registry import Registry

    return Registry.open(store=store)


def _outage_here(exc: BaseException) -> bool:
    if isinstance(exc, (DatabaseUnavailable, RegistryUnavailable)):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):    # refused, reset, socket timeouts
        return True
    if isinstance(exc, (sa.DisconnectionError, sa.TimeoutError)):
        return True
    if isinstance(exc, sa.DBAPIError) and (exc.connection_invalidated or (
            isinstance(exc, (sa.OperationalError, sa.InterfaceError)) and exc.statement is None)):
        return True     # lost the connection, or could not connect (no statement was sent)
    try:
        import requests
        import urllib3
    except ImportError:     # without MLflow's HTTP stack there is no such error to find
        return False
    return isinstance(exc, (requests.ConnectionError, requests.Timeout,
                            urllib3.exceptions.NewConnectionError, urllib3.exceptions.MaxRetryError,
                            urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError))


def is_outage(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, says that the database
    or the tracking server could not be reached (a retry may succeed)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if _outage_here(current):
            return True
        seen.add(id(current))
        current = current.__cause__ if current.__cause__ is not None else current.__context__
    return False


@contextmanager
def task_errors():
    """Around a task's work: outages and unknown errors propagate (the task's retries apply);
    other user-facing errors fail the task at once."""
    sdk = _airflow_sdk()
    try:
        yield
    except SpecdecTaskError as exc:
        if is_outage(exc):
            log.warning("database or tracking server unreachable, the task's retries apply: %s: %s",
                        type(exc).__name__, mask_text(str(exc)))
            raise
        log.error("failed at once, no retry: %s: %s", type(exc).__name__, mask_text(str(exc)))   # in the task log
        raise sdk.exceptions.AirflowFailException(f"{type(exc).__name__}: {mask_text(str(exc))}") from exc


def current_params(params, conf: dict | None) -> dict:
    """The run's Params, with a value given under a deprecated name moved to the current one
    (warned in the task log). The current name wins when the run conf gives both."""
    values = dict(params)
    conf = conf or {}
    for old, new in DEPRECATED_PARAMS.items():
        if old not in conf:
            continue
        if new in conf:
            log.warning("param %r is deprecated and ignored: %r is also given", old, new)
        else:
            log.warning("param %r is deprecated: use %r", old, new)
            values[new] = conf[old]
        values.pop(old, None)
    return values


def check_per_domain_range(params) -> None:
    """The cross-field check Airflow's per-Param validation cannot make: the minimum samples per
    domain must not exceed the samples drawn per domain. SampleError (the task fails at once)."""
    low, high = params.get("min_per_domain"), params.get("max_per_domain")
    if low is not None and high is not None and int(low) > int(high):
        raise SampleError(f"Minimum samples per domain (min_per_domain={low}) is above Samples per "
                          f"domain (max_per_domain={high}): set min_per_domain <= max_per_domain")


# The ranges of specdec_evaluate's numeric Params: (title in the trigger form, lowest, highest).
# They are not in the Params' JSON schema: Airflow's form clamps a number to the schema's
# minimum/maximum when the field loses focus (40 became 32 silently), so the first task (sample)
# refuses a value outside its range instead, naming the field (check_param_ranges).
# Largest K: at most the result tables' gate (the setting quality.k_max, 16), which a run
# planned beyond it would fail at finish, ten minutes in
K_LIMIT = QualitySettings().k_max
PARAM_RANGES = {"window_days": ("Time window (days)", 0.01, 365),
                "max_per_domain": ("Samples per domain", 1, 100000),
                "min_per_domain": ("Minimum samples per domain", 1, 100000),
                "k_max": ("Largest K", 1, K_LIMIT),
                "min_speedup": ("Minimum speedup", 0.01, 10.0),
                "acceptance_alert": ("Low-acceptance alert", 1.0, 33.0)}


def check_param_ranges(params) -> None:
    """SampleError (the task fails at once, no retry) naming every numeric Param outside its
    range (PARAM_RANGES), e.g. "Largest K (k_max=40) is outside 1 to 16"."""
    problems = []
    for name, (title, low, high) in PARAM_RANGES.items():
        value = params.get(name)
        if value is not None and not low <= value <= high:
            problems.append(f"{title} ({name}={value}) is outside {low:g} to {high:g}")
    if problems:
        raise SampleError("; ".join(problems) + ": set a value inside the range (nothing was changed "
                          "for you) and trigger again")


def evaluate_spec(run_id: str, params, conf: dict | None = None):
    """The RunSpec of a `specdec_evaluate` run from its Params (and run conf, for deprecated names)."""
    # imported here: DAG files import this module at parse time (tasks.steps.spec loads no model)
    from ..steps.spec import RunSpec

    p = current_params(params, conf)
    check_param_ranges(p)
    check_per_domain_range(p)
    return RunSpec(run_id=run_id, target=p["target"], db_url=connection_database_url(),
                   domains=p["domains"] or None, window_days=p["window_days"],
                   max_per_domain=p["max_per_domain"], min_per_domain=p["min_per_domain"],
                   candidates=p["candidates"], hardware_profile=p["hardware_profile"] or None,
                   k_max=p["k_max"], min_speedup=p["min_speedup"], promote=bool(p["promote"]),
                   # the alert's threshold: the alert task and the version page state the same one
                   overrides=({"plan_acceptance_alert": p["acceptance_alert"]}
                              if "acceptance_alert" in p else {}))


# mapped tasks are labelled in the UI by what they ran for (a domain, a report): Airflow renders
# map_index_template with the task's context after it ran
MAP_LABEL = "{{ specdec_label }}"


def label_mapped(label: str) -> None:
    """Inside a mapped task: its map index shows as `label` (map_index_template MAP_LABEL), e.g.
    the domain it ran for."""
    _airflow_sdk().get_current_context()["specdec_label"] = label


def run_spec() -> dict:
    """The run's spec as the `sample` task returned it (its XCom). Pulled, not passed as an
    argument: an argument is an edge from sample to every task that takes it, and the graph was a
    web of them; wire_in_order's chain orders the tasks. Where sample did not complete the task
    ends skipped saying so (the run fails at its last task, domain_failures)."""
    sdk = _airflow_sdk()
    spec = sdk.get_current_context()["ti"].xcom_pull(task_ids="sample", map_indexes=-1)
    if spec is None:
        raise sdk.exceptions.AirflowSkipException("sample did not complete: the run has no spec "
                                                  "(see the sample task's log)")
    return spec


def domain_step_failed(steps: tuple[str, ...]) -> str | None:
    """Inside a per-domain task (estimate, confirm and validate are each mapped over the run's
    domains, so one map index is one domain in all three): the first of `steps` that did not
    succeed for this task's domain ("estimate failed"), or None. The per-domain tasks wait for
    each other as whole tasks (all_done) and check their own domain here, so one domain's failure
    stays in that domain."""
    ti = _airflow_sdk().get_current_context()["ti"]
    states = ti.get_task_states(dag_id=ti.dag_id, map_index=ti.map_index, task_ids=list(steps),
                                run_ids=[ti.run_id]).get(ti.run_id, {})
    for step in steps:
        state = states.get(f"{step}_{ti.map_index}")
        if state not in ("success", "skipped"):
            return f"{step} {state or 'did not run'}"
    return None


def wire_in_order(tasks: dict) -> None:
    """Set each step of tasks.steps.run_order.RUN_ORDER downstream of the one before it (the
    run's order, written once; the XCom arguments add the data dependencies). tasks: {step name:
    its task or XComArg}; a name missing from it (e.g. "promote" in a DAG without it) is passed
    over."""
    steps = [tasks[name] for name in RUN_ORDER if name in tasks]
    for before, after in zip(steps, steps[1:]):
        # a step of several tasks (the per-domain chain) is (first, last)
        (before[-1] if isinstance(before, tuple) else before) >> (
            after[0] if isinstance(after, tuple) else after)


def monitor_targets(deployments: list[str], port: int = 8000) -> dict[str, str]:
    """The URL to scrape per deployment: the Variable MONITOR_VARIABLE ({name: url}; a deployment
    it does not name is not scraped), else a connection MONITOR_CONNECTION_PREFIX + name (dashes as
    underscores; its host, port and scheme), else http://NAME:port, the service that
    `specdec config export --format compose` writes for it on the Compose network."""
    sdk = _airflow_sdk()
    raw = sdk.Variable.get(MONITOR_VARIABLE, default=None)
    if raw:
        targets = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(targets, dict):
            raise SampleError(f"Airflow Variable {MONITOR_VARIABLE} must be a JSON object "
                              '{"deployment": "http://host:port"}, got ' + type(targets).__name__)
        return {str(name): str(url) for name, url in targets.items()}
    out = {}
    for name in deployments:
        try:
            conn = sdk.BaseHook.get_connection(MONITOR_CONNECTION_PREFIX + name.replace("-", "_"))
            out[name] = f"{conn.schema or 'http'}://{conn.host}:{conn.port or port}"
        except sdk.exceptions.AirflowNotFoundException:
            out[name] = f"http://{name}:{port}"
    return out
