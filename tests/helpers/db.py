"""Databases: a fresh PostgreSQL schema per test, and reading and writing rows."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager

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
