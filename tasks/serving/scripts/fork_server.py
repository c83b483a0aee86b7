"""Runs inside the serving environment: imports vLLM (or the modules named on its command line)
once, then starts each job the pipeline sends it as a fork of itself, so a job pays none of that
import (about 15-20 s of CPU for torch, inductor and vLLM on a 2-core machine; the engine's own
start is a few seconds). Standard library only, besides what it preloads.

    SERVING_PYTHON fork_server.py [MODULE ...]        (default: vllm)

The first module must import (else it says so and exits); the others are imported where this
build has them (a job imports what is missing itself).

Protocol, one JSON object per line. It prints {"ready": true, "pid", "import_s"} (or {"ready":
false, "error"}) when the modules are imported, then reads jobs on stdin:

    {"id", "argv": [script, arg...] | ["-m", module, arg...] | ["-c", code, arg...], "env", "cwd",
     "stdin": path | null, "stdout": path, "stderr": path | "stdout", "append": bool}

and answers {"id", "pid"} once the job's process is forked (or {"id", "error"}), and {"id",
"exit": status} when it ends (a negative status: killed by that signal, as subprocess reports it).
Each job runs as `python SCRIPT ARG...` / `python -m MODULE ARG...` would: its own session and
process group (the caller stops the job and whatever it starts with one killpg of its pid), the
job's environment replacing this one, its standard streams on the named files, __main__ run by
runpy. Modules read their environment when imported, so the caller starts one fork server per
environment that matters at import (see tasks/serving/forks.py); what vLLM reads when an engine
starts (VLLM_CPU_KVCACHE_SPACE, VLLM_ENABLE_V1_MULTIPROCESSING, the plugins) is the job's.

It never starts an engine, a thread or a CUDA context itself, so each fork begins as a fresh
interpreter would after its imports. When its standard input closes, or the process that
started it is gone, it stops the jobs still running (SIGTERM to each process group, SIGKILL after
10 s) and exits.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback

GRACE_S = 10.0


def _say(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def pin_cpus(bind: str | None) -> None:
    """Keep this process, and every thread it starts, on the CPUs of a SPECDEC_PIN_CPUS list ("0,2"
    or "0-3"): vLLM's in-process engine binds none of its threads (its OpenMP threads, the engine
    loop, the API server), and one left on a neighbour's CPU stalls each step. Other forms ("all", NUMA
    groups with "|") leave the affinity as it is."""
    if not bind or bind == "all" or "|" in bind or not hasattr(os, "sched_setaffinity"):
        return
    os.sched_setaffinity(0, cpu_list(bind))


def cpu_list(bind: str) -> list[int]:
    """The CPUs of a "0,2" or "0-3" list."""
    cpus: set[int] = set()
    for part in bind.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return sorted(cpus)


def _child(job: dict) -> None:
    """In the forked process: become the job, run it, exit with its status (never returns)."""
    status = 1
    try:
        os.setsid()
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        os.chdir(job.get("cwd") or os.getcwd())
        os.environ.clear()
        os.environ.update(job.get("env") or {})
        pin_cpus(os.environ.get("SPECDEC_PIN_CPUS"))
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if job.get("append") else os.O_TRUNC)
        stdin = os.open(job["stdin"], os.O_RDONLY) if job.get("stdin") else os.open(os.devnull, os.O_RDONLY)
        stdout = os.open(job["stdout"], mode, 0o644)
        stderr = stdout if job.get("stderr", "stdout") == "stdout" else os.open(job["stderr"], mode, 0o644)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        for fd in {stdin, stdout, stderr}:
            if fd > 2:
                os.close(fd)
        _title(" ".join([sys.executable, *job["argv"]]))     # as `ps` would show the job's own process
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        status = _run(list(job["argv"]))
    except BaseException:  # noqa: BLE001 - whatever the job raised is its failure, printed as Python would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()      # what the job registered, as an interpreter's exit runs it
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _title(title: str) -> None:
    """The process's title in `ps` (setproctitle, which vLLM depends on, where it is installed)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _run(argv: list[str]) -> int:
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def _stop(running: dict[int, str]) -> None:
    for pid in running:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    while running and time.monotonic() < deadline:
        _reap(running)
        time.sleep(0.1)
    for pid in list(running):
        try:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        running.pop(pid, None)


def _reap(running: dict[int, str]) -> None:
    while running:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        job_id = running.pop(pid, None)
        if job_id is not None:
            _say({"id": job_id, "exit": _status(wait_status)})


def serve(modules: list[str]) -> int:
    parent = os.getppid()
    began = time.perf_counter()
    try:
        importlib.import_module(modules[0])
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which then runs jobs without us
        _say({"ready": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return 1
    missing = []
    for module in modules[1:]:          # the rest where this build has them
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a job that needs it imports it itself
            missing.append(module)
    _title(f"specdec fork server ({sys.executable}, {len(modules) - len(missing)} modules preloaded)")
    sys.stdout.flush()
    sys.stderr.flush()
    _say({"ready": True, "pid": os.getpid(), "import_s": round(time.perf_counter() - began, 2),
          "missing": missing})
    running: dict[int, str] = {}
    pending = b""
    try:
        while True:
            readable, _, _ = select.select([0], [], [], 0.2)
            _reap(running)
            if os.getppid() != parent:
                return 0
            if not readable:
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                job = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:
                    _say({"id": job["id"], "error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    _child(job)
                running[pid] = job["id"]
                _say({"id": job["id"], "pid": pid})
    finally:
        _stop(running)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:] or ["vllm"]))
