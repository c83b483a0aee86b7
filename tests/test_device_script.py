"""benchmarks/run_on_device.sh --smoke on this CPU: what a GPU lease depends on. A step over its
limit is stopped with its processes and its log kept, the next steps still run and bring back their
reports, device.txt lists every step's exit status, the call exits non-zero, and the work folders
are removed, and the call ends when its last step does (not when the limits of steps that ended
early would have run out). Four of the default steps run whole (fused, decode_layer, profile_layer,
scope). And the embedded default's GGUF, too large for one call, split into parts that each fit a
call beside the checkout and joined from the parts that several calls carried."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from .helpers import REPO

pytestmark = pytest.mark.integration


# the limit of the steps that run whole: a number no other process sleeps for
LONG_LIMIT = 1207


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    out, tmp = root / "out", root / "tmp"
    tmp.mkdir()
    env = {name: value for name, value in os.environ.items() if not name.startswith("SPECDEC_")}
    env.update(OUT=str(out), TMPDIR=str(tmp), STEPS="head_step fused decode_layer profile_layer scope",
               LIMITS=" ".join(["head_step=1"] + [f"{step}={LONG_LIMIT}" for step in
                                                  ("fused", "decode_layer", "profile_layer", "scope")]),
               # the script's python3 is this environment's
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # output to files, not pipes: the call returns when the script exits, whatever it left running.
    # A session of its own: what the call left running is what is left in that session (another
    # run of this module, under pytest-xdist, has its own), and only that is stopped, by its PIDs.
    with open(root / "stdout", "w") as stdout, open(root / "stderr", "w") as stderr:
        call = subprocess.Popen(["bash", str(REPO / "benchmarks/run_on_device.sh"), "--smoke"], env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            rc = call.wait(timeout=900)
        finally:
            left = session_processes(call.pid)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            call.kill()          # only if it still runs (a reaped PID may belong to another process)
            call.wait()
    unpacked = root / "results"
    with tarfile.open(out / "results.tar.gz") as archive:
        archive.extractall(unpacked, filter="data")
    return {"rc": rc, "output": (root / "stdout").read_text() + (root / "stderr").read_text(),
            "out": out, "tmp": tmp, "results": unpacked, "left": left}


def session_processes(session: int) -> dict[int, str]:
    """The processes of a session still running: PID -> command line (the call's own leader left out)."""
    found = subprocess.run(["pgrep", "-a", "-s", str(session)], capture_output=True, text=True, check=False)
    rows = (line.split(" ", 1) for line in found.stdout.splitlines())
    return {int(row[0]): row[1] if len(row) > 1 else "" for row in rows if int(row[0]) != session}


def left_running(run, command: str) -> list[str]:
    return [line for line in run["left"].values() if command in line]


def test_every_step_reports_its_exit_status_and_a_failed_one_fails_the_call(run):
    assert run["rc"] == 1, run["output"][-5000:]
    lines = (run["out"] / "device.txt").read_text().splitlines()
    steps = lines[-1].split()          # steps: KEY rc=N KEY rc=N ...
    assert steps[0] == "steps:"
    status = {key: rc.removeprefix("rc=") for key, rc in zip(steps[1::2], steps[2::2])}
    assert list(status) == ["head_step", "fused", "profile_layer", "decode_layer", "scope"]   # the script's order
    assert status["head_step"] != "0"
    assert [status[k] for k in ("fused", "decode_layer", "profile_layer", "scope")] == ["0"] * 4
    assert any(line.startswith("python ") and line.endswith("device cpu") for line in lines)


def test_a_step_over_its_limit_is_stopped_with_its_processes_and_its_log_kept(run):
    log = (run["results"] / "head_step.log").read_text()
    assert log.startswith("=== head_step: ")
    assert "=== head_step: over its limit of 1s, stopped ===" in log
    assert not (run["results"] / "head_step.md").exists()        # it did not get to its report
    left = left_running(run, "benchmarks/head_step.py --device cpu --smoke")
    assert left == [], f"processes of the stopped step still running: {left}"


def test_the_steps_after_it_bring_back_their_reports(run):
    results = run["results"]
    decode = json.loads((results / "gpu_decode_layer.json").read_text())
    assert decode["meta"]["device"] == "cpu" and decode["meta"]["finished"] is True
    assert (results / "gpu_decode_layer.md").read_text().startswith("#")
    profile = (results / "profile_measure_layer.log").read_text()
    # measured and stored (its noise check may say "NOISY" on a busy machine: not this test's subject)
    assert "profiled random-smoke-cpu at batch sizes [1]" in profile
    assert "cost profile random-smoke-cpu (run profile__" in profile
    scope = json.loads((results / "compile_scope.json").read_text())
    # by default the layer scope's cold compile only (the whole forward's is SCOPE_SCOPES=layer,model)
    assert [c["scope"] for c in scope["cold"]] == ["layer"] and "steady" not in scope
    # the fused step: the plain step fused, unfused, compiled (the bandwidth goal's) and compiled with
    # coordinate descent tuning, each measured
    fused = json.loads((results / "breakdown_fused.json").read_text())
    configs = {c["name"]: c for c in fused["configs"]}
    assert list(configs) == ["plain_graphs", "plain_unfused", "plain_compiled", "plain_tuned"]
    assert all("error" not in c and c["mismatched_rows"] == 0 for c in configs.values())
    assert [c["compiled"] for c in configs.values()] == [False, False, True, True]
    assert configs["plain_compiled"]["compiled_bodies"] >= 1 and configs["plain_tuned"]["compiled_bodies"] >= 1
    assert configs["plain_tuned"]["inductor_options"] == {"coordinate_descent_tuning": True}
    assert (results / "breakdown_fused.md").read_text().startswith("# Where decoding time goes")


def test_the_work_folders_are_removed(run):
    assert list(run["tmp"].iterdir()) == []


def test_the_limits_of_steps_that_ended_are_not_left_running(run):
    # a watch left sleeping holds the call's output open: the device call would wait out the limit
    watches = [line for line in run["left"].values() if line == f"sleep {LONG_LIMIT}"]
    assert watches == [], f"limit watches still sleeping after the call: {watches}"


# ------------------------------------------------------------------------------------------------
# the GGUF in parts (--split-gguf, --join-gguf), in a checkout of its own with small limits
def device_script(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items() if not name.startswith("SPECDEC_")}
    return subprocess.run(["bash", str(repo / "benchmarks/run_on_device.sh"), *args],
                          env={**environ, **env}, capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.fixture
def checkout(tmp_path):
    """A git checkout holding the device script, one tracked file, wheels and a GGUF outside it."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks/run_on_device.sh", repo / "benchmarks")
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    (repo / "tracked.txt").write_bytes(b"x" * 3000)
    (repo / ".whl").mkdir()
    (repo / ".whl/pkg-1.0-py3-none-any.whl").write_bytes(b"w" * 2000)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "checkout"], check=True)
    tree = sum(path.stat().st_size for path in (repo / "benchmarks/run_on_device.sh",
                                                repo / ".gitignore", repo / "tracked.txt"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(20_000))
    machine = tmp_path / "machine-tmp"              # the device machine's /tmp, kept between calls
    machine.mkdir()
    return {"repo": repo, "tree": tree, "gguf": gguf, "machine": machine,
            # a call's room beside the checkout: 8000 bytes (6000 beside the wheels)
            "env": {"GGUF": str(gguf), "DEVICE_TREE_LIMIT": str(tree + 500 + 8000),
                    "DEVICE_TREE_MARGIN": "500", "PARTS_TMP": str(machine)}}


def test_the_gguf_is_split_into_parts_that_each_fit_one_call(checkout):
    repo, env = checkout["repo"], checkout["env"]
    done = device_script(repo, "--split-gguf", **env)
    assert done.returncode == 0, done.stderr
    parts = sorted(path.name for path in repo.glob(".gguf-?"))
    assert parts == [".gguf-a", ".gguf-b", ".gguf-c"]
    sizes = [(repo / part / "part").stat().st_size for part in parts]
    assert sizes == [6000, 8000, 6000]      # beside the wheels, then alone, then the rest
    assert b"".join((repo / part / "part").read_bytes() for part in parts) == checkout["gguf"].read_bytes()
    assert all((repo / part / "PARTS").read_text().split() == ["a", "b", "c"] for part in parts)
    # what each call carries, as the device tool counts it: none over the limit
    limit = int(env["DEVICE_TREE_LIMIT"])
    calls = [line for line in done.stdout.splitlines() if line.startswith("  call ")]
    assert calls[0].startswith('  call 1: carry [".whl", ".gguf-a"]: ')
    assert [int(line.rsplit(": ", 1)[1].split()[0]) for line in calls] == [
        checkout["tree"] + 2000 + 6000, checkout["tree"] + 8000, checkout["tree"] + 6000]
    assert all(int(line.rsplit(": ", 1)[1].split()[0]) <= limit for line in calls)
    # the parts are ignored by git: untracked, they would travel in every call beside the carried one
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True,
                            text=True, check=True).stdout
    assert ".gguf" not in status


def test_the_parts_of_several_calls_join_into_the_gguf_in_the_last_one(checkout):
    repo, env = checkout["repo"], checkout["env"]
    assert device_script(repo, "--split-gguf", **env).returncode == 0
    aside = checkout["machine"].parent / "aside"
    aside.mkdir()
    for folder in repo.glob(".gguf-?"):
        folder.rename(aside / folder.name)
    outcomes = []
    for letter in "abc":                    # one call a part: only that part travels
        (aside / f".gguf-{letter}").rename(repo / f".gguf-{letter}")
        outcomes.append(device_script(repo, "--join-gguf", **env))
        (repo / f".gguf-{letter}").rename(aside / f".gguf-{letter}")
    first, second, last = outcomes
    assert first.returncode == 1 and "the GGUF's part b is not here: carry .gguf-b" in first.stderr
    assert second.returncode == 1 and "part c is not here: carry .gguf-c" in second.stderr
    assert last.returncode == 0, last.stderr
    joined = Path(last.stdout.strip())
    assert joined.parent == checkout["machine"] and joined.read_bytes() == checkout["gguf"].read_bytes()


def test_a_part_of_another_split_is_refused_by_its_checksum(checkout):
    repo, env = checkout["repo"], checkout["env"]
    assert device_script(repo, "--split-gguf", **env).returncode == 0
    assert device_script(repo, "--join-gguf", **env).returncode == 0
    (checkout["machine"] / "smollm2.gguf").unlink()
    (checkout["machine"] / "gguf-b.part").write_bytes(os.urandom(8000))    # a stale part
    for folder in repo.glob(".gguf-?"):
        shutil.rmtree(folder)
    done = device_script(repo, "--join-gguf", **env)
    assert done.returncode == 1 and "checksum differs" in done.stderr
    assert not (checkout["machine"] / "smollm2.gguf").exists()


def test_a_split_that_cannot_fit_or_would_travel_untracked_is_refused(checkout):
    repo, env = checkout["repo"], checkout["env"]
    small = {**env, "DEVICE_TREE_LIMIT": str(checkout["tree"] + 500 + 1000)}     # wheels: 2000
    done = device_script(repo, "--split-gguf", **small)
    assert done.returncode == 1 and "does not fit beside the checkout" in done.stderr
    assert "carry fewer wheels or track less" in done.stderr
    (repo / ".gitignore").write_text("/.whl/\n")
    done = device_script(repo, "--split-gguf", **env)
    assert done.returncode == 1 and ".gguf-a/ is not ignored by git" in done.stderr
    assert not list(repo.glob(".gguf-?"))


def test_a_call_with_no_steps_only_installs_and_keeps_the_part_it_carries(checkout, tmp_path):
    # the lease's first call when the head comes next: `STEPS=` (empty) runs no step at all
    repo, env = checkout["repo"], checkout["env"]
    assert device_script(repo, "--split-gguf", **env).returncode == 0
    for letter in "bc":
        shutil.rmtree(repo / f".gguf-{letter}")
    out = tmp_path / "out"
    done = device_script(repo, "--smoke", **env, STEPS="", OUT=str(out), TMPDIR=str(tmp_path),
                         PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "device.txt").read_text().splitlines()[-1] == "steps: none"
    assert (checkout["machine"] / "gguf-a.part").read_bytes() == (repo / ".gguf-a/part").read_bytes()
    assert not (checkout["machine"] / "gguf-b.part").exists()
