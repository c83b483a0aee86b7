"""The config registry (MLflow): registration reused on retry, gated compare-and-set promotion,
refusals that leave the champion, rollback, the vLLM export, the config schema, the serving-side
reader surviving a stopped tracking server, and `specdec config ...` on the command line.

No evaluation runs here: `finished_run` writes the rows an evaluation leaves (eval_runs,
domain_configs, optionally acceptance_estimates) straight into the specdec database.

Backends: each registry test runs on three combinations of (specdec database, MLflow tracking):
(sqlite, local store), (sqlite, `mlflow server`), (postgresql, local store). The PostgreSQL
database only changes where the promotions table lives, so pairing it with the server as well
would add run time (about a third) for no new path. The local store is a copy of one migrated MLflow database per
test (a fresh MLflow database spends seconds in its migrations); the server is started once for
the module, and every test uses its own target id, hence its own experiment and registered model.
The serving test starts (and stops) a server of its own. What starts a server (the sqlite-server
combination and the serving test) carries the `integration` marker.
"""

from __future__ import annotations

import re

import json
import os
import shlex
import shutil
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, insert, select

from tasks.registry.config_schema import (ConfigError, SpecdecConfig, config_model_name, parse_config,
                                          target_slug)
from tasks.db.models import Promotion
from tasks.db.store import Store
from tasks.registry.registry import Registry
from tasks.errors import RegistryError
from tasks.registry.promotion import check_gates, rollback
from tasks.registry.registration import register_config
from tasks.registry.run_config import build_config, validation_status
from tasks.registry.tracking import client, tracking_uri
from tasks.registry.vllm_export import vllm_export
from tasks.settings import load_settings

from .helpers.db import POSTGRES_ENV
from .helpers.processes import MlflowServer, specdec
from .helpers.registry import (DEFAULTS, LABEL, engine_sampling, finished_run, live_evidence, page_text,
                               promote_, register)
from .helpers.registry import now as _now


# ------------------------------------------------------------------------------------------------
# rows an evaluation leaves behind: helpers/registry.py
def promotions(db_url: str) -> list[dict]:
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = [dict(r) for r in connection.execute(select(Promotion).order_by(Promotion.id)).mappings()]
    engine.dispose()
    return rows


def champion_of(uri: str, name: str) -> str:
    return str(client(uri).get_model_version_by_alias(name, "champion").version)


def gate(result: dict, name: str) -> dict:
    return next(g for g in result["gates"] if g["name"] == name)


# ------------------------------------------------------------------------------------------------
# MLflow: a migrated local store to copy (conftest.py's mlflow_template), and a real tracking server
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, mlflow_template):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"), mlflow_template)
    yield server.uri
    server.stop()


COMBOS = [
    pytest.param(("sqlite", "local"), id="sqlite-local"),
    pytest.param(("sqlite", "server"), id="sqlite-server", marks=pytest.mark.integration),
    pytest.param(("postgresql", "local"), id="postgresql-local", marks=pytest.mark.skipif(
        not os.environ.get(POSTGRES_ENV), reason=f"{POSTGRES_ENV} is not set: no PostgreSQL server")),
]


@pytest.fixture(params=COMBOS)
def combo(request) -> tuple[str, str]:
    return request.param


@pytest.fixture
def db_backend(combo) -> str:
    """Overrides conftest's db_backend: the specdec database of this module's combination."""
    return combo[0]


