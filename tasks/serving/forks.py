"""Processes of the serving environment started from a fork server (scripts/fork_server.py).

Each vLLM process the pipeline starts -- an engine check's replay, a cost measurement's engine,
a probe, an OpenAI server -- used to import torch, inductor and vLLM before doing anything: 15-20
s of CPU on a 2-core machine, where the tiny engines of a CPU check then start in 3-4 s and
replay in a few more. A fork server imports them once; every process after that is a fork of
it, with its own session, environment and standard streams, started as `python SCRIPT ARG...`
would be (the job's code runs as __main__ under runpy).

`launch(python, argv, env, ...)` returns a `ForkedProcess` (pid, poll, wait, returncode: the
subset of subprocess.Popen the callers use; the pid is the process group to stop). One fork server
per serving python and per environment that matters when modules are imported (VLLM_*, PYTHON*,
OMP/MKL thread settings, except what vLLM reads only when an engine starts), started on first use
and stopped by its own PID when the pipeline's process exits; it also stops, with the jobs it
still runs, when its standard input closes or its parent is gone. Where no fork server can be
started (or the setting engine.fork_server is off), `launch` returns None and the caller starts
the process itself, as before.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fork_server.py"
# read by vLLM (or our plugin) only when an engine starts: a job may set them per process
PER_JOB = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
           "SPECDEC_VLLM_MENDS", "SPECDEC_VLLM_PLAN")
IMPORT_TIME = ("VLLM_", "PYTHON", "OMP_", "MKL_", "KMP_", "CUDA_", "TORCH", "LD_")
READY_TIMEOUT_S = 300.0
# what the fork server imports: vLLM, its offline engine (`from vllm import LLM` alone is 11 s of
# a 2-core machine's CPU: vllm's __init__ imports it lazily), the OpenAI server, the engine core
# and the CPU worker (the last ones where the build has them)
PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.engine.arg_utils", "vllm.entrypoints.openai.api_server",
           "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker")


def import_key(env: dict) -> tuple:
    """The part of an environment that modules read when they are imported."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(IMPORT_TIME) and k not in PER_JOB))


