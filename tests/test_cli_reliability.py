"""Reliability of what the CLI prints and how fast it gives up: passwords with any URL-legal
character are masked (bare, in messages, through the real CLI); a tracking server that accepts
connections and never answers fails within seconds with the refused-connection line; errors go to
stderr and results to stdout; a missing database driver is named with its fix; a reader that
closes the pipe early (`| head`) changes no exit status and prints no traceback."""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tasks.errors import DatabaseUnavailable, RegistryError, RegistryUnavailable
from tasks.masking import mask_text, mask_url

from .helpers import REPO
from .helpers.processes import free_port
from .helpers.traffic import request_row, write_jsonl

# RFC 3986 userinfo: unreserved, sub-delims, percent-encoded, and ":" inside the password
SPECIALS = ["'", "!", "$", "&", "(", ")", "*", "+", ",", ";", "=", "~", "-", ".", "_", "%40", ":",
            "%3A", "%25", "'!$&()*+,;=~-._%40:"]


def specdec(*args: str, env: dict | None = None, home: Path | None = None, **kwargs):
    """`specdec ARGS` in a new process (this worktree's code), output captured apart."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    environ.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    if home is not None:
        environ["SPECDEC_HOME"] = str(home)
    environ.update(env or {})
    kwargs.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                          text=True, timeout=300, **kwargs)


# ------------------------------------------------------------------------------------------------
# 1. masking by parsing
@pytest.mark.parametrize("special", SPECIALS)
def test_a_password_with_any_url_legal_character_is_masked(special):
    password = f"Pl4nted{special}S3cret"
    for scheme, rest in (("http", "127.0.0.1:9/api/2.0"), ("postgresql+psycopg", "db:5432/x?sslmode=require")):
        url = f"{scheme}://user:{password}@{rest}"
        assert mask_url(url) == f"{scheme}://user:***@{rest}"
    message = (f"API request to http://user:{password}@127.0.0.1:9/api/2.0 failed; database "
               f"'postgresql://u:{password}@db:5432/x' refused (retry with url=http://a:{password}@h).")
    assert mask_text(message) == ("API request to http://user:***@127.0.0.1:9/api/2.0 failed; database "
                                  "'postgresql://u:***@db:5432/x' refused (retry with url=http://a:***@h).")
    query = f"https://h/api?a=1&token={password.replace('&', '%26')}&b=2"
    assert mask_url(query) == "https://h/api?a=1&token=***&b=2"


def test_urls_without_credentials_are_left_as_they_are():
    for url in ("sqlite:////tmp/specdec.db", "sqlite:///file:/tmp/x.db?mode=ro&uri=true",
                "http://127.0.0.1:5000", "http://user@host/x", "not a url", ""):
        assert mask_url(url) == url
        assert mask_text(f"see {url}.") == f"see {url}."


@pytest.mark.integration
def test_the_cli_masks_a_password_with_an_apostrophe(tmp_path):
    uri = f"http://user:my'secret@127.0.0.1:{free_port()}"
    done = specdec("config", "show", "champion", "--tracking-uri", uri, home=tmp_path)
    assert done.returncode == 2
    assert "secret" not in done.stdout + done.stderr
    assert f"MLflow tracking store {mask_url(uri)} is unreachable (connection refused)" in done.stderr
    assert mask_url(uri) == f"http://user:***@{uri.rsplit('@', 1)[1]}"


# ------------------------------------------------------------------------------------------------
# 2. a server that accepts and never answers
@pytest.fixture
def silent_port():
    """A port on 127.0.0.1 whose server accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for connection in accepted:
        connection.close()
    server.close()


def _reason_free(message: str) -> str:
    """The message with its port and the reason in parentheses left out."""
    head, _, rest = message.partition("is unreachable (")
    return head.rsplit(":", 1)[0] + "|" + rest.partition(")")[2]


