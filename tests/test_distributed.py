"""Running on distributed workers without a shared disk: the DAGs' queues, Data Docs that reach
MLflow from the database, a draft registered from what the training worker uploaded, and confirm
refusing live timings from another hardware class than the run's cost profile."""

from __future__ import annotations

import logging
import shutil

import pytest
from sqlalchemy import create_engine, select, update

from tasks.db.models import EvalRun, HardwareProfile, LiveMeasurement
from tasks.db.store import Store
from tasks.registry.registry import Registry

from .helpers.evaluation import run
from .helpers.models import save_tiny_target, tiny_llama
from .helpers.traffic import traffic_rows, write_jsonl

GPU_TASKS = {"specdec_evaluate": {"profile", "estimate", "confirm",
                                  "validate", "finish", "engine_check"},
             "specdec_retrain_draft": {"generate", "train"},   # generate: the target answers prompts
             "specdec_reports": set()}


@pytest.mark.integration       # dagbag: `airflow db migrate` in a process
def test_tasks_that_run_the_model_take_the_gpu_queue_the_others_the_default(dagbag):
    for dag_id, gpu in GPU_TASKS.items():
        dag = dagbag.get_dag(dag_id)
        queues = {task.task_id: task.queue for task in dag.tasks}
        assert {t for t, q in queues.items() if q == "gpu"} == gpu, (dag_id, queues)
        assert {q for t, q in queues.items() if t not in gpu} == {"default"}, (dag_id, queues)
    # timing work is excluded by the pool, which spans every worker
    evaluate = dagbag.get_dag("specdec_evaluate")
    assert {t.task_id for t in evaluate.tasks if t.pool == "specdec_timing"} == {
        "profile", "confirm"}


def test_queue_names_come_from_the_settings(monkeypatch):
    from tasks.orchestration.airflow_glue import queues
    from tasks.errors import SettingsError

    assert queues() == ("default", "gpu")
    monkeypatch.setenv("SPECDEC_QUEUES_GPU", "h100")
    monkeypatch.setenv("SPECDEC_QUEUES_CPU", "db")
    assert queues() == ("db", "h100")
    monkeypatch.setenv("SPECDEC_QUEUES_GPU", "")
    with pytest.raises(SettingsError, match="queues_gpu"):
        queues()


