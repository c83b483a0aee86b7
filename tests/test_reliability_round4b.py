"""Reliability, round 4 (issue 85), the remaining cases: a read-only $SPECDEC_HOME, a full disk,
two commands racing on a new MLflow store, a server's escape sequences in our messages, and the
smaller CLI cases (a --conf value of the wrong type, `config export --format vllm --output`, the
main job after a failed first task, a broken serving python).

Each case a real component: a real read-only directory (a read-only bind mount when the tests run
as root, else a directory without write permission), a real small filesystem where one can be
mounted, real SQLite and a real MLflow file store, the CLI as a real process."""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from .helpers.processes import specdec


@contextmanager
def read_only(directory: Path):
    """`directory` read-only for this user while it lasts: a read-only bind mount as root (root
    writes through permissions), else its write permission taken away."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot make a read-only bind mount here (root needs one: it writes through "
                    f"permissions): {mounted.stderr.decode()[:200]}")
    try:
        remounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True)
        if remounted.returncode != 0:
            pytest.fail(f"cannot remount read-only here: {remounted.stderr.decode()[:200]}")
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, \
        (done.returncode, done.stderr[-3000:])
    return lines[0]


# ------------------------------------------------------------------------------------------------
# 5. a read-only home
@pytest.mark.integration
@pytest.mark.parametrize("command", [["config", "show", "champion"], ["config", "export"],
                                     ["draft", "list"]])
def test_a_read_only_home_is_one_line_naming_the_store_and_the_fix_within_seconds(command, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    kept = home / "notes.txt"
    kept.write_text("kept")
    with read_only(home):
        started = time.monotonic()
        done = specdec(*command, home=home, timeout_s=60)
        took = time.monotonic() - started
    line = _one_error_line(done)
    assert f"MLflow's tracking store {home / 'mlflow.db'} cannot be written" in line, line
    assert "is not writable" in line and "Set SPECDEC_HOME to a writable directory" in line, line
    assert "start the tracking server" not in line.lower(), line      # the wrong fix of before
    assert took < 30, f"{took:.0f} s: MLflow's retries were not cut short"
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"] and kept.read_text() == "kept"


@pytest.mark.integration
def test_a_write_to_a_tracking_store_in_a_home_made_read_only_names_the_store_not_a_server(tmp_path):
    from tasks.errors import RegistryError
    from tasks.registry.tracking import client

    home = tmp_path / "home"
    home.mkdir()
    uri = f"sqlite:///{home / 'mlflow.db'}"
    client(uri).create_experiment("before")         # the store exists, with one experiment
    before = (home / "mlflow.db").read_bytes()
    with read_only(home):
        registry = client(uri)
        assert registry.get_experiment_by_name("before") is not None    # reads still work
        with pytest.raises(RegistryError) as refused:
            registry.create_experiment("after")
    text = str(refused.value)
    assert f"MLflow's tracking store {home / 'mlflow.db'} cannot be written (its directory {home} is not writable" in text, text
    assert "Set SPECDEC_HOME to a writable directory" in text and "unreachable" not in text, text
    assert (home / "mlflow.db").read_bytes() == before


# ------------------------------------------------------------------------------------------------
# 8. a full disk
@contextmanager
def small_filesystem(directory: Path, size: str = "4m"):
    """A real filesystem of `size` mounted at `directory` (tmpfs) while it lasts: mounted where this
    process sees it (the test's own code writes there), so it needs root, as the other disk-full
    tests (marker disk_full) do."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True)
    if mounted.returncode != 0:     # a failure, never a skip: a skip would hide one in CI
        pytest.fail(f"cannot mount a tmpfs ({mounted.stderr.decode()[:200]}): run the disk-full tests "
                    "as root (CAP_SYS_ADMIN), as CI does, or leave them out with -m 'not disk_full'")
    try:
        yield directory
    finally:        # lazily: a store this process keeps open (MLflow caches its engines) lets go later
        subprocess.run(["umount", "--lazy", str(directory)], check=True)


def fill(directory: Path) -> None:
    """Write zeros under `directory` until its disk has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as filler:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    filler.write(b"\0" * chunk)
            except OSError:
                pass
    assert os.statvfs(directory).f_bavail == 0


@pytest.mark.integration
@pytest.mark.disk_full
@pytest.mark.parametrize("command", [["report", "list"], ["monitor", "show"]])
def test_a_disk_full_at_start_is_said_as_such_by_read_only_commands_and_loses_nothing(command, tmp_path):
    from sqlalchemy import create_engine

    from tasks.db import dispose_engines, upgrade

    with small_filesystem(tmp_path / "disk") as disk:
        home = disk / "home"
        home.mkdir()
        database = home / "specdec.db"
        upgrade(f"sqlite:///{database}")
        dispose_engines()
        before = database.read_bytes()
        fill(disk)
        done = specdec(*command, home=home, timeout_s=120)
        line = _one_error_line(done)
        assert line.startswith("error: DiskFull: disk full: the disk under the specdec database "
                               f"sqlite:///{database} has 0 bytes free"), line
        assert "Free space on that disk" in line and "what is stored is kept" in line, line
        assert "check that the server is running" not in line and "db upgrade" not in line, line
        (disk / "filler").unlink()
        assert database.read_bytes() == before
        engine = create_engine(f"sqlite:///{database}")
        try:
            with engine.connect() as connection:       # still whole, at its revision
                assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
                assert connection.exec_driver_sql("SELECT version_num FROM specdec_alembic_version").scalar()
        finally:
            engine.dispose()


@pytest.mark.integration
@pytest.mark.disk_full
def test_a_disk_filling_while_a_run_registers_names_what_was_written_and_the_fix(db_url, mlflow_uri, tmp_path,
                                                                          monkeypatch):
    import tempfile

    from sqlalchemy import create_engine

    from tasks.errors import DiskFull
    from tasks.registry.tracking import client

    from .helpers.registry import finished_run, register

    finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False}}, estimates=True)
    with small_filesystem(tmp_path / "tmpdisk") as disk:
        monkeypatch.setattr(tempfile, "tempdir", str(disk))     # the reports' temporary files
        fill(disk)
        with pytest.raises(DiskFull) as full:
            register("run-1", db_url, mlflow_uri)
    text = " ".join(str(full.value).split())
    assert text.startswith("disk full while writing run run-1's plots to MLflow ("), text
    assert "No space left on device" in text and "its stored results are kept" in text, text
    assert f"temporary files go to {disk}, set TMPDIR to move them" in text, text
    assert "run the command again" in text, text
    engine = create_engine(db_url)
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql(
                "SELECT status FROM eval_runs WHERE run_id = 'run-1'").scalar() == "evaluated"
    finally:
        engine.dispose()
    assert client(mlflow_uri).search_model_versions("name LIKE 'specdec-config-%'") == []


# ------------------------------------------------------------------------------------------------
# 10. commands at once on a new home
@pytest.mark.integration
def test_commands_started_at_once_on_a_new_home_do_not_race_on_mlflows_tables(tmp_path):
    import sys

    from .helpers import REPO

    home = tmp_path / "home"
    home.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")},
           "PYTHONPATH": str(REPO), "SPECDEC_HOME": str(home), "OMP_NUM_THREADS": "1"}
    commands = [["config", "show", "champion"], ["config", "show", "champion"], ["draft", "list"],
                ["config", "show", "champion"]]
    processes = [subprocess.Popen([sys.executable, "-m", "tasks.cli", *command], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for command in commands]
    results = [(process.wait(timeout=180), *process.communicate()) for process in processes]
    for command, (status, out, err) in zip(commands, results):
        assert "Traceback" not in err and "already exists" not in err, (command, err[-3000:])
        if command[0] == "config":
            assert status == 2 and err.strip().splitlines()[-1].endswith(
                "has no version with alias 'champion'"), (command, status, err[-2000:])
        else:
            assert status == 0 and "version" in out, (command, status, err[-2000:])


# ------------------------------------------------------------------------------------------------
# 11. a server's body quoted in an error: no escape sequence reaches the terminal
HOSTILE_BODY = "denied\x1b[2J\x1b]0;owned\x07\u202eevil\rover"


@contextmanager
def hostile_server(status: int):
    """A loopback HTTP server answering every request with `status` and HOSTILE_BODY."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            body = HOSTILE_BODY.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_tracking_servers_escape_sequences_are_shown_escaped_in_the_error_line(tmp_path, monkeypatch,
                                                                                capsys):
    from tasks.cli.app import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    with hostile_server(400) as url:
        assert main(["config", "show", "champion", "--tracking-uri", url]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1, err
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err and "\r" not in err, repr(err)
    # the whole body quoted, each control shown as its escape (the CR: blanks are one space there)
    assert "'denied\\x1b[2J\\x1b]0;owned\\x07\\u202eevil over'" in err, err


def test_printable_escapes_controls_and_bidi_overrides_and_keeps_the_rest():
    from tasks.masking import printable

    assert printable("a\x1b[31mb\u202ec\u2066d\x9be\x7f") == "a\\x1b[31mb\\u202ec\\u2066d\\x9be\\x7f"
    assert printable("x\ny\tz") == "x\\ny\\tz"
    assert printable("x\ny\rz", keep_newlines=True) == "x\ny\\rz"
    assert printable("naïve 日本 ≥ 1.2x") == "naïve 日本 ≥ 1.2x"


# ------------------------------------------------------------------------------------------------
# 12. main-job --conf: a value of the wrong type
@pytest.mark.integration
@pytest.mark.parametrize("conf, expected", [
    ('{"k_max": "abc"}', "'k_max' is \"abc\", but the run's Param 'k_max' (Largest K) takes a whole number; "
                         "e.g. --conf '{\"k_max\": 8}'"),
    ('{"promote": "yes"}', "'promote' is \"yes\", but the run's Param 'promote' (Promote) takes null or "
                           "true or false")])
def test_main_job_conf_of_the_wrong_type_is_one_line_naming_the_key_and_type_before_any_work(conf, expected,
                                                                                          tmp_path):
    home = tmp_path / "home"
    done = specdec("main-job", "--conf", conf, home=home, timeout_s=120)
    line = _one_error_line(done)
    assert line.startswith("error: InvalidValue: --conf: ") and expected in line, line
    assert not (home / "airflow" / "airflow.db").exists() and not (home / "specdec.db").exists()
    assert not (home / "mlflow.db").exists()


def test_main_job_conf_of_the_right_types_passes_the_check():
    from airflow.dag_processing.dagbag import DagBag

    from tasks.cli.main_job import check_conf, default_dags_folder

    dag = DagBag(dag_folder=str(default_dags_folder())).dags["specdec_evaluate"]
    check_conf(dag, {"k_max": 4, "promote": None, "domains": ["json"], "max_per_domain": 20,
                     "not_a_param": "kept as Airflow keeps it"})


# ------------------------------------------------------------------------------------------------
# 13. config export --output, every format
@pytest.mark.parametrize("fmt", ["vllm", "json", "sglang", "trtllm", "compose"])
def test_config_export_output_writes_the_file_in_every_format(fmt, db_url, mlflow_uri, tmp_path, capsys):
    import json

    import yaml

    from tasks.cli.app import main

    from .helpers.registry import finished_run

    common = ["--tracking-uri", mlflow_uri, "--url", db_url]
    finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False}})
    assert main(["config", "register", "run-1", *common, "--target", "tiny-target"]) == 0
    assert main(["config", "promote", "1", *common, "--target", "tiny-target",
                 "--expected-champion", "none"]) == 0
    capsys.readouterr()
    assert main(["config", "export", "--format", fmt, *common, "--target", "tiny-target"]) == 0
    printed = capsys.readouterr().out
    target = tmp_path / f"export.{fmt}"
    assert main(["config", "export", "--format", fmt, *common, "--target", "tiny-target",
                 "--output", str(target)]) == 0
    out, err = capsys.readouterr()
    assert out == "", out                                     # the export went to the file only
    assert f"wrote {target}: specdec-config-tiny-target version 1 ({fmt})" in " ".join(err.split()), err
    written = target.read_text(encoding="utf-8")
    assert written == printed                                 # what stdout would have carried
    if fmt == "vllm":
        assert json.loads(written)["speculative_config"]["json"]["method"] == "ngram"
    elif fmt == "compose":
        assert yaml.safe_load(written)["services"]
    else:
        assert json.loads(written)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_config_export_output_that_cannot_be_written_is_one_line_and_keeps_the_old_file(
        db_url, mlflow_uri, tmp_path, capsys):
    from tasks.cli.app import main

    from .helpers.registry import finished_run

    common = ["--tracking-uri", mlflow_uri, "--url", db_url, "--target", "tiny-target"]
    finished_run(db_url, "run-1", {"json": {}})
    assert main(["config", "register", "run-1", *common]) == 0
    assert main(["config", "promote", "1", *common, "--expected-champion", "none"]) == 0
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "vllm.json"
    target.write_text("old")
    capsys.readouterr()
    with read_only(folder):
        assert main(["config", "export", "--format", "vllm", *common, "--output", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert f"error: InvalidValue: --output {target}: cannot be written (" in err, err
    assert "Give a file in a folder you can write" in err, err
    assert target.read_text() == "old" and sorted(p.name for p in folder.iterdir()) == ["vllm.json"]


# ------------------------------------------------------------------------------------------------
# 13. the main job after its first task failed
@pytest.mark.integration
def test_main_job_whose_first_task_fails_says_which_task_why_and_how_to_run_again(tmp_path):
    home = tmp_path / "home"
    done = specdec("main-job", "--conf", '{"k_max": 99}', home=home, timeout_s=400)  # sample refuses it
    assert done.returncode == 1, done.stderr[-3000:]
    text = " ".join(done.stderr.split())
    assert "error: run manual__" in text and " failed at task sample: " in text, text
    assert "Largest K (k_max=99) is outside 1 to 16" in text, text
    assert "its log: " in text and "task_id=sample" in text, text
    assert "Fix the cause above, then run `specdec main-job` again" in text, text
    for misleading in ("has not finished its evaluation", "does not exist in specdec's database",
                       "evaluate it first"):
        assert misleading not in done.stderr + done.stdout, misleading
    assert "4/4" not in done.stdout          # no result table for a run that did not reach it


# ------------------------------------------------------------------------------------------------
# 13. engine load with a broken serving python
def _broken_pythons(tmp_path: Path) -> dict:
    import sys

    failing = tmp_path / "failing" / "python"
    failing.parent.mkdir()
    failing.write_text("#!/bin/sh\necho 'ImportError: libpython3.12.so.1.0: cannot open shared object file' >&2\n"
                       "exit 1\n")
    failing.chmod(0o755)
    dangling = tmp_path / "dangling" / "python"
    dangling.parent.mkdir()
    dangling.symlink_to(tmp_path / "gone" / "python3.12")
    not_executable = tmp_path / "plain" / "python"
    not_executable.parent.mkdir()
    not_executable.write_text("")
    # a Python of its own without vLLM (no site packages but the standard library's)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    return {"fails": (failing, "fails (exit 1: ImportError: libpython3.12.so.1.0: cannot open shared object file)"),
            "dangling link": (dangling, f"is a link to {tmp_path / 'gone' / 'python3.12'}, which does not exist"),
            "not executable": (not_executable, "cannot be run (Permission denied)"),
            "no vllm": (bare / "bin" / "python", "has no vLLM")}


@pytest.mark.parametrize("case", ["fails", "dangling link", "not executable", "no vllm"])
def test_engine_load_with_a_broken_serving_python_is_one_line_naming_it_and_turns_nothing_off(
        case, db_url, tmp_path, monkeypatch, capsys):

    from sqlalchemy import create_engine

    from tasks.cli.app import main

    from .helpers.registry import finished_run

    python, why = _broken_pythons(tmp_path)[case]
    if case == "not executable" and os.geteuid() == 0:
        why = "cannot be run ("          # root: exec of an empty file fails otherwise (ENOEXEC)
    monkeypatch.setenv("SPECDEC_ENGINE_SERVING_PYTHON", str(python))
    finished_run(db_url, "run-1", {"json": {}, "qa": {}}, target_id="smollm2-135m-instruct")
    assert main(["engine", "load", "run-1", "--url", db_url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    line = " ".join(err.split())
    assert line.startswith(f"error: ServingEnvUnavailable: the serving python {python} {why}"), line
    assert "make one with `make serving-env`" in line, line
    engine = create_engine(db_url)
    try:
        with engine.connect() as connection:
            enabled = dict(connection.exec_driver_sql(
                "SELECT domain, enabled FROM domain_configs WHERE run_id = 'run-1'").all())
            checks = connection.exec_driver_sql("SELECT count(*) FROM load_check_domains").scalar()
    finally:
        engine.dispose()
    assert enabled == {"json": True, "qa": True} and checks == 0


@pytest.mark.integration
@pytest.mark.disk_full
def test_a_full_disk_under_the_mlflow_store_is_disk_full_naming_the_store_not_unreachable(tmp_path):
    from tasks.errors import DiskFull
    from tasks.registry.tracking import client

    with small_filesystem(tmp_path / "disk") as disk:
        uri = f"sqlite:///{disk / 'mlflow.db'}"
        registry = client(uri)                       # the store made, then its disk filled
        fill(disk)
        with pytest.raises(DiskFull) as full:
            for n in range(200):                     # SQLite's free pages first, then the disk
                registry.create_experiment(f"e{n}")
        text = str(full.value)
        assert text.startswith(f"disk full: MLflow's tracking store {uri} cannot grow (database or disk "
                               "is full)"), text
        assert "Free space on the store's disk" in text and "unreachable" not in text, text
        (disk / "filler").unlink()
        assert registry.get_experiment_by_name("e0") is not None or n == 0    # what was written is kept