def test_a_silent_tracking_server_fails_within_ten_seconds_like_a_refused_one(silent_port):
    from tasks.registry.registry import Registry

    with pytest.raises(RegistryUnavailable) as refused:
        Registry.open(f"http://127.0.0.1:{free_port()}").show_version("specdec-config-x")
    for call in (lambda: Registry.open(f"http://127.0.0.1:{silent_port}").show_version("specdec-config-x"),
                 lambda: Registry.open(f"http://127.0.0.1:{silent_port}/").check_reachable()):
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable) as silent:
            call()
        assert time.monotonic() - started < 10
        assert "is unreachable (timed out)" in str(silent.value)
        assert _reason_free(str(silent.value)) == _reason_free(str(refused.value))


def test_a_silent_database_server_fails_within_ten_seconds(silent_port, tmp_path):
    from tasks.db import current_revision
    from tasks.registry.tracking import client

    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable, match="cannot connect to the specdec database"):
        current_revision(f"postgresql+psycopg://u:pw@127.0.0.1:{silent_port}/specdec")
    assert time.monotonic() - started < 10
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable, match="is unreachable"):
        client(f"postgresql://u:pw@127.0.0.1:{silent_port}/mlflow")
    assert time.monotonic() - started < 10


@pytest.mark.integration
def test_the_cli_gives_up_on_a_silent_tracking_server_with_one_line(silent_port, tmp_path):
    started = time.monotonic()
    done = specdec("config", "show", "champion", "--tracking-uri", f"http://127.0.0.1:{silent_port}",
                   home=tmp_path)
    assert time.monotonic() - started < 40      # was 66 s (three tries of 20 s); start-up included
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: RegistryUnavailable: MLflow tracking store http://127.0.0.1:{silent_port} is "
        "unreachable (timed out). Start the tracking server (or the database behind it), or set "
        "MLFLOW_TRACKING_URI to the right one; nothing was changed in the registry"]


# ------------------------------------------------------------------------------------------------
# 3. errors on stderr, results on stdout
@pytest.mark.integration
@pytest.mark.parametrize("args", [
    ("config", "export"), ("report", "traffic_by_domain_per_day", "--format", "csv"),
    ("evaluate", "--json", "--no-register")])
