"""The engine check's comparison and gate (tasks.steps.checks.engine_check) without an engine: vLLM's per-step
counts against the estimate's expected rounds, the tolerance, and the skip without a serving
environment. The check against the real vLLM is in test_vllm_serving.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specdec_core import SamplingParams
from specdec_core.estimate import LoggedRequest, RoundTotals
from tasks.db.domain_records import PlannedDomain
from tasks.db.engine_records import ComparedRequest
from tasks.db.store import Store
from tasks.serving.replay_answer import ServedRequest
from tasks.steps.checks.engine_check import engine_check
from tasks.steps.checks.engine_compare import compare_request, domain_verdict
from tasks.steps.checks.engine_replay import batch_one_k


def _request(response, greedy=True):
    return LoggedRequest("q1", [1, 2, 3], response, SamplingParams(temperature=0.0 if greedy else 0.7), "d")


def _totals(accepted, rounds, widths):
    return RoundTotals(tokens=0.0, rounds=rounds, reached=np.zeros(len(accepted)),
                       accepted=np.asarray(accepted, float), widths=np.asarray(widths, float))


def test_batch_one_k_reads_the_schedule():
    assert batch_one_k({"num_speculative_tokens": 4}) == 4
    assert batch_one_k({"num_speculative_tokens": 4,
                        "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 4], [9, 1 << 20, 0]]}) == 3


def test_compare_request_counts_drafted_steps_only():
    response = [5, 6, 7, 8, 9, 10]
    # vLLM: 3 verify steps had drafts (2 accepted, then 0, then 1), one step none
    answer = ServedRequest(token_ids=response, seconds=1.0, drafted=[3, 0, 3, 3], accepted=[2, 0, 0, 1])
    # the estimate: 4 rounds, one of them without drafts (width 0), accepted 2 / 1 at positions 0 / 1
    offline = _totals([2, 1, 0], rounds=4, widths=[1, 0, 0, 3])
    row = compare_request(_request(response), answer, offline)
    assert row.engine_steps == 3 and row.engine_accepted == 3
    assert row.engine_accepted_per_pos == [2, 1, 0]
    assert row.estimate_steps == 3 and row.estimate_accepted == 3
    assert row.equal_to_log and row.counts_equal is True
    # one accepted draft more on vLLM's side: a mismatch, named by the request
    row = compare_request(_request(response), replace(answer, accepted=[3, 0, 0, 1]), offline)
    assert row.counts_equal is False
    # an output that departs from the log: reported at its first differing position, not compared
    row = compare_request(_request(response), replace(answer, token_ids=[5, 6, 0, 8, 9, 10]), offline)
    assert row.first_difference == 2 and row.counts_equal is None
    # a sampled request is compared in expectation only
    assert compare_request(_request(response, greedy=False), answer, offline).counts_equal is None


def _rows(engine_accepted, estimate_accepted, steps=10, n=8):
    return [ComparedRequest(request_id=f"q{i}", engine_accepted=engine_accepted, engine_steps=steps,
                            engine_accepted_per_pos=[engine_accepted],
                            estimate_accepted=estimate_accepted + 0.5 * (i % 2), estimate_steps=float(steps),
                            estimate_accepted_per_pos=[estimate_accepted], counts_equal=None) for i in range(n)]


def test_gate_fails_a_domain_below_the_interval_beyond_the_tolerance():
    fine = domain_verdict(_rows(6, 6), k=1, tolerance=0.05)
    assert fine.passed is True and fine.status == "ok"
    assert fine.comparison.engine_e == pytest.approx(1.6)
    assert fine.comparison.estimate_e_lo <= fine.comparison.estimate_e <= fine.comparison.estimate_e_hi
    low = domain_verdict(_rows(2, 6), k=1, tolerance=0.05)
    assert low.passed is False and low.status == "below"
    assert "engine_check_tolerance" in low.reason and "1.20" in low.reason
    # within the tolerance under the interval: passes
    edge = domain_verdict(_rows(6, 6), k=1, tolerance=0.05)
    lo = edge.comparison.estimate_e_lo
    just = domain_verdict(_rows(round((lo * 0.97 - 1) * 10), 6), k=1, tolerance=0.05)
    assert just.comparison.engine_e < lo and just.passed is True
    assert "| d | below |" in engine_section([{"domain": "d", **low.to_json()}])


def engine_section(rows: list[dict]) -> str:
    """The version page's engine-check section (tasks.registry.run_view) of these rows."""
    from tasks.registry.config_schema import DomainSetting, DrafterSpec, SpecdecConfig
    from tasks.registry.run_view import RunView, engine_markdown

    config = SpecdecConfig(target={"id": "t", "fingerprint": "sha256:0"}, hardware_profile="hw",
                           run_id="r", created_at="2026-01-01T00:00:00Z",
                           domains={"d": DomainSetting(enabled=True, k=1, drafter=DrafterSpec(kind="suffix"))})
    return engine_markdown(RunView("r", config, [], rows, None, [], None, 1.1, 0.25, 1.2))


