"""Reliability, round 4 (issue 85): numbers from outside parsed with limits (a row with a
4,301-digit number is quarantined, not a traceback that stops the import), bounded scrapes (a size
cap, a total deadline, positions capped at the largest K) whose counters are checked before
anything is stored, and masking of what the process prints (tracebacks included) and stores.

Each case a real component: files imported into real SQLite (and PostgreSQL where
$SPECDEC_TEST_POSTGRES_URL is set: the `db_url` fixture), scrapes of a real HTTP server on
127.0.0.1."""

from __future__ import annotations

import csv
import io
import json

import pytest
from sqlalchemy import create_engine, select

from .helpers.traffic import request_row, write_jsonl

from tasks.db.store import Store

SECRET = "Pl4nted-S3cret"
HUGE = "9" * 4301          # over Python's integer-conversion limit (4,300 digits)


def _stored(url: str, model) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(select(model)).all()
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------------------
# 1. a number of more than 4,300 digits in one row
HUGE_FIELDS = {  # where the number is: (the field as JSON, as the quarantine names it)
    "id": ('"id": {}', '"id"'), "timestamp": ('"timestamp": {}', '"timestamp"'),
    "temperature": ('"temperature": {}', '"temperature"'),
    "token id": ('"response_token_ids": [4, {}]', '"response_token_ids[1]"'),
    "metric": ('"metrics": {{"speculative_decoding": {{"num_spec_steps": {}}}}}',
               '"metrics.speculative_decoding.num_spec_steps"'),
    "unknown field": ('"extra": {}', '"extra"')}


@pytest.mark.parametrize("where", HUGE_FIELDS)
def test_a_row_with_a_4301_digit_number_is_quarantined_and_the_others_stored(where, db_url, tmp_path):
    from tasks.db.models import QuarantinedRequest, TrafficRequest
    from tasks.steps.traffic_import import import_traffic

    field, name = HUGE_FIELDS[where]
    bad = json.dumps(request_row(2))[:-1] + ", " + field.format(HUGE) + "}"
    path = write_jsonl(tmp_path / "t.jsonl", [request_row(1), bad, request_row(3)])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    assert (report["rows_read"], report["inserted"], report["quarantined"]) == (3, 2, 1)
    assert sorted(row.id for row in _stored(db_url, TrafficRequest)) == ["req-00001", "req-00003"]
    (held,) = _stored(db_url, QuarantinedRequest)
    assert (held.line_number, held.reason) == (2, "implausible_value")
    assert f"{name} is a number of 4301 digits" in held.detail and "at most 200" in held.detail, held.detail


def test_a_csv_cell_with_a_4301_digit_number_is_quarantined_and_the_others_stored(db_url, tmp_path):
    from tasks.db.models import QuarantinedRequest, TrafficRequest
    from tasks.steps.traffic_import import import_traffic

    columns = ["id", "timestamp", "prompt", "response", "temperature", "model", "response_token_ids",
               "metrics"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    for index, (ids, metrics) in enumerate([("[4, 5]", ""), (f"[4, {HUGE}]", ""),
                                            ("[4, 5]", f'{{"speculative_decoding": {{"num_spec_steps": {HUGE}}}}}'),
                                            ("[4, 5]", "")], start=1):
        writer.writerow([f"r{index}", "2025-11-03T10:00:00Z", "hello", "world", "0", "m", ids, metrics])
    (tmp_path / "t.csv").write_text(buffer.getvalue(), encoding="utf-8")
    report = import_traffic(tmp_path / "t.csv", store=Store.open(db_url), progress=False)
    assert (report["rows_read"], report["inserted"], report["quarantined"]) == (4, 2, 2)
    assert sorted(row.id for row in _stored(db_url, TrafficRequest)) == ["r1", "r4"]
    held = sorted(_stored(db_url, QuarantinedRequest), key=lambda row: row.line_number)
    assert [(row.line_number, row.reason) for row in held] == [(3, "implausible_value"),
                                                               (4, "implausible_value")]
    assert "response_token_ids" in held[0].detail and "metrics" in held[1].detail
