"""Cost profiles kept between runs: a run reuses the newest stored profile of its key (hardware,
engine and version, dtype, target fingerprint) that passed its checks and is younger than
profile_max_age_days, copied under its own run id, else measures one. Real measurements of tiny
models (one timing per figure, a short context) on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from sqlalchemy import insert, select, update

from tasks.db.models import CostProfile, CostProfileCheck, DomainConfig, EvalRun
from tasks.db.store import Store
from tasks.registry.run_results import profile_check
from tasks.settings import load_settings
from tasks.steps.drafters.candidates import build_drafters
from tasks.steps.costs.costs import load_costs, run_costs
from tasks.steps.costs.reuse import measure_or_reuse, profile_check_text
from tasks.steps.traffic.reports import run_report
from tasks.timeutil import utcnow

from .helpers.db import execute, fetch
from .helpers.models import tiny_llama

CANDIDATES = ["prompt_lookup"]
# one timing per figure of a one-layer model at a short context, batch 1, K 1 (under a second);
# bounds no tiny-model timing can fail, so the profile passes its checks (status ok: the only
# kind reused)
SETTINGS = dict(profile_repeats=1, profile_context_len=8, profile_batch_sizes=(1,), plan_k_max=1,
                profile_max_spread=1e6, profile_noise_floor=1 - 1e-9, profile_verify_dip=1 - 1e-9,
                profile_step_dip=1 - 1e-9, profile_overhead_floor=1e6)
# two timings per figure, no spread allowed and no retry: stored noisy
NOISY = dict(SETTINGS, profile_repeats=2, profile_attempts=1, profile_max_spread=1e-9)


@pytest.fixture(scope="module")
def one_layer():
    return tiny_llama(hidden=32, layers=1, heads=2, seed=0)


def drafters_of(model) -> dict:
    return {label: d for label, (_, d) in build_drafters(CANDIDATES, model).items()}


def profile(db_url, model, run_id, new_profile=False, **overrides) -> dict:
    settings = load_settings({}, **{**SETTINGS, **overrides})
    return measure_or_reuse(run_id, model, drafters_of(model), Store.open(db_url), settings=settings,
                            new_profile=new_profile, progress=False)


def check_row(db_url, run_id) -> dict:
    [row] = fetch(db_url, select(CostProfileCheck).where(CostProfileCheck.run_id == run_id))
    return row


def costs_of(db_url, run_id) -> dict:
    return {(r["hardware_profile"], r["component"], r["drafter"], r["k"], r["batch_size"]):
            (r["seconds"], r["spread"])
            for r in fetch(db_url, select(CostProfile).where(CostProfile.run_id == run_id))}


def backdate(db_url, days: float) -> None:
    """Every stored profile measured `days` ago (as if its runs were that old)."""
    execute(db_url, update(CostProfileCheck).values(measured_at=utcnow() - timedelta(days=days)))


def test_a_second_run_reuses_the_profile_under_its_own_run_id(db_url, one_layer, caplog):
    first = profile(db_url, one_layer, "run-1")
    assert first["profile"]["reused"] is False and first["check"]["status"] == "ok"
    measured = check_row(db_url, "run-1")
    assert measured["reused_from"] is None and measured["measured_at"] is not None
    assert measured["engine"] == "specdec" and measured["target_fingerprint"].startswith("sha256:")
    assert measured["device"] == first["hardware_profile"]["device"] and measured["dtype"] == "float32"

    with caplog.at_level(logging.INFO, logger="tasks.steps.costs.reuse"):
        second = profile(db_url, one_layer, "run-2")
    provenance = second["profile"]
    assert provenance["reused"] is True and provenance["run_id"] == "run-1"
    assert provenance["text"].startswith("reused from run run-1, measured at ")
    assert provenance["text"].endswith(" 0.0 days old") and 0 <= provenance["age_days"] < 0.01
    assert provenance["text"] in caplog.text
    # the run's own rows: the same costs, which every reader of the run's costs finds as its own
    assert costs_of(db_url, "run-2") == costs_of(db_url, "run-1")
    assert len(costs_of(db_url, "run-2")) == len(first["costs"])
    name = first["hardware_profile"]["name"]
    assert load_costs(name, Store.open(db_url)).run_id == "run-2" and run_costs("run-1", Store.open(db_url)) is None
    copied = check_row(db_url, "run-2")
    assert (copied["status"], copied["reused_from"], copied["measured_at"]) == (
        "ok", "run-1", measured["measured_at"])
    assert copied["details"]["reused"]["text"] == provenance["text"]
    assert {k: copied[k] for k in ("device", "processor", "engine", "engine_version", "dtype",
                                   "target_fingerprint")} == \
        {k: measured[k] for k in ("device", "processor", "engine", "engine_version", "dtype",
                                  "target_fingerprint")}

    # idempotent by run id: the step again replaces its rows; a third run names the run that
    # measured the costs, not the copy it found newest
    profile(db_url, one_layer, "run-2")
    assert costs_of(db_url, "run-2") == costs_of(db_url, "run-1")
    third = profile(db_url, one_layer, "run-3")
    assert third["profile"]["run_id"] == "run-1" and check_row(db_url, "run-3")["reused_from"] == "run-1"


def test_a_profile_of_another_target_is_not_reused(db_url, one_layer):
    profile(db_url, one_layer, "run-1")
    other = tiny_llama(hidden=32, layers=1, heads=2, seed=1)   # other weights: another fingerprint
    second = profile(db_url, other, "run-2")
    assert second["profile"]["reused"] is False and check_row(db_url, "run-2")["reused_from"] is None
    assert check_row(db_url, "run-2")["target_fingerprint"] != check_row(db_url, "run-1")["target_fingerprint"]
    assert costs_of(db_url, "run-2") != costs_of(db_url, "run-1")     # timed again
    # the first target's own profile is still found by its key, though not the newest stored
    assert profile(db_url, one_layer, "run-3")["profile"]["run_id"] == "run-1"


def test_a_profile_older_than_profile_max_age_days_is_measured_again(db_url, one_layer):
    assert load_settings({}).profile.max_age_days == 7
    assert load_settings({"SPECDEC_PROFILE_MAX_AGE_DAYS": "2.5"}).profile.max_age_days == 2.5
    profile(db_url, one_layer, "run-1")
    backdate(db_url, 6)
    younger = profile(db_url, one_layer, "run-2")
    assert younger["profile"]["reused"] is True
    assert younger["profile"]["text"].endswith(", 6.0 days old")
    backdate(db_url, 8)
    older = profile(db_url, one_layer, "run-3")
    assert older["profile"]["reused"] is False and check_row(db_url, "run-3")["reused_from"] is None
    assert costs_of(db_url, "run-3") != costs_of(db_url, "run-1")
    # the setting decides: the same 8-day-old profile is reused under a 10-day limit
    backdate(db_url, 8)
    assert profile(db_url, one_layer, "run-4", profile_max_age_days=10)["profile"]["reused"] is True
    assert profile(db_url, one_layer, "run-5", profile_max_age_days=0)["profile"]["reused"] is False


def test_a_noisy_profile_is_not_reused(db_url, one_layer):
    noisy = profile(db_url, one_layer, "run-1", **NOISY)
    assert noisy["check"]["status"] == "noisy" and check_row(db_url, "run-1")["status"] == "noisy"
    second = profile(db_url, one_layer, "run-2")
    assert second["profile"]["reused"] is False and second["check"]["status"] == "ok"
    assert check_row(db_url, "run-2")["reused_from"] is None
    # the next run reuses the profile that passed, not the newer-or-older noisy one
    assert profile(db_url, one_layer, "run-3")["profile"]["run_id"] == "run-2"


def test_new_profile_measures_although_a_profile_could_be_reused(db_url, one_layer):
    first = profile(db_url, one_layer, "run-1")
    forced = profile(db_url, one_layer, "run-2", new_profile=True)
    assert forced["profile"]["reused"] is False and forced["profile"]["text"].startswith(
        "measured by this run at ")
    row = check_row(db_url, "run-2")
    assert row["reused_from"] is None and row["measured_at"] > check_row(db_url, "run-1")["measured_at"]
    assert costs_of(db_url, "run-2") != costs_of(db_url, "run-1")
    assert forced["hardware_profile"]["name"] == first["hardware_profile"]["name"]


def test_a_profile_without_this_runs_candidates_or_k_is_measured_again(db_url, one_layer):
    profile(db_url, one_layer, "run-1")
    assert profile(db_url, one_layer, "run-2", plan_k_max=2)["profile"]["reused"] is False
    settings = load_settings({}, **SETTINGS)
    more = {**drafters_of(one_layer), **{label: d for label, (_, d) in build_drafters(
        ["prompt_lookup:max_ngram=2"], one_layer).items()}}
    result = measure_or_reuse("run-3", one_layer, more, Store.open(db_url), settings=settings, progress=False)
    assert result["profile"]["reused"] is False


def test_the_profile_step_says_which_profile_the_run_plans_with(db_url, one_layer):
    from tasks.steps.context import RunSpec, use_model
    from tasks.steps.pipeline import step_profile

    use_model("tiny-reuse", one_layer)
    for run_id in ("step-1", "step-2", "step-3"):
        execute(db_url, insert(EvalRun).values(run_id=run_id, created_at=utcnow(), updated_at=utcnow(),
                                               status="sampled"))

    def spec(run_id):
        return RunSpec(run_id=run_id, target="tiny-reuse", db_url=db_url, candidates=CANDIDATES,
                       drafts={}, overrides=SETTINGS)

    measured = step_profile(spec("step-1"))
    assert measured["reused"] is False and measured["measured_by"] == "step-1"
    reused = step_profile(spec("step-2"))
    assert reused["hardware_profile"] == measured["hardware_profile"]
    assert reused["reused"] is True and reused["measured_by"] == "step-1"
    assert reused["text"].startswith("reused from run step-1, measured at ")
    [run] = fetch(db_url, select(EvalRun).where(EvalRun.run_id == "step-2"))
    assert run["hardware_profile"] == reused["hardware_profile"] and run["status"] == "profiled"
    assert run["worker_hardware"]["reused_from"] == "step-1" and run["worker_hardware"]["measured"]
    # the run's own readers: its costs (confirm), its check (registry, CLI), the SQL reports' join
    assert run_costs("step-2", Store.open(db_url)).run_id == "step-2"
    check = profile_check("step-2", Store.open(db_url))
    assert (check["profile_run"], check["status"], check["reused_from"]) == ("step-2", "ok", "step-1")
    assert "reused from run step-1, measured at " in profile_check_text(check)
    execute(db_url, insert(DomainConfig).values(run_id="step-2", domain="qa", enabled=False,
                                                status="ok", created_at=utcnow()))
    [row] = [dict(zip(report["columns"], r)) for report in [run_report("planner_safeguards", Store.open(db_url))]
             for r in report["rows"]]
    assert (row["run_id"], row["profile_status"], row["profile_reused_from"]) == ("step-2", "ok", "step-1")
    forced = step_profile(spec("step-3"), new_profile=True)
    assert forced["reused"] is False and forced["measured_by"] == "step-3"


def test_new_profile_is_an_evaluate_flag_and_a_dag_param():
    from tasks.cli.app import build_parser

    assert build_parser().parse_args(["evaluate", "--new-profile"]).new_profile is True
    assert build_parser().parse_args(["evaluate"]).new_profile is False
    pytest.importorskip("airflow")
    from dags.specdec_evaluate import PARAMS

    assert PARAMS["new_profile"].value is False and PARAMS["new_profile"].schema["type"] == "boolean"
