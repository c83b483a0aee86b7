"""The test suite's own layout: shared helpers live in tests/helpers/ (fixtures in conftest.py),
and no test module or helper imports a test module or conftest.py -- so a module runs on its own,
and moving or renaming one breaks nothing else; and how `make test` shares the machine between its
workers (the order of files, the cores of the processes tests start)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import REPO
from .helpers.ordering import longest_first, recorded_seconds
from .helpers.workers import worker_environment

TESTS = Path(__file__).resolve().parent
TEST_MODULES = sorted(TESTS.glob("test_*.py"))
HELPERS = sorted((TESTS / "helpers").glob("*.py"))


def imported_modules(source: str, at: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, a file at `at` under tests/; relative imports
    spelled from the top (`from .test_x import y` and `from . import test_x` are both
    `tests.test_x`, and a name imported from a package counts as its module too)."""
    package = ["tests", *at.parent.relative_to(TESTS).parts]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def forbidden(module: str) -> bool:
    """A test module or conftest, however it is spelled (tests.test_x, test_x, tests.conftest)."""
    parts = module.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and (parts[0].startswith("test_") or parts[0] == "conftest")


@pytest.mark.parametrize("path", TEST_MODULES + HELPERS, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_module_or_helper_imports_a_test_module_or_conftest(path):
    bad = [f"{path.relative_to(TESTS)}:{line}: imports {module}"
           for line, module in imported_modules(path.read_text(encoding="utf-8"), path)
           if forbidden(module)]
    assert not bad, ("shared helpers go into tests/helpers/ (fixtures into conftest.py):\n"
                     + "\n".join(bad))


def test_the_check_sees_every_spelling():
    source = ("from .test_a import x\nfrom . import test_b\nimport tests.test_c\nfrom tests import test_d\n"
              "from .conftest import y\nimport conftest\nfrom .helpers.models import VOCAB\n"
              "from .helpers import REPO\nimport torch\n")
    modules = {module for _, module in imported_modules(source, TESTS / "test_probe.py")}
    assert {m for m in modules if forbidden(m)} == {
        "tests.test_a", "tests.test_a.x", "tests.test_b", "tests.test_c", "tests.test_d",
        "tests.conftest", "tests.conftest.y", "conftest"}
    # from a helper module, `..` is the tests package
    helper = {m for _, m in imported_modules("from ..test_a import x\nfrom .db import fetch\n",
                                             TESTS / "helpers" / "probe.py") if forbidden(m)}
    assert helper == {"tests.test_a", "tests.test_a.x"}


def test_helpers_hold_no_fixtures():
    for path in HELPERS:
        assert "pytest.fixture" not in path.read_text(encoding="utf-8"), \
            f"{path.relative_to(TESTS)}: fixtures belong in tests/conftest.py"


def test_every_recorded_test_file_exists():
    """A renamed or removed file left in tests/file_seconds.json would silently lose its place."""
    stale = [path for path in recorded_seconds() if not (REPO / path).is_file()]
    assert not stale, (f"tests/file_seconds.json names files that are gone: {stale}; run "
                       "scripts/test_durations.py on a full run's --junitxml report")


def test_files_sort_longest_recorded_first_and_unrecorded_ones_last():
    seconds = {"tests/test_a.py": 5.0, "tests/test_b.py": 300.0, "tests/test_c.py": 0.0}
    tests = [(TESTS / name, index) for index, name in
             enumerate(["test_a.py", "test_a.py", "test_new.py", "test_c.py", "test_b.py", "test_b.py"])]
    order = sorted(tests, key=lambda test: longest_first(test[0], seconds))
    assert [(path.name, index) for path, index in order] == [
        ("test_b.py", 4), ("test_b.py", 5), ("test_a.py", 0), ("test_a.py", 1), ("test_c.py", 3),
        ("test_new.py", 2)]
    assert longest_first(Path("/elsewhere/test_x.py"), seconds) == 1.0


def test_the_durations_script_sums_each_files_cases(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="one" time="1.25"/>'
        '<testcase classname="tests.test_a.TestGroup" name="two" time="2.5"/>'
        '<testcase classname="tests.test_b" name="three" time="10"/>'
        '<testcase classname="tests.test_c" name="skipped" time=""/>'
        '</testsuite></testsuites>')
    out = tmp_path / "seconds.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "test_durations.py"), str(report),
                    "--out", str(out)], check=True, capture_output=True)
    assert recorded_seconds(out) == {"tests/test_b.py": 10.0, "tests/test_a.py": 3.8,
                                     "tests/test_c.py": 0.0}
    assert list(recorded_seconds(out)) == ["tests/test_b.py", "tests/test_a.py", "tests/test_c.py"]


@pytest.mark.integration
def test_make_test_runs_files_longest_recorded_first():
    """`make test`'s own pytest options on three quick files given shortest first: the worker runs
    them longest first (xdist alone would keep the order of their test counts)."""
    recipe = next(line for line in (REPO / "Makefile").read_text().splitlines()
                  if "-m pytest" in line and "$(TEST_WORKERS)" in line)
    options = recipe.split("$(TEST_WORKERS)", 1)[1].split()
    files = ["tests/test_verify.py", "tests/test_architecture.py", "tests/test_random_model.py"]
    seconds = recorded_seconds()
    expected = sorted(files, key=lambda name: longest_first(REPO / name, seconds))
    assert expected != files, f"pick three files whose recorded seconds differ: {seconds}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))}
    command = [sys.executable, "-m", "pytest", "-n", "1", *options, "-v", "-p", "no:cacheprovider", *files]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran = re.findall(r"^\[gw0\] \[ *\d+%\] [A-Z]+ (tests/test_\w+\.py)::", result.stdout, re.MULTILINE)
    started = list(dict.fromkeys(ran))
    assert started == expected, result.stdout[-3000:]


def test_each_worker_hands_its_share_of_the_cores_to_the_processes_it_starts():
    # two workers on two cores: one thread each, vLLM's engines bound to a core of their own
    assert worker_environment(2, "gw0", [0, 1], 1) == {"OMP_NUM_THREADS": "1",
                                                       "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert worker_environment(2, "gw1", [0, 1], 1)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert worker_environment(2, "gw1", [0, 1, 2, 3, 4, 5, 6, 7], 4) == {
        "OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7"}
    # more workers than cores: they share, none is left without a core
    assert worker_environment(3, "gw2", [0, 1], 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert worker_environment(1, None, [0, 1], 2) == {}


def test_a_process_a_test_starts_runs_torch_with_its_workers_threads():
    """Under `make test`'s workers a child process (an Airflow task, a Celery worker, vLLM) inherits
    the worker's share: with every core it would fight the other worker (helpers/workers.py)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        # one test process keeps every core: this test again, under two workers as make test runs
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS", "OMP_NUM_THREADS", "VLLM_CPU_OMP"))}
        test = f"{Path(__file__).relative_to(REPO)}::{test_a_process_a_test_starts_runs_torch_with_its_workers_threads.__name__}"
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", test],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:]
        return
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True, timeout=120)
    assert int(child.stdout) == torch.get_num_threads()
    mine = os.environ["VLLM_CPU_OMP_THREADS_BIND"].split(",")
    assert len(mine) == max(1, len(os.sched_getaffinity(0)) // workers)