@pytest.fixture
def tracking(combo, tmp_path, request, mlflow_template, monkeypatch) -> str:
    """The MLflow tracking URI: a local SQLite store of this test, or the module's server."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    if combo[1] == "server":
        return request.getfixturevalue("mlflow_server")
    path = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def target_id() -> str:
    """A target of this test only: its own experiment and registered model on a shared server."""
    return f"Test-Org/Tiny-Target-{uuid.uuid4().hex[:10]}"


# ------------------------------------------------------------------------------------------------
# 1. register and promote
def test_register_then_promote_first_champion(db_url, tracking, target_id):
    finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False}}, target_id=target_id,
                 estimates=True)
    registered = register("run-1", db_url, tracking)
    name = config_model_name(target_id)
    assert registered["name"] == name == f"specdec-config-{target_slug(target_id)}"
    assert registered["version"] == "1" and registered["reused"] is False
    assert registered["champion_version"] is None and registered["validation"] == "passed"

    mlflow_client = client(tracking)
    version = mlflow_client.get_model_version_by_alias(name, "challenger")
    assert str(version.version) == "1"
    assert version.tags == {"run_id": "run-1", "domains_on": "json", "validation": "passed",
                            "hardware_profile": "cpu-test", "target_fingerprint": "sha256:aaa"}
    description = page_text(version.description)
    assert "| json | on | prompt_lookup(max_ngram=3) | 3 | 2.20 |" in description
    assert "| chat | off |" in description and "| json | 4 | - | 25 |" in description
    assert "There was no champion when this version was registered" in description
    with pytest.raises(Exception):                       # no champion before the promotion
        mlflow_client.get_model_version_by_alias(name, "champion")

    # the tracked MLflow run: params, per-domain metrics, the config and the plots
    run = mlflow_client.get_run(registered["mlflow_run_id"])
    assert run.data.tags["specdec.run_id"] == "run-1"
    assert run.data.params["target"] == target_id and run.data.params["hardware_profile"] == "cpu-test"
    assert run.data.params["candidates"] == LABEL and run.data.params["domains"] == "chat,json"
    assert run.data.metrics["json.measured_speedup"] == pytest.approx(1.5)
    # figures at their own precision (4 significant digits), not 16
    assert all(len(repr(value).replace("-", "").replace(".", "").lstrip("0")) <= 4
               for value in run.data.metrics.values()), run.data.metrics
    # the run's own choices are params too (issue 52 item 9)
    assert {"window_days", "acceptance_alert", "promote"} <= set(run.data.params)
    # the version page reads the config artifact's MLmodel: it exists (no flavors: not a model)
    assert "config/MLmodel" in {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "config")}
    assert run.data.metrics["json.enabled"] == 1.0 and run.data.metrics["chat.enabled"] == 0.0
    assert {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "plots")} == {
        "plots/conditional_acceptance.png", "plots/predicted_speedup_vs_k.png"}
    shown = Registry.open(tracking).show_version(name, "challenger")
    assert shown["config"]["run_id"] == "run-1" and shown["config"]["target"]["id"] == target_id
    assert shown["config"]["domains"]["json"]["drafter"]["kind"] == "prompt_lookup"
    assert shown["config"]["domains"]["chat"]["enabled"] is False

    result = promote_(name, "1", db_url, tracking)
    assert result["promoted"] is True and result["forced"] is False
    # json was never measured live here: the live_check gate is unsure, and the reason says so;
    # no engine check was recorded: the engine_check gate says the config is not checked
    assert result["champion_before"] is None and result["reason"] == (
        "no gate failed: 2 passed, 1 unsure (live_check), 1 not checked (engine_check), 2 not run "
        "(no_regression, same_target); see the figures")
    assert [g["name"] for g in result["gates"]] == ["validation", "live_check", "no_regression",
                                                   "min_samples", "same_target", "engine_check"]
    # the page no longer asks to promote the champion it is (issue 52 item 8)
    lines = page_text(mlflow_client.get_model_version(name, "1").description).splitlines()
    assert lines[0].startswith("This version (1) is the champion.") and "promote 1" not in lines[0]
    assert all(g["passed"] for g in result["gates"])
    assert champion_of(tracking, name) == "1"
    assert set(mlflow_client.get_model_version(name, "1").aliases) == {"champion", "challenger"}

    rows = promotions(db_url)
    assert [(r["action"], r["alias"], r["config_version"]) for r in rows] == [
        ("register", "challenger", "1"), ("promote", "champion", "1")]
    assert all(r["run_id"] == "run-1" and r["target_id"] == target_id and r["config_name"] == name
               and r["actor"] == "pytest" for r in rows)
    assert rows[1]["forced"] is False and rows[1]["gates"]["champion_before"] is None
    assert [g["name"] for g in rows[1]["gates"]["gates"]] == [g["name"] for g in result["gates"]]


# 2. a retried registration
def test_retried_registration_reuses_the_run_and_the_version(db_url, tracking, target_id):
    finished_run(db_url, "run-1", {"json": {}}, target_id=target_id)
    first = register("run-1", db_url, tracking)
    again = register("run-1", db_url, tracking)
    assert (first["version"], first["reused"]) == ("1", False)
    assert (again["version"], again["reused"]) == ("1", True)
    assert again["mlflow_run_id"] == first["mlflow_run_id"]

    mlflow_client = client(tracking)
    name = config_model_name(target_id)
    assert [str(v.version) for v in mlflow_client.search_model_versions(f"name='{name}'")] == ["1"]
    experiment = mlflow_client.get_experiment_by_name(f"specdec/{target_slug(target_id)}")
    assert experiment is not None
    tagged = mlflow_client.search_runs([experiment.experiment_id],
                                       filter_string="tags.`specdec.run_id` = 'run-1'")
    assert [r.info.run_id for r in tagged] == [first["mlflow_run_id"]]
    assert len(mlflow_client.search_runs([experiment.experiment_id])) == 1

    rows = promotions(db_url)
    assert [r["action"] for r in rows] == ["register", "register"]
    assert "reused" in rows[1]["reason"] and rows[1]["config_version"] == "1"


# 3. failing gates leave the champion
def test_failed_validation_gate_leaves_the_champion(db_url, tracking, target_id):
    name = config_model_name(target_id)
    finished_run(db_url, "run-1", {"json": {}, "qa": {}}, target_id=target_id)
    assert promote_(name, register("run-1", db_url, tracking)["version"], db_url, tracking)["promoted"]

    finished_run(db_url, "run-2", {"json": {"validation": "failed", "promotable": False},
                                   "qa": {}}, target_id=target_id)
    registered = register("run-2", db_url, tracking)
    assert registered["version"] == "2" and registered["validation"] == "failed"
    assert registered["champion_version"] == "1"
    assert client(tracking).get_model_version(name, "2").tags["validation"] == "failed"

    result = promote_(name, "2", db_url, tracking)
    assert result["promoted"] is False and result["champion"] == "1"
    assert "validation" in result["reason"] and "not passed: json" in result["reason"]
    assert not gate(result, "validation")["passed"]
    assert "1/2 enabled domains passed" in gate(result, "validation")["figure"]
    assert all(g["passed"] for g in result["gates"] if g["name"] != "validation")
    assert champion_of(tracking, name) == "1"
    # the challenger alias moved to the new version; the champion did not
    assert str(client(tracking).get_model_version_by_alias(name, "challenger").version) == "2"

    last = promotions(db_url)[-1]
    assert (last["action"], last["config_version"], last["run_id"]) == ("reject", "2", "run-2")
    assert last["forced"] is False and last["gates"]["champion_before"] == "1"
    assert "validation" in last["reason"]


def test_failed_fingerprint_check_fails_the_validation_gate(db_url, tracking, target_id):
    from tasks.db.models import Validation

    name = config_model_name(target_id)
    finished_run(db_url, "run-fp", {"json": {}}, target_id=target_id)
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(Validation).values(
            run_id="run-fp", check_name="fingerprint", passed=False, created_at=_now(),
            details={"reasons": ["no sampled request was answered by this target"]}))
    engine.dispose()
    result = promote_(name, register("run-fp", db_url, tracking)["version"], db_url, tracking)
    assert result["promoted"] is False
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):    # no champion alias was set
        champion_of(tracking, name)
    assert "target fingerprint check FAILED" in gate(result, "validation")["figure"]


def test_regression_is_refused_unless_forced(db_url, tracking, target_id):
    name = config_model_name(target_id)
    finished_run(db_url, "run-1", {"json": {}, "qa": {}}, target_id=target_id)
    assert promote_(name, register("run-1", db_url, tracking)["version"], db_url, tracking)["promoted"]

    # qa measured 0.5x where the champion measured 1.5x: a third of the champion's speedup
    finished_run(db_url, "run-2", {"json": {}, "qa": {"measured_speedup": 0.5}}, target_id=target_id)
    assert register("run-2", db_url, tracking)["version"] == "2"
    refused = promote_(name, "2", db_url, tracking)
    assert refused["promoted"] is False and "no_regression" in refused["reason"]
    assert not gate(refused, "no_regression")["passed"]
    assert "worst domain qa: 0.33x" in gate(refused, "no_regression")["figure"]
    assert all(g["passed"] for g in refused["gates"] if g["name"] != "no_regression")
    assert champion_of(tracking, name) == "1"

    forced = promote_(name, "2", db_url, tracking, force=True)
    assert forced["promoted"] is True and forced["forced"] is True
    assert forced["champion_before"] == "1" and "no_regression" in forced["reason"]
    assert champion_of(tracking, name) == "2"
    rows = promotions(db_url)
    assert [r["action"] for r in rows] == ["register", "promote", "register", "reject", "promote"]
    assert rows[-1]["forced"] is True and rows[-1]["reason"].startswith("FORCED")
    assert rows[-1]["gates"]["champion_before"] == "1" and rows[-1]["config_version"] == "2"
    assert rows[1]["forced"] is False


# 4. rollback
def test_rollback_restores_the_previous_champion(db_url, tracking, target_id):
    name = config_model_name(target_id)
    finished_run(db_url, "run-1", {"json": {}}, target_id=target_id)
    register("run-1", db_url, tracking)
    with pytest.raises(RegistryError, match="no champion"):
        rollback(name, Store.open(db_url), registry=Registry.open(tracking))
    assert promote_(name, "1", db_url, tracking)["promoted"]

    def first_line(version: str) -> str:
        return page_text(client(tracking).get_model_version(name, version).description).splitlines()[0]
    # issue 83 item 5: the first champion's page gives no advice the rollback then refuses
    assert "restores" not in first_line("1") and "nothing to roll back to" in first_line("1")
    finished_run(db_url, "run-2", {"json": {"measured_speedup": 1.7}}, target_id=target_id)
    register("run-2", db_url, tracking)
    assert promote_(name, "2", db_url, tracking)["champion_before"] == "1"
    assert champion_of(tracking, name) == "2"
    assert (f"specdec config rollback --target {target_id} restores version 1, the champion it "
            "replaced") in first_line("2")

    assert rollback(name, Store.open(db_url), registry=Registry.open(tracking), actor="pytest") == {
        "champion": "1", "champion_before": "2"}
    assert champion_of(tracking, name) == "1"
    assert "nothing to roll back to" in first_line("1")          # restored: it replaced none
    last = promotions(db_url)[-1]
    assert (last["action"], last["alias"], last["config_version"], last["run_id"]) == (
        "rollback", "champion", "1", "run-1")
    assert last["gates"] == {"champion_before": "2"}

    # a rollback meant for champion 2 while 1 is champion: refused, nothing moves
    with pytest.raises(RegistryError, match="asked to roll back champion 2, but the champion is now 1"):
        rollback(name, Store.open(db_url), registry=Registry.open(tracking), expected_champion="2")
    assert champion_of(tracking, name) == "1"
    # version 1 replaced no champion: nothing further to roll back to, and nothing moves
    with pytest.raises(RegistryError, match="replaced no earlier champion"):
        rollback(name, Store.open(db_url), registry=Registry.open(tracking))
    assert champion_of(tracking, name) == "1"
    assert [r["action"] for r in promotions(db_url)].count("rollback") == 1
    # a tracking URI passed by position (uri's place before, the Registry's now): deprecated,
    # and the Registry still opened from it
    with pytest.warns(DeprecationWarning, match="in registry's place is deprecated"), \
            pytest.raises(RegistryError, match="replaced no earlier champion"):
        rollback(name, Store.open(db_url), tracking)
    assert champion_of(tracking, name) == "1"


@pytest.mark.integration
def test_refused_rollbacks_are_audit_rows_and_force_is_recorded_only_when_it_overrode_a_gate(
        db_url, tracking, target_id):
    """`specdec config rollback|promote` in new processes: every refused rollback (no champion,
    nothing to roll back to, another champion than expected) is a committed `reject` row; a
    --force the gates did not need is recorded as not forced, in promotions and refusals alike."""
    name = config_model_name(target_id)
    common = ["--target", target_id, "--tracking-uri", tracking, "--url", db_url]
    for run_id in ("run-1", "run-2"):
        finished_run(db_url, run_id, {"json": {}}, target_id=target_id)
        register(run_id, db_url, tracking)

    def run(*args: str, status: int, says: str) -> dict:
        result = specdec("config", *args, *common)
        said = result.stderr if status == 2 else result.stdout      # errors on stderr, verdicts on stdout
        assert result.returncode == status and says in " ".join(said.split()), \
            result.stdout + result.stderr
        return promotions(db_url)[-1]

    row = run("rollback", status=2, says="has no champion to roll back")
    assert (row["action"], row["config_version"], row["run_id"], row["forced"]) == (
        "reject", None, None, False)
    assert row["reason"].startswith("rollback refused:") and row["gates"]["command"] == "rollback"

    row = run("promote", "1", "--force", status=0, says="version 1: promoted to champion: no gate failed: ")
    assert (row["action"], row["config_version"], row["forced"]) == ("promote", "1", False)

    row = run("rollback", status=2, says="nothing to roll back to")
    assert (row["action"], row["config_version"], row["run_id"], row["target_id"]) == (
        "reject", "1", "run-1", target_id)
    row = run("rollback", "--expected-champion", "2", status=2, says="the champion is now 1")
    assert row["action"] == "reject" and row["gates"]["expected_champion"] == "2"

    row = run("promote", "1", "--force", status=1, says="version 1 is already the champion")
    assert (row["action"], row["forced"], row["gates"]["force_requested"]) == ("reject", False, True)
    row = run("promote", "2", "--force", "--expected-champion", "3", status=1, says="re-run the gates")
    assert (row["action"], row["forced"]) == ("reject", False)

    assert [(r["action"], r["forced"]) for r in promotions(db_url)] == [
        ("register", False), ("register", False), ("reject", False), ("promote", False),
        ("reject", False), ("reject", False), ("reject", False), ("reject", False)]
    assert champion_of(tracking, name) == "1"


# 5. compare-and-set
def test_promotion_is_compare_and_set_on_the_reviewed_champion(db_url, tracking, target_id,
                                                                monkeypatch):
    name = config_model_name(target_id)
    for run_id in ("run-1", "run-2", "run-3"):
        finished_run(db_url, run_id, {"json": {}}, target_id=target_id)
        register(run_id, db_url, tracking)
    assert promote_(name, "1", db_url, tracking, expected_champion=None)["promoted"]
    assert promote_(name, "2", db_url, tracking, expected_champion="1")["promoted"]

    # gates of version 3 were reviewed against champion 1, but the champion is now 2
    stale = promote_(name, "3", db_url, tracking, expected_champion="1")
    assert stale["promoted"] is False and stale["champion"] == "2"
    assert "champion 1" in stale["reason"] and "now 2" in stale["reason"]
    assert champion_of(tracking, name) == "2"
    # reviewed against "no champion" while one exists
    none = promote_(name, "3", db_url, tracking, expected_champion=None)
    assert none["promoted"] is False and "champion none" in none["reason"]
    assert champion_of(tracking, name) == "2"
    rejects = [r for r in promotions(db_url) if r["action"] == "reject"]
    assert [(r["config_version"], r["gates"]["champion_before"]) for r in rejects] == [("3", "2")] * 2

    # reviewed against the actual champion: promoted
    fresh = promote_(name, "3", db_url, tracking, expected_champion="2")
    assert fresh["promoted"] is True and fresh["champion_before"] == "2"
    assert champion_of(tracking, name) == "3"
    # and the champion itself is not promoted again
    same = promote_(name, "3", db_url, tracking)
    assert same["promoted"] is False and "already the champion" in same["reason"]

    # another promotion lands between the gates and the alias move: the champion it set stays
    from tasks.registry import promotion
    real, reads = promotion.alias_version, []

    def racing(mlflow_client, model_name, alias):
        reads.append(alias)
        if len(reads) == 2:        # the compare-and-set re-read: someone moved the champion to 1
            mlflow_client.set_registered_model_alias(model_name, "champion", "1")
        return real(mlflow_client, model_name, alias)

    monkeypatch.setattr(promotion, "alias_version", racing)
    raced = promote_(name, "2", db_url, tracking)
    assert reads == ["champion", "champion"]
    assert raced["promoted"] is False and "moved from 3 to 1" in raced["reason"]
    assert champion_of(tracking, name) == "1"
    assert promotions(db_url)[-1]["action"] == "reject"


# 6. target change
def test_another_target_fingerprint_fails_same_target(db_url, tracking, target_id):
    name = config_model_name(target_id)
    finished_run(db_url, "run-1", {"json": {}}, target_id=target_id, fingerprint="sha256:aaa")
    register("run-1", db_url, tracking)
    assert promote_(name, "1", db_url, tracking)["promoted"]
    finished_run(db_url, "run-2", {"json": {}}, target_id=target_id, fingerprint="sha256:bbb")
    register("run-2", db_url, tracking)
    assert "target changed" in client(tracking).get_model_version(name, "2").description

    result = promote_(name, "2", db_url, tracking)
    assert result["promoted"] is False and "same_target" in result["reason"]
    assert not gate(result, "same_target")["passed"]
    assert "sha256:bbb vs champion sha256:aaa" in gate(result, "same_target")["figure"]
    assert all(g["passed"] for g in result["gates"] if g["name"] != "same_target")
    assert champion_of(tracking, name) == "1"
    assert promotions(db_url)[-1]["action"] == "reject"


# ------------------------------------------------------------------------------------------------
# the config of a run (database only)
@pytest.mark.parametrize("db_backend", [
    "sqlite", pytest.param("postgresql", marks=pytest.mark.skipif(
        not os.environ.get(POSTGRES_ENV), reason=f"{POSTGRES_ENV} is not set"))])
def test_build_config_keeps_the_champions_setting_for_insufficient_domains(db_url):
    finished_run(db_url, "run-1", {"json": {}, "code": {"status": "insufficient", "enabled": False,
                                                        "samples": 7}})
    alone = build_config("run-1", Store.open(db_url))
    assert alone.domains_on == ["json"]
    assert alone.domains["code"].source == "off" and alone.domains["code"].samples == 7
    json_setting = alone.domains["json"]
    assert json_setting.drafter.kind == "prompt_lookup" and json_setting.drafter.params == {"max_ngram": 3}
    assert json_setting.predicted_speedup_ci95 == (1.3, 1.9) and json_setting.max_batch_size == 4
    assert validation_status(alone) == "passed"

    champion = alone.model_copy(update={"domains": {**alone.domains, "code": json_setting}})
    kept = build_config("run-1", Store.open(db_url), champion=champion)
    assert kept.domains["code"].enabled and kept.domains["code"].source == "champion"
    assert kept.domains_on == ["code", "json"]

    finished_run(db_url, "run-2", {"json": {}}, fingerprint=None)
    with pytest.raises(RegistryError, match="not finished"):
        build_config("run-2", Store.open(db_url))
    with pytest.raises(RegistryError, match="does not exist"):
        build_config("no-such-run", Store.open(db_url))


def test_a_version_that_turns_nothing_on_reads_not_run_never_passed(db_url, tracking, target_id,
                                                                    capsys):
    """Issue 83 items 1-2: a run whose every domain is off: no "passed" and no "pass" over a check
    that did not run, in the tags, the MLflow run's description, the page, the gates, the audit
    row and the CLI; the page says the version turns nothing on and what automatic promotion does."""
    from tasks.cli.config import print_gates
    from tasks.steps.pipeline import step_promote

    finished_run(db_url, "run-1", {"json": {"enabled": False, "samples": 30},
                                   "chat": {"enabled": False, "samples": 30}}, target_id=target_id)
    registered = register("run-1", db_url, tracking)
    name = config_model_name(target_id)
    mlflow_client = client(tracking)
    version = mlflow_client.get_model_version(name, registered["version"])
    assert version.tags["validation"] == "not run: no domain is on" == registered["validation"]
    run = mlflow_client.get_run(registered["mlflow_run_id"])
    assert run.data.tags["specdec.validation"] == "not run: no domain is on"
    note = run.data.tags["mlflow.note.content"]
    assert "validation **not run: no domain is on**" in note and "validated" not in note
    page = page_text(version.description)
    assert "validation not run: no domain is on" in page and "validation passed" not in page
    assert "This version turns no domain on" in page and "automatic promotion" in page
    assert "no calibration.png: no domain was measured live on this engine" in page    # item 9
    assert "| json | off |" in page and "not_needed" not in page and "not run (off)" in page
    # item 6: the one reason the load check did not run; "-" in the vLLM columns is explained
    assert "Not run: no domain is on." in page and "or no domain on with a vLLM config" not in page
    assert '"-" is a check not run: the domain is off (here every domain is off)' in page
    gates = {g["name"]: g for g in registered["gates"]}
    for name_ in ("validation", "live_check", "no_regression", "min_samples", "same_target",
                  "engine_check"):
        assert gates[name_]["result"] == "not run" and gates[name_]["figure"].startswith("not run: "), gates[name_]
    assert "had 30 samples or more; required 20" in gates["min_samples"]["figure"]
    assert not re.search(r"\| (validation|live_check|min_samples|engine_check) \| pass", page)
    # the DAG's automatic promotion skips it, saying why
    skipped = step_promote({"run_id": "run-1", "target": target_id, "tracking_uri": tracking,
                            "db_url": db_url}, registered)
    assert not skipped["promoted"] and "turns no domain on" in skipped["reason"]
    # promoted by hand: the audit row and the CLI say "not run", never "all gates passed"
    result = promote_(name, registered["version"], db_url, tracking)
    assert result["promoted"] and "all gates passed" not in result["reason"], result["reason"]
    assert result["reason"].startswith(f"version {registered['version']} turns no domain on")
    assert "6 not run" in result["reason"]
    assert promotions(db_url)[-1]["reason"] == result["reason"]
    capsys.readouterr()
    print_gates(result)
    printed = capsys.readouterr().out
    assert "not run" in printed and not re.search(r"\bpass\b", printed), printed
    # `specdec evaluate`'s printout of the run: the same rule
    from tasks.cli.evaluation import print_run
    from tasks.registry.run_view import build_run_view

    print_run(build_run_view("run-1", Store.open(db_url), DEFAULTS))
    printed = " ".join(capsys.readouterr().out.split())
    assert "validation not run: no domain is on" in printed and "engine check: not run: no domain is on" in printed
    assert "passed" not in printed and "not_needed" not in printed, printed


def test_a_prediction_on_a_noisy_profile_says_so_beside_it(db_url):
    """Issue 83 item 8: the interval is over requests only; the profile's state stands beside
    each prediction, and the legend says what the interval leaves out."""
    from dataclasses import replace

    from tasks.registry.run_view import build_run_view, domains_markdown, table_rows

    finished_run(db_url, "run-1", {"json": {}})
    view = build_run_view("run-1", Store.open(db_url), DEFAULTS)
    assert table_rows(view)[0][7] == "1.60x [1.30, 1.90]"
    noisy = replace(view, profile={"status": "noisy", "reasons": ["spread 40%"]})
    assert table_rows(noisy)[0][7] == "1.60x [1.30, 1.90] (cost profile NOISY)"
    assert "not the cost profile's timing noise otherwise" in domains_markdown(noisy)


def test_the_versions_list_preview_and_the_run_name_read_plainly(db_url, tracking, target_id):
    """Issue 83 item 11: MLflow's versions list previews a description's first characters raw, so
    the page's first line carries no Markdown marks and warns off the "Promote model" button; the
    run's name is readable, not an Airflow run id cut to "manual__2026-12-05T2..."."""
    from tasks.registry.registration import readable_run_name

    run_id = "manual__2026-12-05T21:03:12.345678+00:00"
    finished_run(db_url, run_id, {"json": {}}, target_id=target_id)
    registered = register(run_id, db_url, tracking)
    mlflow_client = client(tracking)
    description = mlflow_client.get_model_version(registered["name"], registered["version"]).description
    first = description.splitlines()[0]
    assert first.startswith(f"Promote only with specdec config promote {registered['version']} ")
    assert "*" not in first and "`" not in first and "do not use either" in first
    run = mlflow_client.get_run(registered["mlflow_run_id"])
    assert run.info.run_name == "evaluate 2026-12-05 21:03 manual" == readable_run_name(run_id)
    assert run.data.tags["specdec.run_id"] == run_id and readable_run_name("run-1") == "run-1"
    assert promote_(registered["name"], registered["version"], db_url, tracking)["promoted"]
    first = mlflow_client.get_model_version(registered["name"], registered["version"]).description.splitlines()[0]
    assert first.startswith(f"This version ({registered['version']}) is the champion.") and "*" not in first


