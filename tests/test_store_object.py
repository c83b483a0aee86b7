"""The Store (tasks/db/store.py): the database resolved and checked once where a process starts
working on it; steps and the registry take it instead of a URL."""

from __future__ import annotations

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
