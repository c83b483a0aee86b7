"""The probe's time-paired answer as typed records (tasks.serving.paired_answer): read once where
the vLLM cost profile receives it (engine_costs._time_engines), their JSON the probe's key for
key and in its order (what the profile's check stores as each engine's timings), and the
profile's table the same from the records as from the probe's rows."""

from __future__ import annotations

import dataclasses
import json
import statistics
from types import SimpleNamespace

import pytest

from tasks.errors import ServingProbeError
from tasks.serving import environment as serving_env
from tasks.serving.paired_answer import PairedAnswer, PairedTiming
from tasks.serving.scripts import vllm_probe
from tasks.settings import load_settings
from tasks.steps.costs.engine_costs import NGRAM, VllmProfilePlan, _table, _time_engines

STEPS = 10      # decode steps of every timed batch


def _result(k: int, decode_s: float):
    """One request's result as vLLM's LLM.generate gives it (what the probe's _decode_phase reads):
    STEPS verify steps, each drafting k and accepting one of them (none at K 0), over decode_s."""
    accepted = min(k, 1)
    metrics = None if k == 0 else SimpleNamespace(per_step_drafted=[k] * STEPS,
                                                  per_step_accepted=[accepted] * STEPS)
    completion = SimpleNamespace(token_ids=list(range(1 + STEPS * (1 + accepted))), spec_decode_metrics=metrics)
    return SimpleNamespace(outputs=[completion],
                           metrics=SimpleNamespace(first_token_ts=100.0, last_token_ts=100.0 + decode_s))


def _probe_answer(steps_s: dict[int, list[float]], b: int = 1, contended=frozenset()) -> dict:
    """One engine's time-paired answer as the probe writes it (time_paired's answer, each row its
    _batch_row with the pair): a round per figure of steps_s[0], in each a pair per K > 0 (K 0
    first in even pairs), a batch at K stepping steps_s[K][round] seconds; `contended`: the pairs
    timed while other processes took CPU."""
    answer = {"vllm": "0.11.0", "start_s": None, "refused": None, "mends": [], "timings": [],
              "k_per_request": None, "stopped": None, "seconds": None}
    answer["start_s"], answer["k_per_request"] = 4.25, True
    pair = 0
    for repeat in range(len(steps_s[0])):
        for k in sorted(steps_s)[1:]:
            for at in ((0, k) if pair % 2 == 0 else (k, 0)):
                decode_s = steps_s[at][repeat] * STEPS
                other = 0.6 if pair in contended else 0.05
                row = vllm_probe._batch_row([_result(at, decode_s)] * b, b, "greedy", at, repeat,
                                            decode_s + 0.02, other, 0.25)
                answer["timings"].append(dict(row, pair=pair))
            pair += 1
    answer["stopped"], answer["seconds"] = "settled", 12.5
    answer["mends"] = ["rejection sampler: K per request"]       # _with_mends, after the command
    return answer


def test_a_time_paired_answer_reads_into_records_and_writes_back_key_for_key():
    answer = _probe_answer({0: [0.040, 0.041, 0.040], 1: [0.044, 0.045, 0.044], 2: [0.048, 0.049, 0.048]})
    record = PairedAnswer.from_json(json.loads(json.dumps(answer)))      # what run_engine returns
    assert len(record.timings) == 12 and all(isinstance(t, PairedTiming) for t in record.timings)
    assert record.to_json() == answer and record.timings_json() == answer["timings"]
    # the key order too, at every level: the stored JSON is the probe's, unchanged
    assert json.dumps(record.to_json()) == json.dumps(answer)
    assert list(record.to_json()) == list(answer)
    assert [list(t.to_json()) for t in record.timings] == [list(row) for row in answer["timings"]]
    assert PairedAnswer.from_json(record.to_json()) == record
    first = record.timings[0]
    assert (first.batch_size, first.sampling, first.k, first.repeat, first.pair) == (1, "greedy", 0, 0, 0)
    assert first.step_s == pytest.approx(0.040) and first.pair_key == 0 and not first.contended
    assert record.timings[1].drafted == STEPS * 1 and record.timings[1].steps == STEPS
    assert (record.vllm, record.start_s, record.k_per_request, record.stopped) == ("0.11.0", 4.25, True, "settled")
    assert record.repeats == 3 and record.contended_pairs == 0
    assert record.groups() == {(1, "greedy"): [0, 1, 2]}
    assert PairedAnswer.from_json(_probe_answer({0: [0.04] * 3, 1: [0.05] * 3}, contended={0, 2})).contended_pairs == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.stopped = "budget"