def test_the_page_says_how_a_reviewer_promotes_and_its_command_promotes_this_version(
        db_url, tracking, target_id):
    """Issue 83 item 11: MLflow's UI cannot host a gated "Promote" action, so the version page
    says how a reviewer promotes: the command names the page's model (--target: without it the
    CLI takes the default target's model, another model's version N), where it runs (Compose
    included) and what MLflow's own controls would do. The command, run as the page writes it
    against this registry and database, promotes this version; the champion's first line then
    names the rollback with the same --target."""
    finished_run(db_url, "run-page", {"json": {}}, target_id=target_id)
    registered = register("run-page", db_url, tracking)
    name, version = registered["name"], registered["version"]
    mlflow_client = client(tracking)
    description = mlflow_client.get_model_version(name, version).description
    first = description.splitlines()[0]
    assert first.startswith(f"Promote only with specdec config promote {version} --target {target_id} (")
    assert first.endswith("How: see Promoting this version below.")
    section = description.split("### Promoting this version", 1)[1].split("\n### ", 1)[0]
    assert "MLflow's UI has no action that promotes through specdec's gates" in section
    command = f"specdec config promote {version} --target {target_id}"
    assert f"`{command}`" in section
    assert f"`docker compose exec airflow-scheduler {command}`" in section
    assert "`MLFLOW_TRACKING_URI`, `SPECDEC_DATABASE_URL`" in section and "Promote model" in section
    assert "Plots: the run's `plots/` artifacts" in description      # kept below the new section
    # the page's command, in a new process, with this registry and database in its environment
    done = specdec(*shlex.split(command)[1:], env={"MLFLOW_TRACKING_URI": tracking,
                                                   "SPECDEC_DATABASE_URL": db_url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert str(mlflow_client.get_model_version_by_alias(name, "champion").version) == str(version)
    first = mlflow_client.get_model_version(name, version).description.splitlines()[0]
    assert first.startswith(f"This version ({version}) is the champion.")
    assert f"specdec config promote N --target {target_id} instead" in first


def test_min_samples_gate_counts_measured_enabled_domains():
    config = parse_config(config_dict(json=enabled_domain(samples=5), chat={"enabled": False}))
    gates = {g.name: g for g in check_gates(config, None, DEFAULTS)}
    # the short domains in words, not a Python list ("short: ['json']", issue 52 item 9)
    assert not gates["min_samples"].passed and gates["min_samples"].figure.endswith("; short: json")
    assert gates["no_regression"].passed and gates["same_target"].passed


def test_gate_json_is_the_stored_shape_and_reads_back():
    from tasks.registry.gate import Gate, gates_json, gates_of

    ran = Gate("same_target", False, "a vs champion b")
    skipped = Gate("no_regression", True, "not run: no champion to compare", result="not run")
    assert gates_json([ran, skipped]) == [
        {"name": "same_target", "passed": False, "figure": "a vs champion b"},
        {"name": "no_regression", "passed": True, "result": "not run",
         "figure": "not run: no champion to compare"}]
    assert gates_of(gates_json([ran, skipped])) == [ran, skipped]
    passed = Gate("validation", True, "1/1 enabled domains passed")
    assert (ran.outcome, skipped.outcome, passed.outcome) == ("fail", "not run", "pass")


def test_tracking_uri_default_and_refuses_specdecs_database(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert tracking_uri() == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert tracking_uri("http://mlflow:5000") == "http://mlflow:5000"
    own = f"sqlite:///{tmp_path / 'specdec.db'}"
    store = Store(url=own, engine=create_engine(own), settings=load_settings({}))
    with pytest.raises(RegistryError, match="specdec's own database"):
        tracking_uri(own, store)
    with pytest.raises(RegistryError, match="specdec's own database"):
        tracking_uri(own, own)      # a step that holds no Store yet passes the URL
    assert tracking_uri("http://mlflow:5000", store) == "http://mlflow:5000"


def test_the_registry_is_resolved_once_and_opens_its_client_on_first_use(tmp_path, monkeypatch):
    # Registry.open resolves the URI as tracking_uri does and touches nothing: a sqlite store's
    # file is made by the first call that needs the client, which is then kept
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    registry = Registry.open()
    assert registry.uri == tracking_uri() and registry.local_store_missing()
    assert not (tmp_path / "mlflow.db").exists()
    assert "pw" not in repr(Registry.open("http://u:pw@mlflow:5000"))
    own = f"sqlite:///{tmp_path / 'specdec.db'}"
    store = Store(url=own, engine=create_engine(own), settings=load_settings({}))
    with pytest.raises(RegistryError, match="specdec's own database"):
        Registry.open(own, store)
    assert registry.client is registry.client
    assert registry.check_reachable() == registry.uri and not registry.local_store_missing()
    assert registry.current_champion(target_id="Test-Org/None") == (None, None)
    with pytest.raises(RegistryError, match="no version with alias"):
        registry.show_version("specdec-config-none")
    with pytest.raises(TypeError, match="not both"):
        rollback("specdec-config-none", store, uri=registry.uri, registry=registry)
    with pytest.raises(TypeError, match="not both"):      # the Registry by position, and uri=
        rollback("specdec-config-none", store, registry, uri=registry.uri)
    with pytest.raises(TypeError, match="not both"):
        rollback("specdec-config-none", store, registry.uri, uri=registry.uri)


# ------------------------------------------------------------------------------------------------
# 7. the schema
def enabled_domain(**overrides) -> dict:
    return {"enabled": True, "drafter": {"kind": "prompt_lookup", "params": {"max_ngram": 3}}, "k": 3,
            "max_batch_size": 4, "conditional_acceptance": [0.8, 0.5], "samples": 25,
            "validation": "passed", **overrides}


def config_dict(**domains) -> dict:
    return {"target": {"id": "tiny", "fingerprint": "sha256:aaa"}, "hardware_profile": "cpu-test",
            "run_id": "run-1", "created_at": "2025-11-01T10:00:00", "domains": domains}


def test_a_valid_config_round_trips():
    config = parse_config(config_dict(json=enabled_domain(), chat={"enabled": False}))
    assert isinstance(config, SpecdecConfig) and config.domains_on == ["json"]
    assert config.default.enabled is False and config.schema_version == 2
    assert parse_config(config.to_json()) == config


def test_schema_1_configs_still_read_and_schedules_are_checked():
    old = parse_config({**config_dict(json=enabled_domain()), "schema_version": 1})
    assert old.schema_version == 1 and old.domains["json"].k_schedule == []
    scheduled = parse_config(config_dict(json=enabled_domain(
        k=4, max_batch_size=4, k_schedule=[[1, 1, 4], [2, 2, 3], [3, 4, 2], [5, 8, 0]])))
    assert scheduled.domains["json"].k_schedule[2] == (3, 4, 2)
    for schedule, max_batch, words in (([[2, 4, 3]], 4, "contiguously from batch size 1"),
                                       ([[1, 2, 3], [4, 8, 1]], 8, "contiguously"),
                                       ([[1, 1, 4], [2, 4, 2]], 1, "max_batch_size 1 != ")):
        with pytest.raises(ConfigError, match=words):
            parse_config(config_dict(json=enabled_domain(k=4, max_batch_size=max_batch,
                                                         k_schedule=schedule)))


@pytest.mark.parametrize("domain, field, words", [
    (enabled_domain(k=-1), "domains.json.k", "greater than or equal to 0"),
    (enabled_domain(conditional_acceptance=[0.9, 1.5]), "domains.json.conditional_acceptance.1",
     "less than or equal to 1"),
    (enabled_domain(conditional_acceptance=[-0.1]), "domains.json.conditional_acceptance.0",
     "greater than or equal to 0"),
    (enabled_domain(drafter={"kind": "medusa"}), "domains.json.drafter.kind", "prompt_lookup"),
    ({"enabled": True, "k": 3}, "domains.json", "needs a drafter"),
    (enabled_domain(k=0), "domains.json", "k >= 1"),
    (enabled_domain(speedup=2.0), "domains.json.speedup", "Extra inputs"),
], ids=["negative-k", "rate-above-1", "rate-below-0", "unknown-drafter", "no-drafter", "k-zero",
        "unknown-field"])
def test_schema_rejects_bad_configs_naming_the_field(domain, field, words):
    with pytest.raises(ConfigError) as caught:
        parse_config(config_dict(json=domain, chat={"enabled": False}))
    message = str(caught.value)
    assert f"{field}: " in message and words in message


def test_schema_lists_every_problem_and_rejects_non_json():
    with pytest.raises(ConfigError) as caught:
        parse_config(config_dict(json=enabled_domain(k=-2), code=enabled_domain(drafter=None)))
    message = str(caught.value)
    assert "(2 problems)" in message and "domains.json.k" in message and "domains.code:" in message
    with pytest.raises(ConfigError, match="not JSON"):
        parse_config("{not json")
    with pytest.raises(ConfigError, match="target: Field required"):
        parse_config({k: v for k, v in config_dict(json=enabled_domain()).items() if k != "target"})


def test_schema_lists_both_problems_of_one_domain():
    with pytest.raises(ConfigError) as caught:
        parse_config(config_dict(json=enabled_domain(k=-1, conditional_acceptance=[1.5])))
    message = str(caught.value)
    assert "(2 problems)" in message
    assert "domains.json.k" in message and "domains.json.conditional_acceptance.0" in message


def test_target_slug_and_model_name():
    assert target_slug("HuggingFaceTB/SmolLM2-135M") == "huggingfacetb--smollm2-135m"
    assert target_slug("a b_c.d") == "a-b-c-d"
    assert target_slug("!!!") == "target" and target_slug("///") == "target"
    assert config_model_name("HuggingFaceTB/SmolLM2-135M") == "specdec-config-huggingfacetb--smollm2-135m"


# ------------------------------------------------------------------------------------------------
# 8. vLLM export
def test_vllm_export_per_domain():
    config = parse_config(config_dict(
        json=enabled_domain(drafter={"kind": "prompt_lookup", "params": {"max_ngram": 4, "min_ngram": 1}},
                            k=5, max_batch_size=8),
        qa=enabled_domain(drafter={"kind": "prompt_lookup", "params": {}}, k=2, max_batch_size=None),
        code=enabled_domain(drafter={"kind": "layer_skip", "params": {"num_layers": 2}}),
        summarize=enabled_domain(drafter={"kind": "draft_model", "params": {},
                                          "model_uri": "models:/tiny-drafter/3"}, k=4),
        chat={"enabled": False}))
    exported = vllm_export(config)
    assert exported["target"] == "tiny" and exported["run_id"] == "run-1" and exported["default"] is None
    spec = exported["speculative_config"]
    # a schema 1 cut-off becomes vLLM's schedule of inclusive [first, last, K] ranges (no V0 keys)
    assert spec["json"] == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 1,
                            "num_speculative_tokens_per_batch_size": [[1, 8, 5], [9, 1 << 20, 0]]}
    assert spec["qa"] == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                          "prompt_lookup_min": 2}
    assert spec["summarize"] == {"method": "draft_model", "model": "models:/tiny-drafter/3",
                                 "num_speculative_tokens": 4,
                                 "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 1 << 20, 0]]}
    assert spec["code"] is None and spec["chat"] is None
    assert not any("disable_by_batch_size" in s for s in spec.values() if s)
    assert set(exported["unsupported"]) == {"code"} and "layer_skip" in exported["unsupported"]["code"]
    assert json.loads(json.dumps(exported)) == exported
    # one deployment per drafter method and its parameters (K per request by the plan); the
    # domains without speculation share one
    deployments = {tuple(d["domains"]): d for d in exported["deployments"]}
    assert set(deployments) == {("json",), ("qa",), ("summarize",), ("chat", "code")}
    serve = "python -m vllm.entrypoints.openai.api_server --model"
    assert deployments[("chat", "code")]["command"] == f"{serve} tiny"
    assert deployments[("chat", "code")]["plan"] is None
    command = deployments[("qa",)]["command"]
    assert command.startswith("SPECDEC_VLLM_PLAN='") and f"{serve} tiny --speculative-config '" in command
    assert json.loads(command.split("--speculative-config ")[1].strip("'")) == spec["qa"]
    assert deployments[("qa",)]["plan"] == {"method": "ngram", "domains": {"qa": 2}, "default": 0}
    # the batch-size schedule travels in the plan; the server drafts up to its largest K
    assert deployments[("json",)]["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    assert deployments[("json",)]["plan"]["domains"] == {"json": [[1, 8, 5], [9, 1 << 20, 0]]}
    assert f"{serve} /models/tiny" in vllm_export(config, target_path="/models/tiny")["deployments"][1]["command"]


def test_vllm_export_of_eagle3_heads():
    # an EAGLE-3 head (speculators format) is vLLM's own eagle3 method: the registered URI or the
    # checkpoint directory as given, K, and the batch schedule as for the other kinds
    config = parse_config(config_dict(
        json=enabled_domain(drafter={"kind": "eagle3", "params": {"model": "models:/tiny-eagle3/2"},
                                     "model_uri": "models:/tiny-eagle3/2"}, k=3,
                            max_batch_size=4, k_schedule=[[1, 2, 3], [3, 4, 2], [5, 8, 0]]),
        qa=enabled_domain(drafter={"kind": "eagle3", "params": {"model": "/ckpt/eagle3"}}, k=2,
                          max_batch_size=None),
        code=enabled_domain(drafter={"kind": "head", "params": {"model": "/ckpt/head"}}, k=2)))
    exported = vllm_export(config)
    spec = exported["speculative_config"]
    assert spec["json"] == {"method": "eagle3", "model": "models:/tiny-eagle3/2",
                            "num_speculative_tokens": 3,
                            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 2], [5, 8, 0],
                                                                      [9, 1 << 20, 0]]}
    assert spec["qa"] == {"method": "eagle3", "model": "/ckpt/eagle3", "num_speculative_tokens": 2}
    # the EAGLE-1/2-style head still has no vLLM equivalent
    assert spec["code"] is None and set(exported["unsupported"]) == {"code"}
    assert "head has no vLLM equivalent" in exported["unsupported"]["code"]
    command = {tuple(d["domains"]): d["command"] for d in exported["deployments"]}[("qa",)]
    assert json.loads(command.split("--speculative-config ")[1].strip("'")) == spec["qa"]


def test_sglang_export_per_domain():
    from tasks.registry.sglang_export import sglang_export

    schedule = [[1, 2, 4], [3, 4, 2], [5, 8, 0]]
    config = parse_config(config_dict(
        eagle=enabled_domain(drafter={"kind": "eagle3", "params": {"model": "models:/tiny-eagle3/2"},
                                      "model_uri": "models:/tiny-eagle3/2"}, k=4, max_batch_size=4,
                             k_schedule=schedule),
        draft=enabled_domain(drafter={"kind": "draft_model", "params": {"model": "/ckpt/draft"}}, k=3,
                             max_batch_size=None),
        json=enabled_domain(drafter={"kind": "prompt_lookup", "params": {"max_ngram": 4, "min_ngram": 1}},
                            k=5, max_batch_size=None),
        code=enabled_domain(drafter={"kind": "suffix", "params": {}}, k=3),
        layers=enabled_domain(drafter={"kind": "layer_skip", "params": {"num_layers": 2}}),
        heads=enabled_domain(drafter={"kind": "head", "params": {"model": "/ckpt/head"}}),
        chat={"enabled": False}))
    exported = sglang_export(config, target_path="/models/tiny")
    flags = exported["speculative_flags"]
    # EAGLE-3 and a draft model: a chain (topk 1) of K steps, K + 1 tokens verified, at the K the
    # plan drafts at batch size 1
    assert flags["eagle"] == ["--speculative-algorithm", "EAGLE3",
                              "--speculative-draft-model-path", "models:/tiny-eagle3/2",
                              "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "5"]
    assert flags["draft"] == ["--speculative-algorithm", "STANDALONE",
                              "--speculative-draft-model-path", "/ckpt/draft",
                              "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "4"]
    assert flags["json"] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
                             "--speculative-ngram-min-match-window-size", "1",
                             "--speculative-ngram-max-match-window-size", "4",
                             "--speculative-ngram-min-bfs-breadth", "1",
                             "--speculative-ngram-max-bfs-breadth", "1"]
    assert flags["chat"] is None
    assert set(exported["unsupported"]) == {"code", "layers", "heads"}
    for name, kind in (("code", "suffix"), ("layers", "layer_skip"), ("heads", "head")):
        assert flags[name] is None and exported["unsupported"][name].startswith(f"{kind} has no SGLang")
    # what the mapping leaves out is said: one K per server, the format, NGRAM's other rule
    notes = exported["notes"]
    assert "K=4" in notes["eagle"] and "K=[2]" in notes["eagle"] and "above batch size 4" in notes["eagle"]
    assert "speculators format" in notes["eagle"]
    assert "not prompt lookup's" in notes["json"] and "K=" not in notes["draft"]
    assert json.loads(json.dumps(exported)) == exported
    # one deployment per distinct set of flags, each with its launch command
    deployments = {tuple(d["domains"]): d for d in exported["deployments"]}
    assert set(deployments) == {("eagle",), ("draft",), ("json",), ("chat", "code", "heads", "layers")}
    assert deployments[("chat", "code", "heads", "layers")]["command"] == (
        "python -m sglang.launch_server --model-path /models/tiny")
    command = deployments[("eagle",)]["command"]
    assert command.startswith("python -m sglang.launch_server --model-path /models/tiny --speculative-")
    assert shlex.split(command)[5:] == flags["eagle"]
    assert sglang_export(config)["deployments"][0]["command"].endswith("--model-path tiny")


def test_k_by_batch_size_goes_to_each_engines_own_key():
    from tasks.registry.trtllm_export import trtllm_export

    schedule = [[1, 1, 5], [2, 2, 4], [3, 4, 2], [5, 8, 0]]
    config = parse_config(config_dict(
        json=enabled_domain(drafter={"kind": "prompt_lookup", "params": {"max_ngram": 4}}, k=5,
                            max_batch_size=4, k_schedule=schedule),
        code=enabled_domain(drafter={"kind": "suffix", "params": {}}, k=3, max_batch_size=1,
                            k_schedule=[[1, 1, 3], [2, 2, 0]]),
        chat={"enabled": False}))
    vllm = vllm_export(config)["speculative_config"]
    assert vllm["json"]["num_speculative_tokens"] == 5 and "disable_by_batch_size" not in vllm["json"]
    assert vllm["json"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 5], [2, 2, 4], [3, 4, 2], [5, 8, 0], [9, 1 << 20, 0]]
    trt = trtllm_export(config)
    assert trt["speculative_config"]["json"] == {"decoding_type": "NGram", "max_draft_len": 5,
                                                 "max_matching_ngram_size": 4,
                                                 "draft_len_schedule": {1: 5, 2: 4, 4: 2}}
    assert trt["speculative_config"]["code"] is None and "suffix" in trt["unsupported"]["code"]
    assert trt["speculative_config"]["chat"] is None
    # vLLM's suffix decoding takes one K at every batch size (a schedule stops its engine): the
    # batch-size-1 K, with a note naming the schedule left out and the batch size to route at
    assert vllm["code"]["num_speculative_tokens"] == 3
    assert "num_speculative_tokens_per_batch_size" not in vllm["code"]
    note = vllm_export(config)["notes"]["code"]
    assert "one K at every batch size" in note and "[[1, 1, 3], [2, 2, 0]]" in note and "above batch size 1" in note


# ------------------------------------------------------------------------------------------------
# 9. serving survives the tracking server being stopped
FAIL_FAST_TIMEOUT_S = 5       # tasks.registry.tracking.fail_fast: what a serving read waits, at most


def http_requests(monkeypatch) -> list[dict]:
    """Every HTTP request MLflow's client makes from now on, as the retries and the timeout it is
    made with (the arguments it is given, else the environment's, as MLflow reads them)."""
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT
    from mlflow.utils import rest_utils

    made = []
    real = rest_utils.http_request

    def recorded(*args, **kwargs):
        retries, timeout = kwargs.get("max_retries"), kwargs.get("timeout")
        made.append({"retries": MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() if retries is None else retries,
                     "timeout_s": MLFLOW_HTTP_REQUEST_TIMEOUT.get() if timeout is None else timeout})
        return real(*args, **kwargs)

    monkeypatch.setattr(rest_utils, "http_request", recorded)
    return made


def test_mlflow_settings_are_scoped_not_written_to_the_environment(tmp_path, monkeypatch):
    # specdec's MLflow settings (bounded retries) hold without os.environ; fail_fast holds in the
    # thread that entered it only; a variable the user set wins over a default, not over fail_fast
    import threading

    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    from tasks.registry.tracking import client, fail_fast

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                 "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        monkeypatch.delenv(name, raising=False)
    environment = dict(os.environ)
    client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == (2, 20)
    seen, inside, release = {}, threading.Event(), threading.Event()

    def other_thread():
        inside.wait(10)
        seen["other"] = MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()
        release.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with fail_fast():
        inside.set()
        release.wait(10)
        seen["scope"] = MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()
        assert dict(os.environ) == environment
    worker.join(10)
    assert seen == {"scope": (0, 5), "other": (2, 20)}
    assert (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == (2, 20)
    assert dict(os.environ) == environment
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "33")
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 33
    with fail_fast():
        assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 5


@pytest.mark.integration
@pytest.mark.parametrize("db_backend", ["sqlite"])
def test_serving_reader_survives_a_stopped_tracking_server(db_url, tmp_path, mlflow_template,
                                                           target_id, monkeypatch):
    from tasks.registry.serving_reader import ChampionReader

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    server = MlflowServer(tmp_path / "server", mlflow_template)
    try:
        finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False}}, target_id=target_id)
        name = register("run-1", db_url, server.uri)["name"]
        assert promote_(name, "1", db_url, server.uri)["promoted"]

        now = [0.0]
        cache = tmp_path / "cache" / "champion.json"
        reader = ChampionReader(server.uri, target_id, ttl_s=30, cache_path=cache, clock=lambda: now[0])
        setting = reader.domain("json")
        assert setting["enabled"] is True and setting["k"] == 3 and setting["max_batch_size"] == 4
        assert setting["drafter"] == {"kind": "prompt_lookup", "params": {"max_ngram": 3},
                                      "model_uri": None}
        assert reader.version == "1" and reader.last_error is None
        assert parse_config(cache.read_text("utf-8")).run_id == "run-1"
        assert reader.domain("chat")["enabled"] is False

        # a new champion: seen once the TTL has passed, not before
        finished_run(db_url, "run-2", {"json": {"k": 5, "measured_speedup": 1.8},
                                       "chat": {"enabled": False}}, target_id=target_id)
        register("run-2", db_url, server.uri)
        assert promote_(name, "2", db_url, server.uri)["promoted"]
        now[0] = 10.0
        assert reader.domain("json") == setting and reader.version == "1"
        now[0] = 40.0
        setting = reader.domain("json")
        assert setting["k"] == 5 and setting["measured_speedup"] == 1.8
        assert reader.version == "2" and reader.last_error is None
        assert parse_config(cache.read_text("utf-8")).run_id == "run-2"
    finally:
        server.stop()

    # within the TTL: served from memory, no registry read at all
    now[0] = 50.0
    assert reader.domain("json") == setting and reader.last_error is None
    # past the TTL: the refresh fails fast and the last good config is served. A serving read
    # must not hang on a stopped server: each request is made once (MLflow's client retries for
    # minutes by default) and waits at most a few seconds
    requests = http_requests(monkeypatch)
    now[0] = 100.0
    assert reader.domain("json") == setting
    assert reader.last_error
    assert reader.version == "2"
    assert requests and all(r == {"retries": 0, "timeout_s": FAIL_FAST_TIMEOUT_S} for r in requests), requests

    # a restart with the server still down: the cached config from disk
    requests.clear()
    restarted = ChampionReader(server.uri, target_id, ttl_s=0, cache_path=cache)
    assert restarted.domain("json") == setting
    assert restarted.last_error
    assert requests and all(r == {"retries": 0, "timeout_s": FAIL_FAST_TIMEOUT_S} for r in requests), requests
    assert restarted.domain("no-such-domain") == {"enabled": False}
    # no cache and no server: speculation off
    cold = ChampionReader(server.uri, target_id, ttl_s=0, cache_path=tmp_path / "none" / "c.json")
    assert cold.domain("json") == {"enabled": False} and cold.last_error