def test_no_serving_environment_skips_with_how_to_make_one(db_url, tmp_path):
    from tasks.errors import ServingEnvUnavailable
    from tasks.settings import load_settings

    missing = str(tmp_path / "nowhere" / "python")
    result = engine_check("r1", "smollm2-135m-instruct", None, {}, {}, Store.open(db_url),
                          settings=load_settings(engine_serving_python=missing))
    assert result["skipped"] and "make serving-env" in result["skipped"] and not result["domains"]
    with pytest.raises(ServingEnvUnavailable, match="make serving-env"):
        engine_check("r1", "smollm2-135m-instruct", None, {}, {}, Store.open(db_url),
                     settings=load_settings(engine_serving_python=missing, engine_check_required=True))


def test_drafts_vllm_accepts_past_the_response_are_left_out():
    from specdec_core.drafters import PromptLookup

    from tasks.steps.checks.engine_compare import engine_walk

    # the prompt repeats: after the first answer token, lookup proposes the next three, and
    # vLLM (K = 3 whatever max_tokens leaves) accepts all three, the last one past the response
    prompt, output = [1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3]
    drafter = PromptLookup(max_ngram=3, min_ngram=1)
    assert engine_walk(prompt, output, [3], [3], drafter, 3) == [1]
    assert engine_walk(prompt, output, [2], [2], drafter, 3) is None     # another proposal length
    answer = ServedRequest(token_ids=output, seconds=1.0, drafted=[3], accepted=[3])
    offline = _totals([1, 1, 0], rounds=1, widths=[0, 0, 1, 0])         # the estimate: 2 in the log
    request = LoggedRequest("q1", prompt, output, SamplingParams(), "d")
    row = compare_request(request, answer, offline, exact=True, drafter=drafter, k=3)
    assert row.engine_accepted == 3 and row.engine_accepted_in_log == 2
    assert row.counts_equal is True


