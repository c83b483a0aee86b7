"""The load check (tasks.steps.checks.load_check): the schedule cut to what a domain's requests measured
on vLLM's OpenAI server at concurrency levels, its storage, report and JSON; and, against a real
`python -m vllm.entrypoints.openai.api_server` of the serving environment on a tiny target (one
pool of servers for the module), two levels measured, /metrics counters equal to the per-request
sums, a schedule cut at a level that does not pay, a server that does not start and one killed
mid-level.

The server tests are skipped when there is no serving environment, unless
SPECDEC_REQUIRE_SERVING=1 (.ci/run sets it). A tiny target's timings are noise (its streamed
chunks can carry several tokens at once): the cut is forced by failed requests at the higher level
(a prompt longer than the server's context), not by a speedup threshold."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tasks.db.load_records import DomainLoad, LoadLevel
from tasks.db.store import Store
from tasks.serving import environment as serving_env
from tasks.settings import load_settings
from tasks.steps.checks.load_levels import (counters_match, cut_schedule, exported_schedule,
                                            level_row, request_sums)

REQUIRED = os.environ.get("SPECDEC_REQUIRE_SERVING") == "1"
needs_server = pytest.mark.skipif(not REQUIRED and not serving_env.available(),
                                  reason="no serving environment (make serving-env); `make test-all` "
                                         "and CI build one and set SPECDEC_REQUIRE_SERVING=1")
BEYOND = 1 << 20


def _level(concurrency, speedup, lo, hi, pays, failed=0):
    return LoadLevel(concurrency=concurrency, measured_speedup=speedup, measured_speedup_lo=lo,
                     measured_speedup_hi=hi, pays=pays, failed=failed, requests=8)


def test_the_schedule_keeps_k_only_up_to_the_largest_level_that_pays_and_every_one_below():
    settings = load_settings(plan_min_speedup=1.1)
    config = {"k": 4, "k_schedule": [[1, 1, 4], [2, 4, 3], [5, 8, 2]], "max_batch_size": 8,
              "reason": "planned on"}
    # 1 and 2 pay, 4 does not, 8 pays again: K > 0 up to 2 only (a level measured below 1.0x
    # is never inside the schedule)
    rows = [_level(1, 1.6, 1.3, 1.9, True), _level(2, 1.4, 1.2, 1.6, True),
            _level(4, 0.94, 0.88, 1.01, False), _level(8, 1.3, 1.15, 1.4, True)]
    verdict = cut_schedule(config, rows, settings)
    assert verdict.status == "cut" and verdict.largest == 2
    assert verdict.changes["k_schedule"] == [[1, 1, 4], [2, 2, 3]]
    assert verdict.changes["max_batch_size"] == 2
    assert "0.94x [0.88, 1.01] at 4 concurrent requests" in verdict.reason
    assert exported_schedule(dict(config, **verdict.changes)) == [[1, 1, 4], [2, 2, 3], [3, BEYOND, 0]]
    # paying nowhere: off, with the first level's figure as the reason
    off = cut_schedule(config, [_level(1, 0.94, 0.9, 0.99, False), _level(2, 1.5, 1.2, 1.8, True)], settings)
    assert off.status == "off" and off.changes["enabled"] is False
    assert off.changes["k_schedule"] is None and off.reason.startswith(
        "load check: 0.94x [0.90, 0.99] at 1 concurrent request does not pay min_speedup 1.10x")
    assert "Planner: planned on" in off.changes["reason"]
    # every level pays: nothing changes
    fine = cut_schedule(config, rows[:2], settings)
    assert fine.status == "ok" and fine.changes == {}
    # a config of one K up to a cut-off (schema 1, or suffix decoding) gets a lower cut-off
    single = cut_schedule({"k": 3, "k_schedule": None, "max_batch_size": 8}, rows, settings)
    assert single.changes == {"k_schedule": None, "max_batch_size": 2,
                              "reason": single.changes["reason"]}


def test_a_level_pays_by_its_interval_and_one_still_straddling_the_bar_by_its_point():
    from tasks.steps.checks.load_levels import level_verdict as verdict, pays

    settings = load_settings(plan_min_speedup=1.1)
    sure = _level(2, 1.3, 1.12, 1.5, None)
    assert verdict(sure, settings, champion_on=False) == "pays" and pays(sure, settings, False)
    below = _level(2, 1.0, 0.92, 1.08, None)                     # upper end under min_speedup
    assert verdict(below, settings, champion_on=False) == "below" and not pays(below, settings, False)
    # the interval straddles 1.1: unsure; after the level's extra requests the point decides
    straddling = _level(2, 1.2, 1.02, 1.4, None)
    assert verdict(straddling, settings, champion_on=False) == "unsure"
    assert pays(straddling, settings, champion_on=False)
    assert not pays(replace(straddling, measured_speedup=1.05), settings, champion_on=False)
    # on in the champion (hysteresis): a lower end over 1.0 and an upper end over 1.1 pay
    assert verdict(straddling, settings, champion_on=True) == "pays"
    assert verdict(replace(straddling, measured_speedup_lo=0.97), settings, champion_on=True) == "unsure"
    # a failed request, or no figure, never pays
    assert not pays(replace(sure, failed=1), settings, champion_on=False)
    assert not pays(replace(sure, measured_speedup_lo=None), settings, champion_on=False)
    # the reason says an unsure level was decided by its point
    from tasks.steps.checks.load_levels import level_text
    assert level_text(replace(straddling, verdict="unsure", requests=24)).endswith(
        "at 2 concurrent requests, unsure after 24 requests: the point estimate decides")


def test_more_requests_never_repeat_one_the_level_or_a_suffix_server_holds():
    from tasks.steps.checks.load_waves import _more

    items = [{"id": f"r{n}", "request_id": f"r{n % 6}"} for n in range(10)]   # r0-r5, then repeats
    assert [i["id"] for i in _more(items, {"r0", "r1"}, 3)] == ["r2", "r3", "r4"]
    assert [i["id"] for i in _more(items, {"r0", "r1", "r2", "r3"}, 5)] == ["r4", "r5"]
    assert _more(items, {f"r{n}" for n in range(6)}, 2) == []


def test_per_request_metrics_sum_to_counters_by_position():
    # acceptance histograms: index j counts the steps that accepted exactly j drafts
    requests = [{"spec": {"drafts": 3, "draft_tokens": 12, "accepted_tokens": 5, "histogram": [1, 0, 1, 1, 0]}},
                {"spec": {"drafts": 2, "draft_tokens": 8, "accepted_tokens": 4, "histogram": [0, 0, 2, 0, 0]}}]
    sums = request_sums(requests)
    assert sums == {"drafts": 5, "draft_tokens": 20, "accepted_tokens": 9, "accepted_per_pos": [4, 4, 1, 0]}
    assert counters_match({"drafts": 5, "draft_tokens": 20, "accepted_tokens": 9,
                           "accepted_per_pos": [4, 4, 1]}, sums) is True
    assert counters_match({"drafts": 5, "draft_tokens": 20, "accepted_tokens": 9,
                           "accepted_per_pos": [4, 3, 1, 1]}, sums) is False
    assert request_sums(requests + [{"spec": None}]) is None


def _served(tokens: int, gap: float, spec: dict | None = None, ok: bool = True) -> dict:
    chunks = [(0.1 + gap * n, 1) for n in range(tokens)]
    return {"id": "q", "ok": ok, "error": None if ok else "HTTP 400", "token_ids": list(range(tokens)) if ok else [],
            "chunks": chunks if ok else [], "spec": spec, "ttft_s": 0.1 if ok else None,
            "decode_s": gap * (tokens - 1) if ok else None, "latency_s": 1.0}


def test_stored_levels_are_shown_as_json_in_the_sql_report_and_in_evaluates_table(db_url, capsys):
    from sqlalchemy import insert, select

    from tasks.cli import main
    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, EngineCheck, EvalRun
    from tasks.db.queries_load import load_checks, store_load_check
    from tasks.steps.evaluate import evaluation_table
    from tasks.steps.traffic.reports import run_report
    from tasks.timeutil import utcnow

    engine = ensure_ready(db_url)
    store = Store.open(db_url)
    now = utcnow()
    with engine.begin() as connection:
        connection.execute(insert(EvalRun).values(run_id="r-load", created_at=now, updated_at=now,
                                                  status="evaluated", target_id="tiny",
                                                  target_fingerprint="sha256:t", hardware_profile="cpu"))
        connection.execute(insert(DomainConfig).values(
            run_id="r-load", domain="code", enabled=True, drafter="prompt_lookup", k=4, status="ok",
            k_schedule=[[1, 1, 4], [2, 2, 4]], max_batch_size=2, samples=10, reason="planned on",
            created_at=now))
        connection.execute(insert(EngineCheck).values(run_id="r-load", domain="code", engine="vllm",
                                                      status="ok", passed=True, created_at=now))
    spec = {"drafts": 4, "draft_tokens": 16, "accepted_tokens": 8, "histogram": [0, 1, 2, 1, 0]}
    counters = {"drafts": 8, "draft_tokens": 32, "accepted_tokens": 16, "accepted_per_pos": [8, 6, 2, 0]}
    levels = []
    for concurrency, spec_gap in ((1, 0.01), (2, 0.05)):
        plain = {"requests": [_served(9, 0.02), _served(9, 0.02)], "wall_s": 1.0}
        config = {"requests": [_served(9, spec_gap, spec), _served(9, spec_gap, spec)], "wall_s": 1.0,
                  "counters": counters}
        row = level_row(concurrency, 4, plain, config)
        levels.append(replace(row, predicted_speedup=1.5, pays=concurrency == 1))
    assert levels[0].measured_speedup == pytest.approx(2.0) and levels[0].counters_equal is True
    assert levels[0].engine_e == pytest.approx(3.0) and levels[0].engine_rates == [1.0, 0.75, 0.25, 0.0]
    config_row = {"k": 4, "k_schedule": [[1, 1, 4], [2, 2, 4]], "max_batch_size": 2, "reason": "planned on"}
    verdict = cut_schedule(config_row, levels, load_settings())
    record = DomainLoad(domain="code", status=verdict.status, passed=True, reason=verdict.reason,
                        schedule_before=exported_schedule(config_row),
                        schedule_after=exported_schedule(dict(config_row, **verdict.changes)),
                        max_level_paying=verdict.largest, spec_log="/logs/spec.log",
                        plain_log="/logs/plain.log", levels=tuple(levels))
    store_load_check(store, "r-load", {"code": record}, {"code": verdict.changes})
    store_load_check(store, "r-load", {"code": record}, {})     # a re-run replaces
    stored = load_checks(store, "r-load")["code"]
    assert [level.concurrency for level in stored.levels] == [1, 2]
    assert stored.schedule_after == [[1, 1, 4], [2, BEYOND, 0]]
    with engine.connect() as connection:
        cut = connection.execute(select(DomainConfig.k_schedule, DomainConfig.max_batch_size).where(
            DomainConfig.run_id == "r-load")).one()
    assert (cut.k_schedule, cut.max_batch_size) == ([[1, 1, 4]], 1)
    # the SQL report: one row per level
    report = run_report("load_check", store=Store.open(db_url))
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    assert [(r["concurrency"], r["pays"], r["domain_status"]) for r in rows] == [(1, 1, "cut"), (2, 0, "cut")]
    # `specdec engine show RUN_ID --format json`: concurrency, speedup, interval, E from /metrics
    assert main(["engine", "show", "r-load", "--format", "json", "--url", db_url]) == 0
    shown = json.loads(capsys.readouterr().out)[0]["load_check"]
    assert shown["status"] == "cut" and shown["schedule_before"] == [[1, 1, 4], [2, 2, 4], [3, BEYOND, 0]]
    first = shown["levels"][0]
    assert (first["concurrency"], first["engine_e"]) == (1, pytest.approx(3.0))
    assert first["measured_speedup_lo"] <= first["measured_speedup"] <= first["measured_speedup_hi"]
    # evaluate's table carries the load check per domain
    table = evaluation_table("r-load", Store.open(db_url))
    assert table[0]["load_check"]["status"] == "cut"
    assert [level["concurrency"] for level in table[0]["load_check"]["levels"]] == [1, 2]
    from tasks.registry.load_results import load_check_text, load_markdown

    summary = DomainLoad.from_json(table[0]["load_check"])
    assert load_check_text(summary) == "c1 2.00x, c2 0.40x x; K>0 up to 1"
    assert "| code | 2 | 4 |" in load_markdown(load_checks(store, "r-load"))
    _round_trips(store, "r-load")


def test_the_served_prediction_prices_the_tokens_vllm_served_not_the_logged_ones(monkeypatch):
    # a sampled request draws its response anew on the server: the second prediction walks the
    # config side's tokens of each request (its first serving where it was served twice; a
    # failed one left out), with the same drafter, K, cost profile and batch size
    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest
    from tasks.steps.checks import load_check
    from tasks.steps.checks.engine_compare import pays_sampled

    logged = [LoggedRequest(f"q{n}", [1, 2, 3], [9, 9, 9, 9], SamplingParams(temperature=0.7), "d")
              for n in range(3)]
    context = SimpleNamespace(model="target", domain_requests=lambda domain: (logged, {}),
                              domain_drafters=lambda domain: {"suffix": ("spec", "the-drafter")})
    chosen = [{"id": "q0", "request_id": "q0"}, {"id": "q1", "request_id": "q1"},
              {"id": "q2", "request_id": "q2"}, {"id": "q0#1", "request_id": "q0"}]
    served = {"requests": [{"id": "q0", "ok": True, "token_ids": [4, 5, 6]},
                           {"id": "q1", "ok": False, "token_ids": []},
                           {"id": "q2", "ok": True, "token_ids": [7, 8]},
                           {"id": "q0#1", "ok": True, "token_ids": [1, 1, 1]}]}
    walked, priced = [], []

    def offline(target, drafter, requests, k):
        walked.append((target, drafter, k, {r.request_id: list(r.response_ids) for r in requests}))
        return {r.request_id: f"totals-{r.request_id}" for r in requests}

    def predicted(costs, label, spec, totals, sampled, batch_size):
        priced.append((costs, label, spec, totals, sampled, batch_size))
        return 1.25

    monkeypatch.setattr(load_check, "offline_totals", offline)
    monkeypatch.setattr(load_check, "predicted_at", predicted)
    config = {"drafter": "suffix", "drafter_spec": {"kind": "suffix"}}
    assert load_check._served_prediction(context, "d", config, served, chosen, 3, 2, "costs") == 1.25
    # each served response with its end slot (the last token once more), as the logged ones get
    assert walked == [("target", "the-drafter", 3, {"q0": [4, 5, 6, 6], "q2": [7, 8, 8]})]
    sampled = pays_sampled(logged[0].sampling)        # each request's own sampling, as logged
    assert priced == [("costs", "suffix", {"kind": "suffix"}, ["totals-q0", "totals-q2"], [sampled] * 2, 2)]
    # no cost profile, or a level served at K 0: nothing to predict
    assert load_check._served_prediction(context, "d", config, served, chosen, 3, 2, None) is None
    assert load_check._served_prediction(context, "d", config, served, chosen, 0, 2, "costs") is None


def _round_trips(store, run_id: str) -> None:
    """The run's stored load check read back, as the tables hold it and as the step returns it
    (the XCom value), goes through from_json and to_json unchanged, key for key and byte for byte."""
    from sqlalchemy import select

    from tasks.db.models import LoadCheckDomain, LoadCheckLevel
    from tasks.db.queries_load import load_checks
    from tasks.steps.checks.load_check import load_check_json

    for per_request in (False, True):
        returned = json.loads(json.dumps(load_check_json(
            {"skipped": None, "domains": load_checks(store, run_id, per_request=per_request)}), default=str))
        assert returned["domains"]
        for check in returned["domains"].values():
            again = DomainLoad.from_json(check).to_json()
            assert json.dumps(again) == json.dumps(check)
            assert all(("per_request" in level) is per_request for level in check["levels"])
    with store.connect() as connection:
        domains = [dict(row) for row in connection.execute(
            select(LoadCheckDomain).where(LoadCheckDomain.run_id == run_id)).mappings()]
        levels = [dict(row) for row in connection.execute(
            select(LoadCheckLevel).where(LoadCheckLevel.run_id == run_id)).mappings()]
    for row in domains:       # the tables' rows: the records' keys, in the columns' order
        assert DomainLoad.from_json({**row, "levels": []}).to_json() == {**row, "levels": []}
        assert list(DomainLoad.from_json(row).to_json())[:-1] == list(row)
    for row in levels:
        assert LoadLevel.from_json(row).to_json() == row
        assert list(LoadLevel.from_json(row).to_json()) == list(row)


# --- on vLLM's OpenAI server: one pool of servers for the module -------------------------------
NGRAM = "prompt_lookup:max_ngram=3,min_ngram=1"
TOKENS = 48
DOMAINS = {
    # domain: (drafter label, K, schedule, requests: "count" (vLLM's n-gram drafts what the target
    # continues) or "long" (longer than the server's 512 positions: refused, a failed request))
    "count": (NGRAM, 4, [[1, 1, 4], [2, 2, 4]], ["count"] * 4),
    "crowded": (NGRAM, 4, [[1, 1, 4], [2, 2, 4]], ["count", "long", "count", "count"]),
    "overlong": (NGRAM, 4, [[1, 1, 4], [2, 2, 4]], ["long"] * 4),
    # min n-gram above max: vLLM refuses the config at start
    "refused": ("prompt_lookup:max_ngram=2,min_ngram=3", 2, [[1, 1, 2]], ["count"] * 4),
}


def _requests(domain: str, kinds: list[str]) -> list:
    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest

    out = []
    for n, kind in enumerate(kinds):
        start = 7 * n
        prompt = [(start + t) % 64 for t in range(100 if kind == "count" else 600)]
        response = [(prompt[-1] + 1 + t) % 64 for t in range(TOKENS)]
        out.append(LoggedRequest(f"{domain}-{n}", prompt, response, SamplingParams(temperature=0.0), domain))
    return out


def _finished_run(url: str, target: str) -> None:
    from tasks.db import upgrade
    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, EvalRun
    from tasks.steps.drafters.candidates import parse_candidate
    from tasks.timeutil import utcnow

    upgrade(url)
    now = utcnow()
    with ensure_ready(url).begin() as connection:
        connection.execute(EvalRun.__table__.insert().values(
            run_id="r1", created_at=now, updated_at=now, status="evaluated", target_id=target,
            target_fingerprint="sha256:test", hardware_profile="cpu"))
        for domain, (label, k, schedule, _) in DOMAINS.items():
            connection.execute(DomainConfig.__table__.insert().values(
                run_id="r1", domain=domain, enabled=True, drafter=label, k=k, k_schedule=schedule,
                max_batch_size=schedule[-1][1], status="ok", drafter_spec=parse_candidate(label),
                samples=30, reason="planned on", created_at=now))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The load check of a finished run on a tiny target (copying_llama: after x, x + 1), levels
    1 and 2, one request per level and at least the level; min_speedup so low that a level pays
    whenever it measured a speedup without a failed request."""
    from tasks.db.engine import ensure_ready
    from tasks.serving.server import ServerPool
    from tasks.steps.checks.load_check import load_check

    from .helpers.models import copying_llama, save_tiny_target

    base = tmp_path_factory.mktemp("load-check")
    target = save_tiny_target(copying_llama(vocab=64), base / "target")
    url = f"sqlite:///{base / 'specdec.db'}"
    _finished_run(url, str(target))
    requests = {domain: _requests(domain, spec[3]) for domain, spec in DOMAINS.items()}
    settings = load_settings(load_levels=(1, 2), load_requests=1,
                             load_max_tokens=TOKENS, plan_min_speedup=1e-9)
    context = SimpleNamespace(settings=settings, spec=SimpleNamespace(run_id="r1", target=str(target)),
                              engine=ensure_ready(url), store=Store.open(url, settings), url=url,
                              model=None,
                              domain_requests=lambda domain: (requests[domain], {}),
                              domain_drafters=lambda domain: {})
    with ServerPool("r1", target, dtype="float32", settings=settings, max_model_len=512,
                    directory=base / "servers") as pool:
        result = load_check(context, pool=pool)
        yield {"result": result, "url": url, "pool": pool, "context": context}
    assert all(not server.alive() for server in pool.servers.values())


