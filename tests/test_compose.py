"""The deployment files: docker-compose.yml parsed and checked (services, health checks, three
databases, LocalExecutor by default, GPU profile, celery profile with one worker per queue, no
inline secrets, serving profile), .env.example complete; `docker-compose --profile celery config`
validates the file, and `docker-compose --profile serving config` the file with the Compose override
`specdec config export --format compose` writes, where a Compose client is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LONG_RUNNING = ("postgres", "mlflow", "airflow-api-server", "airflow-scheduler",
                "airflow-dag-processor", "airflow-triggerer")
CELERY = ("redis", "airflow-worker", "airflow-worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())   # merge keys resolved


def strings(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def test_services_and_health_checks(compose):
    services = compose["services"]
    assert set(LONG_RUNNING) | {"airflow-init", "airflow-scheduler-gpu", "serving-config"} | set(CELERY) \
        == set(services)
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck")
        assert check and check["test"], f"{name} has no health check"
    for name in ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "${AIRFLOW_EXECUTOR:-LocalExecutor}"
        # no asyncpg installed: the async URL must name the psycopg driver too
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] == env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
        assert "specdec-data:/data/specdec" in services[name]["volumes"]
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "api-server" in services["airflow-api-server"]["command"]
    assert "dag-processor" in services["airflow-dag-processor"]["command"]
    assert {"postgres-data", "specdec-data"} <= set(compose["volumes"])


def test_three_databases_one_per_system(compose):
    script = (REPO / "deploy/postgres/init-databases.sh").read_text()
    assert re.findall(r"^create (\w+) (\w+)", script, re.M) == [
        ("airflow", "airflow"), ("specdec", "specdec"), ("mlflow", "mlflow")]
    env = compose["services"]["airflow-scheduler"]["environment"]
    urls = {"airflow": env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], "specdec": env["SPECDEC_DATABASE_URL"],
            "mlflow": compose["services"]["mlflow"]["command"]}
    for database, text in urls.items():
        assert re.search(rf"@postgres:5432/{database}\b", text), (database, text)
    mount = compose["services"]["postgres"]["volumes"]
    assert any("init-databases.sh:/docker-entrypoint-initdb.d/" in m for m in mount)


def test_no_inline_secrets(compose):
    for text in strings(compose):
        for user, password in re.findall(r"://([^:/@\s]+):([^@\s]+)@", text):
            assert password.startswith("${"), f"inline password for {user}: {text}"
    for service in compose["services"].values():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN", key):
                assert str(value).startswith("${") and ":?" in str(value), key
    # ${VAR} is substituted from .env; $${VAR} is a literal for the container shell
    referenced = set(re.findall(r"(?<!\$)\$\{(\w+)", (REPO / "docker-compose.yml").read_text()))
    example = dict(line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert referenced <= set(example), referenced - set(example)
    assert all(value == "change-me" for key, value in example.items() if re.search(r"PASSWORD|SECRET", key))
    assert ".env" in (REPO / ".gitignore").read_text().split()


def test_gpu_worker_is_optional_and_reserves_a_device(compose):
    gpu = compose["services"]["airflow-scheduler-gpu"]
    assert gpu["profiles"] == ["gpu"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_image_installs_torch_before_the_pinned_rest():
    dockerfile = (REPO / "Dockerfile").read_text()
    torch_at = dockerfile.index('pip install "$TORCH_SPEC"')
    assert torch_at < dockerfile.index("pip install -c /tmp/constraints.txt .")
    assert "COPY dags /opt/airflow/dags" in dockerfile


def test_celery_profile_one_worker_per_queue_the_gpu_one_with_a_device(compose):
    services = compose["services"]
    for name in CELERY:
        assert services[name]["profiles"] == ["celery"], name
        assert services[name]["healthcheck"]["test"], name
    assert "redis-cli" in " ".join(services["redis"]["healthcheck"]["test"])
    queues = {}
    for name in ("airflow-worker", "airflow-worker-gpu"):
        command = services[name]["command"]
        assert command[:3] == ["airflow", "celery", "worker"], command
        queues[name] = command[command.index("--queues") + 1]
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        env = services[name]["environment"]
        assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://redis:6379/0"
        # the result backend is the Airflow metadata database (psycopg 3 is the driver installed)
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql+psycopg://airflow:")
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"].endswith("@postgres:5432/airflow")
    assert queues == {"airflow-worker": "${SPECDEC_QUEUES_CPU:-default}",
                      "airflow-worker-gpu": "${SPECDEC_QUEUES_GPU:-gpu}"}
    # the DAGs read the same queue names (SPECDEC_*_QUEUE) as the workers serve
    env = services["airflow-scheduler"]["environment"]
    assert env["SPECDEC_QUEUES_GPU"] == "${SPECDEC_QUEUES_GPU:-gpu}"
    assert env["SPECDEC_QUEUES_CPU"] == "${SPECDEC_QUEUES_CPU:-default}"
    device = services["airflow-worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "deploy" not in services["airflow-worker"]


COMPOSE = shutil.which("docker-compose")


@pytest.mark.integration
@pytest.mark.skipif(COMPOSE is None, reason="no Compose client (Debian: apt-get install docker-compose)")
def test_compose_config_validates_with_the_celery_profile(tmp_path):
    env = tmp_path / ".env"
    env.write_text((REPO / ".env.example").read_text().replace("AIRFLOW_EXECUTOR=LocalExecutor",
                                                                "AIRFLOW_EXECUTOR=CeleryExecutor"))
    done = subprocess.run([COMPOSE, "--project-directory", str(REPO), "--env-file", str(env),
                           "--profile", "celery", "config"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = yaml.safe_load(done.stdout)["services"]
    assert {"redis", "airflow-worker", "airflow-worker-gpu", "airflow-scheduler"} <= set(resolved)
    assert resolved["airflow-scheduler"]["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert resolved["airflow-worker-gpu"]["command"][-3:] == ["gpu", "--concurrency", "1"]


def served_config():
    """A champion with two vLLM deployments (json, qa and code share the ngram method at their
    own K: one server, K per request) and a domain served without speculation."""
    from tasks.registry.config_schema import parse_config

    lookup = {"enabled": True, "drafter": {"kind": "prompt_lookup", "params": {"max_ngram": 3}},
              "k": 3, "samples": 25, "validation": "passed"}
    return parse_config({"target": {"id": "Org/Tiny", "fingerprint": "sha256:aaa"},
                         "hardware_profile": "cpu-test", "run_id": "run-1",
                         "created_at": "2025-11-01T10:00:00",
                         "domains": {"json": lookup, "qa": lookup, "code": dict(lookup, k=5),
                                     "chat": {"enabled": False}}})


def test_the_compose_export_has_one_vllm_service_per_drafter_method_labelled_with_its_version():
    from tasks.registry.compose_export import compose_export

    override = compose_export(served_config(), "specdec-config-org--tiny", "7", "vllm/vllm-openai:v0.32.0")
    services = override["services"]
    assert set(services) == {"vllm-code-json-qa", "vllm-chat"}
    for name, service in services.items():
        assert service["profiles"] == ["serving"] and service["image"] == "vllm/vllm-openai:v0.32.0"
        assert service["labels"]["io.specdec.config_version"] == "7"
        assert service["labels"]["io.specdec.metrics_port"] == "8000"
        assert service["command"][:2] == ["--model", "Org/Tiny"] and "8000" in service["command"]
    command = services["vllm-code-json-qa"]["command"]
    spec = json.loads(command[command.index("--speculative-config") + 1])
    # the server's K is its domains' largest; each domain's own K is in its plan, read by the
    # project's plugin (installed into the image's vLLM at start) from SPECDEC_VLLM_PLAN
    assert spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 2}
    plan = json.loads(services["vllm-code-json-qa"]["environment"]["SPECDEC_VLLM_PLAN"])
    assert plan == {"method": "ngram", "domains": {"code": 5, "json": 3, "qa": 3}, "default": 0}
    assert "/specdec/vllm_plugin" in services["vllm-code-json-qa"]["entrypoint"][2]
    assert command[command.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert services["vllm-code-json-qa"]["labels"]["io.specdec.domains"] == "code,json,qa"
    # no speculation: no speculative config, and vLLM refuses per-request metrics without one
    assert "--speculative-config" not in services["vllm-chat"]["command"]
    assert "--per-request-spec-decode-metrics" not in services["vllm-chat"]["command"]
    assert services["vllm-chat"]["labels"]["io.specdec.speculative"] == "off"
    assert services["vllm-chat"]["environment"] == {}
    assert len({s["ports"][0] for s in services.values()}) == 2


@pytest.mark.integration
@pytest.mark.skipif(COMPOSE is None, reason="no Compose client (Debian: apt-get install docker-compose)")
def test_compose_config_validates_the_exported_override_with_the_serving_profile(tmp_path):
    from tasks.registry.compose_export import compose_export

    env = tmp_path / ".env"
    env.write_text((REPO / ".env.example").read_text())
    override = tmp_path / "docker-compose.serving.yml"
    override.write_text(yaml.safe_dump(compose_export(
        served_config(), "specdec-config-org--tiny", "7", "vllm/vllm-openai:v0.32.0")))
    done = subprocess.run([COMPOSE, "--project-directory", str(REPO), "--env-file", str(env),
                           "-f", str(REPO / "docker-compose.yml"), "-f", str(override),
                           "--profile", "serving", "config"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = yaml.safe_load(done.stdout)
    assert {"vllm-code-json-qa", "vllm-chat", "serving-config", "airflow-scheduler"} <= set(
        resolved["services"])
    served = resolved["services"]["vllm-code-json-qa"]
    assert served["labels"]["io.specdec.config_version"] == "7"
    assert served["entrypoint"][:2] == ["sh", "-c"] and "vllm.entrypoints.openai.api_server" in served["entrypoint"][2]
    # the shell gets "$@" (the service's command as vLLM's arguments); `compose config` prints
    # Compose's escape for it, `$$`, so that its output reads back the same
    assert served["entrypoint"][2].replace("$$", "$").endswith('api_server "$@"'), served["entrypoint"][2]
    assert "SPECDEC_VLLM_PLAN" in served["environment"]
    assert "serving-models" in resolved["volumes"]
    assert resolved["services"]["serving-config"]["command"][:4] == ["config", "export", "champion",
                                                                      "--format"]
