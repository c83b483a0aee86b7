"""Traffic import: rows land, bad rows are quarantined with line and reason, re-runs add nothing."""

from __future__ import annotations

import csv
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest
from sqlalchemy import create_engine, func, select, text

from tasks.db.models import QuarantinedRequest, TrafficRequest
from tasks.db.store import Store
from tasks.errors import DatabaseUnavailable, TrafficFileError
from tasks.settings import load_settings
from tasks.steps.traffic.traffic_import import import_traffic, purge_traffic, sample_traffic_path

from .helpers.processes import specdec
from .helpers.traffic import request_row, traffic


def rows_of(url, model, order_by=None):
    engine = create_engine(url)
    with engine.connect() as connection:
        query = select(model)
        if order_by is not None:
            query = query.order_by(order_by)
        rows = [dict(row._mapping) for row in connection.execute(query.execution_options())]
    engine.dispose()
    return rows


def count(url, table: str) -> int:
    engine = create_engine(url)
    with engine.connect() as connection:
        value = connection.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar()
    engine.dispose()
    return value


def quarantine(url) -> list[tuple[int, str]]:
    engine = create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(select(QuarantinedRequest.line_number, QuarantinedRequest.reason)
                                  .order_by(QuarantinedRequest.line_number)).all()
    engine.dispose()
    return [tuple(row) for row in rows]


def test_valid_rows_land_with_normalised_fields(db_url, jsonl_file, make_request):
    # messages become prompt text, times become UTC, token ids give token counts
    path = jsonl_file([
        make_request(1),
        make_request(2, messages=None, prompt="Plain prompt?", timestamp="2025-11-03T14:00:00+02:00",
                     sampling={"temperature": 0.8, "top_k": 50, "top_p": 0.95}, temperature=None,
                     top_p=None, prompt_token_ids=None),
        make_request(3, timestamp=1762351200),                     # epoch seconds
    ])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    assert (report["rows_read"], report["inserted"], report["quarantined"]) == (3, 3, 0)
    stored = traffic(db_url)
    first, second, third = stored["req-00001"], stored["req-00002"], stored["req-00003"]
    assert first["prompt"] == "What is the capital of country number 1?"
    assert first["messages"] == [{"role": "user", "content": "What is the capital of country number 1?"}]
    assert (first["prompt_tokens"], first["response_tokens"], first["domain_source"]) == (4, 3, "row")
    assert second["prompt"] == "Plain prompt?" and second["messages"] is None
    assert second["requested_at"] == datetime(2025, 11, 3, 12, 0)
    assert (second["temperature"], second["top_k"], second["top_p"]) == (0.8, 50, 0.95)
    assert second["prompt_tokens"] is None
    assert third["requested_at"] == datetime(2025, 11, 5, 14, 0)
    assert first["source_line"] == 1 and third["source_line"] == 3


def test_reimport_adds_nothing(db_url, jsonl_file, make_request):
    # importing the same file twice: second pass skips every row, tables unchanged
    path = jsonl_file([make_request(i) for i in range(1, 11)] + ["{not json"])
    first = import_traffic(path, store=Store.open(db_url), progress=False)
    second = import_traffic(path, store=Store.open(db_url), progress=False)
    assert (first["inserted"], first["quarantined_new"]) == (10, 1)
    assert (second["inserted"], second["skipped_existing"], second["quarantined_new"]) == (0, 10, 0)
    assert count(db_url, "traffic_requests") == 10 and count(db_url, "quarantined_requests") == 1