def test_drafts_a_model_drafter_had_accepted_past_the_response_are_left_out():
    """A model drafter (eagle3, draft_model) drafts at every step, so vLLM's steps lie one after
    the other along the output; drafts accepted past its end are not compared (json-0026 of
    eagle3_vllm.md: 33 accepted on vLLM against the estimate's 32, one past the 48th token)."""
    from specdec_core.drafters import DraftModel

    from .helpers.models import tiny_llama
    from tasks.steps.checks.engine_compare import contiguous_steps

    # 6 tokens: the prefill's, then steps at 1 (2 accepted + its own: 1..3) and at 4 (3 accepted
    # drafts, of which 4 and 5 are in the output and the third past it)
    output = [5, 6, 7, 8, 9, 10]
    assert contiguous_steps(6, [3, 3], [2, 3]) == [1, 4]
    assert contiguous_steps(6, [3, 3], [2, 0]) is None          # steps end before the output does
    assert contiguous_steps(6, [3, 3, 3], [2, 3, 0]) is None    # a step starts past its end
    assert contiguous_steps(6, [3, 0], [2, 0]) is None          # a step without drafts
    drafter = DraftModel(tiny_llama(layers=1))
    answer = ServedRequest(token_ids=output, seconds=1.0, drafted=[3, 3], accepted=[2, 3])
    offline = _totals([2, 2, 0], rounds=2, widths=[0, 0, 0, 2])
    row = compare_request(_request(output), answer, offline, exact=True, drafter=drafter, k=3)
    assert row.engine_accepted == 5 and row.engine_accepted_in_log == 4
    assert row.counts_equal is True
    assert row.engine_accepted_in_output == 4
    assert (row.engine_accepted_per_pos, row.engine_accepted_per_pos_in_output) == ([2, 2, 1], [2, 2, 0])
    # E and the per-position rates compare the drafts inside the output with the estimate's:
    # 1 + 4 / 2 on both sides (vLLM's own count would give 3.5)
    verdict = domain_verdict([row], k=3, tolerance=0.0).comparison
    assert verdict.engine_e == pytest.approx(3.0) == verdict.estimate_e
    assert verdict.engine_rates == pytest.approx([1.0, 1.0, 0.0]) == verdict.estimate_rates
    # a sampled request is placed and counted the same way (its counts are not compared one by one)
    sampled = compare_request(_request(output, greedy=False), answer, offline, exact=True, drafter=drafter, k=3)
    assert sampled.engine_accepted_in_output == 4 and sampled.counts_equal is None
    # where vLLM does not propose what ours does (suffix), nothing is placed: vLLM's own count
    other = compare_request(_request(output), answer, offline, exact=False, drafter=drafter, k=3)
    assert other.engine_accepted_in_output is None
    assert domain_verdict([other], k=3, tolerance=0.0).comparison.engine_e == pytest.approx(3.5)
    # without the drafter (nothing to place the steps by) the raw count is compared: a mismatch
    assert compare_request(_request(output), answer, offline, exact=True).counts_equal is False
    # one accepted draft more inside the output is still a mismatch
    more = replace(answer, token_ids=output + [11], accepted=[2, 3])
    longer = compare_request(_request(output + [11]), more, offline, exact=True, drafter=drafter, k=3)
    assert longer.engine_accepted_in_log == 5 and longer.counts_equal is False


def test_a_registered_checkpoint_is_fetched_before_the_engine_loads_it(monkeypatch):
    from tasks.steps.checks import engine_compare, engine_replay
    from tasks.steps.drafters import draft_training

    fetched = []

    def resolve(uri, registry=None):
        fetched.append(uri)
        return f"/home/drafts/{uri.removeprefix('models:/')}"
    monkeypatch.setattr(draft_training, "resolve_model_uri", resolve)
    spec = {"method": "eagle3", "model": "models:/tiny-eagle3/2", "num_speculative_tokens": 3}
    assert engine_replay.local_spec(spec) == dict(spec, model="/home/drafts/tiny-eagle3/2")
    assert spec["model"] == "models:/tiny-eagle3/2"              # the exported config keeps the URI
    # a directory, a method without a model and no speculation: as they are, nothing fetched
    local = {"method": "draft_model", "model": "/ckpt/draft", "num_speculative_tokens": 2}
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_replay.local_spec(local) == local and engine_replay.local_spec(ngram) == ngram
    assert engine_replay.local_spec(None) is None
    assert fetched == ["models:/tiny-eagle3/2"]
    assert "eagle3" in engine_compare.EXACT_METHODS


def _served(rows: dict) -> dict:
    """{request id: ServedRequest} of the probe's JSON rows."""
    return {key: ServedRequest.from_probe(row) for key, row in rows.items()}


