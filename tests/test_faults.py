"""Fault injection (issue 53, reliability round 3): what a killed, starved, skewed or hostile input
does to a run, each case a real fault on real components, and each asserting the behaviour the
issue asks for:

- a process killed during the estimate (SIGTERM, kill -9) and during an import;
- concurrent conflicting imports on SQLite and PostgreSQL (every row read is stored or
  quarantined, and the reports say so);
- a full disk (a small tmpfs, mounted in a private mount namespace where the machine allows it);
- an over-long request, a `--model` that is not a model, an unreachable HF id;
- rows stamped in the future, a promotion racing a rollback, hostile run ids.

Sized for CI: tiny targets, one evaluation process per case at most.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, text

from .helpers import REPO
from .helpers.evaluation import SETTINGS
from .helpers.processes import free_port, specdec
from .helpers.traffic import request_row, traffic_rows, write_jsonl

from tasks.db.store import Store

pytestmark = pytest.mark.integration

EVAL_ENV = {f"SPECDEC_{key.upper()}": json.dumps(list(value) if isinstance(value, tuple) else value)
            for key, value in SETTINGS.items()}


def _rows(url: str, query) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(query).all()
    finally:
        engine.dispose()


def _status(url: str, run_id: str) -> str | None:
    from tasks.db.models import EvalRun

    found = _rows(url, select(EvalRun.status).where(EvalRun.run_id == run_id))
    return found[0][0] if found else None


def _error_lines(stderr: str) -> list[str]:
    """The lines a command wrote as its error (progress bars and log lines aside)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny target saved as a model directory (the CLI loads it), and its own traffic rows."""
    from .helpers.models import save_tiny_target, tiny_llama

    target = tiny_llama(seed=0)
    directory = save_tiny_target(target, tmp_path_factory.mktemp("tiny") / "target")
    rows = [{**row, "model": str(directory)} for row in traffic_rows(target)]
    return directory, rows


@pytest.fixture
def home(tmp_path, tiny_dir):
    """A migrated $SPECDEC_HOME (SQLite) holding the tiny target's traffic (for commands run as
    new processes)."""
    from tasks.db import dispose_engines, upgrade
    from tasks.steps.traffic.traffic_import import import_traffic

    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'specdec.db'}"
    upgrade(url)
    import_traffic(write_jsonl(tmp_path / "t.jsonl", tiny_dir[1]), store=Store.open(url), progress=False)
    dispose_engines()
    return home


# ------------------------------------------------------------------------------------------------
# 4. over-long requests; a run whose domain failed
def test_an_over_long_request_is_excluded_and_a_failed_domain_sets_the_exit_status(
        tiny_dir, tmp_path, monkeypatch, capsys):
    """A request longer than the target's context (512 tokens), logged without token ids (so
    counted by tokenizing it), is excluded as too_long: never scored. A domain whose estimate
    fails (token ids outside the vocabulary) makes `evaluate` exit 3 with a line naming it."""
    from specdec_core import load_model
    from tasks.cli.app import main
    from tasks.db.models import AcceptanceEstimate, EvalSample
    from tasks.steps import context

    directory, rows = tiny_dir
    long_words = " ".join(f"t{3 + i % 90}" for i in range(700))         # 700 tokens > 512
    extra = [{**rows[0], "id": "json-long", "prompt": long_words, "prompt_token_ids": None,
              "response_token_ids": None, "response": "t5 t6 t7 t8 t9"},
             {**rows[-3], "id": "qa-alien", "prompt_token_ids": [5000, 5001, 5002]}]
    extra = [{k: v for k, v in row.items() if v is not None} for row in extra]
    home, url = tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'specdec.db'}"
    for key, value in {**EVAL_ENV, "SPECDEC_HOME": str(home), "SPECDEC_SAMPLE_MAX_PER_DOMAIN": "30"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SPECDEC_DATABASE_URL", raising=False)
    assert main(["db", "upgrade"]) == 0
    assert main(["traffic", "import", str(write_jsonl(tmp_path / "t.jsonl", rows + extra)),
                 "--no-progress"]) == 0
    context._MODELS.clear()
    context.use_model(str(directory), *load_model(str(directory), device="cpu"), "cpu")
    capsys.readouterr()
    status = main(["evaluate", "--model", str(directory), "--device", "cpu", "--no-register",
                   "--no-progress", "--json", "--run-id", "long-1"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    sampled = {r[0] for r in _rows(url, select(EvalSample.request_id).where(EvalSample.run_id == "long-1"))}
    assert "json-long" in sampled                      # drawn, then left out with its reason
    assert result["excluded"]["too_long"] == 1
    scored = _rows(url, select(func.max(AcceptanceEstimate.requests)).where(
        (AcceptanceEstimate.run_id == "long-1") & (AcceptanceEstimate.domain == "json")))[0][0]
    assert scored == sum(1 for row in rows if row["domain"] == "json")    # all but the long one
    # qa's estimate failed: off in this run, the command says which and exits 3 (not 0)
    assert {row["domain"]: row["status"] for row in result["table"]} == {"json": "ok", "qa": "failed"}
    assert status == 3
    failed_line = [line for line in err.splitlines() if "domain(s) failed" in line]
    assert len(failed_line) == 1 and "qa: failed: estimate" in failed_line[0], err
    assert "[]" not in [line.strip() for line in err.splitlines()]      # no stray list lines
    context._MODELS.clear()


# ------------------------------------------------------------------------------------------------
# 6. a --model directory that is not a model
def test_a_model_directory_that_is_not_a_model_fails_in_one_line_before_sampling(home, tmp_path):
    from tasks.db.models import EvalRun

    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hello": 1}')
    done = specdec("evaluate", "--model", str(folder), "--device", "cpu", "--no-register",
                   "--no-progress", "--run-id", "not-a-model", home=home)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert _error_lines(done.stderr) == [
        f"error: ModelNotFound: '{folder}/config.json' names no model_type: '{folder}' is not a "
        "transformers model directory (save one with model.save_pretrained)"]
    # before sampling: no run was started
    assert _rows(f"sqlite:///{home / 'specdec.db'}", select(EvalRun.run_id)) == []


# ------------------------------------------------------------------------------------------------
# 10. an HF id with no network
@pytest.mark.parametrize("offline", [False, True], ids=["unreachable", "HF_HUB_OFFLINE"])
def test_an_hf_id_without_network_fails_at_once_with_one_line(offline, home):
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}     # nothing listens there
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    done = specdec("evaluate", "--model", "Test-Org/no-such-model", "--device", "cpu",
                   "--no-register", "--no-progress", home=home, env=env, timeout_s=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Retry" not in done.stderr, done.stderr[-3000:]
    (line,) = _error_lines(done.stderr)
    assert line.startswith("error: ModelNotFound: model 'Test-Org/no-such-model' is not a local path")
    assert ("HF_HUB_OFFLINE is set" if offline else "cannot be reached") in line


# ------------------------------------------------------------------------------------------------
# 5. disk full: a small tmpfs in a private mount namespace
def _can_mount_tmpfs(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe}"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


def _on_full_disk(tmp_path: Path, script: str, env: dict) -> subprocess.CompletedProcess:
    """`script` (sh) in a private mount namespace where $D is a fresh 8 MiB tmpfs."""
    if not _can_mount_tmpfs(tmp_path):     # a failure, never a skip: a skip would hide one in CI
        pytest.fail("`unshare -m` could not mount a tmpfs in a private mount namespace: run the "
                    "disk-full tests as root (CAP_SYS_ADMIN), as CI does, or leave them out with "
                    "-m 'not disk_full'")
    disk = tmp_path / "disk"
    disk.mkdir()
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    environ.update(env, D=str(disk), SPECDEC_HOME=str(disk / "home"), PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS="1", PY=sys.executable)
    prelude = ('set -e; mount -t tmpfs -o size=8m tmpfs "$D"; '
               '"$PY" -m tasks.cli db upgrade >/dev/null; set +e; ')
    return subprocess.run(["unshare", "-m", "sh", "-c", prelude + script], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=600)


def _fill(leave_kb: int) -> str:
    """sh: fill $D but leave_kb kilobytes."""
    return (f'dd if=/dev/zero of="$D/fill" bs=1k count=$(( $(df -k --output=avail "$D" | tail -1) '
            f'- {leave_kb} )) 2>/dev/null; ')


@pytest.mark.disk_full
def test_disk_full_during_import_says_disk_full(tmp_path):
    rows = [request_row(i, id=f"r-{i}", response="x" * 400) for i in range(20_000)]   # ~15 MB
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    done = _on_full_disk(tmp_path, f'"$PY" -m tasks.cli traffic import {path} --no-progress', {})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = _error_lines(done.stderr)
    assert line.startswith("error: DiskFull: disk full: the specdec database ")
    assert "cannot connect" not in line and "db upgrade" not in line


@pytest.mark.disk_full
def test_disk_full_during_evaluate_is_one_line_and_exit_2(tmp_path, tiny_dir):
    directory, rows = tiny_dir
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    done = _on_full_disk(tmp_path, (
        f'"$PY" -m tasks.cli traffic import {path} --no-progress >/dev/null; ' + _fill(200)
        + f'"$PY" -m tasks.cli evaluate --model {directory} --device cpu --no-register '
          '--no-progress --run-id full-1'), EVAL_ENV)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = _error_lines(done.stderr)
    assert line.startswith("error: DiskFull: disk full: the specdec database ") and \
        "(database or disk is full)" in line, line


# ------------------------------------------------------------------------------------------------
# 7. a row stamped in the future
def test_the_default_window_ignores_rows_stamped_in_the_future_and_counts_them(db_url, tmp_path, caplog):
    from tasks.steps.traffic.traffic_import import import_traffic
    from tasks.steps.traffic.traffic_sample import sample_traffic
    from tasks.settings import load_settings
    from tasks.timeutil import utcnow

    rows = [request_row(i, domain="qa") for i in range(1, 49)]      # 2025-11-01 .. 2025-11-14
    ahead = (utcnow() + timedelta(hours=20)).strftime("%Y-%m-%dT%H:%M:%SZ")   # accepted: < now + 1 day
    rows.append(request_row(99, domain="qa", timestamp=ahead))
    import_traffic(write_jsonl(tmp_path / "t.jsonl", rows), store=Store.open(db_url), progress=False)
    settings = load_settings({}, sample_min_per_domain=1, sample_max_per_domain=100)
    with caplog.at_level("WARNING"):
        sample = sample_traffic("skewed", store=Store.open(db_url), settings=settings)
    assert sample["sampled"] == 48                              # not 1 (the future row alone)
    assert sample["window"]["end"].startswith("2025-11-14")
    assert sample["window"]["future_rows_ignored"] == 1
    assert "1 stored request(s) are stamped more than 1 h in the future" in caplog.text
    # a tolerance that covers the skew: the row counts again, and moves the window
    wide = load_settings({}, sample_min_per_domain=1, sample_max_per_domain=100,
                         sample_future_tolerance_hours=48)
    assert sample_traffic("skewed", store=Store.open(db_url), settings=wide)["window"]["future_rows_ignored"] == 0


# ------------------------------------------------------------------------------------------------
# 9. a run stopped during its estimate (SIGTERM, kill -9); an import killed mid-file
def _start(args: list[str], home: Path, env: dict | None = None) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    environ.update(EVAL_ENV, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", SPECDEC_HOME=str(home))
    environ.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop_when(process: subprocess.Popen, ready, how: int, limit_s: float = 300) -> None:
    """Send `how` to the process the moment `ready()` holds (polled); fails if it ends first."""
    deadline = time.monotonic() + limit_s
    while not ready():
        assert process.poll() is None, f"ended before the fault: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "the fault point was never reached"
        time.sleep(0.05)
    process.send_signal(how)


def _stop_in_estimate(home: Path, directory: Path, run_id: str, how: int) -> subprocess.CompletedProcess:
    """`evaluate` stopped by `how` once a domain's estimate and plan are stored, before the run
    finishes (its provisional plan is what the reports must not count)."""
    from tasks.db.models import DomainConfig

    url = f"sqlite:///{home / 'specdec.db'}"
    process = _start(["evaluate", "--model", str(directory), "--device", "cpu", "--no-register",
                      "--no-progress", "--run-id", run_id], home)

    def planned() -> bool:
        try:
            return bool(_rows(url, select(DomainConfig.domain).where(DomainConfig.run_id == run_id)))
        except Exception:     # the run's tables are busy or not written yet
            return False
    try:
        _stop_when(process, planned, how)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _in_reports(url: str, run_id: str) -> dict[str, int]:
    """How many rows of run_id each report shows (acceptance: runs counted in its rows)."""
    from tasks.steps.traffic.reports import run_report

    safeguards = run_report("planner_safeguards", store=Store.open(url))
    acceptance = run_report("acceptance_by_domain_per_day", store=Store.open(url))
    runs = acceptance["columns"].index("runs")
    return {"planner_safeguards": sum(1 for row in safeguards["rows"] if row[0] == run_id),
            "acceptance_by_domain_per_day": sum(row[runs] for row in acceptance["rows"])}


def test_a_run_stopped_by_sigterm_during_its_estimate_is_marked_and_left_out_of_reports(home, tiny_dir):
    url = f"sqlite:///{home / 'specdec.db'}"
    done = _stop_in_estimate(home, tiny_dir[0], "term-1", signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "run term-1 interrupted by SIGTERM: marked interrupted" in done.stderr
    assert _status(url, "term-1") == "interrupted"
    assert _in_reports(url, "term-1") == {"planner_safeguards": 0, "acceptance_by_domain_per_day": 0}


def test_a_run_killed_during_its_estimate_is_marked_on_the_next_start_and_left_out_of_reports(
        home, tiny_dir):
    url = f"sqlite:///{home / 'specdec.db'}"
    done = _stop_in_estimate(home, tiny_dir[0], "killed-1", signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    assert _status(url, "killed-1") == "profiled"          # nothing could mark it
    # the next start on this host (here one that fails fast: an unknown domain) marks it
    again = specdec("evaluate", "--model", str(tiny_dir[0]), "--device", "cpu", "--no-register",
                    "--domains", "no-such-domain", "--run-id", "next-1", home=home,
                    env=EVAL_ENV)
    assert again.returncode == 2
    assert "marked 1 run(s) interrupted: their process is gone (killed?): killed-1" in again.stderr
    assert _status(url, "killed-1") == "interrupted"
    assert _in_reports(url, "killed-1") == {"planner_safeguards": 0, "acceptance_by_domain_per_day": 0}


def test_an_import_killed_mid_file_resumes_to_exact_counts(tmp_path):
    from tasks.db.models import QuarantinedRequest, TrafficRequest

    home = tmp_path / "home"
    url = f"sqlite:///{home / 'specdec.db'}"
    assert specdec("db", "upgrade", home=home).returncode == 0
    rows = [request_row(i, id=f"r-{i}") for i in range(30_000)]
    path = write_jsonl(tmp_path / "big.jsonl", rows)

    def some_stored() -> bool:
        try:
            return _rows(url, select(func.count()).select_from(TrafficRequest))[0][0] > 0
        except Exception:
            return False
    process = _start(["traffic", "import", str(path), "--no-progress"], home)
    try:
        _stop_when(process, some_stored, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    stored_then = _rows(url, select(func.count()).select_from(TrafficRequest))[0][0]
    assert 0 < stored_then < len(rows)                       # killed mid-file
    again = specdec("traffic", "import", str(path), "--no-progress", "--json", home=home)
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads(again.stdout)
    assert report["rows_read"] == len(rows)
    assert report["skipped_existing"] >= stored_then        # the rows stored before the kill
    assert report["inserted"] + report["skipped_existing"] == len(rows) and report["quarantined"] == 0
    assert _rows(url, select(func.count()).select_from(TrafficRequest))[0][0] == len(rows)
    assert _rows(url, select(func.count()).select_from(QuarantinedRequest))[0][0] == 0


# ------------------------------------------------------------------------------------------------
# 2 (the goal): 10 concurrent conflicting imports per backend, 0 rows unaccounted for
CONCURRENT, SHARED_IDS = 10, 200


def test_ten_concurrent_conflicting_imports_account_for_every_row(db_url, tmp_path):
    """Ten `specdec traffic import` processes at once, every file carrying the same ids (even ids:
    the same content everywhere; odd ids: each file's own answer). Every row read is stored,
    skipped as already stored or quarantined; the reports say exactly what each import did."""
    from tasks.db.models import QuarantinedRequest, TrafficRequest
    from tasks.steps.traffic.reports import run_report

    paths = [write_jsonl(tmp_path / f"part-{n}.jsonl", [
        request_row(i, response=f"answer {i}" if i % 2 == 0 else f"answer {i} from file {n}")
        for i in range(1, SHARED_IDS + 1)]) for n in range(CONCURRENT)]
    home = tmp_path / "home"
    processes = [_start(["traffic", "import", str(path), "--no-progress", "--json", "--url", db_url],
                        home, env={"SPECDEC_TRAFFIC_IMPORT_BATCH_SIZE": "20"}) for path in paths]
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode in (0, 3), err[-3000:]          # 3: rows quarantined
        outputs.append(json.loads(out))
    stored = _rows(db_url, select(TrafficRequest.id, TrafficRequest.source_file))
    quarantined = _rows(db_url, select(QuarantinedRequest.source_file, QuarantinedRequest.reason))
    read = sum(report["rows_read"] for report in outputs)
    skipped = sum(report["skipped_existing"] for report in outputs)
    assert read == CONCURRENT * SHARED_IDS
    assert len(stored) + len(quarantined) + skipped == read       # 0 rows unaccounted for
    assert len(stored) == SHARED_IDS and {reason for _, reason in quarantined} <= {"duplicate_id"}
    assert sum(report["inserted"] for report in outputs) == len(stored)
    assert sum(report["quarantined"] for report in outputs) == len(quarantined)
    for path, report in zip(paths, outputs):
        assert report["inserted"] == sum(1 for _, source in stored if source.endswith(path.name))
        assert report["quarantined"] == sum(1 for source, _ in quarantined if source.endswith(path.name))
    by_reason = run_report("quarantined_by_reason", store=Store.open(db_url))
    count = by_reason["columns"].index("rows_rejected")
    assert sum(row[count] for row in by_reason["rows"]) == len(quarantined)


# ------------------------------------------------------------------------------------------------
# 8. `config promote N --force` racing `config rollback`
def test_promote_force_decides_already_champion_on_the_champion_read_under_the_lock(db_url, tmp_path):
    """The champion is version 2; a rollback (here: this test process, holding the alias lock as
    `config rollback` does) moves it back to 1 while `config promote 2 --force` runs. The promote
    must not say "version 2 is already the champion" (false once the rollback commits): it waits
    for the lock, sees champion 1, and refuses as moved or promotes 2 again."""
    from tasks.registry.config_schema import config_model_name
    from tasks.db.store import Store
    from tasks.registry.promotion import alias_lock, record_promotion
    from tasks.registry.tracking import CHAMPION, alias_version, client

    from .helpers.registry import finished_run, promote_, register

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    target = "Test-Org/Race-Target"
    name = config_model_name(target)
    for run_id in ("run-1", "run-2"):
        finished_run(db_url, run_id, {"json": {}}, target_id=target)
        register(run_id, db_url, uri)
    assert promote_(name, "1", db_url, uri)["promoted"] and promote_(name, "2", db_url, uri)["promoted"]
    mlflow_client = client(uri)
    with alias_lock(Store.open(db_url), name) as tx:
        process = _start(["config", "promote", "2", "--force", "--target", target,
                          "--tracking-uri", uri, "--url", db_url], tmp_path / "home")
        _wait_for_lock_waiter(db_url, process)
        mlflow_client.set_registered_model_alias(name, CHAMPION, "1")     # the rollback's move
        record_promotion(tx, run_id="run-1", target_id=target, config_name=name,
                         config_version="1", alias=CHAMPION, action="rollback", forced=False,
                         actor="pytest", gates={"champion_before": "2"},
                         reason="rolled back from version 2")
    out, err = process.communicate(timeout=300)
    said = " ".join((out + err).split())
    assert "already the champion" not in said, said
    champion = alias_version(mlflow_client, name, CHAMPION)
    if champion == "1":          # it read champion 2 before the rollback: refused as moved
        assert "the champion moved from 2 to 1 while the gates ran" in said, said
    else:                        # it read champion 1: gated against it and promoted 2 again
        assert champion == "2" and "promoted to champion" in said, said


def _wait_for_lock_waiter(db_url: str, process: subprocess.Popen, limit_s: float = 60) -> None:
    """Until `process` waits on the alias lock (PostgreSQL: an ungranted advisory lock in
    pg_locks) or has ended; on SQLite, whose lock has no such view, until the process ends or
    a while has passed (time for it to start and read the champion; either order is correct),
    shorter than SQLite's busy timeout (30 s, tasks.db.engine), so a waiter is not refused with
    "database is locked" before the lock is released."""
    deadline = time.monotonic() + limit_s
    sqlite_hold_s = 15
    while process.poll() is None and time.monotonic() < deadline:
        if db_url.startswith("postgresql"):
            waiting = _rows(db_url, text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                         "AND NOT granted"))[0][0]
            if waiting:
                return
        elif time.monotonic() > deadline - limit_s + sqlite_hold_s:
            return
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------
# 10. hostile run ids at every command that takes one
@pytest.mark.parametrize("run_id", ["   ", "run\u202egpj", "\u200f\u2066x", "r" * 10_000],
                         ids=["blank", "rlo", "bidi-isolates", "10k"])
@pytest.mark.parametrize("command", [("traffic", "sample"), ("traffic", "check"),
                                     ("engine", "show"), ("config", "register")],
                         ids=lambda c: " ".join(c))
def test_a_hostile_run_id_is_refused_in_one_short_line(command, run_id, tmp_path, monkeypatch, capsys):
    from tasks.cli.app import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    assert main([*command, run_id]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: InvalidIdentifier: run id ") and len(err) < 400, err[:500]
    assert "\u202e" not in err and "\u2066" not in err         # shown escaped, never raw


def test_the_sample_step_refuses_a_blank_run_id(db_url):
    from tasks.errors import InvalidIdentifier
    from tasks.steps.traffic.traffic_sample import sample_traffic

    with pytest.raises(InvalidIdentifier):
        sample_traffic("   ", store=Store.open(db_url))


# ------------------------------------------------------------------------------------------------
# 10. a draft trained without registering (its status is backend-neutral: SQLite only)
@pytest.mark.parametrize("db_backend", ["sqlite"], indirect=True)
def test_a_draft_trained_with_no_register_is_not_left_training(tiny_store):
    from specdec_core.train import TrainConfig
    from tasks.db.models import DraftModelRecord
    from tasks.steps.drafters.draft_training import train_draft_from_traffic

    from tasks.steps.drafters.draft_recipes import DraftModelRecipe

    recipe = DraftModelRecipe(num_layers=1, config=TrainConfig(steps=2, eval_every=1, k_max=2,
                                                                warmup_steps=1))
    train_draft_from_traffic("unregistered-1", recipe, target=tiny_store["target"],
                             store=Store.open(tiny_store["db_url"]), model=tiny_store["model"],
                             tokenizer=tiny_store["tokenizer"], progress=False, register=False)
    (status,) = _rows(tiny_store["db_url"], select(DraftModelRecord.status).where(
        DraftModelRecord.name == "unregistered-1"))[0]
    assert status == "trained"