@needs_server
@pytest.mark.integration
def test_two_levels_are_measured_and_metrics_counters_equal_the_per_request_sums(served):
    check = served["result"]["domains"]["count"]
    assert check.status == "ok" and check.passed is True
    assert [level.concurrency for level in check.levels] == [1, 2]
    for level in check.levels:
        assert level.failed == 0 and level.requests == level.concurrency
        assert level.plain_tokens_per_s > 0 and level.spec_tokens_per_s > 0
        assert level.spec_itl_p50_s is not None and level.spec_ttft_p95_s is not None
        # vLLM's /metrics deltas of the level equal the same requests' per-request metrics summed
        assert level.counters["drafts"] > 0 and level.counters["accepted_tokens"] > 0
        assert level.counters == level.request_sums and level.counters_equal is True
        # the target continues what the n-grams propose: E from /metrics is above 1
        assert level.engine_e > 1.0 and len(level.engine_rates) == 4
    assert check.schedule_after == check.schedule_before == [[1, 1, 4], [2, 2, 4], [3, BEYOND, 0]]
    # what vLLM measured, stored and read back, round-trips through the records' JSON unchanged
    _round_trips(served["context"].store, "r1")


@needs_server
@pytest.mark.integration
def test_a_level_that_does_not_pay_cuts_the_schedule_and_one_paying_nowhere_is_off(served):
    from tasks.registry.run_config import build_config
    from tasks.registry.vllm_export import vllm_export

    crowded = served["result"]["domains"]["crowded"]
    # level 1: its first request, served; level 2: a second one the server refuses (too long)
    assert [(level.concurrency, level.failed, level.pays) for level in crowded.levels] == [
        (1, 0, True), (2, 2, False)]
    assert crowded.status == "cut" and crowded.max_level_paying == 1
    assert "at 2 concurrent requests (2 of 4 requests failed)" in crowded.reason
    assert crowded.schedule_after == [[1, 1, 4], [2, BEYOND, 0]]
    overlong = served["result"]["domains"]["overlong"]
    assert overlong.status == "off" and overlong.passed is False
    assert overlong.reason.startswith("load check: no speedup measured at 1 concurrent request")
    # the exported config follows the measurement
    exported = vllm_export(build_config("r1", Store.open(served["url"])))["speculative_config"]
    assert exported["crowded"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, BEYOND, 0]]
    assert exported["count"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 2, 4], [3, BEYOND, 0]]
    assert exported["overlong"] is None


