"""The champion's vLLM deployments as Docker Compose services (`specdec config export --format
compose`): one service per deployment (one per drafter method, K per request by each domain's
plan, as tasks.registry.vllm_export groups them), named by its domains, in the `serving` profile.

Each service runs vLLM's OpenAI server from the vLLM image (the setting `engine_serving_image`) on port
8000 inside the Compose network (its /metrics there too: the monitor DAG scrapes
http://SERVICE:8000), serves the target (the model directory or id given), takes the domain
group's speculative config with per-request spec-decode metrics on (each response then carries
`metrics.speculative_decoding`), and is labelled with the registered model and config version it
serves, so a gateway can log the version beside each response.
"""

from __future__ import annotations

import hashlib
import json
import re

from .config_schema import SpecdecConfig
from .vllm_export import PLAN_VARIABLE, vllm_export

SERVING_PROFILE = "serving"
SERVER_PORT = 8000            # the OpenAI API and /metrics inside the Compose network
LABEL_PREFIX = "io.specdec."
MODELS_VOLUME = "serving-models"
PLUGIN_SOURCE = "./tasks/serving/vllm_plugin"      # the project's plugin, beside the compose file
PLUGIN_MOUNT = "/specdec/vllm_plugin"
# the image's vLLM gets the project's plugin (K per request by the plan, the CPU mends) before it
# starts: installed from a copy (a build writes into its source folder, mounted read-only). `$$`
# is Compose's escape for a literal `$` (the shell's "$@": the service's command as arguments)
START = (f"cp -r {PLUGIN_MOUNT} /tmp/specdec-plugin && python3 -m pip install --quiet --no-deps "
         "--no-build-isolation /tmp/specdec-plugin && exec python3 -m vllm.entrypoints.openai.api_server \"$$@\"")


NAME_LIMIT = 63               # a DNS label: Compose service names are host names in the network
_PLAIN_DOMAIN = re.compile(r"[a-z0-9]+")


def deployment_name(domains: list[str]) -> str:
    """A deployment's name (and Compose service name): `vllm-` and its domains joined by dashes,
    DNS-safe (lower-case letters, digits and dashes, at most 63 characters). Where that would
    not name the domains exactly (a domain with other characters than a-z and 0-9, `a_b` and
    `a-b` alike, a non-ASCII one, or a name cut at 63 characters), a hash of the domains is
    appended, so no two deployments share a name."""
    ordered = sorted(domains)
    plain = "vllm-" + "-".join(ordered)
    if all(_PLAIN_DOMAIN.fullmatch(domain) for domain in ordered) and len(plain) <= NAME_LIMIT:
        return plain
    digest = hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode("utf-8")).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9]+", "-", "-".join(ordered).lower()).strip("-")
    head = ("vllm-" + slug)[:NAME_LIMIT - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}"


def deployments(config: SpecdecConfig, target_path: str | None = None) -> list[dict]:
    """vllm_export's deployments, each with its `name`."""
    return [dict(d, name=deployment_name(d["domains"]))
            for d in vllm_export(config, target_path=target_path)["deployments"]]


def service(deployment: dict, model: str, image: str, config_name: str, version: str,
            host_port: int) -> dict:
    """One Compose service of a deployment (see the module's docstring)."""
    spec = deployment["speculative_config"]
    command = ["--model", model, "--host", "0.0.0.0", "--port", str(SERVER_PORT)]
    environment = {}
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec, sort_keys=True, separators=(",", ":")),
                    "--per-request-spec-decode-metrics", "summary"]
    if deployment.get("plan") is not None:
        # each request's K by its domain (vllm_xargs specdec_domain), read by the plugin at start
        environment[PLAN_VARIABLE] = json.dumps(deployment["plan"], sort_keys=True, separators=(",", ":"))
    return {
        "image": image,
        "profiles": [SERVING_PROFILE],
        "restart": "unless-stopped",
        "entrypoint": ["sh", "-c", START, "vllm-openai"],
        "command": command,
        "environment": environment,
        "ports": [f"127.0.0.1:{host_port}:{SERVER_PORT}"],
        "volumes": [f"{MODELS_VOLUME}:/root/.cache/huggingface", f"{PLUGIN_SOURCE}:{PLUGIN_MOUNT}:ro"],
        "labels": {LABEL_PREFIX + "config_name": config_name,
                   LABEL_PREFIX + "config_version": str(version),
                   LABEL_PREFIX + "domains": ",".join(deployment["domains"]),
                   LABEL_PREFIX + "speculative": "off" if spec is None else spec.get("method", "on"),
                   LABEL_PREFIX + "metrics_port": str(SERVER_PORT),
                   LABEL_PREFIX + "metrics_path": "/metrics"},
        "healthcheck": {"test": ["CMD", "python3", "-c", "import urllib.request; urllib.request."
                                 f"urlopen('http://localhost:{SERVER_PORT}/health', timeout=5)"],
                        "interval": "15s", "timeout": "10s", "retries": 40, "start_period": "120s"},
    }


def compose_export(config: SpecdecConfig, config_name: str, version: str, image: str,
                   target_path: str | None = None, first_host_port: int = 8100) -> dict:
    """The Compose override: {services: one per deployment, volumes: the model cache}; host ports
    first_host_port, +1, ... on loopback (the monitor scrapes inside the network)."""
    model = target_path or config.target.id
    services = {d["name"]: service(d, model, image, config_name, version, first_host_port + i)
                for i, d in enumerate(deployments(config, target_path))}
    return {"services": services, "volumes": {MODELS_VOLUME: {}}}
