"""Processes and servers on loopback, each in its own process group (stopped with its workers and
supervisors); a free loopback port; `mlflow server`. Tests that use these carry the `integration`
marker."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

MLFLOW = Path(sys.executable).with_name("mlflow")


def stop_process_group(process, timeout_s: float) -> None:
    """SIGTERM to a process started with start_new_session=True and to its whole group (workers,
    supervisors), then SIGKILL to whatever is left of the group."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=timeout_s)


def free_port() -> int:
    """A loopback port nothing listens on right now (a server may take it, or a test may count on
    nothing answering there)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a log file (or why it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"<{path}: {exc}>"


class LoopbackServer:
    """A server process on 127.0.0.1 in its own process group, up once `health` answers 200 (else
    the test fails with the server's output)."""

    def __init__(self, name: str, command: list[str], health: str, env: dict, log: Path,
                 cwd: Path | None = None, timeout_s: float = 120.0):
        self.name, self.log = name, log
        with open(log, "wb") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                            cwd=cwd, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(health, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{name} did not answer {health} within {timeout_s:.0f} s (exit "
                            f"{self.process.returncode}); its output:\n"
                            + log.read_text(errors="replace")[-4000:])
            time.sleep(0.3)

    def stop(self) -> None:
        """The server's whole process group (server, workers)."""
        stop_process_group(self.process, 15)


class MlflowServer(LoopbackServer):
    """`mlflow server` on 127.0.0.1 at a free port, in its own process group."""

    def __init__(self, directory: Path, template: Path | None = None, timeout_s: float = 60.0):
        directory.mkdir(parents=True, exist_ok=True)
        backend = directory / "srv.db"
        if template is not None:
            shutil.copy(template, backend)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"     # no job runner: registry only
        super().__init__(f"mlflow server on port {self.port}",
                         [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{backend}",
                          "--artifacts-destination", str(directory / "artifacts"), "--host", "127.0.0.1",
                          "--port", str(self.port), "--workers", "1"],
                         f"{self.uri}/health", env, directory / "server.log", cwd=directory,
                         timeout_s=timeout_s)


class Service:
    """A long-running command in its own process group, its output in a log file."""

    def __init__(self, name: str, command: list[str], env: dict, directory: Path):
        self.name = name
        self.log = directory / f"{name}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=directory, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """The whole group (workers, task supervisors)."""
        stop_process_group(self.process, 20)

    def describe(self, chars: int = 4000) -> str:
        state = "running" if self.alive() else f"exited {self.process.returncode}"
        return f"--- {self.name} ({state}), {self.log}:\n{tail(self.log, chars)}"


def specdec(*args: str, home: Path | None = None, env: dict | None = None,
            timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`specdec ARGS` as a new process of this checkout (`python -m tasks.cli`), without the
    caller's MLflow and database variables: its exit status and what it printed (text)."""
    from . import REPO

    environ = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_URI", "SPECDEC_DATABASE_URL")}
    environ.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if home is not None:
        environ["SPECDEC_HOME"] = str(home)
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=timeout_s)
