"""The ops SQL reports: each returns the expected rows on a small hand-made fixture, on SQLite and
PostgreSQL alike; all run on an empty database; none prints prompt or response text."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime

import pytest
from sqlalchemy import create_engine, insert

from tasks.db.models import (AcceptanceEstimate, DomainConfig, LiveMeasurement, Promotion,
                             Validation)
from tasks.db.store import Store
from tasks.steps.traffic.reports import list_reports, report_header, run_report, sql_dir
from tasks.steps.traffic.traffic_import import import_traffic

from .helpers.registry import engine_sampling, finished_run, live_evidence

EXPECTED_REPORTS = {"acceptance_by_domain_per_day", "current_config_per_domain",
                    "gpu_seconds_saved_per_domain", "quarantined_by_reason", "speedup_trend",
                    "calibration_trend", "ungated_champions",
                    "traffic_by_domain_per_day", "validation_failures", "planner_safeguards",
                    "engine_checks", "engine_sampling", "production_vs_promised", "load_check"}
CANARY = "CANARY-TEXT"


def rows_as_dicts(report) -> list[dict]:
    return [dict(zip(report["columns"], row)) for row in report["rows"]]


@pytest.fixture
def fixture_db(db_url, jsonl_file, make_request):
    """Traffic for two targets, three rejected lines, two runs with estimates, measurements,
    configs, promotions and validations."""
    def ask(text):
        return [{"role": "user", "content": f"{text} {CANARY}"}]

    rows = [
        make_request(1, id="q1", domain="qa", model="tgt-a", timestamp="2025-11-01T10:00:00Z",
                     messages=ask("Who?"), response=f"A {CANARY}", temperature=0.0,
                     prompt_token_ids=[1, 2], response_token_ids=[1, 2, 3, 4]),
        make_request(2, id="q2", domain="qa", model="tgt-a", timestamp="2025-11-01T12:00:00Z",
                     messages=ask("Why?"), temperature=0.7, prompt_token_ids=[1, 2, 3, 4],
                     response_token_ids=[1, 2, 3, 4, 5, 6]),
        make_request(3, id="c1", domain=None, model="tgt-a", timestamp="2025-11-02T09:00:00Z",
                     messages=ask("Please refactor this python function"), response="y" * 40, temperature=0.7,
                     prompt_token_ids=None, response_token_ids=None),
        make_request(4, id="h1", domain="chat", model="tgt-b", timestamp="2025-11-02T10:00:00Z",
                     messages=ask("Mail me at kim@example.com"), temperature=0.0,
                     prompt_token_ids=[7, 8, 9], response_token_ids=[1, 2]),
        "{oops",                                                  # line 5
        make_request(6, id="u1", domain="astrology"),             # line 6
        f"{{ {CANARY}",                                           # line 7
    ]
    path = jsonl_file(rows)
    import_traffic(path, store=Store.open(db_url), progress=False)

    def at(text):
        return datetime.fromisoformat(text)

    def add(connection, model, rows):
        for row in rows:       # rows name different columns: one statement each
            connection.execute(insert(model).values(**row))

    engine = create_engine(db_url)
    with engine.begin() as connection:
        add(connection, AcceptanceEstimate, [
            dict(run_id="r1", domain="qa", drafter="prompt_lookup", k=4, requests=10, tokens=100,
                 acceptance_rate=0.5, mean_accepted_length=2.0, created_at=at("2025-11-03 10:00")),
            dict(run_id="r2", domain="qa", drafter="prompt_lookup", k=4, requests=30, tokens=300,
                 acceptance_rate=0.7, mean_accepted_length=3.0, predicted_speedup=1.4,
                 predicted_speedup_lo=1.2, predicted_speedup_hi=1.6, created_at=at("2025-11-03 15:00")),
            dict(run_id="r2", domain="code", drafter="layer_skip", k=2, requests=5, tokens=50,
                 acceptance_rate=0.4, mean_accepted_length=1.6, predicted_speedup=1.1,
                 created_at=at("2025-11-04 09:00")),
        ])
        add(connection, LiveMeasurement, [
            dict(run_id="r2", domain="qa", drafter="prompt_lookup", k=4, batch_size=1, requests=4,
                 tokens=200, acceptance_rate=0.68, mean_accepted_length=2.9, plain_tokens_per_s=20.0,
                 spec_tokens_per_s=30.0, predicted_speedup=1.4, measured_speedup=1.5,
                 predicted_same_requests=1.6, cost_model_error=1.5 / 1.6 - 1,
                 subset_expected_tokens=2.7, domain_expected_tokens=3.0, sampling_error=-0.1,
                 greedy_checked=2, greedy_consistent=2, gap=False,
                 created_at=at("2025-11-03 16:00")),
            dict(run_id="r2", domain="code", drafter="layer_skip", k=2, batch_size=1, requests=2,
                 tokens=80, acceptance_rate=0.35, mean_accepted_length=1.5, plain_tokens_per_s=25.0,
                 spec_tokens_per_s=22.5, predicted_speedup=1.1, measured_speedup=0.9,
                 created_at=at("2025-11-04 10:00")),
        ])
        add(connection, DomainConfig, [
            dict(run_id="r1", domain="qa", enabled=True, drafter="prompt_lookup", k=3,
                 max_batch_size=4, predicted_speedup=1.2, samples=10, status="ok",
                 created_at=at("2025-11-03 10:30")),
            dict(run_id="r2", domain="qa", enabled=True, drafter="prompt_lookup", k=4,
                 max_batch_size=8, predicted_speedup=1.4, measured_speedup=1.5, samples=30,
                 status="ok", created_at=at("2025-11-04 07:00")),
            dict(run_id="r2", domain="code", enabled=False, status="ok", samples=5,
                 created_at=at("2025-11-04 07:00")),
        ])
        add(connection, Promotion, [
            dict(run_id="r1", target_id="tgt-a", config_version="1", alias="champion",
                 action="promote", forced=False, actor="bob", created_at=at("2025-11-03 11:00")),
            dict(run_id="r2", target_id="tgt-a", config_version="2", alias="champion",
                 action="promote", forced=True, actor="alice", created_at=at("2025-11-04 08:00")),
            dict(run_id="r3", target_id="tgt-a", config_version="3", alias="challenger",
                 action="promote", forced=False, actor="ci", created_at=at("2025-11-05 08:00")),
            dict(run_id="r3", target_id="tgt-a", config_version="3", alias="champion",
                 action="reject", forced=False, actor="ci", created_at=at("2025-11-05 09:00")),
        ])
        add(connection, Validation, [
            dict(run_id="r1", check_name="fingerprint", passed=False, created_at=at("2025-11-03 09:00")),
            dict(run_id="r2", domain="qa", check_name="greedy_exact", drafter="prompt_lookup", k=4,
                 request_id="q2", passed=False, statistic=3.0, created_at=at("2025-11-04 06:00")),
            dict(run_id="r2", domain="qa", check_name="sampling_test", drafter="prompt_lookup", k=4,
                 passed=True, p_value=0.4, created_at=at("2025-11-04 06:30")),
        ])
    engine.dispose()
    return db_url, str(path.resolve())


def test_report_files_each_state_their_question():
    # one file per report; the header comment's first line is the question it answers
    assert set(list_reports()) == EXPECTED_REPORTS
    for path in sql_dir().glob("*.sql"):
        header = report_header(path)
        assert header.startswith("Question: ") and header.splitlines()[0].endswith("?"), path.name


@pytest.mark.parametrize("name", sorted(EXPECTED_REPORTS))
def test_every_report_runs_on_an_empty_database(db_url, name):
    # no rows, no error, the columns are named
    report = run_report(name, store=Store.open(db_url))
    assert report["rows"] == [] and len(report["columns"]) >= 3


def test_acceptance_by_domain_per_day(fixture_db):
    # two offline runs the same day pool into one row: token-weighted rate, tokens / rounds length
    report = rows_as_dicts(run_report("acceptance_by_domain_per_day", store=Store.open(fixture_db[0])))
    keys = [(r["day"], r["domain"], r["source"], r["drafter"], r["k"]) for r in report]
    assert keys == [("2025-11-03", "qa", "live", "prompt_lookup", 4),
                    ("2025-11-03", "qa", "offline", "prompt_lookup", 4),
                    ("2025-11-04", "code", "live", "layer_skip", 2),
                    ("2025-11-04", "code", "offline", "layer_skip", 2)]
    pooled = report[1]
    assert (pooled["runs"], pooled["requests"], pooled["tokens"]) == (2, 40, 400)
    assert pooled["acceptance_rate"] == pytest.approx(0.65)
    assert pooled["mean_accepted_length"] == pytest.approx(400 / (100 / 2.0 + 300 / 3.0))
    assert report[0]["acceptance_rate"] == pytest.approx(0.68)
    assert report[0]["mean_accepted_length"] == pytest.approx(2.9)


def test_current_config_per_domain(fixture_db):
    # the latest champion promotion wins (challenger and reject rows do not count);
    # a domain with traffic but no config is listed as running without speculation
    report = rows_as_dicts(run_report("current_config_per_domain", store=Store.open(fixture_db[0])))
    assert [(r["target_id"], r["domain"], r["run_id"], r["enabled"], r["drafter"], r["k"],
             r["status"]) for r in report] == [
        ("tgt-a", "code", "r2", 0, None, None, "ok"),
        ("tgt-a", "qa", "r2", 1, "prompt_lookup", 4, "ok"),
        ("tgt-b", "chat", None, None, None, None, "no config")]
    qa = report[1]
    assert (qa["max_batch_size"], qa["measured_speedup"], qa["config_version"], qa["promoted_by"],
            qa["forced"], qa["promoted_at"]) == (8, 1.5, "2", "alice", 1, "2025-11-04 08:00:00")


def test_speedup_trend(fixture_db):
    # predicted vs measured per run and domain, with the interval check where an interval exists
    report = rows_as_dicts(run_report("speedup_trend", store=Store.open(fixture_db[0])))
    assert [(r["day"], r["domain"], r["predicted_speedup"], r["measured_speedup"], r["within_ci95"])
            for r in report] == [("2025-11-03", "qa", 1.4, 1.5, 1), ("2025-11-04", "code", 1.1, 0.9, None)]
    assert report[0]["measured_over_predicted"] == pytest.approx(1.5 / 1.4)
    assert (report[0]["predicted_ci95_lo"], report[0]["predicted_ci95_hi"]) == (1.2, 1.6)


def test_calibration_trend(fixture_db):
    # the cost model's error on the same requests apart from the subset's sampling error
    report = rows_as_dicts(run_report("calibration_trend", store=Store.open(fixture_db[0])))
    assert [(r["day"], r["domain"]) for r in report] == [("2025-11-03", "qa"), ("2025-11-04", "code")]
    qa, code = report
    assert (qa["predicted_same_requests"], qa["measured_speedup"]) == (1.6, 1.5)
    assert qa["cost_model_error"] == pytest.approx(1.5 / 1.6 - 1) and qa["sampling_error"] == -0.1
    assert (qa["greedy_checked"], qa["greedy_consistent"], qa["gap"]) == (2, 2, 0)
    # a measurement from before these figures existed: empty, not invented
    assert code["cost_model_error"] is None and code["gap"] is None


def test_validation_failures(fixture_db):
    # failed checks only, newest first, naming the request by id
    report = rows_as_dicts(run_report("validation_failures", store=Store.open(fixture_db[0])))
    assert [(r["run_id"], r["check_name"], r["request_id"], r["checked_at"]) for r in report] == [
        ("r2", "greedy_exact", "q2", "2025-11-04 06:00:00"),
        ("r1", "fingerprint", None, "2025-11-03 09:00:00")]


def test_engine_sampling(db_url):
    # one row per run and domain with the vLLM test, beside the own engine's; a failing domain
    # is unpromotable; a test that could not run is told apart; other checks are not listed
    finished_run(db_url, "r1", {"json": {}, "qa": {}, "chat": {}, "code": {}})
    for domain in ("json", "qa"):
        live_evidence(db_url, "r1", domain, 1.5, 1.4, (1.3, 1.7))      # own engine: passed, p 0.5
    engine_sampling(db_url, "r1", "json", min_p=0.021)
    engine_sampling(db_url, "r1", "qa", status="failed", min_p=1e-9, control=True)
    engine_sampling(db_url, "r1", "chat", status="error")
    report = rows_as_dicts(run_report("engine_sampling", store=Store.open(db_url)))
    assert [(r["run_id"], r["domain"], r["engine"], r["passed"], r["tested"], r["own_passed"],
             r["validation"], r["promotable"]) for r in report] == [
        ("r1", "chat", "vllm", 0, 0, None, "failed", 0),                    # newest first
        ("r1", "qa", "vllm", 0, 1, 1, "failed", 0),
        ("r1", "json", "vllm", 1, 1, 1, "passed", 1)]
    chat, qa, json_ = report
    assert (json_["smallest_p"], json_["statistic"], json_["own_smallest_p"], json_["k"]) == (0.021, 9.0, 0.5, 3)
    assert qa["smallest_p"] == pytest.approx(1e-9) and qa["request_id"] == "qa-1"
    assert chat["smallest_p"] is None and chat["statistic"] is None and chat["own_smallest_p"] is None
    # a re-run replaces the domain's row: still one row, now passing
    engine_sampling(db_url, "r1", "chat")
    report = rows_as_dicts(run_report("engine_sampling", store=Store.open(db_url)))
    assert len(report) == 3
    assert [(r["passed"], r["tested"]) for r in report if r["domain"] == "chat"] == [(1, 1)]


def test_quarantined_by_reason(fixture_db):
    # counts per reason, most frequent first, with the first file:line to look at
    db_url, source = fixture_db
    report = rows_as_dicts(run_report("quarantined_by_reason", store=Store.open(db_url)))
    assert [(r["reason"], r["rows_rejected"], r["files"], r["first_example"], r["example_request_id"])
            for r in report] == [("malformed_json", 2, 1, f"{source}:5", None),
                                 ("unknown_domain", 1, 1, f"{source}:6", "u1")]


def test_gpu_seconds_saved_per_domain(fixture_db):
    # saved = response tokens / plain rate * (1 - 1/speedup); off -> 0; no config -> NULL
    report = rows_as_dicts(run_report("gpu_seconds_saved_per_domain", store=Store.open(fixture_db[0])))
    assert [(r["target_id"], r["domain"], r["requests"], r["response_tokens"], r["enabled"])
            for r in report] == [("tgt-a", "code", 1, 10, 0), ("tgt-a", "qa", 2, 10, 1),
                                 ("tgt-b", "chat", 1, 2, None)]
    code, qa, chat = report
    assert code["gpu_s_saved"] == 0.0
    assert qa["plain_tokens_per_s"] == 20.0 and qa["plain_decode_s"] == pytest.approx(0.5)
    assert qa["gpu_s_saved"] == pytest.approx(0.5 * (1 - 1 / 1.5))
    assert chat["gpu_s_saved"] is None


def test_traffic_by_domain_per_day(fixture_db):
    # volume per day and domain, how the domain was assigned, redacted rows
    report = rows_as_dicts(run_report("traffic_by_domain_per_day", store=Store.open(fixture_db[0])))
    assert [(r["day"], r["domain"], r["requests"], r["from_row"], r["by_rule"], r["fallback"],
             r["greedy"], r["redacted"]) for r in report] == [
        ("2025-11-01", "qa", 2, 2, 0, 0, 1, 0),
        ("2025-11-02", "chat", 1, 1, 0, 0, 1, 1),
        ("2025-11-02", "code", 1, 0, 1, 0, 0, 0)]
    assert (report[0]["mean_prompt_tokens"], report[0]["mean_response_tokens"]) == (3.0, 5.0)
    assert report[1]["mean_prompt_tokens"] is None          # token ids dropped by redaction


def test_reports_never_show_prompt_or_response_text(fixture_db):
    # every cell of every report is free of the canary planted in prompts, responses and raw lines
    for name in EXPECTED_REPORTS:
        report = run_report(name, store=Store.open(fixture_db[0]))
        assert CANARY not in json.dumps(report["rows"], default=str), name


def test_cli_report_formats(fixture_db, capsys):
    # csv and json carry the same rows; the table names the question; an unknown name is an error
    from tasks.cli import main

    db_url = fixture_db[0]
    assert main(["report", "validation_failures", "--format", "csv", "--url", db_url]) == 0
    parsed = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [row["request_id"] for row in parsed] == ["q2", ""]
    assert main(["report", "validation_failures", "--format", "json", "--url", db_url]) == 0
    assert [row["check_name"] for row in json.loads(capsys.readouterr().out)] == ["greedy_exact", "fingerprint"]
    assert main(["report", "validation_failures", "--url", db_url]) == 0
    assert "which losslessness checks failed" in capsys.readouterr().out
    assert main(["report", "no_such_report", "--url", db_url]) == 2
    assert "UnknownReport" in capsys.readouterr().err