def test_bad_rows_are_quarantined_with_line_and_reason(db_url, jsonl_file, make_request):
    # every defect gets its own reason; the good rows around them land
    huge = make_request(90, response="x" * 5000)
    rows = [
        make_request(1),                                           # 1 ok
        '{"id": "broken", "timestamp": ',                          # 2 malformed JSON
        "[1, 2, 3]",                                               # 3 not an object
        make_request(4, id=None),                                  # 4 no id
        make_request(5, response=None),                            # 5 no response
        make_request(6, messages=None),                            # 6 neither messages nor prompt
        make_request(7, domain="astrology"),                       # 7 unknown domain
        make_request(8, timestamp="last tuesday"),                 # 8 unparseable timestamp
        make_request(9, timestamp="1970-01-02T00:00:00Z"),         # 9 implausibly old
        make_request(10, top_p=0.0),                               # 10 invalid sampling
        make_request(11, temperature=None),                        # 11 no temperature
        huge,                                                      # 12 over max_row_bytes
        "",                                                        # 13 blank: skipped
        make_request(14, messages=[{"role": "wizard", "content": "hi"}]),   # 14 bad message role
        make_request(15),                                          # 15 ok
    ]
    path = jsonl_file(rows)
    settings = load_settings({}, traffic_max_row_bytes=4096)
    report = import_traffic(path, store=Store.open(db_url), settings=settings, progress=False)
    assert report["inserted"] == 2 and set(traffic(db_url)) == {"req-00001", "req-00015"}
    assert quarantine(db_url) == [
        (2, "malformed_json"), (3, "not_an_object"), (4, "missing_field"), (5, "missing_field"),
        (6, "missing_field"), (7, "unknown_domain"), (8, "bad_timestamp"), (9, "bad_timestamp"),
        (10, "invalid_sampling"), (11, "missing_field"), (12, "too_large"), (14, "invalid_field")]
    assert report["quarantined"] == 12
    assert report["quarantined_by_reason"]["missing_field"] == 4
    details = {example["line"]: example["detail"] for example in report["quarantine_examples"]}
    assert "astrology" in details[7] and "known set" in details[7]
    assert "4096" in details[12]


def test_huge_line_is_skipped_without_losing_the_next_line(db_url, jsonl_file, make_request):
    # a 3 MB line over the 1 MB default limit is quarantined; the line after it still lands
    path = jsonl_file([make_request(1, response="y" * 3_000_000), make_request(2)])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    assert (report["inserted"], report["quarantined_by_reason"]) == (1, {"too_large": 1})
    assert set(traffic(db_url)) == {"req-00002"}
    stored = rows_of(db_url, QuarantinedRequest)
    assert stored[0]["line_number"] == 1 and len(stored[0]["raw"]) <= 2000


def test_duplicate_ids(db_url, jsonl_file, make_request):
    # same id, same content: stored once; same id, other content: quarantined, first kept
    original = make_request(1)
    conflicting = make_request(1, response="A different answer.")
    path = jsonl_file([original, make_request(2), dict(original), conflicting])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    assert (report["inserted"], report["skipped_existing"]) == (2, 1)
    assert quarantine(db_url) == [(4, "duplicate_id")]
    assert traffic(db_url)["req-00001"]["response"] == original["response"]


def test_duplicate_id_across_batches_and_files(db_url, jsonl_file, make_request):
    # batch size 1: the duplicate is found in the database, not in the batch; another file too
    path = jsonl_file([make_request(1), make_request(1, response="changed")])
    report = import_traffic(path, store=Store.open(db_url),
                            settings=load_settings({}, traffic_import_batch_size=1), progress=False)
    assert report["inserted"] == 1 and report["quarantined_by_reason"] == {"duplicate_id": 1}
    other = jsonl_file([make_request(1)], name="again.jsonl")
    assert import_traffic(other, store=Store.open(db_url), progress=False)["skipped_existing"] == 1


def test_missing_domain_is_assigned_by_the_first_matching_rule(db_url, jsonl_file, make_request):
    # rules run in order on the last user message; no match falls back to "general"
    def ask(index, text):
        return make_request(index, domain=None, messages=[{"role": "user", "content": text}])

    path = jsonl_file([
        ask(1, "Return this record as JSON: name=Ann"),
        ask(2, "Summarize this text: the meeting was long."),
        ask(3, "Write a haiku about rain"),
        ask(4, "Who wrote Hamlet?"),
        ask(5, "Here is a python function, please refactor it and return JSON"),   # json rule first
        ask(6, "hello there"),
        make_request(7, domain="  Code "),                                           # normalised
    ])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    stored = traffic(db_url)
    got = {rid: (row["domain"], row["domain_source"]) for rid, row in stored.items()}
    assert got == {
        "req-00001": ("json", "rule:json-keyword"), "req-00002": ("summarize", "rule:summarize-keyword"),
        "req-00003": ("creative", "rule:creative-keyword"), "req-00004": ("qa", "rule:question-form"),
        "req-00005": ("json", "rule:json-keyword"), "req-00006": ("general", "fallback"),
        "req-00007": ("code", "row")}
    assert report["domains_by_rule"]["fallback"] == 1


