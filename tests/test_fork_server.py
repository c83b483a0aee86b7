"""The fork server (tasks/serving/scripts/fork_server.py, tasks/serving/forks.py): jobs started as
forks of one process that imported their modules once, run as `python SCRIPT ARG...` would, and
stopped with everything they started. The serving environment's fork server runs the same script
with vLLM preloaded (tests/test_vllm_server.py); here the "serving python" is this test's own
interpreter and the preloaded module one written by the test, which counts its imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.serving import environment as serving_env
from tasks.serving import forks
from tasks.settings import load_settings

pytestmark = pytest.mark.integration

JOB = textwrap.dedent("""\
    import json, os, sys
    import preloaded_for_test
    print("to stderr", file=sys.stderr)
    request = json.load(sys.stdin)
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "request": request,
                      "job_only": os.environ.get("JOB_ONLY"), "server_only": os.environ.get("SERVER_ONLY"),
                      "imports": preloaded_for_test.IMPORTS, "name": __name__,
                      "pid": os.getpid(), "pgid": os.getpgid(0)}))
    sys.exit(int(request.get("exit", 0)))
    """)


@pytest.fixture
def preload(tmp_path, monkeypatch):
    """A module that appends a line to a file each time it is imported, on PYTHONPATH."""
    package = tmp_path / "lib"
    package.mkdir()
    counter = tmp_path / "imports.txt"
    (package / "preloaded_for_test.py").write_text(
        f"with open({str(counter)!r}, 'a') as f:\n    f.write('imported\\n')\n"
        f"IMPORTS = open({str(counter)!r}).read().count('imported')\n")
    (package / "runnable_module.py").write_text(
        "import sys\nprint('module', __name__, sys.argv[1:])\nsys.exit(4)\n")
    monkeypatch.setenv("PYTHONPATH", str(package))
    monkeypatch.setattr(forks, "PRELOAD", ("preloaded_for_test",))
    yield counter
    forks.stop_all()


@pytest.fixture
def server(preload):
    started = forks.ForkServer(sys.executable, dict(os.environ, SERVER_ONLY="1"),
                               modules=("preloaded_for_test",))
    assert started.start(timeout_s=60)
    yield started
    started.stop()


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True                    # exited; its parent (not us) has yet to reap it
        except (ProcessLookupError, FileNotFoundError):
            return True
        try:                                   # our own child: reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def test_a_job_runs_as_its_script_would_with_the_preloaded_module_imported_once(server, preload, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, JOB_ONLY="yes")
    answers = []
    for exit_code in (0, 3):
        stdin, stdout, stderr = tmp_path / "in.json", tmp_path / "out.txt", tmp_path / "err.txt"
        stdin.write_text(json.dumps({"exit": exit_code}))
        process = server.launch([str(script), "one", "two"], env, cwd=str(tmp_path), stdin=str(stdin),
                                stdout=str(stdout), stderr=str(stderr))
        assert process.wait(30) == exit_code and process.poll() == exit_code
        answers.append(json.loads(stdout.read_text()))
        assert stderr.read_text() == "to stderr\n"
    for answer in answers:
        assert answer["argv"] == [str(script), "one", "two"] and answer["name"] == "__main__"
        assert answer["cwd"] == str(tmp_path) and answer["request"]["exit"] in (0, 3)
        # the job's environment replaces the server's
        assert answer["job_only"] == "yes" and answer["server_only"] is None
        # its own session and process group, led by the job
        assert answer["pgid"] == answer["pid"] != server.process.pid
    # imported once, by the server, before either job: each job found it imported
    assert preload.read_text().count("imported") == 1
    assert [a["imports"] for a in answers] == [1, 1]

    out = tmp_path / "module.txt"
    process = server.launch(["-m", "runnable_module", "x"], env, stdout=str(out))
    assert process.wait(30) == 4
    assert out.read_text() == "module __main__ ['x']\n"
    process = server.launch(["-c", "import sys; print(__name__, sys.argv); sys.exit(5)", "y"], env,
                            stdout=str(out))
    assert process.wait(30) == 5
    assert out.read_text() == "__main__ ['-c', 'y']\n"


def test_a_job_past_its_timeout_is_killed_with_what_it_started(server, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""\
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
        """))
    out = tmp_path / "hang.txt"
    job = server.launch([str(script)], dict(os.environ), stdout=str(out))
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(3)
    grandchild = int(out.read_text())
    job.kill_group()
    assert job.wait(30) == -signal.SIGKILL
    assert wait_gone(job.pid) and wait_gone(grandchild)

    # forks.run: the same, as subprocess.run reports it
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run(sys.executable, [str(script)], dict(os.environ), "", timeout_s=3,
                  stderr_path=tmp_path / "hang.log")
    assert time.monotonic() - began < 60
    forks.stop_all()