def test_worker_name_is_the_variable_else_the_host(monkeypatch):
    import socket

    from tasks.settings import worker_name

    monkeypatch.delenv("SPECDEC_WORKER_NAME", raising=False)
    assert worker_name() == socket.getfqdn()
    monkeypatch.setenv("SPECDEC_WORKER_NAME", "gpu-worker-3")
    assert worker_name() == "gpu-worker-3"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_target):
    """One evaluation of the tiny target (SQLite), on 'worker A' (its own SPECDEC_HOME)."""
    from tasks.db import upgrade
    from tasks.steps.traffic.traffic_import import import_traffic

    root = tmp_path_factory.mktemp("distributed")
    url = f"sqlite:///{root / 'specdec.db'}"
    upgrade(url)
    import_traffic(write_jsonl(root / "traffic.jsonl", traffic_rows(tiny_target)), store=Store.open(url),
                   progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_HOME", str(root / "worker-a"))
        patch.setenv("SPECDEC_WORKER_NAME", "worker-a")
        run(url, tiny_target, "dist", plan_min_speedup=0.01)
    return {"url": url, "root": root}


def test_data_docs_reach_mlflow_from_a_worker_without_the_checks_disk(evaluated, monkeypatch):
    from tasks.db.store import Store
    from tasks.registry.run_results import data_docs_pages
    from tasks.registry.registration import register_config
    from tasks.registry.tracking import client

    pages = data_docs_pages("dist", Store.open(evaluated["url"]))
    assert "traffic_sample-table.html" in pages and any(p.startswith("results_") for p in pages)
    assert all("<html" in html.lower() for html in pages.values())
    # the registration runs on "worker B": an empty home, no file of worker A
    monkeypatch.setenv("SPECDEC_HOME", str(evaluated["root"] / "worker-b"))
    uri = f"sqlite:///{evaluated['root'] / 'mlflow.db'}"
    store = Store.open(evaluated["url"])
    registered = register_config("dist", store, registry=Registry.open(uri, store))
    mlflow_client = client(uri)
    run_id = mlflow_client.get_model_version(registered["name"], registered["version"]).run_id
    logged = {a.path for a in mlflow_client.list_artifacts(run_id, "reports/data_docs")}
    assert logged == {f"reports/data_docs/{page}" for page in pages}
    assert "reports/data_quality.html" in {a.path for a in mlflow_client.list_artifacts(run_id, "reports")}
    assert not (evaluated["root"] / "worker-b" / "reports").exists()


def test_profile_task_records_its_worker_and_confirm_stores_the_hardware(evaluated):
    engine = create_engine(evaluated["url"])
    with engine.connect() as connection:
        worker = connection.execute(select(EvalRun.worker_hardware).where(EvalRun.run_id == "dist")).scalar()
        live = connection.execute(select(LiveMeasurement.domain, LiveMeasurement.hardware).where(
            LiveMeasurement.run_id == "dist")).all()
    engine.dispose()
    assert worker["worker"] == "worker-a" and worker["measured"] is True
    assert worker["device"].startswith("cpu") and worker["dtype"] == "float32"
    assert {domain for domain, _ in live} == {"json", "qa"}
    for _, hardware in live:
        assert (hardware["device"], hardware["dtype"], hardware["worker"]) == (
            worker["device"], worker["dtype"], "worker-a")


def _set_run_hardware(url: str, **values) -> None:
    engine = create_engine(url)
    with engine.begin() as connection:
        worker = dict(connection.execute(select(EvalRun.worker_hardware).where(
            EvalRun.run_id == "dist")).scalar())
        worker.update(values)
        connection.execute(update(EvalRun).where(EvalRun.run_id == "dist").values(worker_hardware=worker))
    engine.dispose()


def test_confirm_refuses_live_timings_from_another_hardware_class(evaluated, tiny_target, caplog):  # noqa: F811
    from tasks.steps.checks.confirm import confirm_hardware
    from tasks.steps.costs.costs import HardwareMismatch
    from tasks.db.store import Store

    url = evaluated["url"]
    store = Store.open(url)
    engine = store.engine
    here = confirm_hardware("dist", "json", store, tiny_target)
    assert here["device"].startswith("cpu")
    original = create_engine(url).connect().execute(select(EvalRun.worker_hardware).where(
        EvalRun.run_id == "dist")).scalar()
    try:
        # the run measured its costs on an H100 worker; this confirm is on the CPU: refused
        _set_run_hardware(url, device="NVIDIA H100 80GB HBM3", dtype="bfloat16", worker="gpu-7")
        with pytest.raises(HardwareMismatch) as error:
            confirm_hardware("dist", "json", store, tiny_target)
        message = str(error.value)
        assert "NVIDIA H100 80GB HBM3 bfloat16 on worker gpu-7" in message
        assert f"{here['device']} float32" in message and "queues_gpu" in message
        # a stored profile plans for its hardware from anywhere: confirm elsewhere is skipped
        _set_run_hardware(url, measured=False)
        with engine.begin() as connection:
            name = connection.execute(select(EvalRun.hardware_profile).where(
                EvalRun.run_id == "dist")).scalar()
            stored = connection.execute(select(HardwareProfile.device, HardwareProfile.dtype).where(
                HardwareProfile.name == name)).one()
            connection.execute(update(HardwareProfile).where(HardwareProfile.name == name).values(
                device="NVIDIA H100 80GB HBM3", dtype="bfloat16"))
        try:
            with caplog.at_level(logging.WARNING, logger="tasks.steps.checks.confirm"):
                assert confirm_hardware("dist", "json", store, tiny_target) is None
            assert "confirm skipped" in caplog.text and "NVIDIA H100" in caplog.text
        finally:
            with engine.begin() as connection:
                connection.execute(update(HardwareProfile).where(HardwareProfile.name == name).values(
                    device=stored.device, dtype=stored.dtype))
    finally:
        engine_restore = create_engine(url)
        with engine_restore.begin() as connection:
            connection.execute(update(EvalRun).where(EvalRun.run_id == "dist").values(
                worker_hardware=original))
        engine_restore.dispose()


def test_a_draft_is_registered_from_what_the_training_worker_uploaded(db_url, tmp_path, monkeypatch,
                                                                      mlflow_uri):
    """log_draft uploads on the training worker; the checkpoint is then gone (another machine),
    and register_logged_draft still registers it; another worker downloads it by its URI."""
    from specdec_core import load_model
    from specdec_core.train import TrainConfig
    from tasks.steps.drafters.draft_recipes import DraftModelRecipe
    from tasks.steps.drafters.draft_training import (log_draft, register_logged_draft, resolve_model_uri,
                                                     train_draft_from_traffic)
    from tasks.steps.traffic.traffic_import import import_traffic

    model_dir = save_tiny_target(tiny_llama(seed=0), tmp_path / "tiny-target")
    model, _ = load_model(str(model_dir), device="cpu")
    import_traffic(write_jsonl(tmp_path / "traffic.jsonl", traffic_rows(model, per_domain=6, foreign=0)),
                   store=Store.open(db_url), progress=False)
    tracking = mlflow_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "trainer"))
    recipe = DraftModelRecipe(num_layers=1, config=TrainConfig(steps=2, batch_size=2, eval_every=2))
    trained = train_draft_from_traffic("dist-draft", recipe, target=str(model_dir), store=Store.open(db_url),
                                       register=False, progress=False)
    logged = log_draft(trained["train_id"], str(model_dir), trained["fingerprint"], trained["best_dir"],
                       trained["result"], store=Store.open(db_url))
    # the training worker's checkpoints are not shared (with a SQLite tracking store the artifact
    # store stays under that home: it stands for the tracking server's)
    shutil.rmtree(tmp_path / "trainer" / "drafts")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "registrar"))
    registered = register_logged_draft(trained["train_id"], str(model_dir), trained["fingerprint"], logged,
                                       trained["result"], store=Store.open(db_url))
    again = register_logged_draft(trained["train_id"], str(model_dir), trained["fingerprint"], logged,
                                  trained["result"], store=Store.open(db_url))
    assert again["version"] == registered["version"]          # a retried task reuses the version
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "evaluator"))
    local = resolve_model_uri(registered["model_uri"], Registry.open(tracking))
    assert local.startswith(str(tmp_path / "evaluator")) and (tmp_path / "evaluator").exists()
    assert sorted(p.name for p in (tmp_path / "evaluator").rglob("*.safetensors"))
