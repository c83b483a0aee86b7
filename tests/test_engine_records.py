"""The engine check's rows as typed records (tasks.db.engine_records): their JSON is the shape the
step returned as dicts before (each kind of row its own key set, key for key), and the stored
engine_checks rows read back into the same records."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specdec_core import SamplingParams
from specdec_core.estimate import LoggedRequest, RoundTotals
from tasks.db.domain_records import PlannedDomain
from tasks.db.engine_records import COLUMNS, ComparedRequest, EngineCheckRow, EngineRecord, ServedBy
from tasks.serving.replay_answer import ReplayAnswer, ServedRequest

CONFIG = {"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 2}
COUNTERS = {"drafts": 6, "draft_tokens": 12, "accepted_tokens": 6, "accepted_per_pos": [4, 2]}
SERVED = {"log_path": "/home/engine_checks/r1/spec-code.log", "engine_version": "0.11.0",
          "start_s": 12.5, "counters": COUNTERS, "engine_profile": "cpu-vllm"}
# one request as compare_request made it (a dict before ComparedRequest: its keys, in their order)
PER_REQUEST = [{"request_id": "q1", "greedy": True, "tokens": 5, "seconds": 0.5, "decode_s": 0.4,
                "equal_to_log": True, "first_difference": None, "engine_steps": 2, "engine_accepted": 3,
                "engine_accepted_per_pos": [2, 1], "engine_accepted_in_output": 2,
                "engine_accepted_per_pos_in_output": [2, 0], "engine_accepted_in_log": 2,
                "estimate_steps": 2.0, "estimate_accepted": 2.0, "estimate_accepted_per_pos": [2.0, 0.0],
                "counts_equal": True}]
COMPARED = {"requests": 6, "k": 2, "estimate_e": 2.0, "estimate_e_lo": 1.8, "estimate_e_hi": 2.2,
            "engine_e": 2.0, "estimate_rates": [0.7, 0.3], "engine_rates": [0.67, 0.33],
            "greedy_checked": 3, "greedy_equal": 3, "per_request": PER_REQUEST, "spec_tokens_per_s": 40.0,
            "spec_decode_tokens_per_s": 50.0, "predicted_speedup": 1.5}
PLAIN = {"plain_tokens_per_s": 20.0, "plain_decode_tokens_per_s": 25.0, "measured_speedup": 2.0}

# each kind of row, as the check returned it before the records (its key set and values)
ROWS = {
    "unsupported": {"status": "unsupported", "passed": None, "speculative_config": None,
                    "reason": "engine check: the drafter has no vLLM equivalent"},
    "engine failed": {"speculative_config": CONFIG, **SERVED, "status": "refused", "passed": False,
                      "reason": "engine check: vLLM refused the config: bad"},
    "failed, plain served": {"speculative_config": CONFIG, **SERVED, "status": "died", "passed": False,
                             "reason": "engine check: died", **PLAIN},
    "compared": {"speculative_config": CONFIG, **SERVED, **COMPARED, "status": "ok", "passed": True,
                 "reason": "engine check: vLLM E 2.00 vs estimate 2.00 [1.80, 2.20] on 6 requests at K=2"},
    "compared, plain": {"speculative_config": CONFIG, **SERVED, **COMPARED, "status": "ok", "passed": None,
                        "reason": "engine check: suffix", **PLAIN},
    "live checked": {"speculative_config": CONFIG, **SERVED, **COMPARED, "status": "below", "passed": False,
                     "reason": "engine check: on vLLM: live check: 0.70x", **PLAIN,
                     "live_check": {"verdict": "veto", "measured": 0.7, "engine": "vllm"}},
}


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_each_kind_of_row_round_trips_key_for_key(kind):
    row = ROWS[kind]
    record = EngineCheckRow.from_json(row)
    assert record.to_json() == row
    assert EngineCheckRow.from_json(record.to_json()) == record
    assert record.columns() == {column: row.get(column) for column in COLUMNS}
    if record.comparison is not None:       # its requests read back as records
        assert record.comparison.per_request == [ComparedRequest(**PER_REQUEST[0])]


def test_a_compared_request_is_the_json_compare_request_returned():
    from tasks.steps.checks.engine_compare import compare_request, inside_output

    request = LoggedRequest("q1", [1, 2, 3], [5, 6, 7, 8, 9, 10], SamplingParams(), "d")
    answer = ServedRequest(token_ids=[5, 6, 7, 8, 9, 10], seconds=1.0, drafted=[3, 0, 3, 3], accepted=[2, 0, 0, 1])
    offline = RoundTotals(tokens=0.0, rounds=4, reached=np.zeros(3), accepted=np.asarray([2.0, 1.0, 0.0]),
                          widths=np.asarray([1.0, 0.0, 0.0, 3.0]))
    row = compare_request(request, answer, offline)
    assert list(row.to_json()) == list(PER_REQUEST[0])
    assert row.to_json()["counts_equal"] is True and ComparedRequest.from_json(row.to_json()) == row
    assert row.engine_accepted_inside == inside_output(row.to_json(), "engine_accepted") == 3
    assert list(compare_request(request, answer, None).to_json()) == list(PER_REQUEST[0])


def test_the_check_builds_the_rows_it_returned_as_dicts():
    # the phases that once updated a dict in place now return new records: their JSON is the
    # old dict's, key for key
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_check import _add_plain_figures, _judged
    from tasks.steps.checks.engine_compare import domain_verdict, left_out

    rows = [ComparedRequest(request_id=f"q{i}", engine_accepted=6, engine_steps=6, engine_accepted_per_pos=[6],
                            estimate_accepted=6.0 + 0.5 * (i % 2), estimate_steps=6.0,
                            estimate_accepted_per_pos=[6.0], counts_equal=None) for i in range(6)]
    verdict = domain_verdict(rows, k=1, tolerance=0.05)
    assert set(verdict.to_json()) == {"speculative_config", "requests", "k", "estimate_e", "estimate_e_lo",
                                      "estimate_e_hi", "engine_e", "estimate_rates", "engine_rates",
                                      "greedy_checked", "greedy_equal", "per_request", "spec_tokens_per_s",
                                      "spec_decode_tokens_per_s", "predicted_speedup", "status", "passed",
                                      "reason"}
    row = replace(left_out(verdict, 2, 6, load_settings()), speculative_config=CONFIG,
                  served=ServedBy(**SERVED))
    row = replace(row, comparison=replace(row.comparison, spec_decode_tokens_per_s=50.0))
    request = LoggedRequest("q1", [1], [2, 3], SamplingParams(), "code")
    plain = {"q1": ServedRequest(token_ids=[2, 3, 4, 5, 6], seconds=1.0, decode_s=0.8)}
    figured = _add_plain_figures({"code": row}, {"code": [request]}, plain)["code"]
    assert row.plain is None                                   # the phase's input is left as it was
    out = figured.to_json()
    assert (out["plain_tokens_per_s"], out["plain_decode_tokens_per_s"], out["measured_speedup"]) == (5.0, 5.0, 10.0)
    assert out == {**row.to_json(), **out} and set(out) - set(row.to_json()) == set(PLAIN)
    vetoed = _judged(figured, {"verdict": "veto", "measured": 0.7, "reason": "on vLLM: live check: 0.70x"})
    assert vetoed.to_json() == {**out, "measured_speedup": 0.7, "status": "below", "passed": False,
                                "reason": "engine check: on vLLM: live check: 0.70x; " + out["reason"].removeprefix(
                                    "engine check: "),
                                "live_check": {"verdict": "veto", "measured": 0.7,
                                               "reason": "on vLLM: live check: 0.70x"}}


def test_stored_rows_read_back_into_the_records_they_were(db_url):
    from tasks.db.queries_registry import engine_check_rows
    from tasks.db.store import Store
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_check import _store

    store = Store.open(db_url)
    rows = {kind.replace(" ", "-").replace(",", ""): EngineCheckRow.from_json(row) for kind, row in ROWS.items()}
    on = {domain: PlannedDomain(domain=domain, reason="planned") for domain in rows}
    _store(store, "r1", on, rows, load_settings())
    stored = {row["domain"]: row for row in engine_check_rows(store, "r1")}
    assert sorted(stored) == sorted(rows)
    for domain, record in rows.items():
        assert {column: stored[domain][column] for column in COLUMNS} == record.columns()
        assert EngineCheckRow.from_json(stored[domain]).columns() == record.columns()


def test_a_runs_planned_domains_read_back_as_records(db_url):
    from tasks.db.queries_engine_checks import enabled_domains, planned_domains
    from tasks.db.store import Store

    from .helpers.registry import LABEL, SPEC, finished_run

    finished_run(db_url, "r1", {"chat": {"champion_on": True}, "code": {"enabled": False},
                                "json": {"status": "insufficient"}})
    store = Store.open(db_url)
    planned = planned_domains(store, "r1")
    assert sorted(planned) == ["chat", "code", "json"]
    assert planned["chat"] == PlannedDomain(domain="chat", enabled=True, drafter=LABEL, k=3, drafter_spec=SPEC,
                                            predicted_speedup=1.6, champion_on=True, reason="test row")
    assert planned["code"].enabled is False and planned["code"].drafter is None
    assert planned["chat"].to_json() == {"domain": "chat", "enabled": True, "drafter": LABEL, "k": 3,
                                         "drafter_spec": SPEC, "predicted_speedup": 1.6,
                                         "champion_on": True, "reason": "test row"}
    # on with a drafter and status ok only
    on, confirmed = enabled_domains(store, "r1")
    assert on == {"chat": planned["chat"]} and confirmed == {}


def test_an_engine_record_leaves_out_left_out_where_no_pair_was():
    record = {"engine": "spec-0", "domains": ["code"], "speculative_config": CONFIG, "log": "/l/spec-code.log",
              "start_s": 3.5, "status": "ok", "seconds": 40.2, "starts": 1, "mends": []}
    assert EngineRecord.from_json(record).to_json() == record
    assert EngineRecord.from_json(dict(record, left_out=2)).to_json() == dict(record, left_out=2)


# one engine's answer as the probe prints it (vllm_probe.replay), the engine dying on b0
PROBE = {"vllm": "0.11.0", "start_s": 9.0, "refused": None, "mends": ["sampler"],
         "counters": {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 3, "accepted_per_pos": [2, 1]},
         "requests": {"a0": {"token_ids": [1, 2, 3], "seconds": 0.3, "decode_s": 0.2, "drafted": [3],
                             "accepted": [1], "other_cores": 0.01, "contended": False, "served": 1,
                             "own_cores": 0.98, "slowed": False},
                      "plain::a0": {"token_ids": [1, 2, 3], "seconds": 0.5, "decode_s": 0.4, "drafted": None,
                                    "accepted": None, "other_cores": 0.5, "contended": True, "served": 2,
                                    "own_cores": 0.9, "slowed": True}},
         "left_out": ["c0"], "died": {"request": "b0", "error": "RuntimeError: boom"}}


def test_the_probes_replay_answer_is_read_once_and_summed_over_engines():
    first = ReplayAnswer.from_probe(PROBE)
    assert first.requests["plain::a0"] == ServedRequest(**PROBE["requests"]["plain::a0"])
    assert first.died == [PROBE["died"]] and first.left_out == ["c0"]
    # the engine started again after b0 serves the rest: its requests, counters, death added;
    # vLLM's version, start and mends stay the first engine's
    again = ReplayAnswer.from_probe({"vllm": "0.11.0", "start_s": 8.0, "refused": None, "mends": [], "died": None,
                                     "counters": {"drafts": 1, "draft_tokens": 3, "accepted_tokens": 3,
                                                  "accepted_per_pos": [1, 1, 1]},
                                     "requests": {"d0": {"token_ids": [4], "seconds": 0.1}}})
    total = ReplayAnswer(starts=0).then(first).then(again)
    assert (total.starts, total.start_s, total.mends, total.vllm) == (2, 9.0, ["sampler"], "0.11.0")
    assert sorted(total.requests) == ["a0", "d0", "plain::a0"] and total.died == [PROBE["died"]]
    assert total.counters == {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 6, "accepted_per_pos": [3, 2, 1]}
    served, plain = total.without_plain()
    assert sorted(served.requests) == ["a0", "d0"] and list(plain) == ["a0"] and plain["a0"].served == 2
    assert sorted(total.requests) == ["a0", "d0", "plain::a0"]      # the answer itself is left as it was
    # a request the probe answered without timings (served together): its tokens only
    assert ServedRequest.from_probe({"token_ids": [7, 8]}) == ServedRequest(token_ids=[7, 8])
