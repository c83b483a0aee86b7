"""Great Expectations gates: table-level failures stop the run, a thin domain is "insufficient"."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import create_engine, delete, insert, select

from tasks.db.models import AcceptanceEstimate, EvalRun, QualityResult, TrafficRequest
from tasks.db.store import Store
from tasks.errors import QualityGateFailed, SampleError
from tasks.steps.traffic.quality import check_result_table, check_traffic_sample
from tasks.steps.traffic.traffic_sample import sample_traffic
from tasks.settings import load_settings
from tasks.steps.traffic.traffic_import import import_traffic


def seed(db_url, jsonl_file, make_request, per_domain, settings=None, **overrides):
    rows, index = [], 0
    for domain, n in per_domain.items():
        for _ in range(n):
            index += 1
            stamp = datetime(2025, 6, 1) + timedelta(hours=index)
            rows.append(make_request(index, domain=domain, timestamp=stamp.isoformat() + "Z", **overrides))
    import_traffic(jsonl_file(rows), store=Store.open(db_url), settings=settings, progress=False)


def stored_results(db_url, run_id):
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(select(QualityResult.suite, QualityResult.scope,
                                         QualityResult.expectation, QualityResult.column_name,
                                         QualityResult.status, QualityResult.observed)
                                  .where(QualityResult.run_id == run_id)).all()
        status = connection.execute(select(EvalRun.status).where(EvalRun.run_id == run_id)).scalar()
    engine.dispose()
    return rows, status


def execute(db_url, statement):
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(statement)
    engine.dispose()


def test_clean_sample_passes_and_results_are_stored(db_url, jsonl_file, make_request):
    # every table-level expectation passes; each outcome is stored under the run id
    seed(db_url, jsonl_file, make_request, {"qa": 6, "code": 6})
    sample_traffic("ok-run", store=Store.open(db_url), min_per_domain=3)
    result = check_traffic_sample("ok-run", store=Store.open(db_url))
    assert result["rows"] == 12 and result["insufficient"] == []
    assert result["domains"] == {"code": {"rows": 6, "status": "ok", "min_rows": 3},
                                 "qa": {"rows": 6, "status": "ok", "min_rows": 3}}
    rows, status = stored_results(db_url, "ok-run")
    assert status == "checked"
    assert len(rows) == result["expectations"] + 2
    assert {r.status for r in rows if r.suite == "traffic_sample"} == {"pass"}
    # re-checking replaces the run's results rather than adding to them
    check_traffic_sample("ok-run", store=Store.open(db_url))
    assert len(stored_results(db_url, "ok-run")[0]) == len(rows)


def test_thin_domain_is_insufficient_not_an_error(db_url, jsonl_file, make_request):
    # below min_per_domain: returned and stored as "insufficient"; the run goes on
    seed(db_url, jsonl_file, make_request, {"qa": 8, "creative": 2})
    sample_traffic("thin", store=Store.open(db_url), min_per_domain=5)
    result = check_traffic_sample("thin", store=Store.open(db_url))
    assert result["insufficient"] == ["creative"]
    assert result["domains"]["creative"] == {"rows": 2, "status": "insufficient", "min_rows": 5}
    rows, status = stored_results(db_url, "thin")
    by_scope = {r.scope: (r.status, r.observed["observed_value"]) for r in rows
                if r.suite == "traffic_sample_domain"}
    assert by_scope == {"qa": ("ok", 8), "creative": ("insufficient", 2)}
    assert status == "checked"


def test_purged_request_in_sample_is_a_table_level_failure(db_url, jsonl_file, make_request):
    # a sampled request that is no longer stored has no prompt/response: the run stops, naming its id
    seed(db_url, jsonl_file, make_request, {"qa": 5})
    sample_traffic("gone", store=Store.open(db_url), min_per_domain=1)
    execute(db_url, delete(TrafficRequest).where(TrafficRequest.id == "req-00003"))
    with pytest.raises(QualityGateFailed) as caught:
        check_traffic_sample("gone", store=Store.open(db_url))
    summary = caught.value.summary
    assert "prompt: expect_column_values_to_not_be_null" in summary
    assert "1 of 5 rows unexpected" in summary and "req-00003" in summary
    failed = {(f["expectation"], f["column"]) for f in caught.value.failures}
    assert ("expect_column_values_to_not_be_null", "response") in failed
    rows, status = stored_results(db_url, "gone")
    assert status == "quality_failed"
    assert {(r.column_name, r.status) for r in rows if r.status == "fail"} >= {
        ("prompt", "fail"), ("response", "fail")}


def test_domain_outside_known_set_fails_the_gate(db_url, jsonl_file, make_request):
    # traffic imported under a wider domain set, checked under the default one
    wide = load_settings({"SPECDEC_KNOWN_DOMAINS": "legal,qa,general"})
    seed(db_url, jsonl_file, make_request, {"legal": 3, "qa": 3}, settings=wide)
    sample_traffic("legal", store=Store.open(db_url), min_per_domain=1, settings=wide)
    with pytest.raises(QualityGateFailed, match="domain: expect_column_values_to_be_in_set") as caught:
        check_traffic_sample("legal", store=Store.open(db_url))
    in_set = [f for f in caught.value.failures if f["expectation"] == "expect_column_values_to_be_in_set"]
    assert in_set[0]["unexpected_count"] == 3
    assert sorted(in_set[0]["examples"]) == ["req-00001", "req-00002", "req-00003"]


def test_token_length_bounds_come_from_settings(db_url, jsonl_file, make_request):
    # responses longer than max_response_tokens fail the gate; the ids are named, not the text
    seed(db_url, jsonl_file, make_request, {"qa": 4}, response_token_ids=list(range(10)))
    sample_traffic("long", store=Store.open(db_url), min_per_domain=1)
    check_traffic_sample("long", store=Store.open(db_url))                  # default bounds: fine
    strict = load_settings({}, quality_max_response_tokens=5)
    with pytest.raises(QualityGateFailed, match="response_tokens") as caught:
        check_traffic_sample("long", store=Store.open(db_url), settings=strict)
    assert "What is the capital" not in caught.value.summary
    assert "req-00001" in caught.value.summary


def test_check_without_sample_is_a_sample_error(db_url):
    # the run must be sampled first
    with pytest.raises(SampleError, match="traffic sample never"):
        check_traffic_sample("never", store=Store.open(db_url))


def estimate(run_id="r", domain="qa", k=4, **values):
    row = {"run_id": run_id, "domain": domain, "drafter": "prompt_lookup", "k": k, "requests": 20,
           "tokens": 900, "acceptance_rate": 0.6, "mean_accepted_length": 2.4,
           "conditional_acceptance": [0.8, 0.7, 0.6, 0.5], "predicted_speedup": 1.4,
           "predicted_speedup_lo": 1.2, "predicted_speedup_hi": 1.6,
           "created_at": datetime(2025, 11, 1)}
    row.update(values)
    return row


def test_result_table_with_sane_values_passes(db_url):
    # rates in [0, 1], K in range, positive speedups
    execute(db_url, insert(AcceptanceEstimate).values([estimate(), estimate(domain="code", k=2)]))
    result = check_result_table("r", "acceptance_estimates", store=Store.open(db_url))
    assert result["rows"] == 2
    rows, _ = stored_results(db_url, "r")
    assert {r.suite for r in rows} == {"results:acceptance_estimates"}
    assert {r.status for r in rows} == {"pass"}


def test_result_table_with_impossible_values_fails(db_url):
    # each impossible value is caught by its own expectation
    execute(db_url, insert(AcceptanceEstimate).values([
        estimate(), estimate(domain="code", acceptance_rate=1.3),
        estimate(domain="chat", k=0, predicted_speedup=-0.5),
        estimate(domain="json", conditional_acceptance=[0.9, 1.2])]))
    with pytest.raises(QualityGateFailed) as caught:
        check_result_table("r", "acceptance_estimates", store=Store.open(db_url))
    failed = {f["column"] for f in caught.value.failures}
    assert failed == {"acceptance_rate", "k", "predicted_speedup", "conditional_acceptance_max"}
    assert "acceptance_estimates of run 'r' (4 rows)" in caught.value.summary


def test_result_table_without_rows_for_the_run_fails(db_url):
    # another run's rows do not count: this run wrote nothing
    execute(db_url, insert(AcceptanceEstimate).values([estimate(run_id="other")]))
    with pytest.raises(QualityGateFailed, match="expect_table_row_count_to_be_between"):
        check_result_table("r", "acceptance_estimates", store=Store.open(db_url))


def test_result_frame_can_be_checked_before_writing(db_url):
    # a step checks its DataFrame first, so nothing impossible is ever written
    import pandas as pd

    frame = pd.DataFrame([{"run_id": "f", "domain": "qa", "drafter": "layer_skip", "k": 3,
                           "batch_size": 1, "requests": 5, "tokens": 100, "acceptance_rate": 0.5,
                           "measured_speedup": 0.0, "predicted_speedup": 1.1}])
    with pytest.raises(QualityGateFailed, match="measured_speedup"):
        check_result_table("f", "live_measurements", store=Store.open(db_url), frame=frame)


def test_cli_check_prints_domains_and_fails_with_summary(db_url, jsonl_file, make_request, capsys):
    # exit 0 with a per-domain table; exit 2 with the readable summary when the gate fails
    from tasks.cli import main

    seed(db_url, jsonl_file, make_request, {"qa": 4, "chat": 1})
    sample_traffic("cli", store=Store.open(db_url), min_per_domain=2)
    assert main(["traffic", "check", "cli", "--url", db_url]) == 0
    out = capsys.readouterr().out
    assert "insufficient" in out and "chat" in out
    execute(db_url, delete(TrafficRequest).where(TrafficRequest.id == "req-00001"))
    assert main(["traffic", "check", "cli", "--url", db_url]) == 2
    out = capsys.readouterr().err
    assert "QualityGateFailed" in out and "req-00001" in out
