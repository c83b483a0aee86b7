"""The compose file's services as local processes on loopback: PostgreSQL (the server named by
$SPECDEC_TEST_POSTGRES_URL: Airflow metadata and the specdec database, each in a fresh schema of
its own), the MLflow server (SQLite backend and artifacts in tmp_path), and Airflow 3's
api-server, scheduler (LocalExecutor) and dag-processor, configured like docker-compose.yml.
`specdec_evaluate` is triggered through Airflow's REST API on a tiny target and must succeed;
then the champion config is read back from the MLflow server.

As in the compose file, `[database] sql_alchemy_conn_async` names the same psycopg URL (Airflow
would derive postgresql+asyncpg, which is not installed). Differences: the scheduler runs with
--skip-serve-logs (its log server binds every interface on fixed port 8793; the api-server reads
the task logs from the shared AIRFLOW_HOME); test-only: parallelism 2 and one parsing process for
a 2-core machine, no re-parsing during the run, and `[scheduler] use_job_schedule = False` so that
unpausing the `@daily` DAG does not also start a scheduled run of the default target (it would
queue ahead of ours: max_active_runs=1). No triggerer: the DAG has no deferrable task.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from .helpers import REPO
from .helpers.airflow import DAG_ID, SMALL, TINY_CONF, service_logs, task_logs, wait_for
from .helpers.db import POSTGRES_ENV
from .helpers.models import save_tiny_target, tiny_llama
from .helpers.processes import MlflowServer, Service, free_port
from .helpers.traffic import traffic_rows, write_jsonl

from tasks.db.store import Store

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get(POSTGRES_ENV),
                       reason=f"{POSTGRES_ENV} is not set: the services test needs a PostgreSQL "
                              "server for Airflow's metadata and the specdec database"),
]

RUN_TIMEOUT_S = 15 * 60


@pytest.fixture
def db_backend() -> str:
    """Overrides conftest's: the specdec database is on PostgreSQL here, as in the compose file."""
    return "postgresql"


@pytest.fixture
def tiny_target_traffic(db_url, tmp_path):
    """A tiny target saved as a model directory, and its own traffic (json, qa) imported."""
    from specdec_core import load_model
    from tasks.steps.traffic.traffic_import import import_traffic

    model_dir = save_tiny_target(tiny_llama(seed=0), tmp_path / "tiny-target")
    model, _ = load_model(str(model_dir), device="cpu")
    rows = traffic_rows(model, per_domain=10, foreign=0)
    import_traffic(write_jsonl(tmp_path / "traffic.jsonl", rows), store=Store.open(db_url), progress=False)
    return {"target": str(model_dir), "domains": sorted({row["domain"] for row in rows})}


@pytest.fixture
def services(tmp_path, airflow_db_url, db_url):
    """MLflow server, then the Airflow home (migrated, pool) and its three long-running services."""
    started: list = []
    mlflow = MlflowServer(tmp_path / "mlflow")
    started.append(mlflow)
    try:
        home = tmp_path / "airflow"
        home.mkdir()
        password = secrets.token_hex(8)
        passwords = home / "passwords.json"
        passwords.write_text(json.dumps({"admin": password}))
        port = free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AIRFLOW", "MLFLOW_", "SPECDEC_"))}
        env.update(SMALL)
        env.update({
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db_url,
            # Airflow derives its async URL as postgresql+asyncpg (not installed); psycopg 3 is
            # async-capable, so name the same URL for the async engine
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": airflow_db_url,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW_CONN_SPECDEC_DB": db_url,
            "SPECDEC_DATABASE_URL": db_url,
            "MLFLOW_TRACKING_URI": mlflow.uri,
            "SPECDEC_HOME": str(tmp_path / "specdec-home"),
            # test-only: small and quick on a 2-core machine
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        })
        airflow = [sys.executable, "-m", "airflow"]
        for command in (["db", "migrate"],
                        ["pools", "set", "specdec_timing", "1", "timing work never overlaps"]):
            done = subprocess.run(airflow + command, capture_output=True, text=True, env=env, cwd=home)
            assert done.returncode == 0, \
                f"`airflow {' '.join(command)}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        for name, command in (
                ("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]),
                ("scheduler", ["scheduler", "--skip-serve-logs"]),
                ("dag-processor", ["dag-processor"])):
            started.append(Service(name, airflow + command, env, home))
        yield {"api": f"http://127.0.0.1:{port}", "password": password, "home": home,
               "mlflow": mlflow.uri, "services": started[1:], "mlflow_server": mlflow}
    finally:
        for service in reversed(started):
            service.stop()


