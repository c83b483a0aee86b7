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
        pytest.skip(f"cannot make a read-only bind mount here: {mounted.stderr.decode()[:200]}")
    try:
        remounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True)
        if remounted.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {remounted.stderr.decode()[:200]}")
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
