"""Shared fixtures: tiny random transformers models (built here, no downloads) and, for slow tests,
the embedded default. Models are session-scoped: build once, share across tests.

Database tests take the `db_url` fixture: every such test runs twice, on SQLite (a file in the
test's tmp_path) and on PostgreSQL (a fresh schema per test in the server named by
$SPECDEC_TEST_POSTGRES_URL, dropped afterwards). The PostgreSQL variant is skipped only when that
variable is unset; CI always sets it (.ci/run starts a server on loopback). The schema is migrated
once per session and backend and copied for each test (helpers.db.MigratedTemplates); tests of
migrating take `empty_db_url` and run the migrations themselves.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tasks.cli.main_job import airflow_environment

from .helpers import REPO
from .helpers.db import POSTGRES_ENV, MigratedTemplates, postgres_schema
from .helpers.metrics import Exposition
from .helpers.models import SPREAD_VOCAB, save_tiny_target, tiny_llama
from .helpers.ordering import longest_first, recorded_seconds
from .helpers.traffic import request_row, traffic_rows, write_jsonl
from .helpers.workers import allowed_cores, worker_environment

# The sampling test's streams come from this seed, not from run ids that carry the wall clock
# (DAG runs): a correct run fails that test by chance at rate alpha, which must not make CI flaky.
os.environ.setdefault("SPECDEC_VALIDATION_SEED", "11")

# pytest-xdist (`make test`): the machine's cores shared between the workers, as torch's threads
# here and, through the environment, in the processes the tests start (helpers/workers.py); a
# variable the caller set is kept
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))
    for _name, _value in worker_environment(_WORKERS, os.environ.get("PYTEST_XDIST_WORKER"),
                                            allowed_cores(), torch.get_num_threads()).items():
        os.environ.setdefault(_name, _value)


# Airflow's home for this test process, named before anything imports Airflow: Airflow reads its
# home and metadata database once, at its first import, so a test that reaches airflow.sdk
# in-process before the airflow_env fixture ran (the DAG glue's error mapping, connections,
# Variables) would otherwise point the whole process at ~/airflow/airflow.db -- created there,
# never migrated -- and every later DagBag in the process would fail ("no such table: dag").
# Migrated only when a test asks for airflow_env; removed when the session ends.
# DAGs unpaused here, as in production (the main job's demo home creates them paused): an
# evaluation's asset event queues specdec_reports
_AIRFLOW_ENV = {**airflow_environment(Path(tempfile.mkdtemp(prefix="airflow-home-")), REPO / "dags"),
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False"}
os.environ.update(_AIRFLOW_ENV)


def pytest_unconfigure(config):
    shutil.rmtree(Path(_AIRFLOW_ENV["AIRFLOW_HOME"]).parent, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, test files in the order of their recorded seconds, longest first
    (tests/file_seconds.json, written by scripts/test_durations.py; a file not listed comes after
    every listed one), and their tests in their own order. `make test` hands whole files to its
    workers in collection order (`--dist loadfile --no-loadscope-reorder`), so the long files start
    first and the short ones fill the gaps: by default xdist orders files by their number of tests,
    and a long file of few tests (one server-backed end-to-end run) started last, with the other
    worker idle. One process keeps pytest's own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    seconds = recorded_seconds()
    items.sort(key=lambda item: longest_first(item.path, seconds))  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft():
    """A smaller, unrelated model with the target's vocabulary (partial acceptance)."""
    return tiny_llama(hidden=32, layers=2, heads=2, seed=1)


@pytest.fixture(scope="session")
def spread_target():
    """A tiny target whose next-token distributions are spread over several tokens (power needs
    more than one likely token)."""
    return tiny_llama(vocab=SPREAD_VOCAB, hidden=32, layers=2, heads=2, seed=31, initializer_range=0.3)


@pytest.fixture(scope="session")
def spread_draft(spread_target):
    """A perturbed copy of the target: q close to p but not equal, so drafts are often accepted
    (bonus tokens occur) and often corrected (residual draws occur)."""
    draft = copy.deepcopy(spread_target)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std())
    return draft