def test_a_refused_answer_and_an_earlier_probes_rows_write_back_as_they_came():
    refused = {"vllm": "0.11.0", "start_s": None, "refused": "ValueError: bad | config", "mends": [],
               "timings": [], "k_per_request": None, "stopped": None, "seconds": None}
    record = PairedAnswer.from_json(refused)
    assert record.to_json() == refused and list(record.to_json()) == list(refused)
    assert record.repeats == 0 and record.contended_pairs == 0 and record.groups() == {}
    # an earlier probe's row has no pair: paired by its repeat, and written back without one
    row = {key: value for key, value in _probe_answer({0: [0.04], 1: [0.05]})["timings"][1].items()
           if key != "pair"}
    timing = PairedTiming.from_json(row)
    assert timing.pair is None and timing.pair_key == row["repeat"]
    assert timing.to_json() == row and list(timing.to_json()) == list(row)
    # a row without a key the profile reads is refused, as the dict's KeyError did
    with pytest.raises(TypeError):
        PairedTiming.from_json({key: value for key, value in row.items() if key != "decode_s"})


def test_the_profiles_table_from_the_records_is_the_one_from_the_probes_rows():
    settings = load_settings()
    steps_s = {0: [0.040, 0.041, 0.0395, 0.040], 1: [0.044, 0.046, 0.0435, 0.0445],
               2: [0.050, 0.051, 0.049, 0.0502]}
    answer = _probe_answer(steps_s, contended={3})          # round 1's K 2 pair
    record = PairedAnswer.from_json(json.loads(json.dumps(answer)))
    runs = [(NGRAM, {}, None, [1, 2])]
    table, reasons, notes = _table({NGRAM: record}, runs, 2, [1], 2, settings)
    # before the records, _table read the probe's rows: the target step the median of their K 0
    # steps, verify(K) that step times the median of the probe's own paired ratios over them (the
    # clean pairs: every step drafted K, so no share of plain steps to solve for)
    rows = answer["timings"]
    step = statistics.median(row["decode_s"] / row["steps"] for row in rows if row["k"] == 0)
    assert table.target_step[1] == pytest.approx(step, rel=1e-12)
    for k in (1, 2):
        ratios = vllm_probe.paired_ratios(rows, (1, "greedy"), k, slack=settings.profile.slowed)
        assert len(ratios) == (4 if k == 1 else 3)           # the contended pair left out
        assert table.verify[1][k] == pytest.approx(step * statistics.median(ratios), rel=1e-12)
    assert reasons == []
    # the same table from the record read back from the JSON the profile stores
    again, again_reasons, again_notes = _table({NGRAM: PairedAnswer.from_json(record.to_json())}, runs, 2,
                                               [1], 2, settings)
    assert (again.target_step, again.verify, again.spread, again_reasons, again_notes) == (
        table.target_step, table.verify, table.spread, reasons, notes)


def _plan(tmp_path) -> VllmProfilePlan:
    return VllmProfilePlan(model_dir=tmp_path, dtype="float32", context=64, sizes=[1], ks=[1],
                           sampled_sizes=[1], runs=[(NGRAM, {"method": "ngram"}, None, [1])],
                           lookups=set(), base={})


def _serve(monkeypatch, answer: dict) -> list[str]:
    """The serving environment answering `answer` to the profile (the commands asked: returned)."""
    asked = []

    def run_engine(request, log_path, timeout_s, what, settings=None, command="replay", threads=None):
        asked.append(command)
        return json.loads(json.dumps(answer))

    monkeypatch.setattr(serving_env, "run_engine", run_engine)
    monkeypatch.setattr(serving_env, "free_cpus",
                        lambda count=None: {"cpus": [0], "others": 0.0, "spare": 0, "bind": None})
    return asked


def test_the_profile_reads_the_answer_once_and_stores_the_probes_rows_as_it_wrote_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    answer = _probe_answer({0: [0.040, 0.041], 1: [0.044, 0.045]}, contended={1})
    asked = _serve(monkeypatch, answer)
    answers, engines = _time_engines("paired-run", _plan(tmp_path), load_settings(), progress=False)
    assert asked == ["time-paired"] and answers == {NGRAM: PairedAnswer.from_json(answer)}
    [engine] = engines
    assert json.dumps(engine["timings"]) == json.dumps(answer["timings"])
    assert (engine["start_s"], engine["mends"], engine["repeats"], engine["contended"], engine["stopped"]) == (
        4.25, answer["mends"], 2, 1, "settled")
    # vLLM's refusal, and an engine without K per request, are said as before
    _serve(monkeypatch, dict(answer, refused="ValueError: bad", timings=[]))
    with pytest.raises(ServingProbeError, match="refused the config: ValueError: bad"):
        _time_engines("paired-run", _plan(tmp_path), load_settings(), progress=False)
    _serve(monkeypatch, dict(answer, k_per_request=False))
    with pytest.raises(ServingProbeError, match="no K per request"):
        _time_engines("paired-run", _plan(tmp_path), load_settings(), progress=False)
