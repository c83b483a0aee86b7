"""The Store: specdec's database, resolved once where a process starts working on it.

A boundary (a CLI command, a DAG task, a test) opens the Store: the URL is resolved (the argument,
else the settings' `database_url`, else $SPECDEC_DATABASE_URL, else SQLite under $SPECDEC_HOME),
the database checked to be migrated (once per process and URL: tasks.db.engine.ensure_ready) and
its engine made. Steps and the registry take the Store (or the run context holding it) and never
a URL; their reads and writes are the named functions of tasks.db.queries_*, which take one handle:
the Store (a query that opens its own connection or transaction), or a Unit of it (a query that
runs inside its caller's transaction: `with store.transaction() as tx: ...`). No query takes an
SQLAlchemy Connection or Engine.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from sqlalchemy.engine import Connection, Engine

from ..settings import Settings, load_settings
from .engine import display_url, ensure_ready, resolve_database_url


@dataclass(frozen=True)
class Store:
    """The database one process works on: its resolved URL, its engine and the settings it was
    opened with."""

    url: str = field(repr=False)      # repr: display_url (the password hidden)
    engine: Engine = field(repr=False, compare=False)
    settings: Settings = field(repr=False, compare=False)

    @classmethod
    def open(cls, url: str | None = None, settings: Settings | None = None) -> "Store":
        """The Store of `url` (else the settings' database_url, else the default), checked to be
        migrated to head. Raises DatabaseUnavailable or DatabaseNotMigrated, naming the fix."""
        settings = settings or load_settings()
        url = resolve_database_url(url or settings.database_url)
        return cls(url=url, engine=ensure_ready(url), settings=settings)

    def __repr__(self) -> str:
        return f"Store({self.display_url!r})"

    @property
    def display_url(self) -> str:
        """The URL with its password hidden, for messages and logs."""
        return display_url(self.url)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def connect(self) -> Connection:
        """A connection (a context manager): reads, or writes that commit themselves."""
        return self.engine.connect()

    def begin(self):
        """A transaction (a context manager yielding its connection): commits on success."""
        return self.engine.begin()

    @contextmanager
    def transaction(self) -> Iterator["Unit"]:
        """A unit of work: one transaction (a context manager yielding its Unit), committed on
        success and rolled back on error. The queries that run inside a caller's transaction take
        the Unit, so that a multi-write step is one transaction."""
        with self.engine.begin() as connection:
            yield Unit(self, connection)


@dataclass(frozen=True)
class Unit:
    """One unit of work on the Store: the connection of one transaction (Store.transaction(), or
    the alias lock's in queries_promotions). Queries take it where they run inside their caller's
    transaction; they read and write through `execute`."""

    store: Store
    connection: Connection = field(repr=False, compare=False)

    def execute(self, statement, *args, **kwargs):
        """Execute `statement` in the unit's transaction (Connection.execute)."""
        return self.connection.execute(statement, *args, **kwargs)

    @property
    def dialect(self) -> str:
        """The database's dialect name ("postgresql" or "sqlite")."""
        return self.connection.dialect.name
