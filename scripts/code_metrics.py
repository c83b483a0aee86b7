"""Counts behind the codebase goals of docs/design.md ("Code health"): where the database is
resolved, where SQL runs, how long functions are, how the settings and the README have grown.

    python scripts/code_metrics.py            # a table
    python scripts/code_metrics.py --json     # the same figures, for a note or a diff
    python scripts/code_metrics.py --long     # and every function over the limit, longest first

Read from the source with `ast` (nothing is imported or run), so it works on any checkout.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONG_FUNCTION = 80


def _modules(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path, ast.parse(path.read_text(), filename=str(path))


def _calls(tree: ast.AST, name: str) -> int:
    def called(node: ast.Call) -> str:
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")

    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call) and called(node) == name)


def _functions(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _settings_fields() -> int:
    tree = ast.parse((ROOT / "tasks" / "settings.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Settings":
            return sum(1 for item in node.body if isinstance(item, ast.AnnAssign))
    return 0


def _has_contents(page: Path) -> bool:
    """A page that opens (within its first 20 lines) with a list of links to its own headings."""
    return any(line.lstrip().startswith("- [") and "](#" in line
               for line in page.read_text().splitlines()[1:20])


def measure() -> tuple[dict, list[tuple[int, str]]]:
    figures = {"ensure_ready call sites (tasks, dags)": 0, "db_url parameters (tasks/steps, tasks/registry)": 0,
               "connection.execute outside tasks/db (calls)": 0, "files running SQL outside tasks/db": 0,
               f"functions in tasks/ over {LONG_FUNCTION} lines": 0, "functions in tasks/ returning dict": 0,
               "imports inside functions (tasks/)": 0}
    long_functions = []
    for path, tree in _modules("tasks", "dags"):
        relative = path.relative_to(ROOT)
        figures["ensure_ready call sites (tasks, dags)"] += _calls(tree, "ensure_ready") if relative.parts[-1] != "engine.py" else 0
        if relative.parts[0] != "tasks":
            continue
        executes = _calls(tree, "execute")
        if relative.parts[1] != "db" and executes:
            figures["connection.execute outside tasks/db (calls)"] += executes
            figures["files running SQL outside tasks/db"] += 1
        for function in _functions(tree):
            length = function.end_lineno - function.lineno + 1
            if length > LONG_FUNCTION:
                figures[f"functions in tasks/ over {LONG_FUNCTION} lines"] += 1
                long_functions.append((length, f"{relative}:{function.lineno} {function.name}"))
            returns = function.returns
            if isinstance(returns, ast.Name) and returns.id == "dict":
                figures["functions in tasks/ returning dict"] += 1
            figures["imports inside functions (tasks/)"] += sum(
                1 for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom)))
            if relative.parts[1] in ("steps", "registry"):
                names = [a.arg for a in function.args.args + function.args.kwonlyargs]
                figures["db_url parameters (tasks/steps, tasks/registry)"] += names.count("db_url")
    figures["Settings top-level fields"] = _settings_fields()
    figures["README bytes"] = (ROOT / "README.md").stat().st_size
    docs = sorted((ROOT / "docs").glob("*.md"))
    figures["docs pages with a table of contents"] = f"{sum(_has_contents(p) for p in docs)}/{len(docs)}"
    return figures, sorted(long_functions, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--long", action="store_true", help=f"list the functions over {LONG_FUNCTION} lines")
    args = parser.parse_args()
    figures, long_functions = measure()
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        width = max(map(len, figures))
        for name, value in figures.items():
            print(f"{name:<{width}}  {value}")
    if args.long:
        for length, where in long_functions:
            print(f"{length:5d}  {where}")


if __name__ == "__main__":
    main()