@needs_server
@pytest.mark.integration
def test_a_server_that_does_not_start_leaves_the_domain_off_naming_its_log(served):
    from sqlalchemy import select

    from tasks.db.models import DomainConfig

    refused = served["result"]["domains"]["refused"]
    assert refused.status == "failed" and refused.passed is False and refused.levels == ()
    assert "the config server did not start" in refused.reason and ".log" in refused.reason
    with served["context"].engine.connect() as connection:
        enabled = dict(connection.execute(select(DomainConfig.domain, DomainConfig.enabled)
                                          .where(DomainConfig.run_id == "r1")).all())
    # the other domains' results stay
    assert enabled == {"count": True, "crowded": True, "overlong": False, "refused": False}


@needs_server
@pytest.mark.integration
def test_a_server_killed_mid_level_fails_the_level_naming_its_log(served, monkeypatch):
    import signal

    import tasks.serving.load as load
    import tasks.steps.checks.load_waves as load_waves_step
    from tasks.steps.checks.load_waves import level_items, measure_domain

    pool = served["pool"]
    spec = served["result"]["domains"]["count"].speculative_config
    settings = load_settings(load_levels=(1, 2), load_requests=8, load_timeout_s=120)
    items = level_items(_requests("count", ["count"] * 8), 8, 400)
    server = pool.get(spec, **load_waves_step.SERVER)     # the server measure_domain asks the pool for
    # the kill lands when the config server has streamed its first chunk of the level: mid-level
    # for certain (a request of it is still streaming), whatever the machine's load
    streaming, killed = {}, []
    real_run_level, real_chunk_event = load_waves_step.run_level, load._chunk_event

    def run_level(level_server, *args, **kwargs):
        streaming["server"] = level_server
        return real_run_level(level_server, *args, **kwargs)

    def chunk_event(*args):
        if streaming.get("server") is server and not killed:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=60)
            killed.append(True)
        return real_chunk_event(*args)

    monkeypatch.setattr(load_waves_step, "run_level", run_level)
    monkeypatch.setattr(load, "_chunk_event", chunk_event)
    outcome = measure_domain(pool, spec, [(2, 4)], items, settings)
    assert killed                                   # the first wave (K 0) was cut mid-stream
    status, reason = outcome.failure
    assert status == "died" and outcome.levels == []
    assert "the config server died at 2 concurrent requests" in reason and str(server.log_path) in reason