def test_a_run_planned_on_vllm_is_vetoed_by_vllms_own_speedup():
    # the live check of a run planned on vLLM's costs: the replayed requests' decode phases on
    # vLLM, judged by confirm's rule (one rule for both engines)
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_check import vllm_live_check

    requests = [LoggedRequest(f"q{i}", [1, 2, 3], [4, 5], SamplingParams(), "d") for i in range(6)]
    plain = _served({r.request_id: {"token_ids": list(range(33)), "decode_s": 1.0, "seconds": 1.1}
                     for r in requests})

    def served(decode_s):
        return _served({r.request_id: {"token_ids": list(range(33)), "decode_s": decode_s + i * 0.01,
                                       "seconds": decode_s + 0.1} for i, r in enumerate(requests)})

    config = PlannedDomain(domain="d", enabled=True, champion_on=False, predicted_speedup=1.5)
    settings = load_settings({}, plan_min_speedup=1.1)
    slow = vllm_live_check("d", config, requests, served(1.25), plain, 1.5, settings)
    assert slow["verdict"]["verdict"] == "veto" and slow["verdict"]["engine"] == "vllm"
    assert slow["verdict"]["reason"].startswith("on vLLM: live check: 0.7")
    assert "slower than plain decoding" in slow["verdict"]["reason"]
    assert len(slow["per_request"]) == 6 and slow["verdict"]["requests"] == 6
    fast = vllm_live_check("d", config, requests, served(0.5), plain, 1.5, settings)
    assert fast["verdict"]["verdict"] == "pass" and fast["verdict"]["lo"] > 1.1
    # on in the champion: the same measurement is a flag (the live_check gate fails), not a veto
    kept = vllm_live_check("d", replace(config, champion_on=True), requests, served(1.25), plain, None, settings)
    assert kept["verdict"]["verdict"] == "flag"
    # no timings of one engine: no verdict
    assert vllm_live_check("d", config, requests, served(0.5), {}, None, settings) is None


def test_vllms_live_check_leaves_out_pairs_a_neighbour_reached_while_five_clean_ones_remain():
    # busy 2's code: two of eight plain twins ran while a neighbour took a core, so their plain
    # decode read 3x slower and the point fell under plain; judged on the six clean pairs it
    # passes, and the reason says how many pairs were left out
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_check import vllm_live_check

    requests = [LoggedRequest(f"q{i}", [1, 2, 3], [4, 5], SamplingParams(), "d") for i in range(8)]
    slowed = {"q0", "q1"}
    plain = _served({r.request_id: {"token_ids": list(range(33)), "seconds": 1.1,
                                    "decode_s": 0.3 if r.request_id in slowed else 1.0,
                                    "contended": False} for r in requests})
    spec = _served({r.request_id: {"token_ids": list(range(33)), "seconds": 1.0,
                                   "decode_s": (3.0 if r.request_id in slowed else 0.7) + 0.01 * i,
                                   "contended": r.request_id in slowed}
                    for i, r in enumerate(requests)})
    config = PlannedDomain(domain="d", enabled=True, champion_on=False, predicted_speedup=1.4)
    settings = load_settings({}, plan_min_speedup=1.1)
    live = vllm_live_check("d", config, requests, spec, plain, 1.4, settings)
    verdict = live["verdict"]
    assert verdict["verdict"] == "pass" and verdict["requests"] == 6 and verdict["contended"] == 2
    assert verdict["lo"] > 1.3 and "2 of 8 pairs contended, left out" in verdict["reason"]
    assert sum(row["contended"] for row in live["per_request"]) == 2
    # with every pair contended there is nothing cleaner to judge on: all are used, and said
    spec = {key: replace(row, contended=True) for key, row in spec.items()}
    crowded = vllm_live_check("d", config, requests, spec, plain, 1.4, settings)
    assert crowded["verdict"]["requests"] == 8
    assert "8 of 8 pairs contended, all used: too few clean ones" in crowded["verdict"]["reason"]
    assert crowded["verdict"]["measured"] < 1.0


