"""What operators see, in a real browser: Debian's Chromium driven by Playwright, against the
Airflow api-server and an MLflow server on loopback, on stores made by a small run of
`specdec_evaluate` through dag.test() (tiny target; one domain short of samples, so it is off).

It submits the trigger form with its defaults and sees a queued run, opens a mapped task's log and
sees its lines, sees mapped tasks labelled by domain, and opens the registered version's page to
find the per-domain reasons, the gates and the current-champion line. Screenshots go to
$SPECDEC_SCREENSHOTS (default: screenshots/ in the repository); their names are printed.

Skipped where Chromium or Playwright is missing, unless SPECDEC_REQUIRE_BROWSER=1 (CI sets it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from .helpers import REPO
from .helpers.airflow import SMALL, TINY_CONF
from .helpers.models import save_tiny_target, tiny_llama
from .helpers.processes import LoopbackServer, free_port
from .helpers.traffic import traffic_rows, write_jsonl

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("SPECDEC_REQUIRE_BROWSER") == "1"
try:
    import playwright.sync_api  # noqa: F401
    HAVE_PLAYWRIGHT = True
except ImportError:
    HAVE_PLAYWRIGHT = False
if REQUIRED and not (CHROMIUM and HAVE_PLAYWRIGHT):
    raise RuntimeError("SPECDEC_REQUIRE_BROWSER=1 but Chromium or Playwright is missing: install "
                       "Debian's chromium and the test extra (pip install -e '.[test]')")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (CHROMIUM and HAVE_PLAYWRIGHT),
                       reason="no Chromium or Playwright here (CI installs both and sets "
                              "SPECDEC_REQUIRE_BROWSER=1)"),
]

BIN = Path(sys.executable).parent
SHOTS = Path(os.environ.get("SPECDEC_SCREENSHOTS", REPO / "screenshots"))


@pytest.fixture(scope="module")
def stores(airflow_env, dagbag, tmp_path_factory):
    """A finished specdec_evaluate run (promoted) on a tiny target, its task logs written."""
    from specdec_core import load_model
    from tasks.steps import context
    from tasks.orchestration.airflow_logs import recording, write_task_logs
    from tasks.db import upgrade
    from tasks.steps.traffic_import import import_traffic

    base = tmp_path_factory.mktemp("ui-stores")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**SMALL, "SPECDEC_DATABASE_URL": f"sqlite:///{base / 'specdec.db'}",
                           "MLFLOW_TRACKING_URI": f"sqlite:///{base / 'mlflow.db'}",
                           "SPECDEC_HOME": str(base)}.items():
            patch.setenv(key, value)
        upgrade()
        model_dir = save_tiny_target(tiny_llama(seed=0), base / "tiny-target")
        model, _ = load_model(str(model_dir), device="cpu")
        rows = traffic_rows(model, foreign=0)
        rows += [dict(row, id=row["id"].replace("qa", "code"), domain="code")    # 3 < min_per_domain
                 for row in rows if row["domain"] == "qa"][:3]
        import_traffic(write_jsonl(base / "traffic.jsonl", rows), progress=False)
        context._MODELS.clear()
        with recording() as recorder:
            run = dagbag.get_dag("specdec_evaluate").test(
                run_conf={**TINY_CONF, "target": str(model_dir), "promote": True})
        assert run.state == "success"
        write_task_logs(run, recorder, Path(airflow_env["AIRFLOW_HOME"]) / "logs")
        yield {"base": base, "run_id": run.run_id, "target": str(model_dir)}


@pytest.fixture(scope="module")
def servers(stores, airflow_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(airflow_env)
    env.update({"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True"})   # no login page
    airflow_port, mlflow_port = free_port(), free_port()
    env["AIRFLOW__API__BASE_URL"] = f"http://127.0.0.1:{airflow_port}"
    airflow = LoopbackServer(
        "airflow api-server", [str(BIN / "airflow"), "api-server", "-H", "127.0.0.1", "-p",
                               str(airflow_port), "-w", "1"],
        f"http://127.0.0.1:{airflow_port}/api/v2/version", env, stores["base"] / "api-server.log")
    mlflow_env = {k: v for k, v in env.items() if not k.startswith("AIRFLOW")}
    mlflow_env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    try:
        mlflow = LoopbackServer(
            "mlflow ui", [str(BIN / "mlflow"), "server", "--backend-store-uri",
                          f"sqlite:///{stores['base'] / 'mlflow.db'}", "--host", "127.0.0.1",
                          "--port", str(mlflow_port), "--workers", "1"],
            f"http://127.0.0.1:{mlflow_port}/health", mlflow_env, stores["base"] / "mlflow.log")
    except BaseException:
        airflow.stop()
        raise
    yield {"airflow": f"http://127.0.0.1:{airflow_port}", "mlflow": f"http://127.0.0.1:{mlflow_port}"}
    airflow.stop()
    mlflow.stop()


@pytest.fixture(scope="module")
def page(servers):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.set_default_timeout(60_000)
        yield tab
        browser.close()


def shot(page, name: str) -> Path:
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def test_trigger_form_submits_its_defaults_and_queues_a_run(page, servers):
    page.goto(f"{servers['airflow']}/dags/specdec_evaluate", wait_until="networkidle")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Hardware profile").wait_for()
    dialog.get_by_role("button", name="Trigger").click()       # every field as the form fills it
    page.get_by_text("Dag Run Triggered").first.wait_for()
    page.get_by_text("Queued").first.wait_for()
    shot(page, "1-trigger-form-submitted")
    page.goto(f"{servers['airflow']}/dags/specdec_evaluate/runs", wait_until="networkidle")
    page.get_by_text("Queued").first.wait_for()                # the new run waits for a scheduler


def test_a_mapped_task_is_labelled_by_domain_and_its_log_has_lines(page, servers, stores):
    run = urllib.parse.quote(stores["run_id"], safe="")
    base = f"{servers['airflow']}/dags/specdec_evaluate/runs/{run}/tasks/per_domain.estimate"
    page.goto(f"{base}/mapped", wait_until="networkidle")
    for domain in ("json", "qa"):
        page.get_by_text(domain, exact=True).first.wait_for()   # Map Index column: the domain
    shot(page, "2-mapped-tasks-by-domain")
    page.goto(f"{base}/mapped/0", wait_until="networkidle")
    page.get_by_text("per_domain.estimate [json]").first.wait_for()
    page.get_by_text("[DAG TEST] starting task_id=per_domain.estimate map_index=0").wait_for()
    page.get_by_text("domain json: on: ").first.wait_for()      # the planner's own line
    shot(page, "3-mapped-task-log")


def test_the_version_page_gives_reasons_gates_and_the_champion(page, servers, stores):
    from tasks.registry.config_schema import config_model_name

    name = config_model_name(stores["target"])
    page.goto(f"{servers['mlflow']}/#/models/{name}/versions/1", wait_until="load")
    page.get_by_text("Current champion: version 1").first.wait_for()
    close = page.get_by_role("button", name="Close")           # MLflow's assistant panel: more room
    if close.count():
        close.first.click()
    page.get_by_text("code (off): insufficient samples").first.wait_for()       # why code is off
    page.get_by_text("json (on): on: ").first.wait_for()      # why json is on
    body = " ".join(page.inner_text("body").split())
    assert "Gates (specdec config promote against champion none" in body
    assert "validation pass" in body and "no_regression pass" in body
    shot(page, "4-version-page")
    # the experiment opens in the runs view, and the run ended FINISHED
    page.goto(f"{servers['mlflow']}/#/experiments", wait_until="load")
    page.get_by_text("specdec/").first.wait_for()
    shot(page, "5-experiments")
    with urllib.request.urlopen(f"{servers['mlflow']}/api/2.0/mlflow/experiments/search?max_results=50") as r:
        experiments = json.load(r)["experiments"]
    ours = [e for e in experiments if e["name"].startswith("specdec/")]
    assert ours and all({"key": "mlflow.experimentKind", "value": "custom_model_development"}
                        in e.get("tags", []) for e in ours)
