"""Databases: a fresh PostgreSQL schema per test, copies of a migrated template database (SQLite
and PostgreSQL), and reading and writing rows."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

POSTGRES_ENV = "SPECDEC_TEST_POSTGRES_URL"


def postgres_schema_url(base_url: str, schema: str) -> str:
    """base_url (a PostgreSQL URL) with search_path set to schema, on the psycopg driver."""
    from sqlalchemy.engine import make_url

    url = make_url(base_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    return url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False)


@contextmanager
def postgres_schema(prefix: str, before_drop=None):
    """A fresh schema in the server named by $SPECDEC_TEST_POSTGRES_URL, as a SQLAlchemy URL whose
    search_path is that schema; dropped afterwards (after calling before_drop)."""
    from sqlalchemy import create_engine, text

    base = os.environ[POSTGRES_ENV]
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_schema_url(base, "public"))
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield postgres_schema_url(base, schema)
    finally:
        if before_drop is not None:
            before_drop()
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


# the statements of a migration that change the database; the rest (SELECT, SHOW) only read it
_WRITES = ("CREATE", "ALTER", "DROP", "INSERT", "UPDATE", "DELETE", "COMMENT")


class MigratedTemplates:
    """specdec's schema migrated once per backend and session with the real migrations
    (tasks.db.upgrade), then copied for each test, instead of running every migration again per
    test and backend.

    SQLite: the migrated file is copied. PostgreSQL: the statements that migration sent to the
    server are recorded, and each copy is a fresh schema in which they run again in one round
    trip (the reads among them left out), so every test still has a schema of its own, dropped
    afterwards. test_store.py checks that a copy and a real migration give the same schema.
    Tests of migrating itself take `empty_db_url` and run the real migrations."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._sqlite: Path | None = None
        self._script: str | None = None
        self._admin = None
        self._schemas: list[str] = []

    def sqlite_copy(self, destination: Path) -> str:
        """A copy of the migrated SQLite database at destination, as a URL."""
        if self._sqlite is None:
            from tasks.db import dispose_engines, upgrade

            template = self.directory / "template.db"
            upgrade(f"sqlite:///{template}")
            dispose_engines()       # the last connection closed: the WAL is folded into the file
            leftovers = [p.name for p in self.directory.iterdir() if p.name != template.name]
            assert not leftovers, f"the SQLite template left {leftovers} beside it (open connections?)"
            self._sqlite = template
        shutil.copyfile(self._sqlite, destination)
        return f"sqlite:///{destination}"

    @contextmanager
    def postgres_copy(self, before_drop=None):
        """A fresh schema holding a copy of the migrated schema, as a URL (search_path = it);
        dropped afterwards (after calling before_drop)."""
        if self._script is None:
            self._script = self._record_postgres_migration()
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with self._admin_engine().begin() as connection:
            # one round trip (several statements need psycopg's own execute, without parameters)
            connection.connection.driver_connection.execute(
                f'CREATE SCHEMA "{schema}"; SET LOCAL search_path TO "{schema}";\n' + self._script)
        try:
            yield postgres_schema_url(os.environ[POSTGRES_ENV], schema)
        finally:
            if before_drop is not None:
                before_drop()
            with self._admin_engine().begin() as connection:
                connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')

    def _admin_engine(self):
        if self._admin is None:
            from sqlalchemy import create_engine

            self._admin = create_engine(postgres_schema_url(os.environ[POSTGRES_ENV], "public"))
        return self._admin

    def _record_postgres_migration(self) -> str:
        """Migrate a schema of its own with the real migrations; return the statements that wrote
        to it as one script, their parameters rendered in (the schema itself is kept, for
        comparison, until close())."""
        import psycopg
        from sqlalchemy import event

        from tasks.db import dispose_engines, get_engine, upgrade

        schema = f"tpl_{uuid.uuid4().hex[:12]}"
        with self._admin_engine().begin() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        self._schemas.append(schema)
        url = postgres_schema_url(os.environ[POSTGRES_ENV], schema)
        recorded: list[tuple[str, object]] = []

        def record(_conn, _cursor, statement, parameters, _context, _executemany):
            if statement.lstrip().split(None, 1)[0].upper() in _WRITES:
                recorded.append((statement, parameters))

        engine = get_engine(url, create_dir=True)
        event.listen(engine, "before_cursor_execute", record)
        try:
            upgrade(url)
        finally:
            event.remove(engine, "before_cursor_execute", record)
            dispose_engines()
        with self._admin_engine().connect() as connection:
            cursor = psycopg.ClientCursor(connection.connection.driver_connection)
            script = ";\n".join(cursor.mogrify(statement, parameters) if parameters else statement
                                 for statement, parameters in recorded) + ";"
        assert schema not in script, f"a migration named its schema {schema!r}: it cannot be replayed"
        return script

    def close(self) -> None:
        if self._admin is None:
            return
        with self._admin.begin() as connection:
            for schema in self._schemas:
                connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        self._admin.dispose()


def execute(db_url, statement, *args) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(statement, *args)
    engine.dispose()


def fetch(db_url, statement) -> list[dict]:
    from sqlalchemy import create_engine

    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(statement).mappings().all()
    engine.dispose()
    return [dict(row) for row in rows]