def test_a_suffix_server_serves_each_level_its_own_requests_others_share_them():
    # a server that learns from what it serves (suffix decoding) would draft a request's own
    # response at the second level it is served at: each level takes the next requests, wrapping
    # round only where the domain has too few; other methods serve every level the same ones
    from tasks.steps.checks.load_waves import level_slices

    items = [{"id": f"r{n}"} for n in range(10)]
    levels = [(1, 4), (2, 4), (4, 2)]
    ids = [[item["id"] for item in chosen] for chosen in level_slices(items, levels, 3, disjoint=True)]
    assert ids == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7", "r8", "r9"]]
    ids = [[item["id"] for item in chosen] for chosen in level_slices(items[:5], levels, 3, disjoint=True)]
    assert ids == [["r0", "r1", "r2"], ["r3", "r4", "r0"], ["r1", "r2", "r3", "r4"]]
    shared = level_slices(items, levels, 3, disjoint=False)
    assert [len(chosen) for chosen in shared] == [3, 3, 4] and shared[0] == shared[1] == items[:3]


@needs_server
@pytest.mark.integration
def test_a_wave_a_neighbour_slowed_is_served_again_and_the_cleaner_one_kept(served, monkeypatch):
    # the first plain and config waves read as if a neighbour took 9 cores meanwhile: each side
    # is served again (an n-gram server drafts the same proposals twice) and the clean retry
    # kept, so the level's pairs are not marked contended
    import tasks.steps.checks.load_waves as load_waves_step
    from tasks.steps.checks.load_levels import level_row
    from tasks.steps.checks.load_waves import level_items, measure_domain

    spec = served["result"]["domains"]["count"].speculative_config
    settings = load_settings(load_levels=(1, 2), load_requests=1, load_retries=2)
    items = level_items(_requests("count", ["count"]), 1, TOKENS)
    calls = []
    real_run_level = load_waves_step.run_level

    def run_level(server, wave, *args, **kwargs):
        result = real_run_level(server, wave, *args, **kwargs)
        calls.append(wave[0]["k"])
        if len(calls) <= 2:
            result["other_cores"] = 9.0
        else:
            result["other_cores"] = 0.0
        return result

    monkeypatch.setattr(load_waves_step, "run_level", run_level)
    outcome = measure_domain(served["pool"], spec, [(1, 4)], items, settings)
    assert outcome.failure is None
    # plain and config (asking the level's K, 4), then each again once (the retries are clean:
    # no second retry)
    assert calls == [0, 4, 0, 4]
    level, k, plain, config, chosen = outcome.levels[0]
    assert (level, k, [item["id"] for item in chosen]) == (1, 4, [items[0]["id"]])
    row = level_row(level, k, plain, config)
    assert [pair["contended"] for pair in row.per_request] == [False]
    assert row.counters == row.request_sums       # the kept wave's own /metrics delta