def test_run_captures_the_answer_and_the_exit_status(preload, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = forks.run(sys.executable, [str(script)], dict(os.environ), json.dumps({"exit": 2}), 30)
    assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 2
    assert json.loads(done.stdout)["request"] == {"exit": 2} and done.stderr == "to stderr\n"
    # the same environment's next job reuses the running server: no second import
    again = forks.run(sys.executable, [str(script)], dict(os.environ), "{}", 30)
    assert again.returncode == 0 and preload.read_text().count("imported") == 1
    # a variable read at import (PYTHON*, VLLM_*) asks for a server of its own; a per-job one does not
    forks.run(sys.executable, [str(script)], dict(os.environ, VLLM_CPU_KVCACHE_SPACE="3"), "{}", 30)
    assert preload.read_text().count("imported") == 1
    forks.run(sys.executable, [str(script)], dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG"), "{}", 30)
    assert preload.read_text().count("imported") == 2
    forks.stop_all()


def test_the_server_stops_its_jobs_when_it_is_stopped_or_its_parent_dies(server, preload, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    job = server.launch([str(script)], dict(os.environ))
    server.stop()
    assert wait_gone(job.pid) and server.process.poll() is not None

    # a parent killed with SIGKILL runs no exit handler: the server notices and stops its jobs
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""\
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from tasks.serving import forks
        server = forks.ForkServer(sys.executable, dict(os.environ), modules=("preloaded_for_test",))
        assert server.start(timeout_s=60)
        job = server.launch([{str(script)!r}], dict(os.environ))
        print(server.process.pid, job.pid, flush=True)
        time.sleep(600)
        """))
    process = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True)
    try:
        server_pid, job_pid = map(int, process.stdout.readline().split())
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        assert wait_gone(server_pid, 30) and wait_gone(job_pid, 30)
    finally:
        process.kill()


def test_a_python_that_cannot_preload_runs_the_process_on_its_own(preload, tmp_path, caplog, monkeypatch):
    # a serving python without vLLM (here: this interpreter, where vllm is not installed)
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint(sys.stdin.read().upper())\n")
    monkeypatch.setattr(forks, "PRELOAD", ("no_such_module_for_the_fork_server",))
    assert forks.launch(sys.executable, [str(script)], dict(os.environ)) is None
    assert "could not start" in caplog.text and "no_such_module_for_the_fork_server" in caplog.text
    # the environment's runner then starts a process of its own, with the same answer
    settings = load_settings()
    assert settings.engine.fork_server
    done = serving_env._run(settings, Path(sys.executable), [str(script)], dict(os.environ), "abc", 30)
    assert done.returncode == 0 and done.stdout == "ABC\n"
    forks.stop_all()


def test_a_fork_of_the_pipeline_starts_fork_servers_of_its_own(preload, tmp_path):
    # an executor's worker forked from a process that runs a fork server must not share its pipe
    # (the parent's reader thread would take the answers): the fork forgets the running servers
    script = tmp_path / "job.py"
    script.write_text(JOB)
    assert forks.run(sys.executable, [str(script)], dict(os.environ), "{}", 30).returncode == 0
    assert any(s is not None for s in forks._SERVERS.values())
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not forks._SERVERS else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert any(s is not None and s.alive() for s in forks._SERVERS.values())   # the parent's, still


def test_a_job_of_a_fork_server_that_dies_reads_as_killed(server, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    job = server.launch([str(script)], dict(os.environ))
    os.kill(server.process.pid, signal.SIGKILL)      # no chance to stop its jobs
    # the job is no longer supervised: waiting for it stops it
    assert job.wait(30) == -signal.SIGKILL and not server.alive()
    assert wait_gone(job.pid)


def test_a_job_and_every_thread_it_starts_stay_on_the_cpus_it_was_bound_to(server, preload, tmp_path):
    # vLLM binds only its OpenMP threads; the engine loop and the API server's threads follow
    # the process, which the fork (or the process of its own) keeps on the CPUs it was given
    script = tmp_path / "affinity.py"
    script.write_text("import os, threading\nseen = []\n"
                      "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
                      "t.start(); t.join()\nprint(sorted(os.sched_getaffinity(0)), seen[0])\n")
    first = min(os.sched_getaffinity(0))
    out = tmp_path / "affinity.txt"
    job = server.launch([str(script)], dict(os.environ, SPECDEC_PIN_CPUS=str(first)), stdout=str(out))
    assert job.wait(30) == 0
    assert out.read_text() == f"[{first}] [{first}]\n"
    # unbound (vLLM's own choice): every CPU this process may use
    job = server.launch([str(script)], dict(os.environ), stdout=str(out))
    assert job.wait(30) == 0
    every = sorted(os.sched_getaffinity(0))
    assert out.read_text() == f"{every} {every}\n"
    # a process of its own (no fork server): the same
    done = serving_env._run(load_settings(engine_fork_server=False), Path(sys.executable), [str(script)],
                            dict(os.environ, SPECDEC_PIN_CPUS=str(first)), "", 30)
    assert done.stdout == f"[{first}] [{first}]\n"
    # what an engine's environment asks for: one OpenMP thread per CPU given, and the whole
    # process pinned there (a suffix engine's as well)
    assert serving_env.thread_env("1") == {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1",
                                           "SPECDEC_PIN_CPUS": "1"}
    assert serving_env.thread_env("0-2,5") == {"VLLM_CPU_OMP_THREADS_BIND": "0-2,5",
                                               "OMP_NUM_THREADS": "4", "SPECDEC_PIN_CPUS": "0-2,5"}
    assert serving_env.thread_env(None) == {}


@pytest.mark.parametrize("fork_server", [True, False])
def test_an_engine_given_one_cpu_runs_one_openmp_thread_on_it(preload, tmp_path, monkeypatch, fork_server):
    # vLLM's in-process engine never binds its OpenMP threads: torch keeps the thread count it
    # read when it loaded (in a fork server's fork, the server's), and two threads on the one CPU
    # an engine was given stalled every parallel region (a suffix engine beside a spun core: about
    # 1 token/s). The machine's own count in the environment, as where nothing sets it
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(forks, "PRELOAD", ("torch",))
    script = tmp_path / "threads.py"
    script.write_text("import os, torch\nprint(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))\n")
    first = min(os.sched_getaffinity(0))
    env = dict(os.environ, **serving_env.thread_env(str(first)))
    done = serving_env._run(load_settings(engine_fork_server=fork_server), Path(sys.executable),
                            [str(script)], env, "", 120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"1 [{first}]\n"
    # left to vLLM (every CPU free): the environment's own count, unpinned
    done = serving_env._run(load_settings(engine_fork_server=fork_server), Path(sys.executable),
                            [str(script)], dict(os.environ, **serving_env.thread_env(None)), "", 120)
    assert done.stdout == f"2 {sorted(os.sched_getaffinity(0))}\n"