def test_specdec_evaluate_through_the_rest_api_then_champion_in_mlflow(services, tiny_target_traffic):
    import requests

    from tasks.registry.config_schema import config_model_name
    from tasks.registry.tracking import client, load_version_config

    started = time.monotonic()
    api = services["api"]

    def healthy():
        response = requests.get(f"{api}/api/v2/monitor/health", timeout=5)
        return response.status_code == 200 and response.json()

    health = wait_for("the api-server's /api/v2/monitor/health", healthy, 180, services)

    def token():
        response = requests.post(f"{api}/auth/token", timeout=10,
                                 json={"username": "admin", "password": services["password"]})
        return response.status_code in (200, 201) and response.json()["access_token"]

    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {wait_for('a token from /auth/token', token, 60, services)}"

    def parsed():
        response = session.get(f"{api}/api/v2/dags/{DAG_ID}", timeout=10)
        if response.status_code == 200:
            return response.json()
        errors = session.get(f"{api}/api/v2/importErrors", timeout=10)
        if errors.status_code == 200 and errors.json().get("total_entries"):
            pytest.fail(f"DAG import errors: {errors.json()}\n{service_logs(services)}")
        return None

    dag = wait_for(f"the dag-processor to parse {DAG_ID}", parsed, 300, services)
    assert dag["dag_id"] == DAG_ID
    response = session.patch(f"{api}/api/v2/dags/{DAG_ID}", json={"is_paused": False}, timeout=10)
    assert response.status_code == 200 and response.json()["is_paused"] is False, response.text

    conf = {**TINY_CONF, "target": tiny_target_traffic["target"], "promote": True}
    response = session.post(f"{api}/api/v2/dags/{DAG_ID}/dagRuns", timeout=30,
                            json={"logical_date": None, "conf": conf})
    assert response.status_code == 200, response.text
    run_id = response.json()["dag_run_id"]
    assert response.json()["conf"] == conf

    def finished():
        state = session.get(f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", timeout=10).json()["state"]
        return state if state in ("success", "failed") else None

    state = wait_for(f"run {run_id} to finish", finished, RUN_TIMEOUT_S, services, interval_s=5)
    if state != "success":
        tis = session.get(f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances",
                          params={"limit": 100}, timeout=10).json()["task_instances"]
        states = sorted((ti["task_id"], ti["map_index"], ti["state"], ti["try_number"]) for ti in tis)
        failed = sorted({ti["task_id"] for ti in tis if ti["state"] in ("failed", "upstream_failed")})
        pytest.fail(f"run {run_id} ended {state}; task instances (task, map index, state, try):\n"
                    + "\n".join(map(str, states)) + "\n"
                    + task_logs(services["home"], run_id, failed) + "\n" + service_logs(services))

    tis = session.get(f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances",
                      params={"limit": 100}, timeout=10).json()["task_instances"]
    states: dict[str, list] = {}
    for ti in tis:
        states.setdefault(ti["task_id"], []).append(ti["state"])
    assert states["promote"] == ["success"], states
    assert states["estimate"] == ["success"] * len(tiny_target_traffic["domains"]), states

    # the champion, read from the MLflow server the tasks wrote to
    name = config_model_name(tiny_target_traffic["target"])
    mlflow_client = client(services["mlflow"])
    version = mlflow_client.get_model_version_by_alias(name, "champion")
    assert version is not None and version.version
    champion = load_version_config(mlflow_client, name, version.version)
    assert champion.run_id == run_id
    assert set(champion.domains) == set(tiny_target_traffic["domains"])
    print(f"specdec_evaluate run {run_id} succeeded through the REST API in "
          f"{time.monotonic() - started:.0f} s after the services started (health: {health})")
