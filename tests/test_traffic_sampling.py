"""Per-domain sampling: the same requests for every run over the same traffic (or, per_run, a
draw of its own per run id), window relative to the newest request, re-runs
replace only the run's own rows."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import create_engine, select

from tasks.db.models import EvalRun, EvalSample
from tasks.db.store import Store
from tasks.errors import SampleError
from tasks.settings import load_settings
from tasks.steps.traffic.traffic_sample import sample_traffic
from tasks.steps.traffic.traffic_import import import_traffic

START = datetime(2021, 3, 1, 8, 0)


def traffic_rows(make_request, per_domain: dict[str, int], start=START, step_hours: float = 1.0):
    rows, index = [], 0
    for domain, n in per_domain.items():
        for _ in range(n):
            index += 1
            stamp = start + timedelta(hours=step_hours * index)
            rows.append(make_request(index, domain=domain, timestamp=stamp.isoformat() + "Z"))
    return rows


def load(db_url, jsonl_file, rows, name="t.jsonl"):
    report = import_traffic(jsonl_file(rows, name=name), store=Store.open(db_url), progress=False)
    assert report["quarantined"] == 0
    return report


def samples(db_url, run_id) -> list[tuple[str, str, int]]:
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(select(EvalSample.domain, EvalSample.request_id, EvalSample.position)
                                  .where(EvalSample.run_id == run_id)
                                  .order_by(EvalSample.domain, EvalSample.position)).all()
    engine.dispose()
    return [tuple(row) for row in rows]


def test_runs_over_the_same_traffic_draw_the_same_requests_and_a_later_window_keeps_those_still_in_it(
        db_url, jsonl_file, make_request):
    # the stable draw (the default): the request id alone keys it, so two runs measure the same
    # requests; traffic added later displaces a drawn request only with a smaller key
    load(db_url, jsonl_file, traffic_rows(make_request, {"qa": 60, "code": 40}))
    first = sample_traffic("run-a", store=Store.open(db_url), max_per_domain=10, min_per_domain=5)
    drawn = samples(db_url, "run-a")
    sample_traffic("run-b", store=Store.open(db_url), max_per_domain=10, min_per_domain=5)
    assert samples(db_url, "run-b") == drawn
    assert first["domains"] == {"code": {"available": 40, "sampled": 10, "status": "ok"},
                                "qa": {"available": 60, "sampled": 10, "status": "ok"}}
    later = traffic_rows(make_request, {"qa": 60}, start=START + timedelta(days=5))
    load(db_url, jsonl_file, [{**row, "id": f"later-{i}"} for i, row in enumerate(later)],
         name="later.jsonl")
    sample_traffic("run-c", store=Store.open(db_url), max_per_domain=10, min_per_domain=5,
                   domains=["qa"], window=(START, START + timedelta(days=30)))
    before = {r for d, r, _ in drawn if d == "qa"}
    after = {r for _, r, _ in samples(db_url, "run-c")}
    assert after != before and 0 < len(after & before) < 10
    assert all(r in before or r.startswith("later-") for r in after)


def test_a_per_run_draw_repeats_for_its_run_id_and_draws_anew_for_another(db_url, jsonl_file, make_request):
    # sample_draw "per_run": the run id keys the draw as well
    per_run = load_settings({}, sample_draw="per_run")
    load(db_url, jsonl_file, traffic_rows(make_request, {"qa": 60, "code": 40}))
    first = sample_traffic("run-a", store=Store.open(db_url), max_per_domain=10, min_per_domain=5,
                           settings=per_run)
    drawn = samples(db_url, "run-a")
    again = sample_traffic("run-a", store=Store.open(db_url), max_per_domain=10, min_per_domain=5,
                           settings=per_run)
    assert samples(db_url, "run-a") == drawn and again["domains"] == first["domains"]
    sample_traffic("run-b", store=Store.open(db_url), max_per_domain=10, min_per_domain=5, settings=per_run)
    assert {r for _, r, _ in samples(db_url, "run-b")} != {r for _, r, _ in drawn}
    stable = sample_traffic("run-c", store=Store.open(db_url), max_per_domain=10, min_per_domain=5)
    assert stable["domains"] == first["domains"]


def test_sample_does_not_depend_on_storage_order(db_url, jsonl_file, make_request, tmp_path):
    # the same traffic imported in reverse order into a second database gives the same draw
    from tasks.db import upgrade

    rows = traffic_rows(make_request, {"chat": 50})
    load(db_url, jsonl_file, rows)
    other_url = f"sqlite:///{tmp_path / 'reversed.db'}"
    upgrade(other_url)
    load(other_url, jsonl_file, list(reversed(rows)), name="reversed.jsonl")
    sample_traffic("run-x", store=Store.open(db_url), max_per_domain=7, min_per_domain=1)
    sample_traffic("run-x", store=Store.open(other_url), max_per_domain=7, min_per_domain=1)
    assert samples(db_url, "run-x") == samples(other_url, "run-x")


def test_rerun_replaces_only_its_own_rows(db_url, jsonl_file, make_request):
    # re-running run A with other limits rewrites A's sample; run B's rows are untouched
    load(db_url, jsonl_file, traffic_rows(make_request, {"qa": 30, "json": 30}))
    sample_traffic("A", store=Store.open(db_url), max_per_domain=10, min_per_domain=1)
    sample_traffic("B", store=Store.open(db_url), max_per_domain=10, min_per_domain=1)
    before_b = samples(db_url, "B")
    result = sample_traffic("A", store=Store.open(db_url), max_per_domain=4, min_per_domain=1, domains=["qa"])
    assert result["sampled"] == 4 and [d for d, _, _ in samples(db_url, "A")] == ["qa"] * 4
    assert samples(db_url, "B") == before_b
    engine = create_engine(db_url)
    with engine.connect() as connection:
        runs = connection.execute(select(EvalRun.run_id, EvalRun.status, EvalRun.params)
                                  .order_by(EvalRun.run_id)).all()
    engine.dispose()
    assert [(r.run_id, r.status) for r in runs] == [("A", "sampled"), ("B", "sampled")]
    assert runs[0].params["domains"] == ["qa"] and runs[0].params["max_per_domain"] == 4


def test_smaller_sample_is_a_prefix_of_a_larger_one(db_url, jsonl_file, make_request):
    # a domain's draw is the requests with the smallest keys: raising the maximum only adds rows
    load(db_url, jsonl_file, traffic_rows(make_request, {"creative": 40}))
    sample_traffic("r", store=Store.open(db_url), max_per_domain=5, min_per_domain=1)
    small = [r for _, r, _ in samples(db_url, "r")]
    sample_traffic("r", store=Store.open(db_url), max_per_domain=12, min_per_domain=1)
    large = [r for _, r, _ in samples(db_url, "r")]
    assert large[:5] == small and len(large) == 12


def test_default_window_ends_at_the_newest_request_not_now(db_url, jsonl_file, make_request):
    # traffic from 2021 is found by the default window; rows older than the window are not
    old = traffic_rows(make_request, {"qa": 5}, start=START - timedelta(days=60))
    recent = [make_request(100 + i, domain="qa",
                           timestamp=(START + timedelta(days=i)).isoformat() + "Z") for i in range(8)]
    load(db_url, jsonl_file, old + recent)
    result = sample_traffic("w", store=Store.open(db_url), min_per_domain=1, max_per_domain=100)
    assert result["domains"]["qa"]["available"] == 8
    assert result["window"]["end"] == (START + timedelta(days=7)).isoformat()
    three_days = sample_traffic("w3", store=Store.open(db_url), window=3, min_per_domain=1, max_per_domain=100)
    assert three_days["domains"]["qa"]["available"] == 4          # days 4, 5, 6, 7 (ends inclusive)
    explicit = sample_traffic("we", store=Store.open(db_url), min_per_domain=1, max_per_domain=100,
                              window=("2020-12-01T00:00:00Z", "2021-01-31"))
    assert explicit["domains"]["qa"]["available"] == 5


def test_insufficient_domain_is_marked_not_raised(db_url, jsonl_file, make_request):
    # a domain under its minimum is recorded and listed; an asked-for domain without traffic too
    load(db_url, jsonl_file, traffic_rows(make_request, {"qa": 12, "code": 3}))
    result = sample_traffic("i", store=Store.open(db_url), min_per_domain=5, max_per_domain=10,
                            domains=["qa", "code", "creative"])
    assert result["domains"] == {"code": {"available": 3, "sampled": 3, "status": "insufficient"},
                                 "creative": {"available": 0, "sampled": 0, "status": "insufficient"},
                                 "qa": {"available": 12, "sampled": 10, "status": "ok"}}
    assert result["insufficient"] == ["code", "creative"] and result["sampled"] == 13


def test_model_filter(db_url, jsonl_file, make_request):
    # only requests answered by the named target are drawn
    rows = traffic_rows(make_request, {"qa": 10})
    for row in rows[:4]:
        row["model"] = "other-target"
    load(db_url, jsonl_file, rows)
    result = sample_traffic("m", store=Store.open(db_url), model="other-target", min_per_domain=1)
    assert result["domains"]["qa"]["available"] == 4


@pytest.mark.parametrize("kwargs, fragment", [
    ({"domains": ["astrology"]}, "known set"),
    ({"min_per_domain": 10, "max_per_domain": 5}, "min <= max"),
    ({"window": ("2021-03-05", "2021-03-01")}, "after its end"),
    ({"window": ("yesterday", "2021-03-01")}, "ISO 8601"),
    ({"window": -2}, "positive"),
])
def test_bad_requests_name_the_input(db_url, jsonl_file, make_request, kwargs, fragment):
    # unusable arguments are SampleErrors that say what to change
    load(db_url, jsonl_file, traffic_rows(make_request, {"qa": 3}))
    with pytest.raises(SampleError, match=fragment):
        sample_traffic("bad", store=Store.open(db_url), **kwargs)


def test_empty_traffic_says_import_first(db_url):
    # nothing stored: the default window cannot be placed
    with pytest.raises(SampleError, match="traffic import"):
        sample_traffic("empty", store=Store.open(db_url))


def test_cli_sample_prints_json(db_url, jsonl_file, make_request, capsys):
    # `specdec traffic sample RUN` prints the JSON result
    import json

    from tasks.cli import main

    load(db_url, jsonl_file, traffic_rows(make_request, {"json": 6}))
    assert main(["traffic", "sample", "cli-run", "--min-per-domain", "2", "--max-per-domain", "4",
                 "--url", db_url]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["domains"]["json"] == {"available": 6, "sampled": 4, "status": "ok"}
    assert (result["min_per_domain"], result["max_per_domain"]) == (2, 4) and not captured.err
    # the old option names still work, with a warning on stderr
    assert main(["traffic", "sample", "cli-run", "--min", "3", "--max", "5", "--url", db_url]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert (result["min_per_domain"], result["max_per_domain"]) == (3, 5)
    assert result["domains"]["json"]["sampled"] == 5
    assert "--min is deprecated; use --min-per-domain" in captured.err
    assert "--max is deprecated; use --max-per-domain" in captured.err


def test_default_window_covers_the_shipped_sample(db_url):
    # whatever today's date is, the default window (ending at the newest request) holds every row
    from tasks.steps.traffic.traffic_import import sample_traffic_path

    inserted = import_traffic(sample_traffic_path(), store=Store.open(db_url), progress=False)["inserted"]
    result = sample_traffic("shipped", store=Store.open(db_url), max_per_domain=1000)
    assert sum(info["available"] for info in result["domains"].values()) == inserted
    assert result["insufficient"] == []
