"""Connecting to specdec's database, migrating it, and refusing to work on one that is not ready.

URL: the argument, else $SPECDEC_DATABASE_URL, else sqlite:///$SPECDEC_HOME/specdec.db.
Never point it at MLflow's or Airflow's database: all three use Alembic (specdec keeps its own
version table, `specdec_alembic_version`, but the schemas must stay apart).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from ..errors import DatabaseNotMigrated, DatabaseUnavailable, DiskFull
from ..masking import mask_text, mask_url
from ..settings import DATABASE_URL_ENV, load_settings

log = logging.getLogger(__name__)

VERSION_TABLE = "specdec_alembic_version"
# PostgreSQL: seconds libpq waits for a server to complete a connection (a server that accepts and
# never answers would otherwise hang the command); a connect_timeout in the URL's query wins.
CONNECT_TIMEOUT_S = 3
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def resolve_database_url(url: str | None = None) -> str:
    """The URL to use: `url`, else $SPECDEC_DATABASE_URL, else SQLite under $SPECDEC_HOME."""
    return url or load_settings().resolved_database_url


def display_url(url: str) -> str:
    """The URL with its password hidden, for messages and logs (tasks.redaction.mask_url)."""
    return mask_url(url)


# the package that provides a driver module, where its name differs
_DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]", "MySQLdb": "mysqlclient",
                    "pymysql": "PyMySQL", "pyodbc": "pyodbc", "asyncpg": "asyncpg", "pg8000": "pg8000"}


def missing_driver(url: str, exc: ImportError) -> str:
    """What to say when SQLAlchemy cannot import a URL's DBAPI driver: the module, and the fix
    (psycopg 3 is the PostgreSQL driver specdec installs)."""
    module = (getattr(exc, "name", None) or str(exc)).split(".")[0]
    scheme = url.split(":", 1)[0]
    fix = f"pip install {_DRIVER_PACKAGES.get(module, module)} into this environment"
    if scheme.split("+", 1)[0].lower() in ("postgresql", "postgres"):
        fix = f"use postgresql+psycopg:// (psycopg 3, installed with specdec) instead of {scheme}://, or {fix}"
    return f"its database driver module {module!r} is not installed; {fix}"


def _sqlite_path(url: str) -> Path | None:
    parsed = _parse(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    database = parsed.database
    if parsed.query.get("uri") == "true" and database.startswith("file:"):   # sqlite URI filenames
        database = database[len("file:"):].split("?", 1)[0]
    return Path(database)


def _parse(url: str):
    """make_url, or DatabaseUnavailable naming the fix for a URL specdec cannot use."""
    fix = (f"set {DATABASE_URL_ENV} to e.g. postgresql+psycopg://user@host:5432/specdec "
           "or sqlite:////path/specdec.db")
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise DatabaseUnavailable(f"database URL {display_url(url)!r} cannot be parsed ({exc}); "
                                  f"{fix}") from None
    if parsed.get_backend_name() == "postgres":
        raise DatabaseUnavailable(f"database URL {display_url(url)!r}: the scheme is postgresql, not "
                                  f"postgres; {fix}")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseUnavailable(f"database URL {display_url(url)!r}: {parsed.get_backend_name()} is "
                                  f"not supported (specdec runs on PostgreSQL or SQLite); {fix}")
    return parsed


def _on_sqlite_connect(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")     # readers do not block the importer
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


_ENGINES: dict[str, Engine] = {}
# URLs found migrated to head by this process: checked once per process and URL (the check reads
# the schema revision and Alembic's scripts); upgrade() and dispose_engines() forget them
_READY: set[str] = set()


def _engine_for(url: str) -> Engine:
    if url not in _ENGINES:
        path = _sqlite_path(url)
        if path is not None:
            check_sqlite_file(url, path)    # once per process, before anything connects
        _ENGINES[url] = _create_engine(url)
    return _ENGINES[url]


INTEGRITY_CHECK_MAX_BYTES = 64 * 2**20   # above it the cheaper quick_check (no index contents)


def check_sqlite_file(url: str, path: Path) -> None:
    """Raise DatabaseUnavailable (the corrupt-file line of database_error) when the SQLite file at
    `path` is damaged: PRAGMA integrity_check on files up to INTEGRITY_CHECK_MAX_BYTES, else
    PRAGMA quick_check, on a read-only connection of its own, so a damaged file is never written
    to (no journal-mode switch). Runs before the engine's first connection, so once per process
    and URL. A missing or empty file, or one that cannot be opened for another reason (locked,
    unreadable), passes: creating it or the engine's own error handles those."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size == 0:
        return
    pragma = "integrity_check" if size <= INTEGRITY_CHECK_MAX_BYTES else "quick_check"
    checker = create_engine(URL.create("sqlite", database=f"{path.resolve().as_uri()}?mode=ro",
                                       query={"uri": "true"}), poolclass=NullPool)
    try:
        with checker.connect() as connection:
            problems = [row[0] for row in connection.exec_driver_sql(f"PRAGMA {pragma}(3)")]
    except DBAPIError as exc:
        if _is_corrupt(str(getattr(exc, "orig", exc))):
            raise database_error(url, exc) from None
        return
    finally:
        checker.dispose()
    if problems != ["ok"]:
        raise _corrupt_error(url, f"{pragma}: {'; '.join(problems)[:300]}")