@needs_server
@pytest.mark.integration
def test_a_level_straddling_the_bar_is_served_more_requests_until_settled_or_out_of_them(served):
    # settle says "unsure" after every look: the level takes load_requests (1) at a time up
    # to load_more_requests (2) more, each a request it did not serve yet, and stops there;
    # one that settles at the first look serves only its own
    from tasks.steps.checks.load_levels import level_row
    from tasks.steps.checks.load_waves import level_items, measure_domain

    spec = served["result"]["domains"]["count"].speculative_config
    settings = load_settings(load_requests=1, load_more_requests=2, load_retries=0)
    items = level_items(_requests("count", ["count"] * 4), 4, TOKENS)
    looked = []

    def unsure(row):
        looked.append(row.requests)
        return "unsure"

    outcome = measure_domain(served["pool"], spec, [(1, 4)], items, settings, settle=unsure)
    assert outcome.failure is None and looked == [1, 2]
    level, k, plain, config, chosen = outcome.levels[0]
    assert [item["id"] for item in chosen] == [item["id"] for item in items[:3]]
    row = level_row(level, k, plain, config)
    assert row.requests == 3 and len(row.per_request) == 3 and row.failed == 0
    assert [p["request_id"] for p in row.per_request] == [item["id"] for item in items[:3]]

    settled = measure_domain(served["pool"], spec, [(1, 4)], items, settings, settle=lambda row: "pays")
    assert [item["id"] for item in settled.levels[0][4]] == [items[0]["id"]]


