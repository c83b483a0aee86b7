"""The test suite's own layout: shared helpers live in tests/helpers/ (fixtures in conftest.py),
and no test module or helper imports a test module or conftest.py -- so a module runs on its own,
and moving or renaming one breaks nothing else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
