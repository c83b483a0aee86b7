"""Reliability: broken input files keep every complete row and name the line, implausible rows
are quarantined with reasons and an exit status says so, storage and URL mistakes get one clear
line, an unreachable MLflow fails fast with its URI masked, no planted password reaches any
output, and alias moves are compare-and-set against concurrent processes."""

from __future__ import annotations

import codecs
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select

from tasks.cli.app import main
from tasks.db.models import Promotion, QuarantinedRequest
from tasks.db.store import Store
from tasks.registry.registry import Registry
from tasks.errors import DatabaseUnavailable, RegistryUnavailable, TrafficFileError
from tasks.masking import mask_text, mask_url
from tasks.steps.traffic.traffic_import import EXIT_QUARANTINED, import_traffic

from .helpers import REPO
from .helpers.processes import free_port, specdec
from .helpers.registry import finished_run, register
from .helpers.traffic import request_row, traffic, write_jsonl

PLANTED = "Pl4nted-S3cret"


def quarantined(db_url: str) -> dict[str, str]:
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = dict(connection.execute(select(QuarantinedRequest.request_id, QuarantinedRequest.reason)).all())
    engine.dispose()
    return rows


def cli(*args: str, env: dict | None = None, home: Path | None = None) -> subprocess.CompletedProcess:
    """`specdec ARGS` in a new process: exit status, and everything it printed."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    if home is not None:
        environ["SPECDEC_HOME"] = str(home)
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------
# input files
def test_a_truncated_gzip_keeps_every_complete_row_and_names_the_line(db_url, tmp_path):
    rows = [request_row(i) for i in range(1, 301)]
    whole = write_jsonl(tmp_path / "whole.jsonl.gz", rows, compress=True).read_bytes()
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(TrafficFileError, match=r"reading stopped at line (\d+)") as info:
        import_traffic(path, store=Store.open(db_url), progress=False)   # default batch size (500 rows)
    line = int(info.value.args[0].split("reading stopped at line ")[1].split(" ")[0])
    stored = set(traffic(db_url))
    assert stored == {f"req-{i:05d}" for i in range(1, line)}   # all complete rows before the break
    assert 50 < len(stored) < 300
    assert f"the {len(stored)} new rows before it are stored" in str(info.value)
    # a re-import of the repaired file adds the rest and keeps what is there
    repaired = write_jsonl(tmp_path / "repaired.jsonl.gz", rows, compress=True)
    report = import_traffic(repaired, store=Store.open(db_url), progress=False)
    assert (report["inserted"], report["skipped_existing"]) == (300 - len(stored), len(stored))


def test_a_byte_order_mark_costs_no_row(db_url, tmp_path):
    path = tmp_path / "bom.jsonl"
    write_jsonl(path, [request_row(i) for i in range(1, 4)])
    path.write_bytes(codecs.BOM_UTF8 + path.read_bytes())
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    assert (report["inserted"], report["quarantined"]) == (3, 0)
    csv_path = tmp_path / "bom.csv"
    csv_path.write_bytes(codecs.BOM_UTF8 + b"id,timestamp,domain,prompt,response,temperature,model\n"
                         b"c1,2025-11-03T10:00:00Z,qa,Why?,Because.,0,m\n")
    report = import_traffic(csv_path, store=Store.open(db_url), progress=False)
    assert (report["inserted"], report["quarantined"]) == (1, 0)


def test_implausible_rows_are_quarantined_with_reasons_and_the_exit_status_says_so(db_url, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [request_row(1)])
    assert main(["traffic", "import", str(good), "--url", db_url, "--no-progress"]) == 0
    bad = write_jsonl(tmp_path / "bad.jsonl", [
        request_row(2),
        request_row(3, max_tokens=10 ** 15),
        request_row(4, response="abc\x00def"),
        request_row(5, response=""),
        request_row(6, messages=[{"role": "user", "content": "nul \x00 in the prompt"}]),
    ])
    assert main(["traffic", "import", str(bad), "--url", db_url, "--no-progress"]) == EXIT_QUARANTINED
    assert set(traffic(db_url)) == {"req-00001", "req-00002"}
    assert quarantined(db_url) == {"req-00003": "implausible_value", "req-00004": "nul_character",
                                   "req-00005": "empty_response", "req-00006": "nul_character"}


def test_a_directory_is_not_reported_missing(db_url, tmp_path):
    with pytest.raises(TrafficFileError, match="is a directory"):
        import_traffic(tmp_path, store=Store.open(db_url), progress=False)


# ------------------------------------------------------------------------------------------------
# storage and URLs
@pytest.mark.parametrize("url, message", [
    ("postgresql://u:pw@127.0.0.1:notaport/db", "cannot be parsed"),
    ("postgres://u:pw@127.0.0.1:5432/db", "the scheme is postgresql, not postgres"),
    ("mysql://u:pw@127.0.0.1/db", "mysql is not supported"),
])
def test_malformed_database_urls_get_one_clear_line(url, message, capsys):
    from tasks.db import current_revision

    with pytest.raises(DatabaseUnavailable, match=message) as info:
        current_revision(url)
    assert "pw" not in str(info.value).replace("specdec", "")
    assert main(["db", "current", "--url", url]) == 2
    out = capsys.readouterr().err
    assert message in " ".join(out.split()) and "Traceback" not in out


def test_a_corrupt_sqlite_file_is_named_and_left_alone(tmp_path):
    path = tmp_path / "specdec.db"
    junk = os.urandom(4096)
    path.write_bytes(junk)
    url = f"sqlite:///{path}"
    from tasks.db import upgrade

    with pytest.raises(DatabaseUnavailable, match="not a readable SQLite database"):
        upgrade(url)
    assert path.read_bytes() == junk


@pytest.mark.integration
def test_a_sqlite_file_with_one_overwritten_page_is_refused_and_left_byte_for_byte(tmp_path):
    """One page of a populated database overwritten with garbage: `db upgrade` and `traffic
    import` (new processes) say what a garbage file gets, exit 2, and leave the file as it was: no
    write, no switch to WAL (no -wal/-shm beside it)."""
    import sqlite3

    home = tmp_path / "home"
    assert specdec("db", "upgrade", home=home).returncode == 0
    rows = write_jsonl(tmp_path / "a.jsonl", [request_row(i) for i in range(1, 201)])
    assert specdec("traffic", "import", str(rows), "--no-progress", home=home).returncode == 0
    path = home / "specdec.db"
    with sqlite3.connect(path) as connection:          # as a copy restored from a backup is
        connection.execute("PRAGMA journal_mode=DELETE")
    connection.close()
    with open(path, "r+b") as handle:
        handle.seek(4096 * 2)
        handle.write(bytes((i * 37 + 11) % 256 for i in range(4096)))
    damaged = path.read_bytes()
    for args in (("db", "upgrade"), ("traffic", "import", str(rows), "--no-progress")):
        result = specdec(*args, home=home)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "is not a readable SQLite database" in result.stderr, result.stdout + result.stderr
        assert "Move it aside and run `specdec db upgrade`" in " ".join(result.stderr.split())
        assert "Traceback" not in result.stdout + result.stderr
        assert path.read_bytes() == damaged
        assert sorted(p.name for p in home.iterdir() if p.name.startswith("specdec.db")) == ["specdec.db"]


def test_a_read_only_database_says_so_and_loses_nothing(tmp_path):
    from tasks.db import upgrade

    path = tmp_path / "specdec.db"
    upgrade(f"sqlite:///{path}")
    import_traffic(write_jsonl(tmp_path / "a.jsonl", [request_row(1)]), store=Store.open(f"sqlite:///{path}"),
                   progress=False)
    read_only = f"sqlite:///file:{path}?mode=ro&uri=true"
    with pytest.raises(DatabaseUnavailable, match="is read-only"):
        import_traffic(write_jsonl(tmp_path / "b.jsonl", [request_row(2)]), store=Store.open(read_only),
                       progress=False)
    assert set(traffic(f"sqlite:///{path}")) == {"req-00001"}


@pytest.mark.integration
def test_specdec_home_under_a_file(tmp_path):
    (tmp_path / "a-file").write_text("x")
    result = cli("db", "upgrade", home=tmp_path / "a-file" / "home")
    assert result.returncode == 2
    assert "cannot create the specdec database" in result.stderr and "SPECDEC_HOME" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


# ------------------------------------------------------------------------------------------------
# MLflow unreachable, credentials masked
def test_masking_hides_passwords_in_urls_and_text():
    assert mask_url(f"http://admin:{PLANTED}@127.0.0.1:9") == "http://admin:***@127.0.0.1:9"
    assert mask_url(f"postgresql+psycopg://u:{PLANTED}@db/x") == "postgresql+psycopg://u:***@db/x"
    assert mask_url(f"https://host/api?token={PLANTED}&a=1") == "https://host/api?token=***&a=1"
    assert mask_url("sqlite:////tmp/specdec.db") == "sqlite:////tmp/specdec.db"
    assert PLANTED not in mask_text(f"API request to http://a:{PLANTED}@h:9/api/2.0 failed")


@pytest.mark.integration
def test_unreachable_mlflow_fails_fast_with_one_masked_line_and_no_planted_password(tmp_path):
    """Every command of a failing session with a planted password in both URLs: the exit status,
    a line naming the masked URI and the fix, and the password nowhere in what was printed
    (verbose logging included)."""
    port = free_port()
    http = f"http://admin:{PLANTED}@127.0.0.1:{port}"
    sql = f"postgresql://mlflow:{PLANTED}@127.0.0.1:{port}/mlflow"
    assert cli("db", "upgrade", home=tmp_path).returncode == 0
    printed = []
    for uri, args in [(http, ("config", "show")), (http, ("config", "promote", "2")),
                      (http, ("config", "export", "--format", "vllm")), (sql, ("config", "show")),
                      (http, ("-v", "config", "rollback"))]:
        result = cli(*args, home=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
        text = result.stdout + result.stderr
        printed.append(text)
        assert result.returncode == 2, text
        assert "RegistryUnavailable" in text and "is unreachable" in text, text
        assert mask_url(uri) in " ".join(text.split())
        assert "has no version" not in text           # not mistaken for a missing version
        assert "Traceback" not in text
    # the database URL too: a PostgreSQL that is down
    result = cli("traffic", "import", "--sample", home=tmp_path,
                 env={"SPECDEC_DATABASE_URL": f"postgresql+psycopg://u:{PLANTED}@127.0.0.1:{port}/x"})
    printed.append(result.stdout + result.stderr)
    assert result.returncode == 2 and "cannot connect to the specdec database" in result.stderr
    assert not any(PLANTED in text for text in printed)


def test_evaluate_checks_the_registry_before_the_expensive_steps(db_url, monkeypatch):
    """With register on and MLflow down, evaluate stops before sampling: no run row is written."""
    from tasks.db.models import EvalRun
    from tasks.steps.evaluate import evaluate

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RegistryUnavailable, match="is unreachable"):
        evaluate(run_id="never-sampled", store=Store.open(db_url), register=True, progress=False)
    engine = create_engine(db_url)
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(EvalRun)).scalar() == 0
    engine.dispose()


# ------------------------------------------------------------------------------------------------
# alias moves race in real processes
def _race_worker(action: str, name: str, db_url: str, uri: str, barrier, rounds: int, results) -> None:
    from tasks.db.store import Store
    from tasks.errors import RegistryError
    from tasks.registry.promotion import promote, rollback
    from tasks.settings import load_settings

    settings = load_settings({}, database_url=db_url)
    for _ in range(rounds):
        barrier.wait()             # the parent has reset the champion to 3
        try:
            if action == "promote":
                out = promote(name, "2", Store.open(db_url), registry=Registry.open(uri), force=True, expected_champion="3",
                              settings=settings, actor="race")
                results.put(("promote", out["promoted"]))
            else:
                out = rollback(name, Store.open(db_url), registry=Registry.open(uri), actor="race")
                results.put(("rollback", out["champion_before"]))
        except RegistryError as exc:
            results.put((action, f"refused: {exc}"))
        barrier.wait()             # done; the parent checks


@pytest.mark.integration
def test_promote_racing_rollback_leaves_an_audit_trail_that_tells_the_truth(db_url, mlflow_uri):
    """`promote 2 --force --expected-champion 3` against `rollback`, both started at once, many
    times. Whatever the order, the champion is the version of the last move in the audit rows,
    and every move's champion_before is the version the move before it set."""
    from mlflow import MlflowClient

    from tasks.db.store import Store
    from tasks.registry.config_schema import config_model_name
    from tasks.registry.promotion import promote
    from tasks.settings import load_settings

    uri = mlflow_uri
    target_id = "Test-Org/Race-Target"
    name = config_model_name(target_id)
    settings = load_settings({}, database_url=db_url)
    for run_id in ("run-1", "run-2", "run-3"):
        finished_run(db_url, run_id, {"json": {}}, target_id=target_id)
        register(run_id, db_url, uri)
    assert promote(name, "1", Store.open(db_url, settings), registry=Registry.open(uri), settings=settings)["promoted"]
    rounds = 12
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(3), context.Queue()
    workers = [context.Process(target=_race_worker, args=(action, name, db_url, uri, barrier, rounds, results))
               for action in ("promote", "rollback")]
    for worker in workers:
        worker.start()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        for _ in range(rounds):
            current = str(client.get_model_version_by_alias(name, "champion").version)
            if current != "3":       # reset: 3 is champion, promoted over whatever was there
                assert promote(name, "3", Store.open(db_url, settings), registry=Registry.open(uri), force=True, settings=settings)["promoted"]
            barrier.wait(timeout=120)
            barrier.wait(timeout=120)
            outcome = dict(results.get(timeout=30) for _ in range(2))
            assert set(outcome) == {"promote", "rollback"}
            moves = moves_of(db_url, name)
            champion = str(client.get_model_version_by_alias(name, "champion").version)
            assert moves[-1][0] == champion
            for (before_version, _), (_, champion_before) in zip(moves, moves[1:]):
                assert champion_before == before_version, moves
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    assert all(worker.exitcode == 0 for worker in workers)


def moves_of(db_url: str, name: str) -> list[tuple[str, str | None]]:
    """(version set, champion_before) of every champion move, oldest first."""
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(select(Promotion.config_version, Promotion.gates).where(
            (Promotion.config_name == name) & (Promotion.alias == "champion")
            & Promotion.action.in_(("promote", "rollback"))).order_by(Promotion.id)).all()
    engine.dispose()
    return [(version, (gates or {}).get("champion_before")) for version, gates in rows]