def test_history_items_are_the_rows_cut_at_max_tokens_at_their_logged_sampling():
    from tasks.steps.checks.load_waves import history_items

    rows = [(SimpleNamespace(id="json-9", temperature=0.7, top_k=None, top_p=0.9), [5, 6, 7], [1] * 40),
            (SimpleNamespace(id="json-8", temperature=None, top_k=3, top_p=None), [5], [1, 2])]
    items = history_items(rows, 32)
    assert [(i["id"], i["request_id"], i["max_tokens"]) for i in items] == [
        ("history:json-9", "json-9", 32), ("history:json-8", "json-8", 2)]
    assert [(i["temperature"], i["top_k"], i["top_p"]) for i in items] == [(0.7, 0, 0.9), (0.0, 3, 1.0)]
    assert items[0]["prompt_ids"] == [5, 6, 7]


@needs_server
@pytest.mark.integration
def test_a_suffix_server_is_served_the_domains_history_at_k0_before_its_first_level(served, monkeypatch):
    # a suffix server's tree grows from what it serves: the domain's history (requests outside
    # the sample) goes first, all at once at K 0 (no drafts), then the level, the config's wave
    # first; a server of another method is served no history
    import tasks.steps.checks.load_waves as load_waves_step
    from tasks.steps.checks.load_waves import history_items, level_items, measure_domain

    suffix = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 16,
              "suffix_decoding_min_token_prob": 0.1, "suffix_decoding_max_spec_factor": 1.0}
    rows = [(SimpleNamespace(id=r.request_id, temperature=0.0, top_k=0, top_p=1.0), r.prompt_ids,
             r.response_ids) for r in _requests("old", ["count"] * 3)]
    history = history_items(rows, TOKENS)
    items = level_items(_requests("count", ["count"]), 1, TOKENS)
    settings = load_settings(load_requests=1, load_retries=0)
    calls = []
    real_run_level = load_waves_step.run_level

    def run_level(server, wave, concurrency, *args, **kwargs):
        result = real_run_level(server, wave, concurrency, *args, **kwargs)
        calls.append(([item["id"] for item in wave], [item["k"] for item in wave], concurrency,
                      result["counters"]))
        return result

    monkeypatch.setattr(load_waves_step, "run_level", run_level)
    outcome = measure_domain(served["pool"], suffix, [(1, 4)], items, settings, history=history)
    assert outcome.failure is None and outcome.history == 3
    ids, ks, concurrency, counters = calls[0]
    assert ids == ["history:old-0", "history:old-1", "history:old-2"] and ks == [0, 0, 0]
    assert concurrency == 3
    assert counters["drafts"] == 0 and counters["draft_tokens"] == 0
    assert [(c[0], c[1]) for c in calls[1:]] == [([items[0]["id"]], [4]), ([items[0]["id"]], [0])]
    assert len(outcome.levels) == 1

    calls.clear()
    spec = served["result"]["domains"]["count"].speculative_config
    outcome = measure_domain(served["pool"], spec, [(1, 4)], items, settings, history=history)
    assert outcome.failure is None and outcome.history == 0
    assert not any(i.startswith("old-") or i.startswith("history:") for c in calls for i in c[0])