def test_domain_rules_and_known_set_come_from_settings(db_url, jsonl_file, make_request):
    # a configured domain and rule: "legal" is known and assigned; the default rules are replaced
    settings = load_settings({"SPECDEC_KNOWN_DOMAINS": "legal,general",
                              "SPECDEC_DOMAIN_RULES": json.dumps(
                                  [{"name": "contracts", "domain": "legal", "pattern": r"\bcontract"}])})
    path = jsonl_file([
        make_request(1, domain=None, messages=[{"role": "user", "content": "Review this contract"}]),
        make_request(2, domain=None, messages=[{"role": "user", "content": "Return JSON please"}]),
        make_request(3, domain="qa"),
    ])
    report = import_traffic(path, store=Store.open(db_url), settings=settings, progress=False)
    got = {rid: (row["domain"], row["domain_source"]) for rid, row in traffic(db_url).items()}
    assert got == {"req-00001": ("legal", "rule:contracts"), "req-00002": ("general", "fallback")}
    assert report["quarantined_by_reason"] == {"unknown_domain": 1}


def test_redaction_at_import(db_url, jsonl_file, make_request):
    # e-mails and API keys never reach the database; token ids of a redacted text are dropped
    key = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2"
    path = jsonl_file([
        make_request(1, messages=[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": f"Mail ana.lima@example.org, my key is {key}"}],
                     response="Sent to ana.lima@example.org."),
        make_request(2),
        '{"id": "bad", "note": "contact bob@example.com", "timestamp": "soon"}',
    ])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    stored = traffic(db_url)
    redacted = stored["req-00001"]
    assert redacted["prompt"] == "Be brief.\n\nMail [EMAIL], my key is [API_KEY]"
    assert redacted["messages"][1]["content"] == "Mail [EMAIL], my key is [API_KEY]"
    assert redacted["response"] == "Sent to [EMAIL]."
    assert redacted["redactions"] == 3
    assert redacted["prompt_token_ids"] is None and redacted["response_token_ids"] is None
    assert stored["req-00002"]["prompt_token_ids"] == [1, 2, 3, 2] and stored["req-00002"]["redactions"] == 0
    assert report["redacted_rows"] == 1
    raw = rows_of(db_url, QuarantinedRequest)[0]["raw"]
    assert "bob@example.com" not in raw and "[EMAIL]" in raw


def test_csv_and_gzip(db_url, tmp_path, make_request):
    # CSV with messages and token ids as JSON cells, a cell spanning two lines, gzipped;
    # bad records are reported by the line they start on
    path = tmp_path / "traffic.csv.gz"
    columns = ["id", "timestamp", "domain", "prompt", "messages", "response", "temperature", "top_k",
               "top_p", "model", "response_token_ids"]
    with gzip.open(path, "wt", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerow(["c1", "2025-11-03T10:00:00Z", "chat", "", json.dumps(
            [{"role": "user", "content": "Hi, line one\nline two, with a comma"}]),
            "Hello!", "0.7", "40", "0.9", "m", "[5, 6]"])
        writer.writerow(["c2", "2025-11-03T11:00:00Z", "", "Write a poem\nabout autumn", "",
                         "Leaves fall.", "0", "", "", "m", ""])
        writer.writerow(["c3", "2025-11-03T12:00:00Z", "qa"])
        writer.writerow(["c4", "2025-11-03T13:00:00Z", "qa", "Why?", "", "Because.", "x", "", "", "m", ""])
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    stored = traffic(db_url)
    assert set(stored) == {"c1", "c2"}
    assert stored["c1"]["prompt"] == "Hi, line one\nline two, with a comma"
    assert (stored["c1"]["top_k"], stored["c1"]["response_tokens"]) == (40, 2)
    assert (stored["c2"]["domain"], stored["c2"]["domain_source"]) == ("creative", "rule:creative-keyword")
    assert quarantine(db_url) == [(5, "malformed_csv"), (6, "invalid_sampling")]
    assert report["rows_read"] == 4


def test_unreadable_inputs_are_file_errors(db_url, tmp_path):
    # missing file, unknown extension, CSV without the needed columns
    with pytest.raises(TrafficFileError, match="does not exist"):
        import_traffic(tmp_path / "nope.jsonl", store=Store.open(db_url), progress=False)
    odd = tmp_path / "traffic.txt"
    odd.write_text("{}\n")
    with pytest.raises(TrafficFileError, match="--format"):
        import_traffic(odd, store=Store.open(db_url), progress=False)
    bad_header = tmp_path / "traffic.csv"
    bad_header.write_text("name,text\nx,y\n")
    with pytest.raises(TrafficFileError, match="header"):
        import_traffic(bad_header, store=Store.open(db_url), progress=False)


def test_import_into_a_database_that_does_not_exist(tmp_path, jsonl_file, make_request):
    # the error names the database and the command that creates it
    path = jsonl_file([make_request(1)])
    with pytest.raises(DatabaseUnavailable, match="specdec db upgrade"):
        import_traffic(path, store=Store.open(f"sqlite:///{tmp_path / 'missing.db'}"), progress=False)


@pytest.mark.integration
def test_killed_import_loses_nothing_and_a_rerun_completes(db_url, jsonl_file, make_request, tmp_path):
    # SIGKILL mid-file: committed batches stay; the re-run ends with the same counts as one clean run
    total = 40_000
    rows = [make_request(i, response=f"answer {i} " * 20) for i in range(1, total + 1)]
    for i in range(5, total, 997):
        rows[i] = "{broken"                      # some quarantined lines along the way
    path = jsonl_file(rows)
    bad = len(range(5, total, 997))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tasks.cli", "traffic", "import", str(path),
                             "--url", db_url, "--batch-size", "250", "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    stored_at_kill = 0
    while time.monotonic() < deadline and proc.poll() is None:
        stored_at_kill = count(db_url, "traffic_requests")
        if stored_at_kill >= 2000:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    after_kill = count(db_url, "traffic_requests")
    assert stored_at_kill <= after_kill < total - bad           # nothing lost, not finished
    report = import_traffic(path, store=Store.open(db_url), progress=False)
    assert count(db_url, "traffic_requests") == total - bad
    assert count(db_url, "quarantined_requests") == bad
    assert report["inserted"] == total - bad - after_kill
    assert report["skipped_existing"] == after_kill


def test_purge_older_than(db_url, jsonl_file, make_request):
    # retention: traffic requested before now - days goes, newer stays; a dry run only counts;
    # quarantined rows go by when they were imported
    now = datetime(2025, 11, 20, 12, 0)
    path = jsonl_file([make_request(1, timestamp="2025-10-01T00:00:00Z"),
                       make_request(2, timestamp="2025-11-10T00:00:00Z"),
                       make_request(3, timestamp="2025-11-19T00:00:00Z"),
                       "{broken"])
    import_traffic(path, store=Store.open(db_url), progress=False)
    dry = purge_traffic(7, store=Store.open(db_url), now=now, dry_run=True)
    assert (dry["traffic_requests"], count(db_url, "traffic_requests")) == (2, 3)
    done = purge_traffic(7, store=Store.open(db_url), now=now)
    assert (done["traffic_requests"], done["quarantined_requests"]) == (2, 0)
    assert set(traffic(db_url)) == {"req-00003"} and count(db_url, "quarantined_requests") == 1
    later = datetime.now() + timedelta(days=30)
    assert purge_traffic(7, store=Store.open(db_url), now=later)["quarantined_requests"] == 1
    assert count(db_url, "quarantined_requests") == 0 and count(db_url, "traffic_requests") == 0


def test_cli_import_reports_quarantine_lines(db_url, jsonl_file, make_request, capsys):
    # the CLI prints the counts and the rejected line numbers with reasons; exit status 3 says
    # rows were quarantined
    from tasks.cli import main
    from tasks.steps.traffic.traffic_import import EXIT_QUARANTINED

    path = jsonl_file([make_request(1), "nonsense", make_request(3, domain="astrology")])
    assert main(["traffic", "import", str(path), "--url", db_url, "--no-progress"]) == EXIT_QUARANTINED
    out = capsys.readouterr().out
    assert "1 inserted" in out and "2 quarantined" in out
    assert "malformed_json" in out and "unknown_domain" in out
    assert main(["traffic", "purge", "--older-than", "100000", "--url", db_url]) == 0


def test_shipped_sample_imports_cleanly(db_url):
    # the shipped file: >= 600 requests over six domains, greedy and sampled, nothing quarantined
    report = import_traffic(sample_traffic_path(), store=Store.open(db_url), progress=False)
    assert report["inserted"] >= 600 and report["quarantined"] == 0
    engine = create_engine(db_url)
    with engine.connect() as connection:
        domains = dict(connection.execute(select(TrafficRequest.domain, func.count())
                                          .group_by(TrafficRequest.domain)).all())
        greedy = connection.execute(select(func.count()).where(TrafficRequest.temperature == 0)).scalar()
        span = connection.execute(select(func.min(TrafficRequest.requested_at),
                                         func.max(TrafficRequest.requested_at))).one()
        # token ids are kept on every row that needed no redaction (a redacted text drops them)
        missing_ids = connection.execute(select(func.count()).where(
            (TrafficRequest.redactions == 0) & (TrafficRequest.prompt_tokens.is_(None)
                                                | TrafficRequest.response_tokens.is_(None)))).scalar()
    engine.dispose()
    assert set(domains) == {"json", "code", "summarize", "qa", "chat", "creative"}
    assert min(domains.values()) >= 90
    assert 0 < greedy < report["inserted"]
    assert timedelta(days=10) < span[1] - span[0] <= timedelta(days=14)
    assert missing_ids == 0


# ------------------------------------------------------------------------------------------------
# issue 33: CSV bytes that are not UTF-8, a CSV without its header (the CLI in a new process)
CSV_HEADER = b"id,timestamp,domain,prompt,response,temperature,model\n"


@pytest.mark.integration
def test_a_csv_row_with_a_byte_that_is_not_utf8_is_quarantined_with_its_line_and_offset(db_url, tmp_path):
    # the row is not stored with U+FFFD in place of the byte: it is quarantined like a JSONL line
    # (also inside a quoted cell spanning lines); the rows around it land
    path = tmp_path / "latin1.csv"
    path.write_bytes(CSV_HEADER
                     + b"c1,2025-11-03T10:00:00Z,qa,Why?,Because.,0,m\n"
                     + b"c2,2025-11-03T11:00:00Z,qa,Why?,caf\xe9 au lait,0,m\n"
                     + b"c3,2025-11-03T12:00:00Z,qa,Why?,Fine.,0,m\n"
                     + b'c4,2025-11-03T13:00:00Z,qa,"two\nli\xffnes",Yes.,0,m\n'
                     + b"c5,2025-11-03T14:00:00Z,qa,Why?,Also fine.,0,m\n")
    for _ in range(2):                                        # a re-import adds nothing
        result = specdec("traffic", "import", str(path), "--url", db_url, "--no-progress", "--json")
        assert result.returncode == 3, result.stdout + result.stderr
    stored = traffic(db_url)
    assert set(stored) == {"c1", "c3", "c5"}
    assert not any("\ufffd" in row["response"] + row["prompt"] for row in stored.values())
    assert quarantine(db_url) == [(3, "malformed_csv"), (5, "malformed_csv")]
    details = {row["line_number"]: row["detail"] for row in rows_of(db_url, QuarantinedRequest)}
    assert details[3] == ("not UTF-8 (invalid continuation byte at byte 35 of line 3, byte 134 of "
                          "the file)")
    assert "at byte 2 of line 6" in details[5]


@pytest.mark.integration
def test_a_csv_without_its_header_gets_a_short_redacted_line_naming_the_expected_columns(db_url, tmp_path):
    row = ("r1,2025-11-03T10:00:00Z,qa,Please write to ana.lima@example.org about "
           + "x" * 950 + ",Sure.,0,m\n")
    path = tmp_path / "no-header.csv"
    path.write_text(row * 3)
    result = specdec("traffic", "import", str(path), "--url", db_url, "--no-progress")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]     # errors: stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    message = lines[0]
    assert str(path) in message and "has no header line" in message
    assert "id, timestamp, response, prompt or messages" in message
    assert "ana.lima@example.org" not in message and "[EMAIL]" in message   # redacted preview
    assert "x" * 81 not in message and len(message) < 450 + len(str(path))
    assert count(db_url, "traffic_requests") == 0


def corrupt_gzip(data: bytes) -> tuple[bytes, bytes]:
    """(intact gzip of data, the same with one bit flipped inside its deflate stream) where the
    flipped stream still decodes to its end -- garbled lines, none of them valid JSON -- and only
    the gzip checksum fails. Searched from the middle, so deterministic for a zlib build."""
    import zlib

    good = gzip.compress(data, mtime=0)
    lines = data.split(b"\n")
    for position in range(len(good) // 2, len(good) - 8):
        for bit in range(8):
            bad = bytearray(good)
            bad[position] ^= 1 << bit
            decoder = zlib.decompressobj(-15)          # raw deflate after the 10-byte header
            try:
                out = decoder.decompress(bytes(bad[10:]))
            except zlib.error:
                continue
            garbled = [line for line in out.split(b"\n") if line and line not in lines]
            if decoder.eof and len(garbled) >= 20 and all(_not_json(line) for line in garbled):
                return good, bytes(bad)
    raise AssertionError("no bit flip garbles this stream without breaking it")


def _not_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return True
    return False


@pytest.mark.integration
def test_a_corrupt_gzips_garbled_lines_are_superseded_by_the_intact_files_import(db_url, tmp_path):
    # a bit flipped in the deflate stream: garbled lines are quarantined before the checksum fails;
    # importing the intact file at the same path supersedes them, stores every real row once, and
    # the report counts no open entry
    from tasks.steps.traffic.reports import run_report

    rows = [request_row(i) for i in range(1, 301)]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    good, bad = corrupt_gzip(data)
    path = tmp_path / "traffic.jsonl.gz"
    path.write_bytes(bad)
    broken = specdec("traffic", "import", str(path), "--url", db_url, "--no-progress")
    assert broken.returncode == 2 and "CRC check failed" in broken.stderr, broken.stdout + broken.stderr
    first = rows_of(db_url, QuarantinedRequest, QuarantinedRequest.line_number)
    assert len(first) >= 20 and all(e["file_error"] and "CRC check failed" in e["file_error"]
                                    and e["superseded_at"] is None for e in first)
    assert sum(r["rows_rejected"] for r in report_rows(run_report("quarantined_by_reason", Store.open(db_url)))) \
        == len(first)
    assert set(traffic(db_url)) < {row["id"] for row in rows}

    path.write_bytes(good)                                  # the repaired file, same source
    for _ in range(2):
        repaired = specdec("traffic", "import", str(path), "--url", db_url, "--no-progress")
        assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    after = rows_of(db_url, QuarantinedRequest, QuarantinedRequest.line_number)
    assert [e["id"] for e in after] == [e["id"] for e in first]
    assert all(e["superseded_at"] is not None for e in after)
    by_line = {e["line_number"]: e["superseded_by"] for e in after}
    assert {line: by for line, by in by_line.items() if line <= 300} == {
        line: f"req-{line:05d}" for line in by_line if line <= 300}
    assert report_rows(run_report("quarantined_by_reason", Store.open(db_url))) == []
    stored = traffic(db_url)
    assert set(stored) == {row["id"] for row in rows} and count(db_url, "traffic_requests") == 300
    assert all(stored[row["id"]]["response"] == row["response"] for row in rows)


def report_rows(report: dict) -> list[dict]:
    return [dict(zip(report["columns"], row)) for row in report["rows"]]
