"""Scale-out on Airflow's CeleryExecutor, with real workers: Debian's redis-server as the broker
and PostgreSQL (Airflow's metadata database) as the result backend, all on loopback; the
api-server, scheduler, dag-processor and two Celery workers as processes, one worker per queue
(`default` and `gpu`), each with its own $SPECDEC_HOME (no shared disk between tasks) and its own
name (`[core] hostname_callable = tasks.settings.worker_name`).

`specdec_evaluate` runs on two domains of the shipped traffic with the embedded default. Then the
cluster is stopped and the same run spec runs again in this process (`tasks.steps.evaluate.evaluate`,
what `specdec evaluate` runs: every step in one process, sharing one model and one disk), with
the settings the workers read from their environment. Asserted: every task ran on the worker of
its queue, the run succeeded, and the two runs have the same estimates, plans and decisions (live
timings may differ). Both plan with one cost profile measured before (so the plans can be
compared); the sample is every stored row of the two domains (so the run id's seed draws the same
sample). (The LocalExecutor runs the DAG in tests/test_services.py and tests/test_browser.py; a
second Airflow run here cost about 200 s of a 2-core machine for what the in-process run shows.)

Test-only shortcuts: each worker's model cache starts with the embedded default already converted
(a link into the session's cache: fetching it is tested elsewhere), workers skip serving logs (the
api-server reads them from the shared AIRFLOW_HOME), tiny request counts.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import REPO
from .helpers.airflow import DAG_ID, SMALL, service_logs, task_logs, wait_for
from .helpers.db import POSTGRES_ENV
from .helpers.processes import MlflowServer, Service, free_port, stop_process_group
from .helpers.traffic import write_jsonl

from tasks.db.store import Store

REQUIRE_ENV = "SPECDEC_REQUIRE_CELERY"
REPORT_ENV = "SPECDEC_CELERY_REPORT"       # where to write the runs' tables (CI prints the file)
REDIS = shutil.which("redis-server")
DOMAINS = ("json", "qa")
ROWS_PER_DOMAIN = 6
RUN_TIMEOUT_S = 20 * 60
GPU_TASKS = {"profile", "estimate", "confirm", "validate", "finish",
             "engine_check"}

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get(POSTGRES_ENV),
                       reason=f"{POSTGRES_ENV} is not set: the CeleryExecutor needs PostgreSQL"),
    pytest.mark.skipif(REDIS is None and not os.environ.get(REQUIRE_ENV),
                       reason="redis-server is not installed (Debian: apt-get install redis-server); "
                              f"{REQUIRE_ENV}=1 makes this a failure"),
]


@pytest.fixture
def db_backend() -> str:
    """Overrides conftest's: the specdec database is on PostgreSQL here, as in the compose file."""
    return "postgresql"


@pytest.fixture
def redis_url(tmp_path):
    if REDIS is None:
        pytest.fail(f"{REQUIRE_ENV} is set but redis-server is not installed")
    port = free_port()
    log = tmp_path / "redis.log"
    with open(log, "wb") as handle:
        process = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", str(tmp_path)],
                                   stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    import socket

    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"redis-server did not answer on port {port}:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    yield f"redis://127.0.0.1:{port}/0"
    stop_process_group(process, 10)