class ForkedProcess:
    """A job of a fork server: a process of its own session (pid = its process group)."""

    def __init__(self, server: "ForkServer", job_id: str, pid: int, args: list[str]):
        self.server, self.job_id, self.pid, self.args = server, job_id, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_status(self.job_id)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status (negative: the signal that killed it); subprocess.TimeoutExpired past
        `timeout` seconds."""
        status = self.server.wait_exit(self.job_id, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = status
        return status

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass


class ForkServer:
    """One fork server process (see the module's docstring)."""

    def __init__(self, python: str, env: dict, modules: tuple[str, ...] = PRELOAD):
        self.python, self.env, self.modules = str(python), dict(env), modules
        self.process: subprocess.Popen | None = None
        self.import_s: float | None = None
        self._exits: dict[str, int] = {}
        self._forked: dict[str, dict] = {}
        self._pids: dict[str, int] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._reader: threading.Thread | None = None
        self._ready: dict | None = None
        self._gone = False                  # its output ended: it exited, or is exiting

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Start it and wait until its modules are imported; False (logged) where it cannot."""
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([self.python, str(SCRIPT), *self.modules],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, env=self.env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()
        with self._changed:
            self._changed.wait_for(lambda: self._ready is not None, timeout_s)
        ready = self._ready or {"ready": False, "error": f"not ready within {timeout_s:.0f} s"}
        if not ready.get("ready"):
            self._log.seek(0)
            tail = self._log.read()[-1500:].decode(errors="replace")
            log.warning("fork server %s could not start (%s): processes start on their own; %s",
                        self.python, ready.get("error"), tail)
            self.stop()
            return False
        self.import_s = ready.get("import_s")
        log.info("fork server %s (pid %d): %s imported in %.1f s", self.python, self.process.pid,
                 ", ".join(self.modules), self.import_s or 0.0)
        return True

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                if "ready" in message:
                    self._ready = message
                elif "exit" in message:
                    self._exits[message["id"]] = int(message["exit"])
                else:
                    self._forked[message["id"]] = message
                self._changed.notify_all()
        with self._changed:                 # gone: no job of it will report again
            self._gone = True
            self._ready = self._ready or {"ready": False, "error": "it exited"}
            self._changed.notify_all()

    def alive(self) -> bool:
        return (self.process is not None and not self._gone and self.process.poll() is None
                and bool(self._ready and self._ready.get("ready")))

    def launch(self, argv: list[str], env: dict, cwd: str | None = None, stdin: str | None = None,
               stdout: str = os.devnull, stderr: str = "stdout", append: bool = False) -> ForkedProcess:
        """Fork one job (see scripts/fork_server.py for the fields); OSError when it cannot."""
        job_id = str(next(self._ids))
        job = {"id": job_id, "argv": [str(a) for a in argv], "env": dict(env),
               "cwd": cwd or os.getcwd(), "stdin": stdin and str(stdin), "stdout": str(stdout),
               "stderr": str(stderr), "append": append}
        with self._changed:
            if not self.alive():
                raise OSError(f"fork server {self.python} is not running")
            self.process.stdin.write((json.dumps(job) + "\n").encode())
            self.process.stdin.flush()
            self._changed.wait_for(lambda: job_id in self._forked or not self.alive(), 60)
            answer = self._forked.pop(job_id, None)
            if answer and "pid" in answer:
                self._pids[job_id] = int(answer["pid"])
        if not answer or "pid" not in answer:
            raise OSError(f"fork server {self.python} did not start {argv[:2]}: "
                          f"{(answer or {}).get('error', 'no answer')}")
        return ForkedProcess(self, job_id, int(answer["pid"]), job["argv"])

    def exit_status(self, job_id: str) -> int | None:
        with self._lock:
            return self._exits.get(job_id)

    def wait_exit(self, job_id: str, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: job_id in self._exits or not self.alive(), timeout)
            if job_id not in self._exits and not self.alive():
                # the server is gone: it stopped its jobs, or it was killed and a job it forked
                # may run on, unsupervised -- stopped here, so that nothing is left behind
                pid = self._pids.get(job_id)
                # its group, and the process itself: the server reports a fork's pid before the
                # fork has made its own session (os.setsid), so a job killed with its server in
                # between has no group of its own yet and a killpg alone missed it
                for kill in (os.killpg, os.kill) if pid is not None else ():
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self._exits[job_id] = -signal.SIGKILL
            return self._exits.get(job_id)

    def stop(self, grace_s: float = 15.0) -> None:
        """Close its input (it stops its jobs and exits), then stop it by its own PID."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=grace_s)
        log.info("fork server %s (pid %d) stopped", self.python, self.process.pid)


_SERVERS: dict[tuple, ForkServer | None] = {}
_SERVERS_LOCK = threading.Lock()


def launch(python, argv: list[str], env: dict, **files) -> ForkedProcess | None:
    """`python ARGV...` as a fork of the serving environment's fork server for (python, the
    environment's import-time part); None where none can run (the caller starts it itself)."""
    key = (str(python), import_key(env))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key, False)
        if server is False or (server is not None and not server.alive()):
            server = ForkServer(str(python), {k: v for k, v in env.items() if k not in PER_JOB},
                                PRELOAD)
            _SERVERS[key] = server = server if server.start() else None
    if server is None:
        return None
    try:
        return server.launch(argv, env, **files)
    except OSError as exc:
        log.warning("%s: the process starts on its own", exc)
        return None


def run(python, argv: list[str], env: dict, input_text: str, timeout_s: float,
        stderr_path: str | Path | None = None) -> subprocess.CompletedProcess | None:
    """subprocess.run(argv, input=input_text, capture_output (or stderr to stderr_path),
    text=True, timeout=timeout_s) as a fork; None where no fork server can run it.
    subprocess.TimeoutExpired (carrying the stderr captured so far) past the timeout, after the
    job's process group is killed."""
    with tempfile.TemporaryDirectory(prefix="specdec-fork-") as work:
        stdin, stdout = Path(work) / "stdin", Path(work) / "stdout"
        stdin.write_text(input_text)
        stderr = Path(stderr_path) if stderr_path is not None else Path(work) / "stderr"
        process = launch(python, [*map(str, argv)], env, stdin=str(stdin), stdout=str(stdout),
                         stderr=str(stderr))
        if process is None:
            return None
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill_group()
            process.wait(30)
            raise subprocess.TimeoutExpired(
                argv, timeout_s, stderr=None if stderr_path else stderr.read_bytes()) from None
        return subprocess.CompletedProcess(
            argv, process.returncode, stdout.read_text(errors="replace"),
            "" if stderr_path else stderr.read_text(errors="replace"))


def _forget_in_child() -> None:
    # a fork of this process (an executor's worker, a forked task) starts fork servers of its own:
    # the running ones' pipes and reader threads belong to the parent
    global _SERVERS_LOCK
    _SERVERS.clear()
    _SERVERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def stop_all() -> None:
    """Stop every fork server this process started (each stops the jobs it still runs)."""
    with _SERVERS_LOCK:
        servers = [s for s in _SERVERS.values() if s is not None]
        _SERVERS.clear()
    for server in servers:
        server.stop()