@needs_server
@pytest.mark.integration
def test_a_running_server_of_the_method_at_a_larger_k_serves_a_smaller_ks_requests(served):
    # one server per drafter method: asked with share, the pool hands a running server of the
    # same method and parameters at a K at least the asked one (each request asks its K);
    # another parameter or a larger K is not covered
    from tasks.steps.checks.load_waves import SERVER

    pool = served["pool"]
    suffix = {"method": "suffix", "suffix_decoding_max_tree_depth": 16,
              "suffix_decoding_min_token_prob": 0.1, "suffix_decoding_max_spec_factor": 1.0}
    four = pool.get(dict(suffix, num_speculative_tokens=4), **SERVER)
    started = len(pool.servers)
    three = dict(suffix, num_speculative_tokens=3)
    assert pool.running(three, **SERVER, share=True) and not pool.running(three, **SERVER)
    assert pool.get(three, **SERVER, share=True) is four and len(pool.servers) == started
    assert not pool.running(dict(three, suffix_decoding_max_tree_depth=8), **SERVER, share=True)
    assert not pool.running(dict(suffix, num_speculative_tokens=5), **SERVER, share=True)
    # the one it handed is the one used last: starting another stops the others first
    assert pool.used[-1] == next(key for key, server in pool.servers.items() if server is four)