def test_vllms_live_check_leaves_out_pairs_with_a_slowed_twin_as_it_does_contended_ones():
    # the probe marks a twin "slowed" (a step over profile_slowed past its K's fastest) where
    # /proc saw no neighbour: busy 1's json, three plain twins and four config twins stalled
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_check import vllm_live_check

    requests = [LoggedRequest(f"q{i}", [1, 2, 3], [4, 5], SamplingParams(), "d") for i in range(8)]
    plain = _served({r.request_id: {"token_ids": list(range(47)), "seconds": 2.0,
                                    "decode_s": 4.5 if i < 2 else 1.8 + 0.01 * i,
                                    "contended": False, "slowed": i < 2}
                     for i, r in enumerate(requests)})
    spec = _served({r.request_id: {"token_ids": list(range(47)), "seconds": 1.0,
                                   "decode_s": 0.6 + 0.01 * i, "contended": False, "slowed": False}
                    for i, r in enumerate(requests)})
    config = PlannedDomain(domain="d", enabled=True, champion_on=False, predicted_speedup=2.5)
    settings = load_settings({}, plan_min_speedup=1.1)
    live = vllm_live_check("d", config, requests, spec, plain, 2.5, settings)
    assert [row["contended"] for row in live["per_request"]] == [True, True] + [False] * 6
    verdict = live["verdict"]
    assert verdict["requests"] == 6 and verdict["contended"] == 2
    # judged on the six unmarked pairs: about 1.8 / 0.65, not pulled up by the stalled twins
    assert 2.6 < verdict["measured"] < 3.0 and verdict["hi"] < 3.0


def test_where_the_check_cannot_run_the_own_engine_sampling_test_gates_again(db_url, tmp_path):
    # validation let the own-engine sampling test pass unread, trusting the test on vLLM; when the
    # engine check then cannot run, a domain whose own test failed is marked failed after all
    from sqlalchemy import insert, select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, Validation
    from tasks.settings import load_settings
    from tasks.timeutil import utcnow

    engine = ensure_ready(db_url)
    now = utcnow()
    with engine.begin() as connection:
        for domain, passed in (("json", False), ("code", True)):
            connection.execute(insert(DomainConfig).values(
                run_id="r1", domain=domain, enabled=True, status="ok", drafter="prompt_lookup", k=2,
                validation="passed", promotable=True, created_at=now))
            connection.execute(insert(Validation).values(
                run_id="r1", check_name="sampling", domain=domain, passed=passed, created_at=now))
    result = engine_check("r1", "smollm2-135m-instruct", None, {}, {}, Store.open(db_url),
                          settings=load_settings(engine_serving_python=str(tmp_path / "none" / "python")))
    assert result["skipped"] and result["sampling"] == {}
    with engine.connect() as connection:
        rows = {r.domain: r for r in connection.execute(select(DomainConfig))}
    assert (rows["json"].validation, rows["json"].promotable) == ("failed", False)
    assert (rows["code"].validation, rows["code"].promotable) == ("passed", True)


def test_a_deferred_sampling_test_runs_nothing_and_leaves_no_earlier_try_behind(db_url):
    # where vLLM's test gates, the validate step defers ours for a domain on: nothing is drawn,
    # and a test stored by an earlier try of the same run id is removed (the engine check's
    # fallback would otherwise take it for this try's); a domain off is still "not needed"
    from sqlalchemy import insert, select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import Validation
    from tasks.steps.checks.validate import validate_domain
    from tasks.timeutil import utcnow

    from .helpers.registry import finished_run

    finished_run(db_url, "r1", {"json": {}, "chat": {"enabled": False}})
    engine = ensure_ready(db_url)
    with engine.begin() as connection:
        for domain in ("json", "chat"):
            connection.execute(insert(Validation).values(run_id="r1", check_name="sampling", domain=domain,
                                                         passed=True, created_at=utcnow()))
    store = Store.open(db_url)
    # no target, drafters or requests: a test that ran would fail on them
    assert validate_domain("r1", "json", None, {}, [], store, defer=True)["validation"] == "deferred"
    assert validate_domain("r1", "chat", None, {}, [], store, defer=True)["validation"] == "not_needed"
    with engine.connect() as connection:
        assert connection.execute(select(Validation).where(Validation.check_name == "sampling")).all() == []