@pytest.fixture
def shipped_two_domains(db_url, tmp_path):
    """The shortest ROWS_PER_DOMAIN rows of json and qa from the shipped traffic, imported."""
    from tasks.steps.traffic.traffic_import import import_traffic

    with gzip.open(REPO / "tasks" / "data" / "sample_traffic.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    chosen = []
    for domain in DOMAINS:
        of_domain = sorted((r for r in rows if r["domain"] == domain),
                           key=lambda r: len(json.dumps(r["messages"])) + len(r["response"]))
        chosen += of_domain[:ROWS_PER_DOMAIN]
    import_traffic(write_jsonl(tmp_path / "two-domains.jsonl", chosen), store=Store.open(db_url), progress=False)
    return [r["id"] for r in chosen]


@pytest.fixture
def stored_profile(embedded, db_url, shipped_two_domains):
    """A cost profile of the embedded default on this machine, measured once for both runs."""
    from tasks.steps.costs.costs import profile_costs
    from tasks.settings import load_settings

    model, tokenizer = embedded
    settings = load_settings(SMALL)
    from tasks.steps.drafters.candidates import build_drafters

    drafters = build_drafters(CANDIDATES, model, tokenizer)
    measured = profile_costs("ci-profile", model, {label: d for label, (_, d) in drafters.items()},
                             Store.open(db_url), settings=settings, k_max=3, hardware_profile="ci-cpu",
                             progress=False, tokenizer=tokenizer)
    return measured["hardware_profile"]["name"]


CANDIDATES = ["prompt_lookup:max_ngram=3:min_ngram=1", "layer_skip:num_layers=2"]
FLOAT32_SUMS = 1e-5     # the relative margin of a figure summed from float32 probabilities
# the settings of both runs: the workers' environment, and the in-process run's load_settings
RUN_SETTINGS = {**SMALL,
                "SPECDEC_VALIDATION_ROWS": "50",     # the least the settings allow (135M model, 2 cores)
                "SPECDEC_ENGINE_CHECK": "false",     # vLLM: test_vllm_serving.py and test_embedded.py
                "SPECDEC_VALIDATION_SEED": "11"}


def _worker_home(root: Path, name: str, embedded_dir: Path | None) -> Path:
    """A worker's own SPECDEC_HOME; with embedded_dir, its model cache holds the embedded default
    (linked)."""
    home = root / f"home-{name}"
    home.mkdir()
    if embedded_dir is not None:
        cache = home / "models" / "smollm2-135m-instruct"
        cache.mkdir(parents=True)
        (cache / "transformers").symlink_to(embedded_dir, target_is_directory=True)
    return home


class Cluster:
    """Airflow (api-server, dag-processor, scheduler, Celery workers) on loopback."""

    def __init__(self, root: Path, env: dict):
        self.root, self.env = root, env
        self.home = Path(env["AIRFLOW_HOME"])
        self.services: list[Service] = []
        self.api = env["AIRFLOW__API__BASE_URL"]
        self.airflow = [sys.executable, "-m", "airflow"]

    def start(self, name: str, command: list[str], **env) -> Service:
        service = Service(name, self.airflow + command, {**self.env, **env}, self.home)
        self.services.append(service)
        return service

    def stop(self, service: Service) -> None:
        service.stop()
        self.services.remove(service)

    def stop_all(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services.clear()

    def info(self) -> dict:
        return {"services": self.services, "mlflow_server": self.mlflow}


@pytest.fixture
def cluster(tmp_path, airflow_db_url, db_url, redis_url, embedded):  # noqa: F811
    embedded_dir = Path(embedded[0].config._name_or_path).resolve()
    assert (embedded_dir / "config.json").exists(), embedded_dir
    mlflow = MlflowServer(tmp_path / "mlflow")
    port = free_port()
    home = tmp_path / "airflow"
    home.mkdir()
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps({"admin": "celery-test"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "SPECDEC_"))}
    env.update(RUN_SETTINGS)
    result_backend = "db+" + airflow_db_url
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tasks.settings.worker_name",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db_url,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": airflow_db_url,
        "AIRFLOW__API_AUTH__JWT_SECRET": "celery-test-secret-" + os.urandom(8).hex(),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CELERY__BROKER_URL": redis_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": result_backend,
        "AIRFLOW_CONN_SPECDEC_DB": db_url,
        "SPECDEC_DATABASE_URL": db_url,
        "MLFLOW_TRACKING_URI": mlflow.uri,
        # test-only: small and quick on a 2-core machine
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    })
    # the CPU worker gets no model: its tasks (database, registry) must not load one
    homes = {name: _worker_home(tmp_path, name, None if name == "cpu" else embedded_dir)
             for name in ("cpu", "gpu", "local")}
    env["SPECDEC_HOME"] = str(homes["local"])
    cluster = Cluster(tmp_path, env)
    cluster.mlflow = mlflow
    cluster.homes = homes
    try:
        for command in (["db", "migrate"],
                        ["pools", "set", "specdec_timing", "1", "timing work never overlaps"]):
            done = subprocess.run(cluster.airflow + command, capture_output=True, text=True, env=env,
                                  cwd=home)
            assert done.returncode == 0, \
                f"`airflow {' '.join(command)}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        cluster.start("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(port),
                                     "--workers", "1"], SPECDEC_WORKER_NAME="api")
        cluster.start("dag-processor", ["dag-processor"], SPECDEC_WORKER_NAME="dag-processor")
        yield cluster
    finally:
        cluster.stop_all()
        mlflow.stop()


