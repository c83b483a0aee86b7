"""benchmarks/run_on_device.sh --smoke on this CPU: what a GPU lease depends on. A step over its
limit is stopped with its processes and its log kept, the next steps still run and bring back their
reports, device.txt lists every step's exit status, the call exits non-zero, and the work folders
are removed, and the call ends when its last step does (not when the limits of steps that ended
early would have run out). Three of the default steps run whole (decode_layer, profile_layer,
scope)."""

from __future__ import annotations

import json
import os
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
    # output to files, not pipes: the call returns when the script exits, whatever it left running
    with open(root / "stdout", "w") as stdout, open(root / "stderr", "w") as stderr:
        done = subprocess.run(["bash", str(REPO / "benchmarks/run_on_device.sh"), "--smoke"], env=env,
                              stdout=stdout, stderr=stderr, timeout=900, check=False)
    watches = pgrep(f"^sleep {LONG_LIMIT}$")
    subprocess.run(["pkill", "-f", f"^sleep {LONG_LIMIT}$"], check=False)
    unpacked = root / "results"
    with tarfile.open(out / "results.tar.gz") as archive:
        archive.extractall(unpacked, filter="data")
    return {"rc": done.returncode, "output": (root / "stdout").read_text() + (root / "stderr").read_text(),
            "out": out, "tmp": tmp, "results": unpacked, "watches": watches}


def pgrep(pattern: str) -> str:
    return subprocess.run(["pgrep", "-a", "-f", pattern], capture_output=True, text=True, check=False).stdout


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
    left = pgrep("benchmarks/head_step.py --device cpu --smoke")
    assert left == "", f"processes of the stopped step still running: {left}"


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
    # the fused step: the plain step fused, unfused and compiled (the bandwidth goal's), each measured
    fused = json.loads((results / "breakdown_fused.json").read_text())
    configs = {c["name"]: c for c in fused["configs"]}
    assert list(configs) == ["plain_graphs", "plain_unfused", "plain_compiled"]
    assert all("error" not in c and c["mismatched_rows"] == 0 for c in configs.values())
    assert [c["compiled"] for c in configs.values()] == [False, False, True]
    assert configs["plain_compiled"]["compiled_bodies"] >= 1
    assert (results / "breakdown_fused.md").read_text().startswith("# Where decoding time goes")


def test_the_work_folders_are_removed(run):
    assert list(run["tmp"].iterdir()) == []


def test_the_limits_of_steps_that_ended_are_not_left_running(run):
    # a watch left sleeping holds the call's output open: the device call would wait out the limit
    assert run["watches"] == "", f"limit watches still sleeping after the call: {run['watches']}"