def _create_engine(url: str) -> Engine:
    parsed = _parse(url)
    if parsed.drivername == "postgresql":   # psycopg 3 is the driver we install, not psycopg2
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    connect_args = {}
    if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
    try:
        engine = create_engine(url, pool_pre_ping=True, future=True, connect_args=connect_args)
    except ImportError as exc:
        raise DatabaseUnavailable(f"database URL {display_url(url)!r}: {missing_driver(url, exc)}") from None
    except ArgumentError as exc:
        raise DatabaseUnavailable(f"database URL {display_url(url)!r} cannot be used ({exc}); use "
                                  "postgresql+psycopg:// or sqlite:///") from None
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _on_sqlite_connect)
    return engine


def dispose_engines() -> None:
    """Close every cached engine's connections (tests, and processes that switch databases), and
    forget which databases were found ready (ensure_ready checks them again)."""
    for engine in list(_ENGINES.values()):
        engine.dispose()
    _ENGINES.clear()
    _READY.clear()


def get_engine(url: str | None = None, create_dir: bool = False) -> Engine:
    """A (cached) engine for the URL. SQLite's directory is created only when create_dir is set."""
    url = resolve_database_url(url)
    path = _sqlite_path(url)
    if path is not None and create_dir:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as exc:
            raise DatabaseUnavailable(
                f"cannot create the specdec database in {str(path.parent)!r} ({exc.strerror or exc}); "
                f"set SPECDEC_HOME to a writable directory (now {os.environ.get('SPECDEC_HOME', '.specdec')!r}) "
                f"or {DATABASE_URL_ENV} to another database") from None
    return _engine_for(url)


def _alembic_config(url: str):
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.set_main_option("version_table", VERSION_TABLE)
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head()