def test_where_vllms_test_cannot_take_a_domain_ours_runs_then_and_gates(db_url, tmp_path, monkeypatch):
    # the validate step left our sampling test to vLLM's; the engine check cannot run, so ours
    # runs now for each domain on without one (json) -- not for one that has it (code), nor
    # for one that is off (qa) -- and a failure there makes the domain unpromotable
    from sqlalchemy import insert, select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, Validation
    from tasks.settings import load_settings
    from tasks.steps.checks import engine_validate
    from tasks.timeutil import utcnow

    engine = ensure_ready(db_url)
    now = utcnow()
    with engine.begin() as connection:
        for domain, enabled in (("json", True), ("code", True), ("qa", False)):
            connection.execute(insert(DomainConfig).values(
                run_id="r1", domain=domain, enabled=enabled, status="ok", drafter="prompt_lookup", k=2,
                validation="passed" if enabled else "not_needed", promotable=enabled, created_at=now))
        connection.execute(insert(Validation).values(
            run_id="r1", check_name="sampling", domain="code", passed=True, created_at=now))
    tested = []

    def own_test(run_id, domain, target, drafters, requests, store, settings=None):
        tested.append((run_id, domain, target, drafters, requests))
        with store.transaction() as tx:
            tx.execute(insert(Validation).values(run_id=run_id, check_name="sampling", domain=domain,
                                                 passed=False, created_at=utcnow()))

    monkeypatch.setattr(engine_validate, "validate_domain", own_test)
    drafters = {d: {f"pl-{d}": ("spec", "drafter")} for d in ("json", "code")}
    result = engine_check("r1", "smollm2-135m-instruct", "target", drafters,
                          {"json": ["json-1"], "code": ["code-1"], "qa": ["qa-1"]}, Store.open(db_url),
                          settings=load_settings(engine_serving_python=str(tmp_path / "none" / "python")))
    assert result["skipped"]
    assert tested == [("r1", "json", "target", drafters["json"], ["json-1"])]
    with engine.connect() as connection:
        rows = {r.domain: r for r in connection.execute(select(DomainConfig))}
    assert (rows["json"].validation, rows["json"].promotable) == ("failed", False)
    assert (rows["code"].validation, rows["code"].promotable) == ("passed", True)


