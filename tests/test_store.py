"""The schema: Alembic migrations match the models, own version table, clear errors when not ready."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, inspect, text

from tasks.db import VERSION_TABLE, current_revision, ensure_ready, head_revision, upgrade
from tasks.db.models import Base
from tasks.errors import DatabaseNotMigrated, DatabaseUnavailable, SettingsError
from tasks.settings import load_settings


def test_upgrade_creates_every_model_table_and_its_own_version_table(empty_db_url):
    # the first upgrade goes from nothing to head; the version table is specdec's, not "alembic_version"
    result = upgrade(empty_db_url)
    assert result["from"] is None and result["to"] == head_revision()
    tables = set(inspect(create_engine(empty_db_url)).get_table_names())
    assert set(Base.metadata.tables) <= tables
    assert VERSION_TABLE in tables and "alembic_version" not in tables


def test_upgrade_twice_is_a_no_op(empty_db_url):
    # re-running the migration on a current database changes nothing
    upgrade(empty_db_url)
    again = upgrade(empty_db_url)
    assert (again["from"], again["to"]) == (head_revision(), head_revision())


def test_migrations_match_the_models(empty_db_url):
    # the models are the one schema: autogenerate finds nothing left to migrate (on a database the
    # migrations themselves made, not db_url's copy of one)
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    upgrade(empty_db_url)
    engine = create_engine(empty_db_url)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE,
                                                               "compare_type": True})
        diffs = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert diffs == []


def test_missing_sqlite_file_names_the_url_and_the_fix(tmp_path):
    # a database that does not exist is not created behind the user's back
    url = f"sqlite:///{tmp_path / 'nowhere' / 'specdec.db'}"
    with pytest.raises(DatabaseUnavailable) as caught:
        ensure_ready(url)
    assert str(tmp_path / "nowhere" / "specdec.db") in str(caught.value)
    assert "specdec db upgrade" in str(caught.value)
    assert not (tmp_path / "nowhere").exists()


def test_unreachable_postgres_is_a_clear_error():
    # nothing listens on port 1: the message names the URL (password hidden) and the fix
    url = "postgresql+psycopg://specdec:secret@127.0.0.1:1/specdec?connect_timeout=2"
    with pytest.raises(DatabaseUnavailable) as caught:
        current_revision(url)
    message = str(caught.value)
    assert "127.0.0.1:1" in message and "secret" not in message and "SPECDEC_DATABASE_URL" in message


def test_database_without_schema_says_run_upgrade(empty_db_url):
    # an existing but empty database: DatabaseNotMigrated with the command to run
    create_engine(empty_db_url).connect().close()
    with pytest.raises(DatabaseNotMigrated, match="specdec db upgrade"):
        ensure_ready(empty_db_url)


def test_another_applications_database_is_recognised(empty_db_url):
    # MLflow and Airflow keep an "alembic_version" table: specdec must not share their database
    engine = create_engine(empty_db_url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
    engine.dispose()
    with pytest.raises(DatabaseNotMigrated, match="another application"):
        ensure_ready(empty_db_url)


def test_default_url_is_sqlite_under_specdec_home(tmp_path, monkeypatch):
    # no SPECDEC_DATABASE_URL: $SPECDEC_HOME/specdec.db; with it: that URL
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.delenv("SPECDEC_DATABASE_URL", raising=False)
    assert load_settings().resolved_database_url == f"sqlite:///{tmp_path.resolve() / 'specdec.db'}"
    monkeypatch.setenv("SPECDEC_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert load_settings().resolved_database_url == "postgresql+psycopg://u@h/db"


def test_settings_take_environment_overrides(tmp_path):
    # one settings object: env variables (comma lists, JSON rules) and a JSON file override defaults
    settings_file = tmp_path / "settings.json"
    settings_file.write_text('{"sample_min_per_domain": 3, "sample_max_per_domain": 9}')
    environ = {"SPECDEC_KNOWN_DOMAINS": "json, legal ,general",
               "SPECDEC_DOMAIN_RULES": '[{"name": "law", "domain": "legal", "pattern": "contract"}]',
               "SPECDEC_SETTINGS_FILE": str(settings_file), "SPECDEC_TRAFFIC_IMPORT_BATCH_SIZE": "77"}
    settings = load_settings(environ)
    assert settings.known_domains == ("json", "legal", "general")
    assert [rule.name for rule in settings.domain_rules] == ["law"]
    assert (settings.sample.min_per_domain, settings.sample.max_per_domain, settings.traffic.import_batch_size) == (3, 9, 77)


@pytest.mark.parametrize("environ, fragment", [
    ({"SPECDEC_KNOWN_DOMAINS": "json,code"}, "fallback_domain"),          # general missing
    ({"SPECDEC_TRAFFIC_IMPORT_BATCH_SIZE": "zero"}, "traffic_import_batch_size"),
    ({"SPECDEC_DOMAIN_RULES": '[{"name": "x", "domain": "qa", "pattern": "("}]'}, "regular expression"),
    ({"SPECDEC_SETTINGS_FILE": "/nonexistent/settings.json"}, "SPECDEC_SETTINGS_FILE"),
])
def test_bad_settings_name_the_setting(environ, fragment):
    # a malformed setting is a SettingsError naming what to fix
    with pytest.raises(SettingsError, match=fragment):
        load_settings(environ)


def _schema_of(url: str) -> dict:
    """Everything the inspector reads of a database's schema, and its revision."""
    engine = create_engine(url)
    inspector = inspect(engine)
    schema = {}
    for table in sorted(inspector.get_table_names()):
        schema[table] = {
            "columns": [(c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                        for c in inspector.get_columns(table)],
            "primary key": inspector.get_pk_constraint(table)["constrained_columns"],
            "foreign keys": sorted(str(sorted(fk.items())) for fk in inspector.get_foreign_keys(table)),
            "indexes": sorted(str(sorted(ix.items())) for ix in inspector.get_indexes(table)),
            "unique": sorted(str(sorted(uq.items())) for uq in inspector.get_unique_constraints(table)),
            "checks": sorted(str(sorted(ck.items())) for ck in inspector.get_check_constraints(table))}
    with engine.connect() as connection:
        schema["revision"] = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    engine.dispose()
    return schema


def test_db_url_is_a_copy_of_a_real_migration(db_url, db_backend, tmp_path):
    # db_url copies a template migrated once per session (conftest.py); the copy must be the
    # schema the migrations make: every table, column, type, default, key, index and constraint
    from contextlib import nullcontext

    from tasks.db import dispose_engines

    from .helpers.db import postgres_schema

    fresh = (nullcontext(f"sqlite:///{tmp_path / 'migrated.db'}") if db_backend == "sqlite"
             else postgres_schema("t", before_drop=dispose_engines))
    with fresh as url:
        upgrade(url)
        migrated = _schema_of(url)
    copied = _schema_of(db_url)
    assert set(Base.metadata.tables) <= set(copied)
    assert copied["revision"] == [(head_revision(),)]
    assert copied == migrated


def test_cli_db_upgrade_and_current(empty_db_url, capsys):
    # `specdec db current` exits 1 before the upgrade and 0 after it
    from tasks.cli import main

    assert main(["db", "current", "--url", empty_db_url]) in (1, 2)
    assert main(["db", "upgrade", "--url", empty_db_url]) == 0
    assert main(["db", "current", "--url", empty_db_url]) == 0
    assert "up to date" in capsys.readouterr().out


def test_narrowing_known_domains_keeps_only_the_matching_default_rules():
    # without explicit rules, the default rules for domains outside the known set are dropped
    settings = load_settings({"SPECDEC_KNOWN_DOMAINS": "json,qa,general"})
    assert {rule.domain for rule in settings.domain_rules} == {"json", "qa"}


@pytest.mark.integration
def test_specdec_home_and_default_model_have_one_definition_that_loads_no_torch(tmp_path,
                                                                              monkeypatch):
    # tasks.settings re-exports the engine's own definitions (specdec_core.home), and importing
    # them loads no torch (data commands and DAG parses stay light)
    import subprocess
    import sys

    from specdec_core import home, models

    from tasks import settings

    assert settings.specdec_home is home.specdec_home is models.specdec_home
    assert settings.DEFAULT_MODEL == models.DEFAULT_MODEL == "smollm2-135m-instruct"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert settings.specdec_home() == tmp_path
    probe = ("import sys, tasks.settings, tasks.orchestration.airflow_glue; "
             "print('torch' in sys.modules, tasks.settings.DEFAULT_MODEL)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "smollm2-135m-instruct"]


@pytest.mark.integration
def test_data_commands_do_not_import_torch():
    # the store, import, sampling and report modules load without the engine's heavy dependencies
    import subprocess
    import sys

    code = ("import sys, tasks.steps.traffic.traffic_import, tasks.steps.traffic.traffic_sample, "
            "tasks.steps.traffic.reports, tasks.cli.data, tasks.orchestration.airflow_glue; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.integration
def test_the_command_line_starts_and_runs_a_data_command_without_torch(tmp_path):
    # `specdec` imports every command module at start-up: only the commands that run a model
    # load torch (about 1.5 s of each start), so `db`, `traffic`, `report` and `config` start light
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'specdec.db'}"
    code = ("import sys; from tasks.cli import main; "
            f"statuses = [main(['db', 'upgrade', '--url', {url!r}]), "
            f"main(['report', 'current_config_per_domain', '--format', 'json', '--url', {url!r}])]; "
            "print(statuses, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "SPECDEC_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    # the migration's line, the report's JSON (no rows yet), then the statuses and whether torch
    # was imported
    assert out.stdout.strip().endswith(f"-> {head_revision()}\n[][0, 0] False"), \
        out.stdout + out.stderr[-3000:]


def test_the_schema_is_checked_once_per_process_and_url_until_upgrade_or_dispose(db_url):
    # the check (revision + Alembic's scripts) runs on a URL's first ensure_ready; later calls
    # reuse it, so a schema dropped behind the process's back goes unnoticed until dispose_engines
    # (or upgrade) makes the next call check again
    from sqlalchemy import create_engine, text

    from tasks.db import dispose_engines

    engine = ensure_ready(db_url)
    other = create_engine(db_url)
    with other.begin() as connection:
        connection.execute(text(f"DROP TABLE {VERSION_TABLE}"))
    other.dispose()
    assert ensure_ready(db_url) is engine              # memoized: not checked again
    dispose_engines()
    with pytest.raises(DatabaseNotMigrated, match="specdec db upgrade"):
        ensure_ready(db_url)