def current_revision(url: str | None = None) -> str | None:
    """The revision the database is at (None: never migrated). Raises DatabaseUnavailable."""
    url = resolve_database_url(url)
    engine = _connectable(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            return context.get_current_revision()
    except DBAPIError as exc:
        raise database_error(url, exc) from None


def database_error(url: str, exc: Exception) -> DatabaseUnavailable:
    """The clear error for a database that fails (cannot connect, corrupt, read-only), naming the
    database (password hidden) and the fix."""
    reason = mask_text(str(getattr(exc, "orig", exc)).strip().splitlines()[0][:300])
    lowered = reason.lower()
    if _is_corrupt(lowered):
        return _corrupt_error(url, reason)
    if is_disk_full(exc):
        return DiskFull(
            f"disk full: the specdec database {display_url(url)} cannot grow ({reason}); what was "
            "written before is kept. Free space on its disk (or move the database, "
            f"{DATABASE_URL_ENV}), then run the command again: a run or import repeats by its id")
    free = _free_bytes_under(url)
    if free is not None and free < NEARLY_FULL_BYTES:    # SQLite says "disk I/O error": its
        return DiskFull(                                 # journal files cannot be made
            f"disk full: the disk under the specdec database {display_url(url)} has {free} bytes "
            f"free ({reason}), so it cannot be opened, not even to read; what is stored is kept. "
            f"Free space on that disk (or move the database, {DATABASE_URL_ENV}), then run the "
            "command again")
    if "readonly" in lowered or "read-only" in lowered or "read only" in lowered:
        return DatabaseUnavailable(
            f"the specdec database {display_url(url)} is read-only ({reason}); nothing was written. "
            f"Make it writable, or set {DATABASE_URL_ENV} to a database this user can write")
    return DatabaseUnavailable(
        f"cannot connect to the specdec database {display_url(url)} ({reason}); check that the "
        f"server is running and {DATABASE_URL_ENV} is right, then run `specdec db upgrade`")


# Below it, a SQLite database that fails to open is taken to fail for want of space: opening one
# in WAL mode makes its -wal and -shm files beside it (the -shm file alone is 32 KiB)
NEARLY_FULL_BYTES = 1 << 20


def _free_bytes_under(url: str) -> int | None:
    """Bytes free to this user on the disk of a SQLite database's directory (None: not SQLite, or
    the directory is unknown)."""
    path = _sqlite_path(url)
    if path is None:
        return None
    try:
        return shutil.disk_usage(path.resolve().parent).free
    except OSError:
        return None


_DISK_FULL = ("database or disk is full", "no space left on device", "disk full",
              "could not extend file", "could not write to file")


def is_disk_full(exc: BaseException) -> bool:
    """Whether a database or file error says the disk is full (SQLite's SQLITE_FULL, PostgreSQL's
    disk_full 53100 or a failed extend, an OSError ENOSPC)."""
    original = getattr(exc, "orig", exc)
    if isinstance(original, OSError) and original.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if getattr(original, "sqlstate", None) == "53100" or getattr(original, "sqlite_errorcode", None) == 13:
        return True
    return any(text in str(original).lower() for text in _DISK_FULL)


def _is_corrupt(message: str) -> bool:
    lowered = message.lower()
    return "not a database" in lowered or "malformed" in lowered


def _corrupt_error(url: str, reason: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"the specdec database {display_url(url)} is not a readable SQLite database ({reason}): it "
        "is corrupt or another kind of file. Move it aside and run `specdec db upgrade` for a new "
        "one, or restore it from a backup")


def _connectable(url: str) -> Engine:
    path = _sqlite_path(url)
    if path is not None and not path.exists():
        raise DatabaseUnavailable(
            f"the specdec database {display_url(url)} does not exist; create it with `specdec db "
            f"upgrade` (or set {DATABASE_URL_ENV} to the database you meant)")
    return get_engine(url)


def upgrade(url: str | None = None, revision: str = "head") -> dict:
    """Create or migrate the schema to `revision`. Returns {"url", "from", "to"}. The URL is
    checked again by the next ensure_ready (a downgrade leaves it not ready)."""
    url = resolve_database_url(url)
    _READY.discard(url)
    engine = get_engine(url, create_dir=True)
    before = None
    try:
        with engine.begin() as connection:
            before = MigrationContext.configure(
                connection, opts={"version_table": VERSION_TABLE}).get_current_revision()
            config = _alembic_config(url)
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    except DBAPIError as exc:
        raise database_error(url, exc) from None
    after = current_revision(url)
    log.info("database %s: %s -> %s", display_url(url), before, after)
    return {"url": display_url(url), "from": before, "to": after}


def ensure_ready(url: str | None = None) -> Engine:
    """The engine, after checking (once per process and URL) that the database exists and is
    migrated to head. Called where a process opens its Store (tasks.db.store.Store.open).

    Raises DatabaseUnavailable (cannot connect / no such SQLite file) or DatabaseNotMigrated.
    """
    url = resolve_database_url(url)
    if url in _READY and url in _ENGINES:
        return _ENGINES[url]
    current = current_revision(url)
    head = head_revision()
    if current != head:
        state = "has no specdec schema" if current is None else f"is at revision {current}, not {head}"
        existing = []
        if current is None:
            try:
                existing = inspect(get_engine(url)).get_table_names()
            except SQLAlchemyError:
                existing = []
        hint = ""
        if current is None and any(name in existing for name in ("alembic_version", "dag", "experiments")):
            hint = (" It holds another application's tables (MLflow or Airflow?): give specdec its "
                    "own database.")
        raise DatabaseNotMigrated(f"the database {display_url(url)} {state}; run `specdec db upgrade` "
                                  f"(with {DATABASE_URL_ENV} set the same way).{hint}")
    _READY.add(url)
    return get_engine(url)
