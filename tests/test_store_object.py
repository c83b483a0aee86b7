"""The Store (tasks/db/store.py): the database resolved and checked once where a process starts
working on it; steps and the registry take it instead of a URL."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from tasks.db import engine as db_engine
from tasks.db.store import Store
from tasks.errors import DatabaseNotMigrated, DatabaseUnavailable
from tasks.settings import load_settings


def test_open_resolves_the_url_checks_the_schema_and_keeps_the_settings(db_url):
    settings = load_settings()
    store = Store.open(db_url, settings)
    assert store.url == db_url and store.settings is settings
    with store.connect() as connection:
        assert connection.exec_driver_sql("SELECT 1").scalar() == 1
    assert store.dialect in ("sqlite", "postgresql")


def test_the_schema_is_checked_once_per_process_and_url(db_url, monkeypatch):
    Store.open(db_url)
    calls = []
    original = db_engine.current_revision
    monkeypatch.setattr(db_engine, "current_revision", lambda url: calls.append(url) or original(url))
    Store.open(db_url)
    Store.open(db_url, load_settings())
    assert calls == []


def test_an_unmigrated_or_missing_database_names_the_fix(empty_db_url, tmp_path):
    create_engine(empty_db_url).connect().close()      # exists, without specdec's schema
    with pytest.raises(DatabaseNotMigrated, match="specdec db upgrade"):
        Store.open(empty_db_url)
    with pytest.raises(DatabaseUnavailable, match="specdec db upgrade"):
        Store.open(f"sqlite:///{tmp_path / 'nowhere' / 'specdec.db'}")


def test_the_password_stays_out_of_the_displayed_url():
    url = "postgresql+psycopg://specdec:secret@127.0.0.1:5432/specdec"
    store = Store(url=url, engine=None, settings=load_settings())
    assert "secret" not in store.display_url and "secret" not in repr(store)
    assert "127.0.0.1:5432" in repr(store)


def test_a_unit_of_work_commits_on_success_and_rolls_back_on_error(db_url):
    from tasks.db.queries_runs import fail_domain, merge_run_params, run_params
    from tasks.db.queries_samples import record_sample
    from tasks.db.store import Unit
    from tasks.timeutil import utcnow

    store = Store.open(db_url)
    with store.transaction() as tx:
        assert isinstance(tx, Unit) and tx.store is store and tx.dialect == store.dialect
        record_sample(tx, "r-unit", {"status": "sampled", "params": {"a": 1}, "updated_at": utcnow()}, [],
                      "sample", utcnow())
    with pytest.raises(RuntimeError):
        with store.transaction() as tx:
            merge_run_params(tx, "r-unit", {"b": 2})
            fail_domain(tx, "r-unit", "code", "no")
            raise RuntimeError("a failing step")
    assert run_params(store, "r-unit") == {"a": 1}       # neither write of the failed unit stayed


QUERY_MODULES = sorted((Path(__file__).resolve().parents[1] / "tasks" / "db").glob("queries_*.py"))


def test_every_query_takes_the_store_or_a_unit_never_a_connection_or_an_engine():
    """One handle (issue 84): a query takes the Store, or the Unit of its caller's transaction
    (Store.transaction(), alias_lock); none names an SQLAlchemy Connection or Engine."""
    assert QUERY_MODULES
    offenders = []
    for path in QUERY_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for arg in args:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    if ("Connection" in annotation or "Engine" in annotation
                            or arg.arg in ("connection", "engine")):
                        offenders.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
    assert offenders == []


def test_each_query_is_defined_once_across_the_query_modules():
    seen: dict[str, list[str]] = {}
    for path in QUERY_MODULES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(path.name)
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
