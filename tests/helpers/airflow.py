"""Airflow runs in tests: small settings (environment) and run conf for a tiny target, and for
tests that run Airflow's services: waiting on them, and their logs and task logs when one fails."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .processes import tail

DAG_ID = "specdec_evaluate"
TINY_CONF = {"max_per_domain": 10, "min_per_domain": 5, "k_max": 3, "min_speedup": 0.01,
             "candidates": ["prompt_lookup:max_ngram=3:min_ngram=1", "layer_skip:num_layers=2"]}
SMALL = {"SPECDEC_VALIDATION_ROWS": "100", "SPECDEC_PROFILE_BATCH_SIZES": "[1, 2]",
         "SPECDEC_PROFILE_REPEATS": "1", "SPECDEC_PROFILE_CONTEXT_LEN": "32",
         "SPECDEC_LIVE_REQUESTS": "2", "SPECDEC_LIVE_MAX_NEW_TOKENS": "12",
         "SPECDEC_VALIDATION_GREEDY_CHECK_TOKENS": "8", "SPECDEC_PLAN_BOOTSTRAP_SAMPLES": "200",
         "SPECDEC_REGISTRY_REGRESSION_TOLERANCE": "0.99",   # tiny-model timings are noise
         # and so are their profiles and live speedups: the noise checks and the live veto are
         # tested on their own (test_costs_plan.py, test_confirm_veto.py)
         "SPECDEC_PROFILE_CHECKS": "false", "SPECDEC_LIVE_VETO": "false",
         "SPECDEC_ENGINE_CHECK": "false",   # vLLM: test_vllm_serving.py and test_embedded.py
         # these runs test orchestration: a run's sample (and so the validated context) follows its
         # timestamped run id, and at the default alpha = 0.01 one run in a hundred fails validation
         # by design, which would fail a test about something else (statistics: test_validation.py)
         "SPECDEC_VALIDATION_ALPHA": "0.0001"}


def service_logs(services: dict, chars: int = 3000) -> str:
    """The log tails of every service in services["services"] and of services["mlflow_server"]."""
    parts = [service.describe(chars) for service in services["services"]]
    parts.append(f"--- mlflow server, {services['mlflow_server'].log}:\n"
                 + tail(services["mlflow_server"].log, chars))
    return "\n".join(parts)


def log_lines(path: Path, lines: int = 25) -> str:
    """The last lines of a task log (JSON lines) as `time level event`, exceptions' type and value
    added (the frames left out)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        text = f"{record.get('timestamp', '')} {record.get('level', '')} {record.get('event', '')}"
        for error in record.get("error_detail") or []:
            text += f"\n    {error.get('exc_type')}: {error.get('exc_value')}"
        out.append(text)
    return "\n".join(out[-lines:])


def task_logs(home: Path, run_id: str, task_ids: list[str], dag_id: str = DAG_ID) -> str:
    """The logs of the given tasks in this run (every map index and attempt), summarised."""
    out = []
    for run_dir in (home / "logs").glob(f"dag_id={dag_id}/run_id=*"):
        if run_dir.name != f"run_id={run_id}":
            continue
        for task_id in task_ids:
            for path in sorted(run_dir.glob(f"task_id={task_id}/**/*.log")):
                out.append(f"--- task log {path.relative_to(home)}:\n{log_lines(path)}")
    return "\n".join(out)


def wait_for(what: str, check, timeout_s: float, services: dict, interval_s: float = 2.0):
    """check() until it returns something truthy; fails with every service's log tail."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        for service in services["services"]:
            if not service.alive():
                pytest.fail(f"{service.name} exited while waiting for {what}\n{service_logs(services)}")
        try:
            result = check()
        except Exception as exc:   # connection refused while starting, ...
            result, last = None, exc
        if result:
            return result
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last!r})\n"
                f"{service_logs(services)}")
