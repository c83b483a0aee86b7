"""Imports inside function bodies in tasks/ and specdec_core/ (issue 84), for whoever adds one: an
import sits at the top of its module unless it defers a dependency that the module's importers
must not pay for -- an optional or heavy package (HEAVY), or a project module that loads one at
import time. The code that runs in the separate vLLM environment (VLLM_ENV) keeps its own."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("tasks", "specdec_core")

# run inside the separate vLLM environment: every import there is its own business
VLLM_ENV = ("tasks/serving/scripts/", "tasks/serving/vllm_plugin/")

# top-level packages a module may import inside a function: optional, or heavy enough (about a
# second or more) that the CLI's start-up or a DAG file's parse must not load them
HEAVY = {
    "vllm",                 # the vLLM environment only
    "torch",                # the engine: only the commands and steps that run a model
    "transformers",
    "huggingface_hub",      # downloads only
    "mlflow",               # the tracking store: only the commands and steps that use it
    "airflow",              # only inside an Airflow task, or the commands that drive Airflow
    "playwright",           # the browser checks only
    "great_expectations",   # the traffic sample's quality check only (~11 s)
    "matplotlib",           # the figures only
    "pandas",               # loaded with great_expectations: not at CLI start-up
    "requests",             # optional: MLflow's HTTP stack (tasks.orchestration.airflow_glue)
    "urllib3",
}

# project modules deferred for another reason than HEAVY, each with it
DEFERRED = {
    # the database (SQLAlchemy's models, Alembic) and the registry load for the Airflow tasks that
    # use them, not when a DAG file is parsed (tasks.orchestration.airflow_glue's docstring)
    ("tasks/orchestration/airflow_glue.py", "tasks.db.store"),
    ("tasks/orchestration/airflow_glue.py", "tasks.registry.registry"),
    ("tasks/orchestration/airflow_glue.py", "tasks.steps.spec"),
    # importing tasks.cli stays light: the command line's parsers load only when `main` runs
    ("tasks/cli/__init__.py", "tasks.cli.app"),
}

# modules whose local imports stay as they are, whatever they import: at the top of
# specdec_core.profile they changed the costs the draft training measures (its held-out report
# differed between a run and its resumption in tests/test_draft_training.py, 3 runs in 5), and
# specdec_core.train times the same forwards: to be looked into before either moves. Since moved
# to their tops: the imports of modules each one loaded already (profile's records, drafters,
# decoder, sampling; train's graphs) and train's head, cache and safetensors (the draft engine
# loads them before it); train's `.profile` (static_cache, the decoder) stays local
AS_THEY_ARE = ("specdec_core/profile.py", "specdec_core/train.py")

# every function-level import counted, VLLM_ENV and AS_THEY_ARE included (issue 84's goal: at
# most 80); lower it as imports move to the top, never raise it
MAX_FUNCTION_IMPORTS = 79


def _files() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module) -> tuple[list, list]:
    """(module-level imports, function-level imports) of a parsed module; an import under
    `if TYPE_CHECKING:` is neither (it never runs)."""
    top, local = [], []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (local if in_function else top).append(child)
            function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_function or function)

    visit(tree, False)
    return top, local


@functools.cache
def _lazy_exports(package: str) -> dict[str, str]:
    """A package's names imported on first use (specdec_core's _EXPORTS: name -> submodule)."""
    init = REPO / package.replace(".", "/") / "__init__.py"
    if not init.is_file():
        return {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_EXPORTS"]:
            return ast.literal_eval(node.value)
    return {}


def _project_file(module: str) -> Path | None:
    base = REPO / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The modules an import statement loads (a package's submodules named in a `from` import
    included)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module
    exports = _lazy_exports(module)
    found = [module]
    for alias in node.names:
        if _project_file(f"{module}.{alias.name}"):
            found.append(f"{module}.{alias.name}")
        elif alias.name in exports:
            found.append(f"{module}.{exports[alias.name]}")
    return found


_TOP: dict[str, set[str]] = {}


@functools.cache
def _loads(module: str) -> set[str]:
    """The top-level package names that importing `module` loads by its module-level imports
    (through the project's modules, their parent packages included); read from the source."""
    seen: set[str] = set()
    found: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        if parts[0] not in ROOTS:
            found.add(parts[0])
            continue
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = _project_file(name)
        if path is None:
            continue
        if name not in _TOP:
            top, _ = _imports(ast.parse(path.read_text()))
            _TOP[name] = {t for node in top for t in _targets(node, _package(path))}
        todo += sorted(_TOP[name])
    return found


@functools.cache
def _function_imports() -> tuple[tuple[str, ast.Import | ast.ImportFrom, str], ...]:
    """(file relative to the repository, import node, its package) of every function-level import."""
    found = []
    for path in _files():
        _, local = _imports(ast.parse(path.read_text()))
        found += [(path.relative_to(REPO).as_posix(), node, _package(path)) for node in local]
    return tuple(found)


def _allowed(file: str, node: ast.Import | ast.ImportFrom, package: str) -> bool:
    if file.startswith(VLLM_ENV) or file in AS_THEY_ARE:
        return True
    for target in _targets(node, package):
        root = target.split(".")[0]
        if root in HEAVY or (file, target) in DEFERRED:
            return True
        # a project module is deferred where it loads a HEAVY package that the importing module
        # does not load already
        if root in ROOTS and (_loads(target) & HEAVY) - _loads(_module_name(REPO / file)):
            return True
    return False


def test_function_level_imports_only_defer_optional_or_heavy_dependencies():
    offenders = [f"{file}:{node.lineno}: {ast.unparse(node)}" for file, node, package in _function_imports()
                 if not _allowed(file, node, package)]
    assert not offenders, ("move these imports to the top of their module (or, for an optional or "
                           "heavy package, add it to HEAVY with why):\n" + "\n".join(offenders))


def test_the_number_of_function_level_imports_does_not_grow():
    count = len(_function_imports())
    assert count <= MAX_FUNCTION_IMPORTS, (f"{count} function-level imports in {', '.join(ROOTS)}; at most "
                                           f"{MAX_FUNCTION_IMPORTS}")


def test_the_check_sees_imports_in_nested_functions_and_methods_but_not_type_checking_blocks():
    tree = ast.parse("import json\nif TYPE_CHECKING:\n    import torch\n"
                     "class A:\n    def f(self):\n        import yaml\n"
                     "        def g():\n            from . import x\n")
    top, local = _imports(tree)
    assert [ast.unparse(n) for n in top] == ["import json"]
    assert [ast.unparse(n) for n in local] == ["import yaml", "from . import x"]


def test_a_project_module_that_loads_torch_counts_as_heavy():
    assert "torch" in _loads("specdec_core.models")
    assert "torch" in _loads("tasks.steps.evaluate")
    assert "torch" not in _loads("tasks.cli.app")      # the CLI starts without the engine
    node = ast.parse("from specdec_core import load_model").body[0]
    assert "specdec_core.models" in _targets(node, "tasks.steps")