def test_engine_validate_refuses_what_it_cannot_serve_before_starting_anything(db_url, capsys):
    from sqlalchemy import insert

    from tasks.cli.app import main
    from tasks.db.engine import ensure_ready
    from tasks.db.models import EvalRun
    from tasks.timeutil import utcnow

    now = utcnow()
    with ensure_ready(db_url).begin() as connection:
        connection.execute(insert(EvalRun).values(run_id="r1", created_at=now, updated_at=now,
                                                  status="evaluated", target_id="tiny"))
    assert main(["engine", "validate", "nosuch", "--url", db_url]) == 2
    assert "run nosuch does not exist" in capsys.readouterr().err
    assert main(["engine", "validate", "r1", "--url", db_url, "--speculative-config", "{bad"]) == 2
    assert "--speculative-config is not JSON" in capsys.readouterr().err
    assert main(["engine", "validate", "r1", "--url", db_url, "--speculative-config", "[4]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_which_engines_costs_plan_a_run(tmp_path):
    # auto: vLLM's where the engine check is on, a serving environment exists and it can serve the
    # target (the embedded default or a transformers directory); the setting forces either
    from tasks.serving import environment as serving_env
    from tasks.settings import load_settings
    from tasks.steps.costs.engine_costs import plans_on_vllm

    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    auto = load_settings({}, engine_serving_python=str(python))
    assert plans_on_vllm(auto, "smollm2-135m-instruct") and plans_on_vllm(auto, str(tmp_path / "model"))
    assert not plans_on_vllm(auto, "org/some-hf-id")               # not servable here: our engine
    assert not plans_on_vllm(load_settings({}, engine_serving_python=str(tmp_path / "none")),
                             "smollm2-135m-instruct")
    assert not plans_on_vllm(load_settings({}, engine_serving_python=str(python), engine_check=False),
                             "smollm2-135m-instruct")
    assert plans_on_vllm(load_settings({}, plan_engine="vllm"), "org/some-hf-id")
    assert not plans_on_vllm(load_settings({}, engine_serving_python=str(python), plan_engine="specdec"),
                             "smollm2-135m-instruct")
    assert serving_env.servable("SmolLM2-135M-Instruct")


def test_each_domain_is_served_by_its_methods_one_deployment_at_the_largest_k():
    # the sampling test and the load check take their servers from here: one per drafter
    # method (and parameters other than K), as the replay and production serve them
    from tasks.registry.vllm_export import deployment_specs

    suffix = {"method": "suffix", "suffix_decoding_max_tree_depth": 24}
    ngram = {"method": "ngram", "prompt_lookup_max": 3}
    servers = deployment_specs({
        "chat": dict(suffix, num_speculative_tokens=4), "json": dict(suffix, num_speculative_tokens=7),
        "code": dict(ngram, num_speculative_tokens=5, num_speculative_tokens_per_batch_size=[[1, 2, 5], [3, 8, 2]]),
        "qa": dict(suffix, suffix_decoding_max_tree_depth=8, num_speculative_tokens=2), "off": None})
    assert servers == {"chat": dict(suffix, num_speculative_tokens=7), "json": dict(suffix, num_speculative_tokens=7),
                       "code": dict(ngram, num_speculative_tokens=5),
                       "qa": dict(suffix, suffix_decoding_max_tree_depth=8, num_speculative_tokens=2),
                       "off": None}


def test_a_suffix_engines_history_is_every_planned_domains_traffic_at_k_0():
    # vLLM keeps one suffix tree for all requests: the history is each planned domain's (the
    # off ones too) requests that are not replayed, all at K 0, so that the tree is the same
    # whatever the plan turned on and at whatever K; an ngram engine has none
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_replay import EngineRun, replay_history

    requests = {d: [LoggedRequest(f"{d}-{n}", [1, 2, 3], [4, 5, 6], SamplingParams(temperature=0.7), d)
                    for n in range(4)] for d in ("json", "chat", "code")}
    picked = {"json": requests["json"][:1], "code": requests["code"][:2]}       # chat: off
    settings = load_settings(engine_check_history=2)
    suffix = EngineRun("spec-0", {"method": "suffix", "num_speculative_tokens": 4}, ["code", "json"])
    history = replay_history(suffix, picked, requests, settings)
    assert [item["id"] for item in history] == ["chat-0", "chat-1", "code-2", "code-3", "json-1", "json-2"]
    assert {item["k"] for item in history} == {0} and history[0]["temperature"] == pytest.approx(0.7)
    ngram = EngineRun("spec-1", {"method": "ngram", "num_speculative_tokens": 4}, ["code"])
    assert replay_history(ngram, picked, requests, settings) == []


def test_configs_differing_in_k_only_share_one_engine_each_request_asking_its_domains_k():
    # one deployment per drafter method serves every domain at its own K: the check replays
    # them the same way, on one engine started as that deployment (its largest K), each request
    # asking its domain's K
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_check import _plan_check
    from tasks.steps.checks.engine_replay import PLAIN, paired_items

    suffix = {"method": "suffix", "suffix_decoding_max_tree_depth": 24}
    exported = {"unsupported": {}, "speculative_config": {
        "chat": dict(suffix, num_speculative_tokens=8),
        "json": dict(suffix, num_speculative_tokens=7),
        "summarize": dict(suffix, num_speculative_tokens=4),
        "code": {"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 8}}}
    requests = {d: [LoggedRequest(f"{d}-{n}", [1, 2, 3], [4, 5, 6], SamplingParams(), d) for n in range(2)]
                for d in exported["speculative_config"]}
    plan = _plan_check({d: PlannedDomain(domain=d) for d in requests}, {}, exported, requests, load_settings())
    assert sorted((run.spec["method"], run.domains) for run in plan.engines) == [
        ("ngram", ["code"]), ("suffix", ["chat", "json", "summarize"])]
    run = next(run for run in plan.engines if run.spec["method"] == "suffix")
    assert run.spec == dict(suffix, num_speculative_tokens=8)
    assert [run.spec_of(d)["num_speculative_tokens"] for d in run.domains] == [8, 7, 4]
    items = paired_items([(0, requests["chat"][0], 8), (0, requests["json"][0], 7)])
    assert [(item["id"], item.get("k")) for item in items] == [
        ("chat-0", 8), (PLAIN + "chat-0", 0), ("json-0", 7), (PLAIN + "json-0", 0)]