def _session(cluster: Cluster):
    import requests

    info = cluster.info()
    wait_for("the api-server's health", lambda: requests.get(
        f"{cluster.api}/api/v2/monitor/health", timeout=5).status_code == 200, 180, info)
    session = requests.Session()
    token = wait_for("a token", lambda: requests.post(
        f"{cluster.api}/auth/token", timeout=10, json={"username": "admin", "password": "celery-test"}
    ).json().get("access_token"), 60, info)
    session.headers["Authorization"] = f"Bearer {token}"
    return session


def _run(cluster: Cluster, session, conf: dict) -> tuple[str, list[dict]]:
    """Trigger a run, wait for it; (run id, its task instances)."""
    info = cluster.info()
    api = cluster.api
    response = session.post(f"{api}/api/v2/dags/{DAG_ID}/dagRuns", timeout=30,
                            json={"logical_date": None, "conf": conf})
    assert response.status_code == 200, response.text
    run_id = response.json()["dag_run_id"]

    def finished():
        state = session.get(f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", timeout=10).json()["state"]
        return state if state in ("success", "failed") else None

    state = wait_for(f"run {run_id} to finish", finished, RUN_TIMEOUT_S, info, interval_s=5)
    tis = session.get(f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances",
                      params={"limit": 100}, timeout=10).json()["task_instances"]
    if state != "success":
        states = sorted((ti["task_id"], ti["map_index"], ti["state"], ti["hostname"], ti["queue"])
                        for ti in tis)
        failed = sorted({ti["task_id"] for ti in tis if ti["state"] in ("failed", "upstream_failed")})
        pytest.fail(f"run {run_id} ended {state}; task instances (task, map index, state, host, "
                    "queue):\n" + "\n".join(map(str, states)) + "\n"
                    + task_logs(cluster.home, run_id, failed) + "\n" + service_logs(info))
    return run_id, tis


def _results(db_url: str, run_id: str) -> dict:
    """What must not depend on the executor: estimates, plans, decisions."""
    from sqlalchemy import create_engine, select

    from tasks.db.models import AcceptanceEstimate, DomainConfig

    engine = create_engine(db_url)
    with engine.connect() as connection:
        estimates = {(r.domain, r.drafter, r.k): (r.requests, r.tokens, r.acceptance_rate,
                                                  r.mean_accepted_length, r.predicted_speedup,
                                                  r.predicted_speedup_lo, r.predicted_speedup_hi)
                     for r in connection.execute(select(AcceptanceEstimate).where(
                         AcceptanceEstimate.run_id == run_id))}
        plans = {r.domain: {"enabled": r.enabled, "status": r.status, "drafter": r.drafter, "k": r.k,
                            "samples": r.samples, "mean_accepted_length": r.mean_accepted_length,
                            "k_schedule": r.k_schedule, "max_batch_size": r.max_batch_size,
                            "predicted_speedup": r.predicted_speedup,
                            "predicted_speedup_lo": r.predicted_speedup_lo,
                            "predicted_speedup_hi": r.predicted_speedup_hi,
                            "validation": r.validation, "promotable": r.promotable,
                            "measured_speedup": r.measured_speedup}
                 for r in connection.execute(select(DomainConfig).where(DomainConfig.run_id == run_id))}
    engine.dispose()
    return {"estimates": estimates, "plans": plans}


def _task_times(tis: list[dict]) -> str:
    """Each task instance's wait (queued to started) and run time (started to ended), in the order
    they started: where a run's wall time goes besides the work."""
    from datetime import datetime

    def at(value):
        return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None

    lines = ["| task | queue | state | queued -> start, s | start -> end, s |", "|---|---|---|---|---|"]
    for ti in sorted(tis, key=lambda ti: ti.get("start_date") or "~"):
        queued, start, end = at(ti.get("queued_when")), at(ti.get("start_date")), at(ti.get("end_date"))
        name = ti["task_id"] + (f"[{ti['rendered_map_index']}]" if ti["map_index"] >= 0 else "")
        wait = f"{(start - queued).total_seconds():.1f}" if queued and start else "-"
        ran = f"{(end - start).total_seconds():.1f}" if start and end else "-"
        lines.append(f"| {name} | {ti['queue']} | {ti['state']} | {wait} | {ran} |")
    return "\n".join(lines)


def _table(label: str, plans: dict) -> str:
    lines = [f"{label}:", "| domain | on | drafter | K | predicted [lo, hi] | validation | measured |",
             "|---|---|---|---|---|---|---|"]
    for domain, p in sorted(plans.items()):
        measured = "-" if p["measured_speedup"] is None else f"{p['measured_speedup']:.2f}x"
        lines.append(f"| {domain} | {p['enabled']} | {p['drafter']} | {p['k']} | "
                     f"{p['predicted_speedup']:.3f}x [{p['predicted_speedup_lo']:.3f}, "
                     f"{p['predicted_speedup_hi']:.3f}] | {p['validation']} | {measured} |")
    return "\n".join(lines)


def test_celery_workers_by_queue_then_the_same_results_as_an_in_process_run(
        cluster, db_url, stored_profile, shipped_two_domains, embedded):
    started = time.monotonic()
    session = _session(cluster)
    info = cluster.info()

    def parsed():
        return session.get(f"{cluster.api}/api/v2/dags/{DAG_ID}", timeout=10).status_code == 200

    wait_for(f"the dag-processor to parse {DAG_ID}", parsed, 300, info)
    response = session.patch(f"{cluster.api}/api/v2/dags/{DAG_ID}", json={"is_paused": False}, timeout=10)
    assert response.status_code == 200, response.text
    conf = {"target": "smollm2-135m-instruct", "domains": list(DOMAINS), "window_days": 365,
            "max_per_domain": ROWS_PER_DOMAIN, "min_per_domain": 4, "k_max": 3, "min_speedup": 0.5,
            "candidates": CANDIDATES, "hardware_profile": stored_profile, "promote": False}

    # 1. CeleryExecutor: one worker per queue, each with its own home and name
    cluster.start("scheduler", ["scheduler", "--skip-serve-logs"], SPECDEC_WORKER_NAME="scheduler")
    for name, queue in (("cpu", "default"), ("gpu", "gpu")):
        cluster.start(f"worker-{queue}", [
            "celery", "worker", "--queues", queue, "--concurrency", "1", "--skip-serve-logs",
            "--celery-hostname", f"{name}@%h"], SPECDEC_WORKER_NAME=f"{name}-worker",
            SPECDEC_HOME=str(cluster.homes[name]))
    celery_run, tis = _run(cluster, session, conf)
    celery_seconds = time.monotonic() - started
    ran = [ti for ti in tis if ti["state"] == "success"]
    per_queue: dict[str, set] = {}
    for ti in ran:
        expected = "gpu" if ti["task_id"] in GPU_TASKS else "default"
        assert ti["queue"] == expected, ti
        assert ti["hostname"] == ("gpu-worker" if expected == "gpu" else "cpu-worker"), ti
        per_queue.setdefault(f"{ti['queue']} on {ti['hostname']}", set()).add(
            ti["task_id"] + (f"[{ti['rendered_map_index']}]" if ti["map_index"] >= 0 else ""))
    # the engine check is off here ($SPECDEC_ENGINE_CHECK): its task ran on the gpu worker and
    # ended skipped, saying why (a skipped check is a state, not a success)
    skipped = {ti["task_id"]: ti for ti in tis if ti["state"] == "skipped"}
    assert skipped["engine_check"]["queue"] == "gpu", skipped["engine_check"]
    assert skipped["engine_check"]["hostname"] == "gpu-worker", skipped["engine_check"]
    assert {ti["task_id"] for ti in ran} | {"engine_check"} >= GPU_TASKS | {"sample", "check", "register",
                                                                          "report"}
    # the database and registry tasks never loaded (nor fetched) a model on the CPU worker
    assert not (cluster.homes["cpu"] / "models").exists(), sorted(cluster.homes["cpu"].rglob("*"))[:10]
    cluster.stop_all()          # the run is stored: Airflow is no longer needed

    # 2. the same run spec in this process, with the settings the workers read from their environment
    from tasks.settings import load_settings
    from tasks.steps.evaluate import evaluate

    in_process_started = time.monotonic()
    model, tokenizer = embedded
    settings = load_settings(RUN_SETTINGS, plan_min_speedup=conf["min_speedup"])
    in_process_run = evaluate(run_id="in-process", target=conf["target"], store=Store.open(db_url),
                         settings=settings, domains=conf["domains"], window=conf["window_days"],
                         candidates=conf["candidates"], hardware_profile=conf["hardware_profile"],
                         k_max=conf["k_max"], max_per_domain=conf["max_per_domain"],
                         min_per_domain=conf["min_per_domain"], model=model, tokenizer=tokenizer,
                         progress=False)["run_id"]
    in_process_seconds = time.monotonic() - in_process_started

    celery, in_process = _results(db_url, celery_run), _results(db_url, in_process_run)
    assert set(celery["plans"]) == set(DOMAINS)
    assert celery["estimates"].keys() == in_process["estimates"].keys() and celery["estimates"]
    # the same requests (the draw is the same for the same traffic): estimated in request
    # id order, so the same batches. Counts are equal; rates and speedups sum the target's float32
    # probabilities, which another process's thread count and CPU kernels add up in another order
    # (1.2e-6 relative seen): the margin allows for that, not for one token more or less accepted
    for key, values in celery["estimates"].items():
        requests, tokens, *rates = values
        assert in_process["estimates"][key][:2] == (requests, tokens), key
        assert in_process["estimates"][key][2:] == pytest.approx(rates, rel=FLOAT32_SUMS, abs=1e-9), key
    for domain, plan in celery["plans"].items():
        other = in_process["plans"][domain]
        for field in plan:
            if field == "measured_speedup":        # live timings may differ
                continue
            if isinstance(plan[field], float):
                assert other[field] == pytest.approx(plan[field], rel=FLOAT32_SUMS, abs=1e-9), (domain, field)
            else:
                assert other[field] == plan[field], (domain, field)
    report = [f"CeleryExecutor run {celery_run} ({celery_seconds:.0f} s), tasks by queue and worker:"]
    report += [f"- {where}: {', '.join(sorted(tasks))}" for where, tasks in sorted(per_queue.items())]
    report += ["", _task_times(tis), "", _table(f"CeleryExecutor run {celery_run}", celery["plans"]), "",
               _table(f"in-process run {in_process_run} ({in_process_seconds:.0f} s)", in_process["plans"])]
    print("\n" + "\n".join(report))
    if os.environ.get(REPORT_ENV):          # CI prints it after the tests (.ci/run)
        Path(os.environ[REPORT_ENV]).parent.mkdir(parents=True, exist_ok=True)
        Path(os.environ[REPORT_ENV]).write_text("\n".join(report) + "\n")
