"""The call walk of registration and promotion: which project files a call enters, and how often.

Prepares a small store (a fresh SQLite specdec database with one evaluated run written by the
test helpers, tests/helpers/registry.py, and a fresh MLflow SQLite store), then traces
`tasks.registry.registration.register_config` and `tasks.registry.promotion.promote` with
sys.setprofile, in two views:

- the database walk (the goals' view, "walked as the data"): only the calls handed the database,
  i.e. an argument that is its URL string, a Store, a RunContext holding one, or an SQLAlchemy
  Engine or Connection; a call not handed it is followed through but not counted;
- every call: all calls into project files.

Either walk follows each distinct call edge (caller function -> callee function) once, in the
order it first happens, so a loop over domains is walked once. Along it, a file is *entered*
when an edge leads into it from another file; a *re-entry* is every entry after a file's first.
Prints, per traced call and view, the files in the order first entered, each with its entries,
and the totals.

    PYTHONPATH=. python scripts/call_walk.py [--json]

Works on both sides of the Store refactor: a callee that takes `store` gets a Store opened here
(the boundary), one that takes `db_url` gets the URL.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tuple(str(ROOT / name) + os.sep for name in ("tasks", "specdec_core", "dags"))


def _project_file(filename: str) -> str | None:
    return filename[len(str(ROOT)) + 1:] if filename.startswith(PROJECT) else None


def _is_database(value, url: str) -> bool:
    if isinstance(value, str):
        return value == url
    from sqlalchemy.engine import Connection, Engine

    if isinstance(value, (Engine, Connection)):
        return True
    kind = type(value).__name__
    return kind == "Store" or (kind == "RunContext" and hasattr(value, "store"))


def _handed_database(frame, url: str) -> bool:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames[:count + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)]
    values = [frame.f_locals.get(name) for name in names]
    for value in list(values):
        if isinstance(value, dict):
            values.extend(value.values())
        elif isinstance(value, tuple):
            values.extend(value)
    return any(_is_database(value, url) for value in values)


class Walk:
    """A sys.setprofile hook recording file entries along the deduplicated call walk; with `url`,
    only the calls handed the database count (the database walk)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url
        self.stack: list[tuple[object, object, str]] = []     # (frame, code, file) of walked frames
        self.edges: set[tuple[object, object]] = set()
        self.entries: Counter[str] = Counter()
        self.order: list[str] = []

    def __call__(self, frame, event, _arg) -> None:
        if event == "call":
            path = _project_file(frame.f_code.co_filename)
            if path is None or (self.url is not None and self.stack
                                and not _handed_database(frame, self.url)):
                return      # the traced call itself always counts
            caller = self.stack[-1] if self.stack else (None, None, None)
            edge = (caller[1], frame.f_code)
            if edge not in self.edges:
                self.edges.add(edge)
                if caller[2] != path:
                    self.entries[path] += 1
                    if path not in self.order:
                        self.order.append(path)
            self.stack.append((frame, frame.f_code, path))
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()

    def report(self) -> dict:
        return {"files": [{"file": f, "entries": self.entries[f]} for f in self.order],
                "files_entered": len(self.order),
                "re_entries": sum(n - 1 for n in self.entries.values()),
                "most_entries": max(self.entries.values(), default=0)}


class Both:
    """Both views in one pass: the database walk and every call."""

    def __init__(self, url: str) -> None:
        self.walks = {"database": Walk(url), "every_call": Walk()}

    def __call__(self, frame, event, arg) -> None:
        for walk in self.walks.values():
            walk(frame, event, arg)


def traced(url: str, function, *args, **kwargs):
    both = Both(url)
    sys.setprofile(both)
    try:
        result = function(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, {name: walk.report() for name, walk in both.walks.items()}


def _database_argument(function, url: str) -> dict:
    """{"store": Store} for a function that takes one, else {"db_url": url}."""
    if "store" in inspect.signature(function).parameters:
        from tasks.db.store import Store

        return {"store": Store.open(url)}
    return {"db_url": url}


def _registry_argument(function, uri: str) -> dict:
    """{"registry": Registry} for a function that takes one, else {"uri": uri}."""
    if "registry" in inspect.signature(function).parameters:
        from tasks.registry.registry import Registry

        return {"registry": Registry.open(uri)}
    return {"uri": uri}


def prepare(directory: Path) -> tuple[str, str]:
    """(specdec database URL, MLflow URI): a migrated database holding one evaluated run ("walk":
    json on with live evidence, code off), and an empty MLflow store."""
    sys.path.insert(0, str(ROOT))
    from tasks.db.engine import upgrade
    from tests.helpers.registry import finished_run, live_evidence

    url = f"sqlite:///{directory / 'specdec.db'}"
    upgrade(url)
    finished_run(url, "walk", {"json": {}, "code": {"enabled": False}})
    live_evidence(url, "walk", "json", measured=1.5, predicted=1.6, interval=(1.3, 1.7))
    return url, f"sqlite:///{directory / 'mlflow.db'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the walks as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPECDEC_HOME"] = tmp
        url, uri = prepare(Path(tmp))
        from tasks.registry.promotion import promote
        from tasks.registry.registration import register_config
        from tests.helpers.registry import DEFAULTS

        registered, register_walk = traced(url, register_config, "walk", settings=DEFAULTS, actor="walk",
                                           **_registry_argument(register_config, uri),
                                           **_database_argument(register_config, url))
        promoted, promote_walk = traced(url, promote, registered["name"], registered["version"],
                                        settings=DEFAULTS, actor="walk",
                                        **_registry_argument(promote, uri),
                                        **_database_argument(promote, url))
        assert promoted["promoted"], promoted["reason"]
    walks = {"register_config": register_walk, "promote": promote_walk}
    if args.json:
        print(json.dumps(walks, indent=1))
        return
    for name, views in walks.items():
        for view, walk in views.items():
            print(f"{name} ({view}): {walk['files_entered']} files entered, {walk['re_entries']} "
                  f"re-entries, most entries into one file {walk['most_entries']}")
            for row in walk["files"]:
                print(f"  {row['entries']:3d}  {row['file']}")


if __name__ == "__main__":
    main()