# ------------------------------------------------------------------------------------------------
# 10. the command line
def test_cli_config_register_show_export_promote(db_url, tracking, target_id, capsys, monkeypatch):
    from rich.console import Console

    from tasks.cli import config, main

    monkeypatch.setattr(config, "console", Console(width=400))   # no wrapping at 80 columns
    common = ["--target", target_id, "--tracking-uri", tracking]
    finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False}}, target_id=target_id)
    assert main(["config", "register", "run-1", *common, "--url", db_url]) == 0
    assert "version 1 (registered), alias challenger" in capsys.readouterr().out
    assert main(["config", "promote", "1", *common, "--url", db_url,
                 "--expected-champion", "none"]) == 0
    out = capsys.readouterr().out
    assert "version 1: promoted to champion: no gate failed: " in out

    assert main(["config", "show", "champion", *common]) == 0
    out = capsys.readouterr().out
    assert f"{config_model_name(target_id)} version 1 aliases" in out
    assert "| json | on | prompt_lookup(max_ngram=3) | 3 | 2.20 |" in out and "| chat | off |" in out
    assert "run_id=run-1" in out

    assert main(["config", "show", "champion", *common, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == "1" and "champion" in shown["aliases"]

    assert main(["config", "export", "--format", "vllm", *common]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["speculative_config"]["json"]["method"] == "ngram"
    assert exported["speculative_config"]["json"]["num_speculative_tokens"] == 3
    assert exported["speculative_config"]["chat"] is None
    assert main(["config", "export", "--format", "sglang", *common]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["speculative_flags"]["json"][:2] == ["--speculative-algorithm", "NGRAM"]
    assert exported["speculative_flags"]["chat"] is None
    assert main(["config", "export", *common]) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == "run-1"

    # a failing gate: exit code 1, champion unchanged
    finished_run(db_url, "run-2", {"json": {"validation": "failed"}}, target_id=target_id)
    assert main(["config", "register", "run-2", *common, "--url", db_url]) == 0
    assert "version 2 (registered)" in capsys.readouterr().out
    assert main(["config", "promote", "2", *common, "--url", db_url]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "NOT promoted" in out and "validation" in out
    assert champion_of(tracking, config_model_name(target_id)) == "1"

    # errors: exit code 2
    assert main(["config", "promote", "99", *common, "--url", db_url]) == 2
    assert "RegistryError" in capsys.readouterr().err
    assert main(["config", "rollback", *common, "--url", db_url]) == 2
    assert "nothing to roll back" in capsys.readouterr().err


# 12. the MLflow run of an evaluation ends with the right status
@pytest.mark.parametrize("error, status", [(None, "FINISHED"), (RuntimeError("store broke"), "FAILED"),
                                           (KeyboardInterrupt(), "KILLED")])
def test_evaluation_run_ends_finished_failed_or_killed(db_url, tracking, target_id, monkeypatch,
                                                        error, status):
    from tasks.registry import registration
    from tasks.registry.tracking import RUN_TAG

    finished_run(db_url, "run-1", {"json": {}}, target_id=target_id)
    if error is not None:
        def broken(*args, **kwargs):
            raise error
        monkeypatch.setattr(registration, "record_promotion", broken)   # after the run exists
        with pytest.raises(type(error)):
            register("run-1", db_url, tracking)
    else:
        register("run-1", db_url, tracking)
    mlflow_client = client(tracking)
    experiment = mlflow_client.get_experiment_by_name(f"specdec/{target_slug(target_id)}")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"   # runs view
    run = mlflow_client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_TAG}` = 'run-1'")[0]
    assert run.info.status == status


# 13. the version page a reviewer decides from; a champion moved by hand is flagged
def test_version_page_explains_itself_and_a_champion_moved_outside_the_gates_is_flagged(
        db_url, tracking, target_id, capsys):
    from tasks.cli.app import main
    from tasks.steps.traffic.reports import run_report

    name = config_model_name(target_id)
    off_reason = "off: best prompt_lookup K=2 predicts 1.04x [0.98, 1.09]; lower end below min_speedup 1.1"
    finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False, "reason": off_reason}},
                 target_id=target_id)
    register("run-1", db_url, tracking)
    page = client(tracking).get_model_version(name, "1").description
    page = page_text(page)
    # why chat is off, said once (not "(off): off: ...")
    assert f"- chat (off): {off_reason.removeprefix('off: ')}" in page.splitlines()
    assert "| json | on |" in page and "[1.30, 1.90]" in page  # predicted with its interval
    assert "- json (on): test row" in page
    assert "Gates (preview at registration against champion none" in page
    assert "Current champion: none yet" in page
    assert promote_(name, "1", db_url, tracking)["promoted"]
    page = page_text(client(tracking).get_model_version(name, "1").description)
    assert "Current champion: version 1 (promoted with specdec config promote" in page
    # the heading counts the gates by result (issue: "promoted (all gates passed (live_check: ...)))")
    assert re.search(r"Gates \(specdec config promote against champion none, .+ UTC: promoted: 2 passed, "
                     r"1 unsure \(live_check\), 1 not checked \(engine_check\), 2 not run "
                     r"\(no_regression, same_target\)\)", page), page
    assert "preview at registration" not in page

    finished_run(db_url, "run-2", {"json": {"validation": "failed"}}, target_id=target_id)
    register("run-2", db_url, tracking)
    assert "validation FAILED" in client(tracking).get_model_version(name, "2").description
    # a reviewer presses MLflow's own "Promote": the alias moves past the gates
    client(tracking).set_registered_model_alias(name, "champion", "2")
    capsys.readouterr()
    assert main(["config", "show", "champion", "--target", target_id, "--url", db_url,
                 "--tracking-uri", tracking]) == 0
    shown = " ".join(capsys.readouterr().err.split())        # a warning: on stderr
    assert "WARNING: champion version 2 was moved outside specdec" in shown
    assert "specdec last moved it to version 1 (promote)" in shown
    assert main(["config", "export", "champion", "--target", target_id, "--url", db_url,
                 "--tracking-uri", tracking]) == 0
    captured = capsys.readouterr()
    assert "moved outside specdec" in " ".join(captured.err.split())
    json.loads(captured.out)                                   # the export itself stays clean JSON
    # the next pipeline run notices it, on its page and in the ops report
    finished_run(db_url, "run-3", {"json": {}}, target_id=target_id)
    registered = register("run-3", db_url, tracking)
    assert registered["champion_audit"]["gated"] is False
    assert "WARNING: champion version 2 was moved outside specdec" in \
        client(tracking).get_model_version(name, "3").description
    report = run_report("ungated_champions", store=Store.open(db_url))
    rows = [dict(zip(report["columns"], row)) for row in report["rows"]]
    assert [(r["champion_version"], r["noticed_by_run"]) for r in rows] == [("2", "run-3")]
    # promoting through specdec clears it
    assert promote_(name, "3", db_url, tracking, force=True)["promoted"]
    capsys.readouterr()
    assert main(["config", "show", "champion", "--target", target_id, "--url", db_url,
                 "--tracking-uri", tracking, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["champion_audit"]["gated"] is True


def test_a_domain_measured_faster_than_predicted_is_no_warning(db_url, tracking, target_id):
    # code measured 1.93x [1.67, 2.47] against 1.41x predicted: faster, so not "below the bar"
    # and not "within the measurement's noise"; the page and the gate say it is faster
    name = config_model_name(target_id)
    on = "on: prompt_lookup K=3 predicts 1.41x [1.20, 1.70] at batch 1; pays up to batch 4 on cpu-test"
    finished_run(db_url, "run-1", {"code": {"reason": on}}, target_id=target_id)
    live_evidence(db_url, "run-1", "code", 1.93, 1.41, (1.67, 2.47), requests=8)
    registered = register("run-1", db_url, tracking)
    lines = page_text(client(tracking).get_model_version(name, registered["version"]).description).splitlines()
    assert not any("WARNING: on, but" in line for line in lines)
    row = next(line for line in lines if line.startswith("| code |"))
    assert "| 1.93x vs 1.41x 37% faster than predicted for the same requests (tolerance 25%) |" in row
    assert "WARNING" not in row
    gate_row = next(line for line in lines if line.startswith("| live_check |"))
    assert gate_row.startswith("| live_check | pass | 1/1 enabled domains measured at or above their bar")
    assert "at or above the bar, 37% faster than predicted" in gate_row
    assert "noise" not in gate_row


# 14. what the page says must be what was measured: the live check, the alert, the proposal rate
def test_version_page_shows_a_slow_live_check_the_alert_and_the_proposal_rate(db_url, tracking, target_id):
    name = config_model_name(target_id)
    on = "on: prompt_lookup K=3 predicts 1.46x [1.20, 1.70] at batch 1; pays up to batch 4 on cpu-test"
    finished_run(db_url, "run-1", {d: {"reason": on, "champion_on": True,
                                       "mean_accepted_length": 1.12 if d == "chat" else 2.2}
                                   for d in ("json", "summarize", "chat")}, target_id=target_id)
    live_evidence(db_url, "run-1", "json", 1.52, 1.46, (1.35, 1.70), requests=6)
    # measured slower than plain decoding: the stored verdict flags it (the champion had it on)
    live_evidence(db_url, "run-1", "summarize", 0.97, 1.46, (0.91, 0.99), verdict="flag")
    # below min_speedup, but within its own noise; E 1.12 with drafts in 10% of the rounds
    live_evidence(db_url, "run-1", "chat", 1.04, 1.30, (0.93, 1.18), e=1.12,
                  width_share=[0.9, 0.0, 0.0, 0.1], shared_from="json")
    registered = register("run-1", db_url, tracking)
    page = page_text(client(tracking).get_model_version(name, registered["version"]).description)
    lines = page.splitlines()
    assert lines[0].startswith("Promote only with specdec config promote 1 ")
    # MLflow 3's "Promote model" opens "Copy to model": the page says so, and names the pencil
    assert "alias pencil moves champion past both" in lines[0]
    assert "\"Promote model\" button does not move champion" in lines[0]
    # issue 83 item 10: the decision in 9 named columns, the rest in a table below (1280 px)
    header, more = [line for line in lines if line.startswith("| domain |")][:2]
    assert header == ("| domain | on | drafter | K | E [tokens/round] | predicted (95% CI) | "
                      "live check (same requests) | validation | on vLLM |")
    assert more == "| domain | max batch | proposal rate | samples | vLLM sampling | under load (vLLM) | source |"
    rows, details = {}, {}
    for line in (line for line in lines if line.startswith("| ") and not line.startswith("| domain |")):
        (rows if line.split(" | ")[0][2:] not in rows else details)[line.split(" | ")[0][2:]] = line
    assert rows["json"] == ("| json | on | prompt_lookup(max_ngram=3) | 3 | 2.20 | "
                            "1.60x [1.30, 1.90] | 1.52x vs 1.46x | passed | NOT CHECKED |")
    assert details["json"] == "| json | 4 | 100% | 25 | - | - | run |"
    # one rule (live_check.judge_live) for the cell, the reasons and the gate: summarize's
    # interval lies below the bar (a WARNING); chat's only reaches below it (unsure, no WARNING)
    assert ("| 0.97x vs 1.46x WARNING: slower than plain decoding; the interval's upper end 0.99x is "
            "below min_speedup 1.10x; 34% slower than predicted for the same requests, beyond the 25% "
            "tolerance |") in rows["summarize"]
    assert "| 1.12 |" in rows["chat"] and "| 10% |" in details["chat"]
    assert ("| 1.04x vs 1.30x unsure: its interval [0.93, 1.18] reaches below min_speedup 1.10x |"
            in rows["chat"]) and "WARNING" not in rows["chat"]
    assert rows["chat"].endswith("| passed, shared from json | NOT CHECKED |")
    assert details["chat"].endswith("| - | - | run |")
    # each domain's reason says it once, and quotes the live check beside the prediction
    assert ("- summarize (on): prompt_lookup K=3 predicts 1.46x [1.20, 1.70] at batch 1; pays up to "
            "batch 4 on cpu-test. Live check: 0.97x measured [0.91, 0.99] vs 1.46x predicted on the "
            "same 3 requests: slower than plain decoding; the interval's upper end 0.99x is below "
            "min_speedup 1.10x; 34% slower than predicted for the same requests, beyond the 25% "
            "tolerance (weak evidence: 3 requests)") in lines
    assert "(on): on:" not in page
    assert any(line.startswith("- chat (on):") and line.endswith(
        "Sampling test shared from json (same drafter, K and sampling settings)") for line in lines)
    assert not any(line.startswith("- json (on):") and "shared from" in line for line in lines)
    assert ("WARNING: on, but the live check measured them below the bar or slower than predicted (see "
            "the live_check gate):" in lines)
    assert ("Low-acceptance alert (expected tokens per round below 1.20; published as "
            "specdec://alerts/low-acceptance, which triggers draft retraining): chat (on, "
            f"{LABEL} K=3: E = 1.12, proposal rate 10%).") in lines
    # the live check is a gate: summarize's measurement fails it, chat's is unsure, json passes
    gate_row = next(line for line in lines if line.startswith("| live_check |"))
    assert gate_row.startswith("| live_check | FAIL | 1/3 enabled domains measured at or above their "
                               "bar; FAILED: summarize; unsure: chat")
    assert ("chat 1.04x measured [0.93, 1.18] vs 1.30x predicted on the same 3 requests: unsure, its "
            "interval [0.93, 1.18] reaches below min_speedup 1.10x") in gate_row
    result = promote_(name, registered["version"], db_url, tracking)
    assert not result["promoted"] and "live_check" in result["reason"]
    gate_row = next(line for line in page_text(client(tracking).get_model_version(
        name, registered["version"]).description).splitlines() if line.startswith("| live_check |"))
    assert gate_row.startswith("| live_check | FAIL |")


def test_version_page_shows_the_sampling_test_on_vllm_beside_the_own_engines(db_url, tracking, target_id):
    # per domain: vLLM's verdict with rows, tests and smallest p, and the own engine's; a domain
    # whose vLLM test failed is failed and unpromotable; no vLLM test, no line
    from tasks.registry.run_results import domain_evidence

    name = config_model_name(target_id)
    finished_run(db_url, "run-1", {d: {} for d in ("json", "chat", "qa")}, target_id=target_id)
    for domain in ("json", "chat", "qa"):
        live_evidence(db_url, "run-1", domain, 1.52, 1.46, (1.35, 1.70), requests=6)
    engine_sampling(db_url, "run-1", "json", min_p=0.021)
    engine_sampling(db_url, "run-1", "chat", status="failed", min_p=1e-9, control=True)
    evidence = domain_evidence("run-1", Store.open(db_url))
    assert evidence["json"]["engine_sampling"] == {
        "engine": "vllm", "status": "passed", "passed": True, "rows": 300, "positions": 6,
        "min_p": 0.021, "reason": "vLLM sampling test passed: 6 G-tests of 300 rows, smallest p 0.021",
        "control": None, "shared_from": None, "first": None}
    assert evidence["chat"]["engine_sampling"]["control"] == "passed"
    assert evidence["qa"]["engine_sampling"] is None and evidence["qa"]["validation"]["min_p"] == 0.5
    registered = register("run-1", db_url, tracking)
    assert registered["validation"] == "failed"
    lines = page_text(client(tracking).get_model_version(name, registered["version"]).description).splitlines()
    assert ("- json: sampling test on vLLM: passed (300 rows, 6 tests, p>=0.021); own engine: "
            "passed (p>=0.5)") in lines
    assert next(line for line in lines if line.startswith("- chat: ")).startswith(
        "- chat: sampling test on vLLM: FAILED (300 rows, 6 tests, p>=1e-09, plain server passed); "
        "own engine: passed (p>=0.5). vLLM sampling test FAILED with the config at T0.7 position 2")
    assert not any(line.startswith("- qa: sampling test") for line in lines)
    # the validation column in the first table, the vLLM sampling test in the one below
    rows, details = {}, {}
    for line in (line for line in lines if line.startswith("| ") and not line.startswith("| domain |")):
        (rows if line.split(" | ")[0][2:] not in rows else details)[line.split(" | ")[0][2:]] = line
    assert "| failed | NOT CHECKED |" in rows["chat"] and "| passed | NOT CHECKED |" in rows["json"]
    assert "| 25 | FAILED (300 rows, 6 tests, p>=1e-09, plain server passed) |" in details["chat"]
    assert "| 25 | passed (300 rows, 6 tests, p>=0.021) |" in details["json"]


def test_a_sampling_test_passed_on_confirmation_says_its_first_draw_failed(db_url, tracking, target_id):
    # the first draw of 300 rows failed, 1200 fresh rows passed and decided (validation_confirm_factor)
    from tasks.registry.run_results import domain_evidence, own_sampling_text

    name = config_model_name(target_id)
    finished_run(db_url, "run-1", {"json": {}}, target_id=target_id)
    live_evidence(db_url, "run-1", "json", 1.52, 1.46, (1.35, 1.70), requests=6)
    engine_sampling(db_url, "run-1", "json", rows=1200, min_p=0.016, first_rows=300)
    evidence = domain_evidence("run-1", Store.open(db_url))
    assert evidence["json"]["engine_sampling"]["first"] == "first draw of 300 rows failed"
    registered = register("run-1", db_url, tracking)
    assert registered["validation"] == "passed"
    lines = page_text(client(tracking).get_model_version(name, registered["version"]).description).splitlines()
    assert ("- json: sampling test on vLLM: passed on confirmation (1200 rows, 6 tests, p>=0.016, first draw "
            "of 300 rows failed); own engine: passed (p>=0.5)") in lines
    assert own_sampling_text({"passed": True, "min_p": 0.2, "first": "first draw of 300 rows failed"}) == (
        "passed on confirmation (p>=0.2, first draw of 300 rows failed)")
    assert own_sampling_text({"passed": False, "min_p": 1e-6, "first": "first draw of 300 rows failed"}) == (
        "FAILED (p>=1e-06, first draw of 300 rows failed)")


def test_live_check_gate_is_unsure_not_silent_on_noise_and_reports_when_not_enforced(db_url):
    from tasks.registry.promotion import live_gate
    from tasks.registry.run_results import domain_evidence

    finished_run(db_url, "run-1", {"json": {}, "chat": {}, "qa": {}})
    live_evidence(db_url, "run-1", "json", 1.52, 1.46, (1.35, 1.70), requests=6)
    live_evidence(db_url, "run-1", "chat", 1.04, 1.30, (0.93, 1.18))      # qa: never measured
    config = build_config("run-1", Store.open(db_url))
    evidence = domain_evidence("run-1", Store.open(db_url))
    gate = live_gate(config, evidence, DEFAULTS)
    assert gate.passed and gate.result == "unsure"
    assert "unsure: chat, qa" in gate.figure and "qa: not measured live" in gate.figure
    assert live_gate(config, evidence, DEFAULTS, profile_noisy=True).figure.endswith(
        "The cost profile is noisy: predictions are not evidence")
    evidence["chat"]["live"]["verdict"] = "flag"
    assert live_gate(config, evidence, DEFAULTS).result == "fail"
    off = live_gate(config, evidence, load_settings({}, live_veto=False))
    assert off.passed and off.result == "not enforced" and "FAILED: chat" in off.figure


# ------------------------------------------------------------------------------------------------
# what a reviewer sees of the MLflow run: its time span, its description, its data-quality report
QUALITY_ROWS = [
    {"suite": "sample", "scope": "table", "expectation": "expect_column_values_to_be_unique",
     "column_name": "id", "success": True, "status": "pass",
     "observed": {"unexpected_count": 0, "element_count": 60}},
    {"suite": "sample", "scope": "table", "expectation": "expect_column_values_to_not_be_null",
     "column_name": "prompt", "success": False, "status": "fail",
     "observed": {"unexpected_count": 2, "examples": ["json-3", "json-9"]}},
    {"suite": "per_domain", "scope": "code", "expectation": "expect_table_row_count_to_be_between",
     "column_name": None, "success": False, "status": "insufficient", "observed": {"observed_value": 3}},
]


def test_the_mlflow_run_spans_the_evaluation_and_describes_itself(db_url, tracking, target_id):
    import tempfile
    from datetime import timedelta, timezone

    from tasks.db.models import EvalRun, QualityResult

    finished_run(db_url, "run-1", {"json": {}, "chat": {"enabled": False}}, target_id=target_id)
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(QualityResult), [dict(row, run_id="run-1", created_at=_now())
                                                   for row in QUALITY_ROWS])
        recorded = connection.execute(select(EvalRun.created_at).where(EvalRun.run_id == "run-1")).scalar()
    engine.dispose()
    before = _now()
    registered = register("run-1", db_url, tracking)
    mlflow_client = client(tracking)
    run = mlflow_client.get_run(registered["mlflow_run_id"])
    # from when the sample step recorded the run (5 minutes before here), not from registration
    assert run.info.start_time == int(recorded.replace(tzinfo=timezone.utc).timestamp() * 1000)
    assert run.info.end_time >= int(before.replace(tzinfo=timezone.utc).timestamp() * 1000)
    assert run.info.end_time - run.info.start_time >= timedelta(minutes=5).total_seconds() * 1000
    note = run.data.tags["mlflow.note.content"]
    assert "specdec evaluation `run-1`" in note and "Domains on: json (K=3). Off: chat." in note
    assert "data quality (FAILED)" in note and "validation **passed**" in note
    # the report inside MLflow's pane: every expectation with its result, nothing fetched
    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow_client.download_artifacts(run.info.run_id, "reports/data_quality.html", tmp)
        html = Path(path).read_text("utf-8")
    assert_self_contained(html)
    assert "expect_column_values_to_not_be_null" in html and "FAILED" in html
    assert "insufficient" in html


def test_the_mlflow_run_starts_at_the_dag_runs_start(db_url, tracking, target_id):
    from datetime import datetime, timedelta, timezone

    finished_run(db_url, "run-1", {"json": {}}, target_id=target_id)
    dag_start = datetime.now(timezone.utc) - timedelta(minutes=10)      # before the sample step
    with pytest.warns(DeprecationWarning, match="uri= is deprecated"):   # callers outside the repository
        registered = register_config("run-1", Store.open(db_url), uri=tracking, settings=DEFAULTS,
                                     actor="pytest", started_at=dag_start)
    run = client(tracking).get_run(registered["mlflow_run_id"])
    assert run.info.start_time == int(dag_start.timestamp() * 1000)
    assert run.info.status == "FINISHED"


def assert_self_contained(html: str) -> None:
    """No scripts, stylesheets, images or links: nothing to load, nothing to navigate the pane to."""
    import re

    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I), html
    for tag in ("<script", "<link", "<a ", "<img", "<iframe", "@import", "url("):
        assert tag not in html.lower(), tag


def test_data_quality_report_shows_every_expectation_and_loads_nothing():
    import re

    from tasks.registry.registration import data_quality_report

    html = data_quality_report("run-1", QUALITY_ROWS, ["sample-table.html"])
    assert_self_contained(html)
    text = " ".join(re.sub(r"<[^>]+>", " ", html).split())
    assert "sample FAILED" in text and "per_domain FAILED" in text
    # the outcome once ("passed", not "passed (pass)" beside "passed (ok)"); a status that says
    # more stays ("FAILED (insufficient)")
    assert "table expect_column_values_to_be_unique id passed {" in text and "(pass)" not in text
    assert "table expect_column_values_to_not_be_null prompt FAILED {" in text and "(fail)" not in text
    assert "json-9" in text
    assert "code expect_table_row_count_to_be_between FAILED (insufficient)" in text
    assert "reports/data_docs/sample-table.html" in text        # GX's own pages: attached, named


def test_data_docs_pages_are_attached_without_requests_to_outside_hosts():
    # GX's Data Docs load Bootstrap, fonts and Vega from CDNs: the attached copy requests none
    from tasks.registry.registration import offline_html

    page = ('<html><head><link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/bootstrap.min.css">'
            '<link rel="icon" href="local.ico"><script src="https://cdn.jsdelivr.net/npm/vega@5"></script>'
            '<script src="//code.jquery.com/jquery.js"></script><style>@import url("https://fonts.x.com/a.css");'
            'td{background:url(https://img.example.org/a.png)}</style></head><body><table><tr><td>'
            'expect_column_values_to_not_be_null</td></tr></table><a href="https://greatexpectations.io/x">'
            'docs</a><img src="https://img.example.org/logo.png"><script>var x = 1;</script></body></html>')
    html = offline_html(page)
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html, re.I), html
    assert "expect_column_values_to_not_be_null" in html and "var x = 1;" in html
    assert 'href="local.ico"' in html                       # a local reference stays


# ------------------------------------------------------------------------------------------------
# the plots, read at 1280 px: short titles, legends off the data, the threshold, the chosen K
RUN_ID = "manual__2026-05-04T10:11:12.345678+00:00"


def estimate_rows() -> list[dict]:
    rows = []
    for domain, base in (("chat", 0.8), ("code", 1.1), ("json", 1.3), ("qa", 0.9)):
        for drafter, lift in (("prompt_lookup(max_ngram=3)", 0.1), ("suffix", 0.15)):
            for k in range(1, 9):
                speedup = base + lift * min(k, 4) - 0.03 * max(k - 4, 0)
                rows.append({"domain": domain, "drafter": drafter, "k": k,
                             "predicted_speedup": speedup, "predicted_speedup_lo": speedup - 0.1,
                             "predicted_speedup_hi": speedup + 0.1,
                             "conditional_acceptance": [0.8 - 0.05 * i for i in range(k)],
                             "mean_accepted_length": 1.0 + base * 0.5,
                             "draft_width_share": [0.93 if domain == "chat" else 0.2,
                                                   0.07 if domain == "chat" else 0.8]})
    return rows


def figure_texts(fig) -> list[str]:
    return [t.get_text() for t in [fig._suptitle, *[ax.title for ax in fig.axes]] if t is not None
            and t.get_text()]


def assert_legends_off_the_data(fig) -> None:
    fig.canvas.draw()
    legends = [*fig.legends, *[ax.get_legend() for ax in fig.axes if ax.get_legend()]]
    assert legends
    for legend in legends:
        box = legend.get_window_extent()
        assert box.height >= 20                                      # readable, not a 6 px strip
        for ax in fig.axes:
            if ax.get_visible():
                assert not box.overlaps(ax.get_window_extent()), (legend, ax.get_title())


def assert_footnote_apart(fig) -> None:
    """The run-id footnote overlaps no legend, axes or title (it overlapped a legend entry)."""
    fig.canvas.draw()
    foot = next(t for t in fig.texts if RUN_ID in t.get_text()).get_window_extent()
    boxes = [legend.get_window_extent() for legend in fig.legends]
    boxes += [ax.get_tightbbox() for ax in fig.axes if ax.get_visible()]
    if fig._suptitle is not None:
        boxes.append(fig._suptitle.get_window_extent())
    assert not [box for box in boxes if box.overlaps(foot)], (foot, boxes)


def test_speedup_plot_has_threshold_chosen_k_interval_and_a_legend_off_the_data():
    from matplotlib.collections import PolyCollection

    from tasks.registry.plots import speedup_figure

    configs = {"json": {"drafter": "suffix", "k": 4, "enabled": True},
               "code": {"drafter": "prompt_lookup(max_ngram=3)", "k": 3, "enabled": True},
               "chat": {"drafter": None, "k": 0, "enabled": False}}
    fig = speedup_figure(estimate_rows(), configs, 1.1, RUN_ID)
    assert_legends_off_the_data(fig)
    for title in figure_texts(fig):
        assert len(title) <= 40 and RUN_ID not in title, title
    assert any(RUN_ID in t.get_text() for t in fig.texts)           # the run id: a footnote
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"chat: off", "code: on, K=3", "json: on, K=4", "qa: off"}
    for ax in panels.values():
        thresholds = [line for line in ax.get_lines() if line.get_label() == "min_speedup 1.1"]
        assert thresholds and list(thresholds[0].get_ydata()) == [1.1, 1.1]
        assert any(isinstance(c, PolyCollection) for c in ax.collections)     # the 95% band
    chosen = [line for line in panels["json: on, K=4"].get_lines() if line.get_label() == "chosen K"]
    assert len(chosen) == 1 and list(chosen[0].get_xdata()) == [4]
    assert list(chosen[0].get_ydata()) == [pytest.approx(1.3 + 0.15 * 4)]
    assert not [line for line in panels["chat: off"].get_lines() if line.get_label() == "chosen K"]
    assert "min_speedup 1.1" in [t.get_text() for t in fig.legends[0].get_texts()]
    # issue 83 item 9: a domain that is off has its best candidate hollow, never "chosen K"
    configs["qa"] = {"drafter": "suffix", "k": 2, "enabled": False}
    off = {ax.get_title(): ax for ax in speedup_figure(estimate_rows(), configs, 1.1, RUN_ID).axes}["qa: off"]
    assert [line.get_label() for line in off.get_lines() if "K" in line.get_label()] == ["best K (off)"]
    # one neutral swatch for the bands (each in its drafter's colour), not the first drafter's
    entries = dict(zip([t.get_text() for t in fig.legends[0].get_texts()], fig.legends[0].legend_handles))
    swatch = entries["95% interval (in the drafter's colour)"]
    assert swatch.get_facecolor()[:3] == pytest.approx((0.5, 0.5, 0.5), abs=0.01)
    assert_footnote_apart(fig)


def test_acceptance_plot_at_k_1_has_a_readable_axis_and_markers_apart():
    """Issue 83 item 9: K = 1 everywhere: the x axis spans a position (not 0.96-1.04) and equal
    rates of several domains do not sit on one another."""
    from tasks.registry.plots import acceptance_figure

    rows = [r for r in estimate_rows() if r["k"] == 1 and r["drafter"] == "suffix"]
    fig = acceptance_figure(rows, {d: "suffix" for d in ("chat", "code", "json", "qa")}, RUN_ID,
                            {d: 1 for d in ("chat", "code", "json", "qa")})
    ax = fig.axes[0]
    assert ax.get_xlim() == (0.5, 1.5) and list(ax.get_xticks()) == [1]
    xs = [float(line.get_xdata()[0]) for line in ax.get_lines()]
    assert len(set(xs)) == 4 and max(xs) - min(xs) < 0.5


def test_acceptance_plot_draws_each_points_stored_interval():
    """Issue 83 item 9: every point of the acceptance plot has its 95% interval drawn from the
    stored conditional_acceptance_ci, in its domain's colour; a row stored without one (before
    migration 0016) is named under the plot, not drawn as if it had none."""
    from matplotlib.collections import LineCollection

    from tasks.registry.plots import acceptance_figure

    rows = [dict(r) for r in estimate_rows() if r["drafter"] == "suffix"]
    for row in rows:
        if row["domain"] != "qa":
            row["conditional_acceptance_ci"] = [[a - 0.1, min(1.0, a + 0.05)]
                                                for a in row["conditional_acceptance"]]
    fig = acceptance_figure(rows, {d: "suffix" for d in ("chat", "code", "json", "qa")}, RUN_ID,
                            {"chat": 1, "code": 4, "json": 8, "qa": 2})
    ax = fig.axes[0]
    assert "95% interval" in ax.get_ylabel()
    lines = {line.get_label().split(" ")[0]: line for line in ax.get_lines()}
    spans = {}
    for collection in ax.collections:
        if isinstance(collection, LineCollection):
            for segment in collection.get_segments():
                (x0, y0), (x1, y1) = segment
                if x0 == x1:        # the vertical bars: one per point
                    spans[round(float(x0), 3)] = (round(float(y0), 3), round(float(y1), 3),
                                                  tuple(collection.get_color()[0]))
    for domain, k in (("chat", 1), ("code", 4), ("json", 8)):
        line = lines[domain]
        assert len(line.get_xdata()) == k
        for x, y in zip(line.get_xdata(), line.get_ydata()):
            lo, hi, colour = spans[round(float(x), 3)]
            assert (lo, hi) == (round(y - 0.1, 3), round(min(1.0, y + 0.05), 3))
            assert colour[:3] == pytest.approx(matplotlib_rgb(line.get_color()))
    qa_xs = {round(float(x), 3) for x in lines["qa"].get_xdata()}
    assert not qa_xs & set(spans)                       # qa has none stored: none drawn
    assert "no interval stored: qa" in [t.get_text() for t in ax.texts]
    assert_legends_off_the_data(fig)


def test_the_intervals_an_estimate_stores_are_the_ones_the_acceptance_plot_draws(db_url):
    """The interval travels: estimate_domains stores each position's interval (real SQLite
    store, migration 0016), the registration's read returns it and the plot draws those ends."""
    from matplotlib.collections import LineCollection

    from specdec_core import PromptLookup
    from specdec_core.estimate import LoggedRequest
    from tasks.db.queries_registry import tracked_rows
    from tasks.registry.plots import acceptance_figure
    from tasks.steps.estimate.offline_estimate import estimate_domains

    from .helpers.models import tiny_llama

    pattern = [5, 6, 7, 8, 9, 10]
    requests = [LoggedRequest(f"rep{i}", pattern * 2, pattern * 5, domain="json") for i in range(6)]
    requests += [LoggedRequest(f"mix{i}", [5, 6, 7, 5, 7, 6] * 2, [5, 6, 7, 6, 5, 7, 7, 5] * 4,
                               domain="json") for i in range(6)]
    store = Store.open(db_url)
    estimate_domains("ci-run", tiny_llama(), {"prompt_lookup": ({"kind": "prompt_lookup", "params": {}},
                                                                PromptLookup())},
                     {"json": requests}, store, k_max=3, progress=False)
    rows = [r for r in tracked_rows(store, "ci-run")["estimates"] if r["k"] == 3]
    stored = rows[0]["conditional_acceptance_ci"]
    assert len(stored) == 3 and all(lo <= a <= hi for a, (lo, hi)
                                    in zip(rows[0]["conditional_acceptance"], stored))
    fig = acceptance_figure(rows, {"json": "prompt_lookup"}, "ci-run", {"json": 3})
    drawn = sorted((round(float(y0), 6), round(float(y1), 6))
                   for c in fig.axes[0].collections if isinstance(c, LineCollection)
                   for (x0, y0), (x1, y1) in c.get_segments() if x0 == x1)
    assert drawn == sorted((round(lo, 6), round(hi, 6)) for lo, hi in stored)


def matplotlib_rgb(colour) -> tuple:
    from matplotlib.colors import to_rgb

    return to_rgb(colour)


def test_acceptance_and_calibration_plots_keep_labels_apart_and_titles_short():
    from tasks.registry.plots import acceptance_figure, calibration_figure

    rows = estimate_rows()
    fig = acceptance_figure(rows, {d: "suffix" for d in ("chat", "code", "json", "qa")}, RUN_ID,
                            {"chat": 3, "code": 4, "json": 8, "qa": 2})
    assert_legends_off_the_data(fig)
    # the planned K's rates, and the share of rounds that drafted beside them (chat: 7%)
    lines = {line.get_label().split(" ")[0]: line for line in fig.axes[0].get_lines()}
    assert len(lines["json"].get_xdata()) == 8 and len(lines["qa"].get_xdata()) == 2
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "chat (suffix, drafts in 7% of rounds, E 1.40)" in labels
    bars = {t.get_text(): patch.get_width()
            for t, patch in zip(fig.axes[1].get_yticklabels(), fig.axes[1].patches)}
    assert bars == {"chat": pytest.approx(7), "code": pytest.approx(80),
                    "json": pytest.approx(80), "qa": pytest.approx(80)}
    assert fig.axes[1].get_xlim() == (0, 100) and "%" in fig.axes[1].get_xlabel()    # issue 83 item 9
    assert fig.axes[1].get_title() == "Rounds that drafted"
    assert all(len(t) <= 60 and RUN_ID not in t for t in figure_texts(fig))
    # chat and qa at nearly the same point: one legend entry each, no labels drawn on the data
    live = [{"domain": "chat", "predicted": 1.02, "measured": 0.98},
            {"domain": "qa", "predicted": 1.03, "measured": 0.99},
            {"domain": "json", "predicted": 1.5, "measured": 1.4}]
    live[0].update(lo=0.80, hi=1.20, requests=3)          # each point rests on a few requests
    fig = calibration_figure(live, RUN_ID)
    assert_legends_off_the_data(fig)
    assert_footnote_apart(fig)
    from matplotlib.collections import LineCollection
    bars = [c for c in fig.axes[0].collections if isinstance(c, LineCollection)]
    spans = sorted(round(float(seg[1][1] - seg[0][1]), 2) for c in bars for seg in c.get_segments())
    assert 0.4 in spans, spans                               # chat's interval [0.80, 1.20] drawn
    assert "chat (3 requests)" in {t.get_text() for t in fig.legends[0].get_texts()}
    assert not [t for ax in fig.axes for t in ax.texts]
    assert {"qa", "json"} <= {t.get_text() for t in fig.legends[0].get_texts()}
    assert all(len(t) <= 60 and RUN_ID not in t for t in figure_texts(fig))
