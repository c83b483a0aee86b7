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
    from tasks.steps.traffic.traffic_import import import_traffic

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
    from tasks.steps.traffic.traffic_import import import_traffic

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


# ------------------------------------------------------------------------------------------------
# 2. bounded scrapes: positions capped at the largest K, a size cap, a total deadline
def _scrapes(url: str) -> list:
    from tasks.db.models import MonitorScrape

    return _stored(url, MonitorScrape)


def _monitor(db_url: str, **settings):
    from tasks.settings import load_settings
    from tasks.steps.monitor.monitor import MonitorContext

    return MonitorContext.open(Store.open(db_url), settings=load_settings({}, **settings))


def test_a_position_beyond_the_largest_k_is_refused_in_bounded_memory(db_url, metrics_server):
    import tracemalloc

    from tasks.errors import MonitorScrapeError
    from tasks.steps.monitor.scrape import scrape

    from .helpers.metrics import exposition

    metrics_server.text = exposition(10, 30, 12, [6, 4, 2]).replace('position="2"', 'position="1000000000"')
    tracemalloc.start()
    try:
        with pytest.raises(MonitorScrapeError) as refused:
            scrape(_monitor(db_url), metrics_server.url, "vllm-a", config=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert "position 1000000000" in message and "largest K (16, setting quality_k_max)" in message
    assert "nothing stored" in message and "\n" not in message
    assert peak < 16 * 2**20, peak                   # not a list of a billion entries
    assert _scrapes(db_url) == []


def test_a_body_over_the_size_cap_is_refused_in_bounded_memory(db_url, metrics_server):
    import tracemalloc

    from tasks.errors import MonitorScrapeError
    from tasks.steps.monitor.scrape import scrape

    from .helpers.metrics import exposition

    filler = b"# " + b"x" * 1000 + b"\n"
    metrics_server.text = exposition(10, 30, 12, [6, 4, 2]).encode() + filler * (70 * 1024)   # 70 MB
    tracemalloc.start()
    try:
        with pytest.raises(MonitorScrapeError) as refused:
            scrape(_monitor(db_url), metrics_server.url, "vllm-a", config=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "is over 67108864 bytes (setting monitor_scrape_max_bytes)" in str(refused.value)
    assert "nothing stored" in str(refused.value)
    assert peak < 16 * 2**20, peak                   # streamed: not the body held in memory
    assert _scrapes(db_url) == []


def test_a_large_body_under_the_cap_is_stored_in_bounded_memory(db_url, metrics_server):
    import tracemalloc

    from tasks.steps.monitor.scrape import scrape

    from .helpers.metrics import exposition

    filler = b"# " + b"x" * 1000 + b"\n"
    metrics_server.text = filler * (50 * 1024) + exposition(10, 30, 12, [6, 4, 2]).encode()   # 50 MB
    tracemalloc.start()
    try:
        row = scrape(_monitor(db_url), metrics_server.url, "vllm-a", config=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (row["drafts"], row["draft_tokens"], row["accepted_tokens"], row["accepted_per_pos"]) == \
        (10, 30, 12, [6, 4, 2])
    assert peak < 16 * 2**20, peak
    assert len(_scrapes(db_url)) == 1


def test_a_body_that_drips_ends_at_the_total_deadline(db_url, metrics_server):
    from tasks.errors import MonitorScrapeError
    from tasks.steps.monitor.scrape import scrape

    # each read answers well within the timeout, so only a deadline over the whole scrape ends it
    metrics_server.drip_s = 0.2
    with pytest.raises(MonitorScrapeError) as refused:
        scrape(_monitor(db_url, monitor_scrape_timeout_s=1.5), metrics_server.url, "vllm-a", config=False)
    assert "did not finish within 1.5 s (setting monitor_scrape_timeout_s); nothing stored" in str(refused.value)
    assert _scrapes(db_url) == []


# ------------------------------------------------------------------------------------------------
# 3. counters checked before anything is stored
IMPOSSIBLE = {   # (drafts, draft tokens, accepted, per position), what the refusal names
    "negative": ((-5, 30, 12, [6, 4, 2]), "drafts -5 is not a count"),
    "accepted over drafted": ((10, 10, 298, [10, 10, 10]), "298 accepted of 10 draft tokens"),
    "drafts over draft tokens": ((50, 30, 12, [6, 4, 2]), "50 drafts of 30 draft tokens"),
    "a position over drafts": ((10, 30, 12, [12, 0, 0]), "position 0 counts 12 accepted of 10 drafts"),
    "+Inf": ((float("inf"), 30, 12, [6, 4, 2]), "drafts inf is not a count"),
    "NaN": ((10, 30, float("nan"), [6, 4, 2]), "accepted_tokens nan is not a count"),
    "1e25": ((10, 1e25, 12, [6, 4, 2]), "draft_tokens 1e+25 is not a count"),
    "fraction": ((10.5, 30, 12, [6, 4, 2]), "drafts 10.5 is not a count"),
}


@pytest.mark.parametrize("case", IMPOSSIBLE)
def test_impossible_counters_are_refused_and_nothing_is_stored(case, db_url, metrics_server):
    from tasks.errors import MonitorScrapeError
    from tasks.steps.monitor.scrape import scrape

    from .helpers.metrics import exposition

    counters, named = IMPOSSIBLE[case]
    metrics_server.text = exposition(*counters)
    with pytest.raises(MonitorScrapeError) as refused:
        scrape(_monitor(db_url), metrics_server.url, "vllm-a", config=False)
    message = str(refused.value)
    assert named in message and "nothing stored" in message and "\n" not in message, message
    assert message.startswith("deployment vllm-a: ")
    assert _scrapes(db_url) == []


def test_deltas_with_more_accepted_than_drafted_are_refused(db_url, metrics_server):
    from tasks.errors import MonitorScrapeError
    from tasks.steps.monitor.scrape import scrape

    from .helpers.metrics import exposition

    ctx = _monitor(db_url)
    metrics_server.text = exposition(100, 300, 50, [20, 20, 10])
    scrape(ctx, metrics_server.url, "vllm-a", config=False)
    metrics_server.text = exposition(101, 303, 250, [100, 100, 50])    # +200 accepted of +3 drafted
    with pytest.raises(MonitorScrapeError, match="since the previous scrape: 200 accepted of 3 draft tokens"):
        scrape(ctx, metrics_server.url, "vllm-a", config=False)
    assert len(_scrapes(db_url)) == 1


def test_monitor_scrape_of_impossible_counters_exits_2_with_one_line(db_url, metrics_server, capsys):
    from tasks.cli.app import main

    from .helpers.metrics import exposition

    metrics_server.text = exposition(10, 10, 298, [10, 10, 10])
    assert main(["monitor", "scrape", "--url", metrics_server.url, "--deployment", "vllm-a",
                 "--no-check", "--db-url", db_url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: MonitorScrapeError: deployment vllm-a: ")
    assert _scrapes(db_url) == []


# ------------------------------------------------------------------------------------------------
# 4. masking: tracebacks and stored URLs
@pytest.mark.integration
def test_a_traceback_prints_no_password(tmp_path, metrics_server):
    """An uncaught error (here: a database that refuses the scrape's row, by a trigger) still
    prints its traceback, SQL parameters and all, with every URL's password masked."""
    from tasks.db import dispose_engines, upgrade

    from .helpers.processes import specdec

    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'specdec.db'}"
    upgrade(url)
    dispose_engines()
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TRIGGER refuse BEFORE INSERT ON monitor_scrapes "
                                   "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
    engine.dispose()
    scraped = metrics_server.url.replace("http://", f"http://user:{SECRET}@")
    done = specdec("monitor", "scrape", "--url", scraped, "--deployment", "vllm-a", "--no-check",
                   home=home)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "refused by the test" in done.stderr
    assert "user:***@127.0.0.1" in done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_the_scrape_url_is_stored_without_its_password(db_url, metrics_server):
    from tasks.steps.monitor.scrape import scrape

    scraped = metrics_server.url.replace("http://", f"http://user:{SECRET}@")
    row = scrape(_monitor(db_url), scraped, "vllm-a", config=False)
    (stored,) = _scrapes(db_url)
    assert stored.url == row["url"] == metrics_server.url.replace("http://", "http://user:***@")


# ------------------------------------------------------------------------------------------------
# 12, 13. bad values on the command line: one line naming the value and the fix, exit 2, before
# any work (no model loaded, nothing deleted)
BAD_VALUES = {
    "purge inf": (["traffic", "purge", "--older-than", "inf"],
                  "--older-than 'inf': give a number of days from 0 to 100,000"),
    "purge 1e12": (["traffic", "purge", "--older-than", "1e12"],
                   "--older-than '1e12': give a number of days from 0 to 100,000"),
    "purge -1": (["traffic", "purge", "--older-than", "-1"],
                 "--older-than '-1': give a number of days from 0 to 100,000"),
    "since garbage": (["monitor", "show", "--since", "garbage"],
                      "--since 'garbage': give an ISO 8601 time in UTC from 2000-01-01 on, e.g. "
                      "2026-01-31T12:00:00"),
    "since 0001": (["monitor", "show", "--since", "0001-01-01"],
                   "--since '0001-01-01': give an ISO 8601 time in UTC from 2000-01-01 on"),
    "until garbage": (["monitor", "show", "--until", "x"], "--until 'x': give an ISO 8601 time"),
    "evaluate days nan": (["evaluate", "--days", "nan", "--no-register"],
                          "--days 'nan': give a number of days from 0 to 100,000"),
    "sample days inf": (["traffic", "sample", "r1", "--days", "inf"],
                        "--days 'inf': give a number of days from 0 to 100,000"),
    "evaluate k-max 0": (["evaluate", "--k-max", "0", "--no-register"],
                         "--k-max '0': give a whole number from 1 to 32"),
    "evaluate k-max abc": (["evaluate", "--k-max", "abc", "--no-register"],
                           "--k-max 'abc': give a whole number from 1 to 32"),
    "conf bad json": (["main-job", "--conf", "{bad"],
                      "--conf '{bad' is not JSON (Expecting property name"),
    "conf not an object": (["main-job", "--conf", "[1]"],
                           "--conf '[1]': give a JSON object of the run's Params"),
    "export to a folder": (["config", "export", "--format", "compose", "--output", "TMP"],
                           "--output 'TMP' is a folder: give a file path to write"),
    "export to a missing folder": (["config", "export", "--format", "compose", "--output", "TMP/no/x.yml"],
                                   # (the value quoted may be cut; the folder it names is whole)
                                   "the folder 'TMP/no' does not exist"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2(case, db_url, tmp_path, monkeypatch, capsys):
    from tasks.cli.app import main
    from tasks.db.models import TrafficRequest
    from tasks.steps.traffic.traffic_import import import_traffic

    argv, line = BAD_VALUES[case]
    argv, line = [arg.replace("TMP", str(tmp_path)) for arg in argv], line.replace("TMP", str(tmp_path))
    import_traffic(write_jsonl(tmp_path / "t.jsonl", [request_row(1)]), store=Store.open(db_url), progress=False)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", db_url)
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: InvalidValue: ") and line in err, err
    assert len(_stored(db_url, TrafficRequest)) == 1          # nothing purged


@pytest.mark.parametrize("command", [["traffic", "import"], ["traffic", "purge"], ["monitor", "scrape"],
                                     ["monitor", "show"], ["config", "export"]])
def test_the_commands_a_help_names_exist(command, capsys):
    import re

    from tasks.cli.app import build_parser, main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    named = re.findall(r"`specdec ([a-z-]+(?: [a-z_-]+)?)", " ".join(capsys.readouterr().out.split()))
    for words in named:
        with pytest.raises(SystemExit) as parsed:      # each parses (its --help exits 0)
            build_parser().parse_args([*words.split(), "--help"])
        assert parsed.value.code == 0, f"{' '.join(command)} --help names `specdec {words}`"
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------
# 9. a draft's training window and a row stamped in the future
def test_the_draft_training_window_ignores_a_row_stamped_in_the_future(db_url, tmp_path):
    from datetime import timedelta

    from tasks.steps.drafters.draft_training import training_requests
    from tasks.steps.traffic.traffic_import import import_traffic
    from tasks.timeutil import utcnow

    rows = [request_row(i) for i in range(1, 49)]                      # 2025-11-01 .. 2025-11-14
    ahead = (utcnow() + timedelta(hours=20)).strftime("%Y-%m-%dT%H:%M:%SZ")   # accepted: < now + 1 day
    rows.append(request_row(99, timestamp=ahead))
    import_traffic(write_jsonl(tmp_path / "t.jsonl", rows), store=Store.open(db_url), progress=False)
    requests, (start, end) = training_requests(Store.open(db_url), "sha256:test", window_days=7)
    assert end.strftime("%Y-%m-%d") == "2025-11-14"                  # not the future row's time
    since = start.strftime("%Y-%m-%dT%H:%M:%S")
    assert len(requests) == sum(1 for row in rows[:48] if row["timestamp"] >= since) >= 10
    assert "req-00099" not in {request.request_id for request in requests}


# ------------------------------------------------------------------------------------------------
# 6. deployment names that slug alike
def test_deployments_whose_domains_slug_alike_get_distinct_service_names():
    import re

    from tasks.registry.compose_export import compose_export, deployments
    from tasks.registry.config_schema import parse_config

    def lookup(n: int) -> dict:       # a deployment per drafter method and parameters (K per request)
        return {"enabled": True, "drafter": {"kind": "prompt_lookup", "params": {"max_ngram": n}},
                "k": 4, "samples": 25, "validation": "passed"}

    domains = {"a_b": lookup(2), "a-b": lookup(3), "a": lookup(4), "b": lookup(4), "日本": lookup(5),
               "中文": lookup(6), "json": lookup(7), "x" * 80: lookup(8), "x" * 81: lookup(9)}
    config = parse_config({"target": {"id": "Org/Tiny", "fingerprint": "sha256:aaa"},
                           "hardware_profile": "cpu-test", "run_id": "run-1",
                           "created_at": "2025-11-01T10:00:00", "domains": domains})
    found = deployments(config)
    names = [d["name"] for d in found]
    assert len(found) == 8 and len(set(names)) == 8, names      # a and b share one deployment
    assert all(re.fullmatch(r"vllm-[a-z0-9][a-z0-9-]{0,57}[a-z0-9]", name) for name in names), names
    assert {d["name"] for d in found if d["domains"] == ["json"]} == {"vllm-json"}   # plain names stay
    services = compose_export(config, "specdec-config-org--tiny", "7", "vllm/vllm-openai:v0.32.0")["services"]
    assert sorted(services) == sorted(names)
    served = sorted(domain for s in services.values() for domain in s["labels"]["io.specdec.domains"].split(","))
    assert served == sorted(domains)                             # every domain has its service


# ------------------------------------------------------------------------------------------------
# 7. an over-long row: quarantined at import with the gate's limit; one row removed by id
@pytest.mark.parametrize("field", ["prompt", "response"])
def test_a_row_longer_than_the_gate_allows_is_quarantined_at_import(field, db_url, tmp_path):
    from tasks.db.models import QuarantinedRequest, TrafficRequest
    from tasks.steps.traffic.traffic_import import import_traffic

    long_row = request_row(2, **{field: "word " * 80_000})       # 400,000 characters
    if field == "prompt":
        long_row.pop("messages")
    report = import_traffic(write_jsonl(tmp_path / "t.jsonl", [request_row(1), long_row, request_row(3)]),
                            store=Store.open(db_url), progress=False)
    assert (report["inserted"], report["quarantined"]) == (2, 1)
    assert sorted(row.id for row in _stored(db_url, TrafficRequest)) == ["req-00001", "req-00003"]
    (held,) = _stored(db_url, QuarantinedRequest)
    assert (held.line_number, held.reason) == (2, "too_large")
    assert f"{field} is 400000 characters; at most 200000 (setting max_{field}_chars" in held.detail


def test_traffic_purge_by_id_removes_that_row_only(db_url, tmp_path, capsys):
    from tasks.cli.app import main
    from tasks.db.models import TrafficRequest
    from tasks.steps.traffic.traffic_import import import_traffic

    import_traffic(write_jsonl(tmp_path / "t.jsonl", [request_row(i) for i in (1, 2, 3)]),
                   store=Store.open(db_url), progress=False)
    assert main(["traffic", "purge", "--id", "req-00002", "--dry-run", "--url", db_url]) == 0
    assert len(_stored(db_url, TrafficRequest)) == 3
    assert main(["traffic", "purge", "--id", "req-00002", "--url", db_url]) == 0
    assert sorted(row.id for row in _stored(db_url, TrafficRequest)) == ["req-00001", "req-00003"]
    capsys.readouterr()
    assert main(["traffic", "purge", "--id", "req-00002", "--url", db_url]) == 2     # gone already
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["error: TrafficFileError: request 'req-00002' is not stored; "
                                        "nothing deleted"]
    with pytest.raises(SystemExit) as neither:          # argparse: --older-than or --id is required
        main(["traffic", "purge", "--url", db_url])
    assert neither.value.code == 2 and "one of the arguments --older-than --id is required" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# 13. Ctrl-C during an import
@pytest.mark.integration
def test_sigint_during_an_import_is_one_line_and_keeps_the_committed_rows(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tasks.db import dispose_engines, upgrade
    from tasks.db.models import TrafficRequest

    from .helpers import REPO

    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'specdec.db'}"
    upgrade(url)
    dispose_engines()
    rows = 60_000
    path = write_jsonl(tmp_path / "big.jsonl", [request_row(i) for i in range(1, rows + 1)])
    env = {"PYTHONPATH": str(REPO), "SPECDEC_HOME": str(home), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen([sys.executable, "-m", "tasks.cli", "traffic", "import", str(path),
                                "--no-progress", "--batch-size", "500"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               # as a shell starts it: a child inherits an ignored SIGINT, and a
                               # test runner's worker may ignore it (the import then ran to its end)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    engine = create_engine(url)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with engine.connect() as connection:
                    if connection.exec_driver_sql("SELECT count(*) FROM traffic_requests").scalar():
                        break
            except Exception:        # the table locked by the writer: ask again
                pass
            time.sleep(0.05)
        assert process.poll() is None, "the import ended before it could be interrupted"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        engine.dispose()
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: Interrupted: stopped by Ctrl-C (SIGINT)"), err
    stored = len(_stored(url, TrafficRequest))
    assert 0 < stored < rows and stored % 500 == 0               # whole batches, as committed


# ------------------------------------------------------------------------------------------------
# 12, 13. `engine validate` with an unknown domain, or on a run that turns no domain on
@pytest.mark.parametrize("argv, line", [
    (["--domain", "zzz"], "--domain zzz: run run-1 has no domain zzz; its domains: json, qa"),
    ([], "run run-1 turns no domain on: nothing to validate; name one with --domain (its domains: "
         "json, qa)"),
], ids=["unknown domain", "no domain on"])
def test_engine_validate_refuses_a_domain_it_cannot_validate_before_loading_a_model(argv, line, db_url, capsys):
    from tasks.cli.app import main

    from .helpers.registry import finished_run

    finished_run(db_url, "run-1", {"json": {"enabled": False}, "qa": {"enabled": False}},
                 target_id="no-such-org/no-such-model")
    capsys.readouterr()
    assert main(["engine", "validate", "run-1", *argv, "--url", db_url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.strip() == f"error: InvalidValue: {line}"


# ------------------------------------------------------------------------------------------------
# 11. deployment names
@pytest.mark.parametrize("name", ["", "a\nb", "vllm\u202egpj", "d" * 10_000, "\x1b[31mred"],
                         ids=["empty", "newline", "bidi", "long", "escape"])
def test_a_hostile_deployment_name_is_refused_in_one_line_and_nothing_is_stored(name, db_url, metrics_server,
                                                                                 capsys):
    from tasks.cli.app import main

    capsys.readouterr()
    assert main(["monitor", "scrape", "--url", metrics_server.url, "--deployment", name, "--no-check",
                 "--db-url", db_url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: InvalidIdentifier: deployment name ") and "is not allowed" in err
    assert len(err) < 400 and "\x1b" not in err and "\u202e" not in err
    assert _scrapes(db_url) == []
