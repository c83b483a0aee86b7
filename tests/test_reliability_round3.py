"""Reliability, round 3: no MLflow password on stdout or stderr (MLflow's own "View run" lines
included) and `--json` output that parses; concurrent imports of conflicting files that account for
every row; identifiers that become paths kept under $SPECDEC_HOME."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO
from .helpers.processes import MlflowServer

from tasks.db.store import Store

SECRET = "Pl4nted-S3cret"


def specdec(*args: str, home: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`specdec ARGS` in a new process of this worktree: exit status, stdout and stderr apart."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("MLFLOW_") and k != "SPECDEC_DATABASE_URL"}
    environ.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SPECDEC_HOME": str(home)})
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------
# 1. MLflow's "View run ... at: http://user:password@..." lines
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on loopback (sqlite backend); stopped by its process group."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.integration
def test_registering_over_http_prints_no_password(mlflow_server, tmp_path):
    from .helpers.registry import finished_run

    home = tmp_path / "home"
    uri = mlflow_server.uri.replace("http://", f"http://user:{SECRET}@")
    assert specdec("db", "upgrade", home=home).returncode == 0
    finished_run(f"sqlite:///{home / 'specdec.db'}", "run-1", {"json": {}}, target_id="Test-Org/Masked")
    done = specdec("config", "register", "run-1", "--target", "Test-Org/Masked", home=home,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "View run" not in done.stdout and "View experiment" not in done.stdout
    assert "registered" in done.stdout      # the command's own result is still printed


@pytest.mark.integration
def test_evaluate_json_promote_over_http_prints_parseable_json_and_no_password(mlflow_server, tmp_path,
                                                                                tiny_target):
    from .helpers.evaluation import SETTINGS
    from .helpers.models import save_tiny_target
    from .helpers.traffic import traffic_rows, write_jsonl

    home = tmp_path / "home"
    directory = save_tiny_target(tiny_target, tmp_path / "tiny")
    rows = [{**row, "model": str(directory)} for row in traffic_rows(tiny_target)]   # the target id
    env = {f"SPECDEC_{key.upper()}": json.dumps(list(value) if isinstance(value, tuple) else value)
           for key, value in SETTINGS.items()}
    env["MLFLOW_TRACKING_URI"] = mlflow_server.uri.replace("http://", f"http://user:{SECRET}@")
    assert specdec("db", "upgrade", home=home).returncode == 0
    assert specdec("traffic", "import", str(write_jsonl(tmp_path / "t.jsonl", rows)), "--no-progress",
                   home=home).returncode == 0
    done = specdec("evaluate", "--model", str(directory), "--device", "cpu", "--json", "--promote",
                   "--no-progress", home=home, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert SECRET not in done.stdout + done.stderr
    result = json.loads(done.stdout)        # stdout is the JSON document and nothing else
    assert result["registered"]["version"] and result["promoted"]


def test_what_reaches_the_cli_streams_has_its_credentials_masked(capsys):
    from tasks.cli.console import MaskingStream

    stdout = MaskingStream(sys.stdout)
    text = f"at: http://user:{SECRET}@127.0.0.1:5000/#/runs/1\n"
    assert stdout.write(text) == len(text)
    stdout.writelines([f"db postgresql://u:{SECRET}@db/x\n"])
    print(f"cannot reach http://a:{SECRET}@h", file=MaskingStream(sys.stderr))
    out, err = capsys.readouterr()
    assert out == "at: http://user:***@127.0.0.1:5000/#/runs/1\ndb postgresql://u:***@db/x\n"
    assert err == "cannot reach http://a:***@h\n"


# ------------------------------------------------------------------------------------------------
# 2. concurrent imports of files that carry the same ids
IMPORTERS, IDS = 4, 1200


def _import_worker(path: str, db_url: str, barrier, results) -> None:
    """One import in a process of its own (its own connections), started with the others."""
    from tasks.settings import load_settings
    from tasks.steps.traffic.traffic_import import import_traffic

    settings = load_settings({}, traffic_import_batch_size=100)     # many transactions to interleave
    barrier.wait(timeout=120)
    try:
        results.put((path, import_traffic(path, store=Store.open(db_url), settings=settings, progress=False)))
    except Exception as exc:    # the assertion names it
        results.put((path, f"{type(exc).__name__}: {exc}"))


def test_concurrent_imports_of_conflicting_files_account_for_every_row(db_url, tmp_path):
    from sqlalchemy import create_engine, func, select

    from tasks.db.models import QuarantinedRequest, TrafficRequest

    from .helpers.traffic import request_row, write_jsonl

    # every file has the same ids; an even id has the same content in every file, an odd one
    # the file's own response
    paths = [str(write_jsonl(tmp_path / f"part-{n}.jsonl", [
        request_row(i, response=f"answer {i}" if i % 2 == 0 else f"answer {i} from file {n}")
        for i in range(1, IDS + 1)])) for n in range(IMPORTERS)]
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(IMPORTERS), context.Queue()
    workers = [context.Process(target=_import_worker, args=(path, db_url, barrier, results))
               for path in paths]
    for worker in workers:
        worker.start()
    try:
        reports = dict(results.get(timeout=240) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    assert all(isinstance(report, dict) for report in reports.values()), reports

    engine = create_engine(db_url)
    with engine.connect() as connection:
        stored = connection.execute(select(TrafficRequest.id, TrafficRequest.source_file)).all()
        held = dict(connection.execute(
            select(QuarantinedRequest.source_file, func.count()).where(
                QuarantinedRequest.reason == "duplicate_id").group_by(QuarantinedRequest.source_file)).all())
    engine.dispose()
    assert len(stored) == IDS               # every id once
    for path, report in reports.items():
        # each import: every row read is inserted, skipped (same content) or quarantined
        assert report["rows_read"] == IDS
        assert report["inserted"] + report["skipped_existing"] + report["quarantined"] == IDS, report
        # ... and says what it did: its inserted rows are the stored rows from its file, its
        # quarantined rows are the entries of its file
        mine = sum(1 for _, source in stored if source.endswith(Path(path).name))
        assert report["inserted"] == mine, (path, report, mine)
        assert report["quarantined"] == report["quarantined_new"] == held.get(
            next((f for f in held if f.endswith(Path(path).name)), None), 0), (path, report, held)
    # across the imports: every id inserted once; an odd id quarantined by every other file, an
    # even id skipped by every other file
    assert sum(r["inserted"] for r in reports.values()) == IDS
    assert sum(r["quarantined"] for r in reports.values()) == (IMPORTERS - 1) * (IDS // 2)
    assert sum(r["skipped_existing"] for r in reports.values()) == (IMPORTERS - 1) * (IDS // 2)


# ------------------------------------------------------------------------------------------------
# 3. identifiers that become paths
HOSTILE = {"parent": "../..", "absolute": "/tmp/specdec-outside", "dot-dot": "..", "blank": "   ",
           "long": "r" * 10_000, "bidi": "run\u202egpj.exe", "newline": "run\n1", "empty": ""}
COMMANDS = {
    "draft train --id": ("draft", "train", "--model", "smollm2-135m-instruct", "--id"),
    "evaluate --run-id": ("evaluate", "--no-register", "--run-id"),
    "profile measure --engine vllm --run-id": ("profile", "measure", "--engine", "vllm", "--run-id"),
    "profile measure --name": ("profile", "measure", "--name"),
    "profile import --name": ("profile", "import", "costs.json", "--name"),
}


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_identifier_is_refused_with_one_line_and_creates_nothing(command, name, tmp_path,
                                                                           monkeypatch, capsys):
    from tasks.cli.app import main

    value = HOSTILE[name].replace("/tmp/", f"{tmp_path}/")
    home = tmp_path / "a" / "home"
    home.mkdir(parents=True)
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.chdir(home)
    before = _tree(tmp_path)
    assert main([*COMMANDS[command], value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    what = "draft id" if "--id" in command else "profile name" if "--name" in command else "run id"
    assert err.startswith(f"error: InvalidIdentifier: {what} ")
    assert "is not allowed: use 1 to 200 of letters, digits and _ . ~ : + -" in err
    assert len(err) < 400 and "\u202e" not in err           # truncated, control characters escaped
    assert _tree(tmp_path) == before                        # nothing created, in the home or out


@pytest.mark.integration
def test_draft_train_with_a_parent_id_exits_2_and_creates_nothing(tmp_path):
    home = tmp_path / "a" / "home"
    done = specdec("draft", "train", "--id", "../..", "--model", "smollm2-135m-instruct", home=home)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: InvalidIdentifier: draft id '../..' is not allowed: use 1 to 200 of letters, digits "
        "and _ . ~ : + -, starting with a letter, digit or _ (it names files under $SPECDEC_HOME)"]
    assert list(tmp_path.iterdir()) == []


def test_the_steps_refuse_a_hostile_identifier_before_any_work(tmp_path, monkeypatch):
    from tasks.errors import InvalidIdentifier
    from tasks.steps.drafters.draft_training import train_draft_from_traffic
    from sqlalchemy import create_engine

    from tasks.db.store import Store
    from tasks.settings import load_settings
    from tasks.steps.costs.engine_costs import profile_vllm

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    url = "postgresql+psycopg://nowhere:1/none"
    nowhere = Store(url, create_engine(url), load_settings({}))     # never connected
    for value in HOSTILE.values():
        # no database, no model: the identifier is checked first
        with pytest.raises(InvalidIdentifier, match="draft id"):
            train_draft_from_traffic(value)
        with pytest.raises(InvalidIdentifier, match="run id"):
            profile_vllm(value, "tiny", None, nowhere)
    assert not (tmp_path / "home").exists()


def test_paths_built_from_identifiers_stay_under_the_home(tmp_path, monkeypatch):
    from tasks.errors import InvalidIdentifier
    from tasks.paths import check_identifier, home_path
    from tasks.steps.drafters.draft_training import resolve_model_uri
    from tasks.serving.server import log_dir as _log_dir

    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    # a run id of ".." made the engine check's log folder $SPECDEC_HOME itself
    for run_id in ("..", "."):
        with pytest.raises(InvalidIdentifier, match="would leave its folder under"):
            _log_dir(run_id)
    assert _log_dir("scheduled__2025-11-03T00:00:00+00:00") == \
        home / "engine_checks" / "scheduled__2025-11-03T00_00_00_00_00"
    assert _log_dir("a/../..") == home / "engine_checks" / "a_.._.."
    # a registered model's version is a path component too: models:/NAME/VERSION
    with pytest.raises(InvalidIdentifier):
        resolve_model_uri("models:/draft/../../../outside")
    for parts in (("models", ".."), ("drafts", "/etc"), ("drafts", "a\\b"), ("drafts", "")):
        with pytest.raises(InvalidIdentifier):
            home_path(*parts)
    assert home_path("drafts", "d-1") == home / "drafts" / "d-1"
    for good in ("manual__2026-11-27T02:26:33", "draft__2026-11-27T02-26-33", "cpu-1t-float32",
                 "_x", "a" * 200):
        assert check_identifier(good) == good
    assert not home.exists() and list(tmp_path.iterdir()) == []