def _drawn_requests():
    """A domain's logged requests for the drawn-pricing tests: prompts ending in a repeated chunk
    (prompt lookup drafts from it), responses that copy the chunk (accepted often) or not."""
    import torch

    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest

    from .helpers.models import VOCAB

    torch.manual_seed(5)
    chunk = torch.randint(3, VOCAB, (6,)).tolist()
    ways = {"g": SamplingParams(), "a": SamplingParams(temperature=0.7, top_p=0.9),
            "b": SamplingParams(temperature=1.0)}
    rows = []
    for name, way, copies in [("g0", "g", True), ("a0", "a", False), ("a1", "a", True), ("a2", "a", True),
                              ("a3", "a", False), ("b0", "b", False), ("b1", "b", False)]:
        prompt = torch.randint(3, VOCAB, (5,)).tolist() + chunk + torch.randint(3, VOCAB, (3,)).tolist() + chunk[:2]
        response = (chunk[2:] + chunk) if copies else torch.randint(3, VOCAB, (10,)).tolist()
        rows.append(LoggedRequest(name, prompt, response + torch.randint(3, VOCAB, (6,)).tolist(), ways[way], "d"))
    return rows


def test_a_sampled_request_is_priced_at_the_mean_of_the_requests_sampled_as_it_is():
    # a greedy request is served its logged tokens again: priced along them; a sampled one draws
    # anew: priced at the mean rounds per token of the domain's requests of its way of sampling
    # (cut where the check cuts), or of all sampled ones where its way has fewer than MIN_CLASS
    from specdec_core import PromptLookup
    from tasks.steps.checks import drawn
    from tasks.steps.checks.confirm import offline_totals, truncated
    from tasks.steps.checks.engine_replay import end_slot

    from .helpers.models import tiny_llama

    target, drafter, k, cut = tiny_llama(seed=0), PromptLookup(max_ngram=3), 3, 12
    domain = _drawn_requests()
    cut_of = {r.request_id: end_slot(truncated(r, min(len(r.response_ids), cut))) for r in domain}
    asked = [cut_of["g0"], cut_of["a0"], cut_of["b0"]]
    own = offline_totals(target, drafter, asked, k)
    cache = {}
    priced = drawn.priced_totals(target, drafter, asked, domain, k, cut, cache)

    def per_token(ids):
        totals = offline_totals(target, drafter, [cut_of[i] for i in ids], k)
        return sum(t.rounds for t in totals.values()) / sum(t.tokens for t in totals.values())

    assert drawn.MIN_CLASS == 3
    assert (priced["g0"].tokens, priced["g0"].rounds) == (own["g0"].tokens, own["g0"].rounds)
    for request_id, pool in (("a0", ["a0", "a1", "a2", "a3"]),                    # 4 sampled alike
                             ("b0", ["a0", "a1", "a2", "a3", "b0", "b1"])):       # 2: all sampled
        assert priced[request_id].tokens == own[request_id].tokens
        assert priced[request_id].rounds / priced[request_id].tokens == pytest.approx(per_token(pool))
        assert priced[request_id].widths.sum() == pytest.approx(priced[request_id].rounds)
    # the copying draws of a0's way make its price better than its own draw, which copied nothing;
    # b0's way alone would be priced as its own draw, all sampled ones better, a0's way better still
    assert priced["a0"].rounds < priced["b0"].rounds < own["b0"].rounds == own["a0"].rounds
    # the pools are read once per K and cut, kept in the caller's cache
    assert list(cache) == [(k, cut)]
    again = drawn.priced_totals(target, drafter, asked, [], k, cut, cache)
    assert again["b0"].rounds == pytest.approx(priced["b0"].rounds)
    # greedy requests alone: the estimate along them, no pool read
    alone = drawn.priced_totals(target, drafter, [cut_of["g0"]], domain, k, cut, {})
    assert (alone["g0"].tokens, alone["g0"].rounds) == (own["g0"].tokens, own["g0"].rounds)


def test_the_load_checks_prediction_prices_sampled_requests_at_their_pool(monkeypatch):
    # the level's prediction (pools given) reads the domain's logged requests at the load check's
    # cut; the prediction along what vLLM served (pools None) walks the served tokens as they are
    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest
    from tasks.steps.checks import load_check

    logged = [LoggedRequest("q0", [1, 2, 3], [9, 9, 9], SamplingParams(temperature=0.7), "d")]
    settings = load_settings(load_max_tokens=24)
    context = SimpleNamespace(model="target", settings=settings, domain_requests=lambda domain: (logged, {}),
                              domain_drafters=lambda domain: {"suffix": ("spec", "the-drafter")})
    calls = []

    def priced(target, drafter, requests, domain_requests, k, max_tokens, cache):
        calls.append(("priced", domain_requests, max_tokens, cache))
        return {"q0": "pooled"}

    def offline(target, drafter, requests, k):
        calls.append(("offline",))
        return {"q0": "own"}

    monkeypatch.setattr(load_check, "priced_totals", priced)
    monkeypatch.setattr(load_check, "offline_totals", offline)
    monkeypatch.setattr(load_check, "predicted_at", lambda costs, label, spec, totals, sampled, level: totals)
    config = {"drafter": "suffix", "drafter_spec": {"kind": "suffix"}}
    pools = {}
    assert load_check._predicted(context, "d", config, logged, 3, 2, "costs", pools) == ["pooled"]
    assert calls == [("priced", logged, 24, pools)]
    assert load_check._predicted(context, "d", config, logged, 3, 2, "costs") == ["own"]
    assert calls[-1] == ("offline",)