@pytest.fixture(scope="module")
def tiny_target():
    """The target fixture's model, built per module (evaluations load it into their own model
    cache)."""
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded default, fetched into $SPECDEC_HOME/models once."""
    from specdec_core import load_model

    return load_model("smollm2-135m-instruct", device="cpu")


# --- database fixtures ----------------------------------------------------------------------
@pytest.fixture(params=[
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.skipif(
        not os.environ.get(POSTGRES_ENV),
        reason=f"{POSTGRES_ENV} is not set: no PostgreSQL server configured (CI always sets it)")),
])
def db_backend(request) -> str:
    return request.param


@pytest.fixture
def empty_db_url(db_backend, tmp_path, monkeypatch):
    """A URL of an empty database (no schema yet) on the backend under test."""
    from tasks.db import dispose_engines

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_DATABASE_URL", raising=False)
    if db_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'specdec.db'}"
        dispose_engines()
        return
    with postgres_schema("t", before_drop=dispose_engines) as url:
        yield url


@pytest.fixture(scope="session")
def migrated_templates(tmp_path_factory):
    """specdec's schema migrated once per backend in this session (in this worker, under
    pytest-xdist), copied by `db_url` for each test."""
    templates = MigratedTemplates(tmp_path_factory.mktemp("db-template"))
    yield templates
    templates.close()


@pytest.fixture
def db_url(db_backend, tmp_path, monkeypatch, migrated_templates):
    """A migrated (empty) specdec database on the backend under test: a copy of the session's
    migrated template (a file in tmp_path, or a fresh PostgreSQL schema dropped afterwards)."""
    from tasks.db import dispose_engines

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_DATABASE_URL", raising=False)
    if db_backend == "sqlite":
        yield migrated_templates.sqlite_copy(tmp_path / "specdec.db")
        dispose_engines()
        return
    with migrated_templates.postgres_copy(before_drop=dispose_engines) as url:
        yield url


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """One MLflow SQLite store with its schema created, once per session (MLflow migrates a new
    store itself, which takes seconds): `mlflow_uri` copies it for each test."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    uri = f"sqlite:///{path}"
    template = MlflowClient(tracking_uri=uri, registry_uri=uri)
    template.search_experiments()
    template.search_registered_models()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, mlflow_template) -> str:
    """The URI of a fresh local MLflow store of this test (tmp_path/mlflow.db, a copy of the
    session's template)."""
    path = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def tiny_db(db_url, tmp_path, tiny_target):
    """db_url with tiny_target's own traffic imported (json and qa, 10 each, and 2 foreign qa)."""
    from tasks.db.store import Store
    from tasks.steps.traffic.traffic_import import import_traffic

    import_traffic(write_jsonl(tmp_path / "tiny.jsonl", traffic_rows(tiny_target)), store=Store.open(db_url),
                   progress=False)
    return db_url


@pytest.fixture
def airflow_db_url():
    """A fresh schema for Airflow's metadata in the PostgreSQL server (dropped afterwards, once
    every service is stopped)."""
    with postgres_schema("af") as url:
        yield url


# ------------------------------------------------------------------------------------------------
# traffic rows
@pytest.fixture
def make_request():
    return request_row


@pytest.fixture
def jsonl_file(tmp_path):
    """jsonl_file(rows, name="traffic.jsonl", compress=False) -> Path"""
    def write(rows, name: str = "traffic.jsonl", compress: bool = False) -> Path:
        return write_jsonl(tmp_path / name, rows, compress=compress)
    return write


# ------------------------------------------------------------------------------------------------
# Airflow (the DAG tests and the browser test share one metadata database per session)
@pytest.fixture(scope="session")
def airflow_env():
    """An Airflow home with a migrated SQLite metadata database and the timing pool; the DAG
    folder is the repository's dags/. Its environment is this process's from the start
    (_AIRFLOW_ENV), as Airflow reads its home and database once, when first imported."""
    from tasks.cli.main_job import prepare_airflow

    prepare_airflow(_AIRFLOW_ENV)   # the main job's own setup: migrate, the one-slot timing pool
    return _AIRFLOW_ENV


@pytest.fixture(scope="session")
def dagbag(airflow_env):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


# ------------------------------------------------------------------------------------------------
# one line at the end: what this machine skipped and why, and how to run it all (`make test-all`
# sets up what .ci/run sets up), printed last, after -ra's short summary and before the counts
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import re
    from collections import Counter

    result = yield
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return result
    reasons, files = Counter(), {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = re.sub(r"^Skipped: ", "", reason)
        why = reason.split(":")[0].split(" (")[0].split(";")[0][:60]
        reasons[why] += 1
        files.setdefault(why, set()).add(report.nodeid.split("::")[0].removeprefix("tests/"))
    summary = ", ".join(
        f"{count} {why} ({', '.join(sorted(files[why])[:3])}{', ...' if len(files[why]) > 3 else ''})"
        for why, count in reasons.most_common())
    cuda = any("CUDA" in why for why in reasons)
    if all("CUDA" in why for why in reasons):
        how = "they need a CUDA GPU (docs/operations.md: Installing on a CUDA machine)"
    else:
        how = ("run `make test-all` to set up PostgreSQL, Chromium, Redis and the serving environment "
               "as CI does and run them all" + (" (the CUDA ones need a GPU)" if cuda else ""))
    terminalreporter.write_line(f"skipped {len(skipped)} here: {summary}; {how}")
    return result


@pytest.fixture
def tiny_store(db_url, tmp_path, monkeypatch, mlflow_uri):
    """A tiny target saved as a model directory, its traffic imported, a fresh MLflow store
    (draft training and the run context's tests)."""
    from specdec_core import load_model
    from tasks.db.store import Store
    from tasks.steps.traffic.traffic_import import import_traffic

    model_dir = save_tiny_target(tiny_llama(seed=0), tmp_path / "tiny-target")
    model, tokenizer = load_model(str(model_dir), device="cpu")
    rows = traffic_rows(model, per_domain=16, foreign=0)
    import_traffic(write_jsonl(tmp_path / "traffic.jsonl", rows), store=Store.open(db_url), progress=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    from tasks.steps import context
    context._MODELS.clear()
    return {"db_url": db_url, "target": str(model_dir), "model": model, "tokenizer": tokenizer}


@pytest.fixture
def metrics_server():
    """A loopback HTTP server answering GET /metrics with what the test sets (helpers.monitor)."""
    server = Exposition()
    yield server
    server.close()