def test_an_error_goes_to_stderr_and_stdout_stays_empty(args, tmp_path):
    # no database yet under this SPECDEC_HOME; MLflow refuses connections
    done = specdec(*args, home=tmp_path / "home",
                   env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"})
    assert done.returncode == 2
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert ("is unreachable" if args[0] == "config" else "does not exist") in errors[0]


@pytest.mark.integration
def test_results_alone_go_to_stdout(tmp_path, monkeypatch):
    from .helpers.registry import finished_run, register

    home = tmp_path / "home"
    # the in-process register below writes MLflow artifacts under $SPECDEC_HOME: this test's
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    db_url = f"sqlite:///{home / 'specdec.db'}"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert specdec("db", "upgrade", home=home).returncode == 0
    assert specdec("traffic", "import", "--sample", "--no-progress", home=home).returncode == 0
    report = specdec("report", "traffic_by_domain_per_day", "--format", "csv", home=home)
    assert report.returncode == 0 and report.stderr == ""
    rows = list(csv.DictReader(io.StringIO(report.stdout)))
    assert rows and {"day", "domain", "requests"} <= set(rows[0])
    target = "Test-Org/Streams"
    finished_run(db_url, "run-1", {"json": {}}, target_id=target)
    register("run-1", db_url, uri)
    assert (home / "mlartifacts" / "test-org--streams").is_dir()
    export = specdec("config", "export", "challenger", "--target", target,
                     "--format", "trtllm", "--tracking-uri", uri, home=home)
    assert export.returncode == 0, export.stderr
    assert isinstance(json.loads(export.stdout), dict)
    assert "{" not in export.stderr and "error" not in export.stderr


# ------------------------------------------------------------------------------------------------
# 4. a missing database driver
def test_a_missing_database_driver_is_named_with_its_fix(capsys):
    from tasks.cli.app import main
    from tasks.db import current_revision
    from tasks.registry.tracking import client

    url = "postgresql+psycopg2://u:pw@127.0.0.1:5432/specdec"
    with pytest.raises(DatabaseUnavailable) as info:
        current_revision(url)
    message = str(info.value)
    assert "driver module 'psycopg2' is not installed" in message
    assert "use postgresql+psycopg://" in message and "pip install psycopg2-binary" in message
    assert "pw" not in message.replace("psycopg", "")
    with pytest.raises(RegistryError) as info:
        client(url.replace("/specdec", "/mlflow"))
    assert not isinstance(info.value, RegistryUnavailable)      # not an outage: no retry helps
    message = str(info.value)
    assert "driver module 'psycopg2' is not installed" in message and "use postgresql+psycopg://" in message
    assert "unreachable" not in message and "Start the tracking server" not in message
    assert main(["config", "show", "champion", "--tracking-uri", "mysql://u:pw@127.0.0.1/mlflow"]) == 2
    err = capsys.readouterr().err
    assert "driver module 'MySQLdb' is not installed; pip install mysqlclient" in err


# ------------------------------------------------------------------------------------------------
# 5. a reader that closes the pipe early
def _read_one_line_then_close(*args: str, home: Path) -> tuple[int, str, str]:
    """Run `specdec ARGS` with stdout into a pipe this side closes after one line: (exit status,
    the line, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    environ.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SPECDEC_HOME": str(home)})
    process = subprocess.Popen([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    return process.wait(timeout=300), line, stderr


@pytest.fixture
def many_days_home(tmp_path) -> Path:
    """A specdec home whose traffic spans 3,000 (day, domain) pairs: reports far larger than a
    pipe's buffer."""
    home = tmp_path / "home"
    first = datetime(2018, 1, 1, 10, tzinfo=timezone.utc)
    rows = [request_row(i, domain=("json", "code", "qa")[i % 3],
                        timestamp=(first + timedelta(days=i)).isoformat().replace("+00:00", "Z"))
            for i in range(3000)]
    assert specdec("db", "upgrade", home=home).returncode == 0
    done = specdec("traffic", "import", str(write_jsonl(tmp_path / "many.jsonl", rows)), "--no-progress",
                   home=home)
    assert done.returncode == 0, done.stdout + done.stderr
    return home


@pytest.mark.integration
@pytest.mark.parametrize("args", [("report", "traffic_by_domain_per_day", "--format", "csv"),
                                  ("report", "traffic_by_domain_per_day"),
                                  ("report", "traffic_by_domain_per_day", "--format", "json")])
def test_a_reader_that_stops_after_one_line_changes_no_exit_status(args, many_days_home):
    status, line, stderr = _read_one_line_then_close(*args, home=many_days_home)
    assert line.strip()
    assert (status, stderr) == (0, "")


def _reader_gone(*args: str, home: Path) -> subprocess.CompletedProcess:
    """`specdec ARGS` with stdout into a pipe whose reader is gone before the first line."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    environ.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SPECDEC_HOME": str(home)})
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)


@pytest.mark.integration
def test_a_closed_stdout_keeps_each_commands_own_exit_status(tmp_path):
    home = tmp_path / "home"
    assert specdec("db", "upgrade", home=home).returncode == 0
    path = write_jsonl(tmp_path / "half-bad.jsonl", [request_row(i) for i in range(1, 200)]
                       + [request_row(i, response="") for i in range(1000, 1400)])
    done = _reader_gone("traffic", "import", str(path), "--no-progress", home=home)
    assert (done.returncode, done.stderr) == (3, "")       # rows quarantined: 3, as documented
    for args in (("report", "--list"), ("report", "traffic_by_domain_per_day", "--format", "csv"),
                 ("traffic", "import", str(path), "--json", "--no-progress")):
        done = _reader_gone(*args, home=home)
        assert (done.returncode, done.stderr) == (3 if "import" in args else 0, ""), args
