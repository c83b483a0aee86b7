"""The Store: specdec's database, resolved once where a process starts working on it.

A boundary (a CLI command, a DAG task, a test) opens the Store: the URL is resolved (the argument,
else the settings' `database_url`, else $SPECDEC_DATABASE_URL, else SQLite under $SPECDEC_HOME),
the database checked to be migrated (once per process and URL: tasks.db.engine.ensure_ready) and
its engine made. Steps and the registry take the Store (or the run context holding it) and never
a URL; their reads and writes are the named functions of tasks.db.queries, which take the Store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
