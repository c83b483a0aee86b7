"""The export and the n-gram estimate against the real vLLM, in the serving environment
(`make serving-env`; vLLM's CPU build in its own virtual environment, driven as a process).

Skipped when there is no serving environment, unless SPECDEC_REQUIRE_SERVING=1 (.ci/run sets it):
then its absence is a failure."""

from __future__ import annotations

import os

import numpy as np
import pytest

from specdec_core.drafters import find_continuation
from specdec_core.lookup import lookup_batch
from tasks.db.store import Store
from tasks.serving import environment as serving_env
from tasks.registry.config_schema import parse_config
from tasks.registry.vllm_export import vllm_export

from .helpers import PASSING_ALPHA
from .helpers.models import save_tiny_target, tiny_llama

REQUIRED = os.environ.get("SPECDEC_REQUIRE_SERVING") == "1"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not REQUIRED and not serving_env.available(),
                                 reason="no serving environment (make serving-env); `make test-all` "
                                        "and CI build one and set SPECDEC_REQUIRE_SERVING=1")]


@pytest.fixture(scope="module")
def serving():
    # required (CI): a missing environment fails here with how to make one
    return serving_env.probe("versions", {}, timeout_s=300)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # vLLM needs a head size it has kernels for: 4 heads of 32
    return save_tiny_target(tiny_llama(vocab=256, hidden=128, heads=4, layers=2),
                            tmp_path_factory.mktemp("tiny-target"))


def domain(kind, params, k, schedule=None, model_uri=None):
    return {"enabled": True, "drafter": {"kind": kind, "params": params, "model_uri": model_uri},
            "k": k, "max_batch_size": (max(last for _, last, kk in schedule if kk) if schedule else None),
            "k_schedule": schedule or [], "conditional_acceptance": [0.5] * k,
            "mean_accepted_length": 1.5, "predicted_speedup": 1.3, "samples": 30}


def test_every_exported_config_is_accepted_by_vllm(serving, tiny_dir):
    schedule = [[1, 1, 4], [2, 4, 2], [5, 8, 0]]
    config = parse_config({
        "schema_version": 2, "target": {"id": "tiny", "fingerprint": "sha256:0"},
        "hardware_profile": "cpu", "run_id": "r", "created_at": "2026-11-24T00:00:00",
        "domains": {
            "ngram": domain("prompt_lookup", {"max_ngram": 3, "min_ngram": 2}, 4),
            "ngram_schedule": domain("prompt_lookup", {"max_ngram": 4, "min_ngram": 1}, 4, schedule),
            "suffix": domain("suffix", {"max_depth": 24, "min_token_prob": 0.1}, 3),
            "suffix_schedule": domain("suffix", {"max_depth": 16}, 4, schedule),
            "draft": domain("draft_model", {"model": str(tiny_dir)}, 3),
            "draft_schedule": domain("draft_model", {"model": str(tiny_dir)}, 4, schedule)},
        "default": {"enabled": False}})
    exported = vllm_export(config, target_path=str(tiny_dir))
    assert exported["unsupported"] == {}
    configs = {name: spec for name, spec in exported["speculative_config"].items()}
    verdicts = serving_env.probe("check-configs", {"model": str(tiny_dir), "configs": configs},
                                 timeout_s=600)
    refused = {name: v["error"] for name, v in verdicts.items() if not v["ok"]}
    assert refused == {}, f"vLLM {serving['vllm']} refused: {refused}"
    # the old export's object of "lo-hi" keys is what vLLM refuses: the check can fail
    bad = dict(configs["ngram_schedule"], num_speculative_tokens_per_batch_size={"1-1": 4, "2-8": 2})
    verdict = serving_env.probe("check-configs", {"model": str(tiny_dir), "configs": {"bad": bad}},
                                timeout_s=600)["bad"]
    assert verdict["ok"] is False and verdict["error"]


def test_exported_schedules_serve_batches_across_their_batch_sizes(serving, tiny_dir, tmp_path):
    # accepted is not enough: each exported config with K by batch size serves 4 requests at once
    # (batch sizes 4 down to 1 as they finish, so every K of its schedule runs). vLLM 0.32's suffix
    # proposer stops the engine at a batch size whose K differs from num_speculative_tokens, which
    # is why the export gives suffix one K: the raw schedule dies here, the export serves
    schedule = [[1, 1, 4], [2, 4, 2], [5, 8, 0]]
    config = parse_config({
        "schema_version": 2, "target": {"id": "tiny", "fingerprint": "sha256:0"},
        "hardware_profile": "cpu", "run_id": "r", "created_at": "2026-11-24T00:00:00",
        "domains": {"ngram": domain("prompt_lookup", {"max_ngram": 4, "min_ngram": 1}, 4, schedule),
                    "suffix": domain("suffix", {"max_depth": 16}, 4, schedule)},
        "default": {"enabled": False}})
    exported = vllm_export(config, target_path=str(tiny_dir))["speculative_config"]
    assert "num_speculative_tokens_per_batch_size" in exported["ngram"]
    raw_suffix = dict(exported["suffix"], num_speculative_tokens_per_batch_size=
                      exported["ngram"]["num_speculative_tokens_per_batch_size"])
    rng = np.random.default_rng(0)
    pattern = rng.integers(3, 200, 12).tolist()
    requests = [{"id": str(i), "prompt_ids": pattern * 4 + [int(i) + 3], "max_tokens": 24,
                 "temperature": 0.0} for i in range(4)]
    outcomes = {}
    for name, spec in {**exported, "raw_suffix": raw_suffix}.items():
        answer = serving_env.run_engine(
            {"model": str(tiny_dir), "speculative_config": spec, "requests": requests,
             "max_num_seqs": 4, "together": True, "dtype": "float32"},
            tmp_path / f"{name}.log", 600, f"batched {name}")
        outcomes[name] = answer
    for name in exported:
        assert outcomes[name]["refused"] is None and outcomes[name]["died"] is None, outcomes[name]
        assert len(outcomes[name]["requests"]) == 4
        assert all(len(r["token_ids"]) == 24 for r in outcomes[name]["requests"].values())
    died = outcomes["raw_suffix"]["died"]
    assert died is not None and "AssertionError" in died["error"]


def test_replay_serves_the_history_batched_and_measures_only_the_requests(serving, tiny_dir, tmp_path):
    # the engine check's suffix replay: 6 history requests in one batched call (not answered),
    # then the 2 requests one at a time, each with its own timing, per-step counts and the CPU
    # other processes took meanwhile; a contended K 0 twin served again
    spec = vllm_export(parse_config({
        "schema_version": 2, "target": {"id": "tiny", "fingerprint": "sha256:0"},
        "hardware_profile": "cpu", "run_id": "r", "created_at": "2026-11-24T00:00:00",
        "domains": {"suffix": domain("suffix", {"max_depth": 16}, 3)},
        "default": {"enabled": False}}), target_path=str(tiny_dir))["speculative_config"]["suffix"]
    pattern = np.random.default_rng(1).integers(3, 200, 10).tolist()
    item = {"max_tokens": 16, "temperature": 0.0}
    history = [dict(item, id=f"h{i}", prompt_ids=pattern * 3 + [i + 3]) for i in range(6)]
    requests = [dict(item, id=f"r{i}", prompt_ids=pattern * 3 + [i + 3]) for i in range(2)]
    # r0's K 0 twin (the engine check's plain control); a contention limit below zero marks
    # every request contended, so the twin is served again twice after the replay
    twin = dict(requests[0], id="plain::r0", k=0)
    answer = serving_env.run_engine(
        {"model": str(tiny_dir), "speculative_config": spec, "requests": requests + [twin],
         "history": history, "max_num_seqs": 6, "dtype": "float32", "contention_cores": -1.0,
         "retries": 2},
        tmp_path / "history.log", 600, "history replay")
    assert answer["died"] is None and set(answer["requests"]) == {"r0", "r1", "plain::r0"}
    for name in ("r0", "r1"):
        row = answer["requests"][name]
        assert len(row["token_ids"]) == 16 and row["seconds"] > 0 and row["drafted"] is not None
        # a request that drafts is never served again: the suffix tree and the counters keep
        # what the replay gave them
        assert row["contended"] and row["served"] == 1 and row["other_cores"] >= 0
    plain = answer["requests"]["plain::r0"]
    assert plain["served"] == 3 and plain["contended"] and sum(plain["drafted"] or [0]) == 0
    assert plain["token_ids"] == answer["requests"]["r0"]["token_ids"]      # greedy, lossless
    assert answer["counters"]["drafts"] > 0


def ngram_spec(tiny_dir) -> dict:
    """The vLLM config of a prompt-lookup domain at K 3 on the tiny target (its export)."""
    return vllm_export(parse_config({
        "schema_version": 2, "target": {"id": "tiny", "fingerprint": "sha256:0"},
        "hardware_profile": "cpu", "run_id": "r", "created_at": "2026-11-24T00:00:00",
        "domains": {"ngram": domain("prompt_lookup", {"max_ngram": 3, "min_ngram": 1}, 3)},
        "default": {"enabled": False}}), target_path=str(tiny_dir))["speculative_config"]["ngram"]


def test_replay_serves_a_slowed_k0_twin_again_though_proc_saw_no_neighbour(serving, tiny_dir, tmp_path):
    # no request is contended (a limit of 100 cores), but a negative slack marks every timing
    # slowed: the K 0 twin is served again twice after the replay, the request that drafts
    # never (its drafts and the counters stay as the replay gave them)
    spec = ngram_spec(tiny_dir)
    pattern = np.random.default_rng(2).integers(3, 200, 10).tolist()
    request = {"id": "r0", "prompt_ids": pattern * 3, "max_tokens": 16, "temperature": 0.0, "k": 3}
    twin = dict(request, id="plain::r0", k=0)
    answer = serving_env.run_engine(
        {"model": str(tiny_dir), "speculative_config": spec, "requests": [request, twin],
         "dtype": "float32", "contention_cores": 100.0, "retries": 2, "slowed": -0.5},
        tmp_path / "slowed.log", 600, "slowed replay")
    assert answer["died"] is None and set(answer["requests"]) == {"r0", "plain::r0"}
    drafted, plain = answer["requests"]["r0"], answer["requests"]["plain::r0"]
    assert not drafted["contended"] and drafted["slowed"] and drafted["served"] == 1
    assert not plain["contended"] and plain["slowed"] and plain["served"] == 3
    assert plain["token_ids"] == drafted["token_ids"]          # greedy, lossless


def test_a_replay_past_its_budget_leaves_out_the_pairs_not_started_and_names_them(serving, tiny_dir, tmp_path):
    # a budget already spent when the first pair would start (a machine whose other processes
    # left the engine too little CPU): no pair of either domain starts, each is named left out,
    # and the replay ends without serving their K 0 twins or any retry
    spec = ngram_spec(tiny_dir)
    pattern = np.random.default_rng(3).integers(3, 200, 10).tolist()
    items = []
    for group in ("a", "b"):
        request = {"id": f"{group}0", "prompt_ids": pattern * 3, "max_tokens": 8, "temperature": 0.0,
                   "k": 3, "group": group}
        items += [request, dict(request, id=f"plain::{group}0", k=0)]
    request = {"model": str(tiny_dir), "speculative_config": spec, "requests": items, "dtype": "float32",
               "contention_cores": 100.0, "retries": 2, "budget_s": 1e-9}
    answer = serving_env.run_engine(request, tmp_path / "spent.log", 600, "spent replay")
    assert answer["died"] is None and answer["requests"] == {} and answer["left_out"] == ["a0", "b0"]
    # no budget: every pair served, none left out
    answer = serving_env.run_engine(dict(request, budget_s=None), tmp_path / "whole.log", 600, "replay")
    assert set(answer["requests"]) == {"a0", "plain::a0", "b0", "plain::b0"} and answer["left_out"] == []


def test_ngram_proposals_equal_vllms(serving):
    rng = np.random.default_rng(0)
    sequences = []
    for vocab in (3, 5, 20):              # small vocabularies: many (and repeated) matches
        sequences += [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 60, 60)]
    # real traffic: token ids of the shipped json and code responses
    from tasks.steps.traffic.traffic_import import sample_traffic_path
    import gzip
    import json

    with gzip.open(sample_traffic_path(), "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for _, line in zip(range(40), handle)]
    for row in rows:
        ids = list(row.get("prompt_token_ids") or []) + list(row.get("response_token_ids") or [])
        if ids:
            sequences += [ids[:cut] for cut in range(max(len(ids) - 60, 2), len(ids), 7)]
    assert len(sequences) > 300
    for min_n, max_n, k in ((1, 3, 4), (2, 3, 8), (2, 5, 3), (1, 1, 2)):
        answer = serving_env.probe("ngram", {"min_n": min_n, "max_n": max_n, "k": k,
                                             "sequences": sequences}, timeout_s=300)["proposals"]
        ours = [find_continuation(np.asarray(s), max_n, k, min_n).tolist() for s in sequences]
        mismatched = [(s, a, b) for s, a, b in zip(sequences, answer, ours) if a != b]
        assert not mismatched, f"{len(mismatched)} of {len(sequences)} differ, e.g. {mismatched[0]}"
        # and the batched kernel the decode loop uses proposes the same
        for start in range(0, len(sequences), 50):
            chunk = sequences[start:start + 50]
            width = max(len(s) for s in chunk)
            prompts = np.zeros((len(chunk), width), dtype=np.int64)
            for row, s in enumerate(chunk):
                prompts[row, width - len(s):] = s
            tokens, counts = lookup_batch(prompts, np.array([len(s) for s in chunk]),
                                          np.zeros((len(chunk), 1), dtype=np.int64),
                                          np.zeros(len(chunk), dtype=np.int64),
                                          np.full(len(chunk), k), k, max_n, min_n)
            for row in range(len(chunk)):
                assert tokens[row, :counts[row]].tolist() == answer[start + row]


# --- the engine check: configs served by vLLM, its counters beside the estimate -----------------
ENGINE_DOMAINS = {
    # domain: (candidate, K, sampling of its requests)
    "loops": ("prompt_lookup:max_ngram=3,min_ngram=1", 3, {"temperature": 0.0}),
    "sampled": ("prompt_lookup:max_ngram=3,min_ngram=1", 3, {"temperature": 0.8, "top_p": 0.9}),
    "topk": ("prompt_lookup:max_ngram=3", 2, {"temperature": 0.8, "top_k": 5}),
    "toolong": ("prompt_lookup:max_ngram=4", 2, {"temperature": 0.0}),
    "missing": ("draft_model:model=/nonexistent/draft", 2, {"temperature": 0.0}),
    "layers": ("layer_skip:num_layers=1", 2, {"temperature": 0.0}),
}


def _logged_requests(model, domain: str, sampling: dict, count: int = 6, new_tokens: int = 24):
    """Requests of a domain logged as the target answered them: our own decoding with the
    domain's sampling parameters (greedy rows are what vLLM must reproduce), cut after the
    first end-of-sequence token (where vLLM stops too)."""
    import torch

    from specdec_core import SamplingParams, SpecDecoder
    from specdec_core.drafters import PromptLookup
    from specdec_core.estimate import LoggedRequest

    decoder = SpecDecoder(model, PromptLookup(), k=2)
    rng = np.random.default_rng(len(domain))
    requests = []
    for index in range(count):
        motif = rng.integers(3, 24, 5).tolist()
        prompt = [1] + (motif * 4)[: 12 + index] + rng.integers(3, 24, 6).tolist()
        params = SamplingParams(**sampling)
        result = decoder.generate_plain(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                        sampling=params, seed=index)
        response = result.tokens[0, : result.num_tokens[0]].tolist()
        if 2 in response:
            response = response[: response.index(2) + 1]
        requests.append(LoggedRequest(f"{domain}-{index}", prompt, response, params, domain))
    return requests


def _finished_run(url: str, target_dir, model, tokenizer) -> tuple[dict, dict]:
    """A run that finished its evaluation with every ENGINE_DOMAINS domain planned on:
    (requests by domain, drafters by domain)."""
    from tasks.steps.drafters.candidates import build_drafters, candidate_label, parse_candidate
    from tasks.db import upgrade
    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, EvalRun
    from tasks.timeutil import utcnow

    upgrade(url)
    now = utcnow()
    requests, drafters = {}, {}
    with ensure_ready(url).begin() as connection:
        connection.execute(EvalRun.__table__.insert().values(
            run_id="r1", created_at=now, updated_at=now, status="evaluated", target_id=str(target_dir),
            target_fingerprint="sha256:test", hardware_profile="cpu"))
        for domain, (candidate, k, sampling) in ENGINE_DOMAINS.items():
            spec = parse_candidate(candidate)
            if spec["kind"] != "draft_model":
                drafters[domain] = build_drafters([candidate], model, tokenizer, None)
            requests[domain] = _logged_requests(model, domain, sampling)
            connection.execute(DomainConfig.__table__.insert().values(
                run_id="r1", domain=domain, enabled=True, drafter=candidate_label(spec), k=k,
                status="ok", drafter_spec=spec, mean_accepted_length=1.5, samples=30,
                reason="planned on", created_at=now))
    # a prompt longer than the target's 512 positions: vLLM rejects the request mid-replay
    long = requests["toolong"][0]
    requests["toolong"][0] = type(long)(long.request_id, list(long.prompt_ids) * 40, long.response_ids,
                                        long.sampling, long.domain)
    return requests, drafters


def _plan_on(url: str, run_id: str, profile: dict) -> None:
    """Make `profile` (profile_vllm's output) the run's own cost profile, as a run planned on
    vLLM's costs has it (a reused profile is copied this way)."""
    from sqlalchemy import select, update

    from tasks.db.engine import ensure_ready
    from tasks.db.models import CostProfileCheck, EvalRun
    from tasks.steps.costs.reuse import reuse_costs

    engine = ensure_ready(url)
    with engine.connect() as connection:
        source = dict(connection.execute(select(CostProfileCheck).where(
            CostProfileCheck.run_id == profile["run_id"])).mappings().one())
    reuse_costs(run_id, source, Store.open(url))
    with engine.begin() as connection:
        connection.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
            hardware_profile=source["hardware_profile"]))


@pytest.fixture(scope="module")
def engine_run(serving, tmp_path_factory):
    """Engine checks over the scenario domains, each on a finished run in its own database."""
    from specdec_core import load_model
    from tasks.steps.checks.engine_check import engine_check
    from tasks.steps.costs.engine_costs import profile_vllm
    from tasks.settings import load_settings

    base = tmp_path_factory.mktemp("engine-check")
    # a small vocabulary: the random target's answers repeat themselves, so n-grams match
    target_dir = save_tiny_target(tiny_llama(vocab=24, hidden=128, heads=4, layers=2), base / "target")
    model, tokenizer = load_model(str(target_dir), device="cpu")
    url, timed_url = f"sqlite:///{base / 'specdec.db'}", f"sqlite:///{base / 'timed.db'}"
    requests, drafters = _finished_run(url, target_dir, model, tokenizer)
    _finished_run(timed_url, target_dir, model, tokenizer)
    settings = dict(engine_check_requests=6, live_max_new_tokens=24)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_HOME", str(base / "home"))
        # vLLM's own cost profile, stored first: the engine check predicts its speedups from it
        profile = profile_vllm("vllm-costs", str(target_dir), ["prompt_lookup:max_ngram=3,min_ngram=1",
                                                               "suffix:max_depth=16"],
                               Store.open(url), k_max=3, batch_sizes=[1, 2], ks=[1, 3], steps=8,
                               settings=load_settings(profile_repeats=2, profile_engine_budget_s=20),
                               progress=False)
        # the gate's tolerance is tested on its own (test_engine_check.py): none is applied here
        result = engine_check("r1", str(target_dir), model, drafters, requests, Store.open(url),
                              settings=load_settings(**settings, engine_check_tolerance=1.0,
                                                     validation_alpha=PASSING_ALPHA))
        # again, as a run planned on vLLM's costs (the profile above copied as its own): a re-run
        # checks the domains still on and replaces their rows, and its live check is vLLM's
        # speedup (live_veto off: a tiny target's timings are noise). The sampling test on vLLM
        # ran above; it is off here and below, to save its servers' start
        _plan_on(url, "r1", profile)
        again = engine_check("r1", str(target_dir), model, drafters, requests, Store.open(url),
                             settings=load_settings(**settings, engine_check_tolerance=1.0,
                                                    engine_sampling=False, live_veto=False))
        timed = engine_check("r1", str(target_dir), model, drafters, requests, Store.open(timed_url),
                             settings=load_settings(**settings, engine_check_timeout_s=0.5,
                                                    engine_sampling=False))
    return {"result": result, "again": again, "timed": timed, "url": url, "requests": requests,
            "profile": profile}


def test_engine_check_counts_equal_the_estimate_on_greedy_requests(engine_run):
    row = engine_run["result"]["domains"]["loops"]
    assert row["status"] == "ok" and row["passed"] is True, row["reason"]
    assert row["greedy_checked"] >= 3, row["per_request"]       # vLLM reproduced the logged outputs
    assert row["greedy_equal"] == row["greedy_checked"], row["per_request"]
    assert row["engine_e"] > 1.0                                # the prompts' loops are drafted
    assert row["engine_e"] == pytest.approx(row["estimate_e"], rel=1e-9)
    assert row["engine_rates"] == pytest.approx(row["estimate_rates"])
    # vLLM's own counters agree with its per-request counts
    counters = row["counters"]
    assert counters["accepted_tokens"] >= sum(r["engine_accepted"] for r in row["per_request"])
    assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0


def test_vllms_own_cost_profile_is_stored_and_the_planner_reads_it(engine_run):
    from tasks.steps.costs.costs import load_costs

    profile = engine_run["profile"]
    hardware = profile["hardware_profile"]
    engine = hardware["details"]["engine"]
    assert engine["name"] == "vllm"
    assert engine["version"] == engine_run["result"]["domains"]["loops"]["engine_version"]
    assert hardware["name"].startswith("vllm-") and hardware["device"].startswith("vLLM ")
    # one engine, K per request: K 0 (the plain step), K = 1 and 3 in alternating batches (K = 2
    # interpolated between them), every figure a ratio paired inside one repeat; and suffix's own
    assert [e["config"] for e in profile["engines"]] == ["ngram", "suffix(max_depth=16)"]
    timings = profile["engines"][0]["timings"]
    assert {t["k"] for t in timings} == {0, 1, 3} and profile["engines"][0]["repeats"] >= 2
    # a later round times only the ratios still open: a repeat may hold no batch-1 greedy pair
    checked = 0
    for repeat in {t["repeat"] for t in timings}:
        drafted = {t["k"]: t["drafted"] for t in timings if t["repeat"] == repeat
                   and t["batch_size"] == 1 and t["sampling"] == "greedy"}
        if drafted:
            assert drafted[0] == 0 and drafted.get(3, 1) > 0, drafted     # K 0: no drafts at all
            checked += 1
    assert checked >= 1
    assert hardware["details"]["engine"]["paired"] is True
    costs = load_costs(hardware["name"], Store.open(engine_run["url"]))
    assert costs.batch_sizes == [1, 2] and all(costs.k_max(b) == 3 for b in (1, 2))
    for b in (1, 2):
        verify = costs.verify[b]
        assert verify[2] == pytest.approx((verify[1] + verify[3]) / 2)
        assert costs.target_step[b] > 0 and all(v > 0 for v in verify.values())
        # vLLM's ngram search is inside its steps: prompt lookup's own draft step is 0
        assert costs.draft_ratio("prompt_lookup(max_ngram=3,min_ngram=1)", b) == 0.0
        # suffix's rounds timed in its own engine at K 1 and 3 (and draft_k), K 2 between them
        rounds = costs.draft_round["suffix(max_depth=16)"][b]
        assert sorted(rounds) == [1, 2, 3] and all(r > 0 for r in rounds.values())
        assert len(costs.round_ratios("suffix(max_depth=16)", b)) == 3
    suffix = profile["engines"][1]["timings"]
    assert {t["k"] for t in suffix} == {0, 1, 3} and any(t["drafted"] for t in suffix if t["k"] == 3)
    assert profile["check"]["status"] in ("ok", "noisy")
    assert all(isinstance(reason, str) for reason in profile["check"]["reasons"])


def test_engine_check_measures_vllms_speedup_beside_the_profiles_prediction(engine_run):
    from sqlalchemy import select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import EngineCheck

    row = engine_run["result"]["domains"]["loops"]
    assert row["engine_profile"] == engine_run["profile"]["hardware_profile"]["name"]
    assert row["plain_decode_tokens_per_s"] > 0 and row["spec_decode_tokens_per_s"] > 0
    assert row["measured_speedup"] == pytest.approx(row["spec_decode_tokens_per_s"]
                                                    / row["plain_decode_tokens_per_s"])
    assert row["predicted_speedup"] is not None and row["predicted_speedup"] > 0
    # decode phase only (vLLM's first token to its last, inside the client's wall time): it leaves
    # the prefill and the first token out, so it is never under (n - 1) / n of the end-to-end
    # rate -- at least half of it, every reply holding 2 tokens or more. (Which of the two is
    # larger depends on how long the prefill took: a tiny model's is shorter than one token.)
    assert row["plain_decode_tokens_per_s"] >= 0.5 * row["plain_tokens_per_s"]
    again = engine_run["again"]["domains"]["loops"]       # the re-run replaced the stored row
    with ensure_ready(engine_run["url"]).connect() as connection:
        stored = connection.execute(select(EngineCheck).where(EngineCheck.domain == "loops")).one()
    assert stored.measured_speedup == pytest.approx(again["measured_speedup"])
    assert stored.predicted_speedup == pytest.approx(again["predicted_speedup"])
    assert stored.engine_profile == row["engine_profile"]


def test_a_run_planned_on_vllms_costs_is_live_checked_on_vllm(engine_run):
    from sqlalchemy import select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, LiveMeasurement

    first, again = engine_run["result"]["domains"]["loops"], engine_run["again"]["domains"]["loops"]
    assert "live_check" not in first             # planned on no vLLM profile: reported only
    verdict = again["live_check"]
    assert verdict["engine"] == "vllm" and verdict["reason"].startswith("on vLLM: live check:")
    # judged on the pairs served, less those a neighbour reached where 5 or more are left
    left_out = verdict["contended"] if verdict["requests"] < again["requests"] else 0
    assert verdict["requests"] == again["requests"] - left_out and verdict["requests"] >= 1
    assert verdict["lo"] <= verdict["measured"] <= verdict["hi"]
    assert verdict["measured"] == pytest.approx(again["measured_speedup"], rel=1e-6)
    with ensure_ready(engine_run["url"]).connect() as connection:
        live = connection.execute(select(LiveMeasurement).where(LiveMeasurement.domain == "loops")).one()
        config = connection.execute(select(DomainConfig).where(DomainConfig.domain == "loops")).one()
    assert live.measured_speedup == pytest.approx(verdict["measured"])
    assert live.predicted_same_requests == pytest.approx(again["predicted_speedup"])
    # every pair is stored, the contended ones marked: the verdict's are the unmarked ones
    assert live.hardware["engine"] == "vllm" and len(live.per_request) == again["requests"]
    judged = [r for r in live.per_request if not (left_out and r.get("contended"))]
    assert len(judged) == verdict["requests"]
    assert config.live_check["engine"] == "vllm" and config.measured_speedup == pytest.approx(verdict["measured"])


def test_engine_check_sampled_domain_is_compared_in_expectation(engine_run):
    row = engine_run["result"]["domains"]["sampled"]
    assert row["status"] == "ok" and row["greedy_checked"] == 0 and row["engine_e"] is not None
    assert row["estimate_e_lo"] <= row["estimate_e"] <= row["estimate_e_hi"]
    # sampled requests share the greedy domain's config: one engine served both
    engines = engine_run["result"]["engines"]
    shared = [e for e in engines if "loops" in e["domains"] and e["speculative_config"]]
    assert len(shared) == 1 and "sampled" in shared[0]["domains"]


def test_vllms_cpu_sampler_is_mended_so_top_k_and_sampled_requests_are_served(engine_run):
    # vLLM 0.32's CPU rejection sampler expands temperature/top-k/top-p over a round's draft tokens
    # into uninitialised memory, and its top-k mask dies on a round without drafts: the probe
    # checks both on the engine's own code and replaces them, and says so
    engines = engine_run["result"]["engines"]
    spec_engines = [e for e in engines if e["speculative_config"] and e["status"] != "refused"]

    def sampler_mends(engine):
        return [m for m in engine["mends"] if "expand kernel" in m or "top-k mask" in m]

    # each mend is checked at its first use: the expand kernel in every engine that drafted, the
    # top-k mask where requests used top-k or top-p (topk, and sampled's top-p, which shares loops'
    # engine); none in the plain engine
    served = [e for e in spec_engines if e["status"] == "ok"]
    assert served and all(any("expand kernel" in m for m in e["mends"]) for e in served), served
    by_domain = {d: e for e in served for d in e["domains"]}
    assert all(len(sampler_mends(by_domain[d])) == 2 for d in ("topk", "sampled")), served
    assert all(not sampler_mends(e) for e in engines if not e["speculative_config"])
    topk = engine_run["result"]["domains"]["topk"]
    assert topk["status"] == "ok" and topk["passed"] is True, topk["reason"]
    assert topk["engine_e"] is not None and "mend of vLLM's CPU build" in topk["reason"]
    sampled = engine_run["result"]["domains"]["sampled"]
    assert sampled["estimate_e_lo"] <= sampled["engine_e"] <= sampled["estimate_e_hi"], sampled


def test_the_engine_check_runs_the_sampling_test_on_vllms_server_and_stores_it(engine_run):
    from sqlalchemy import select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import Validation

    sampling = engine_run["result"]["sampling"]
    # the domains the replay passed went through the test on the server; the failed ones did not
    assert set(sampling) == {"loops", "sampled", "topk"}, sampling
    for domain, row in sampling.items():
        assert row["status"] == "passed" and row["passed"] is True, row
        assert row["rows"] == 300 and row["positions"] >= 3 and 0 < row["min_p"] <= 1
    with ensure_ready(engine_run["url"]).connect() as connection:
        stored = {r.domain: r for r in connection.execute(select(Validation).where(
            Validation.check_name == "engine_sampling"))}
    assert set(stored) == set(sampling)
    details = stored["topk"].details
    assert details["engine"] == "vllm" and details["speculative_config"]["method"] == "ngram"
    assert details["samplings"][0]["top_k"] > 0 and details["config"]["passed"] is True
    assert details["log"].endswith(".log") and "engine_checks" in details["log"]
    assert any("expand kernel" in m for m in details["mends"])


def test_engine_failures_turn_the_domain_off_with_vllms_own_line(engine_run):
    from sqlalchemy import select

    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, EngineCheck

    domains = engine_run["result"]["domains"]
    # a request vLLM cannot take fails its domain, named; a config it refuses, with vLLM's line
    assert domains["toolong"]["status"] == "died" and "toolong-0" in domains["toolong"]["reason"]
    assert domains["missing"]["status"] == "refused" and domains["missing"]["passed"] is False
    assert "/nonexistent/draft" in domains["missing"]["reason"]
    assert domains["layers"]["status"] == "unsupported" and domains["layers"]["passed"] is None
    with ensure_ready(engine_run["url"]).connect() as connection:
        configs = {r.domain: r for r in connection.execute(select(DomainConfig))}
        stored = {r.domain: r for r in connection.execute(select(EngineCheck))}
    for domain in ("toolong", "missing"):
        assert not configs[domain].enabled and configs[domain].reason.startswith("engine check:")
    assert configs["loops"].enabled and configs["layers"].enabled    # passed / not gated: unchanged
    # the re-run replaced the rows of the domains still on; the gated ones keep theirs
    assert set(stored) == set(ENGINE_DOMAINS)
    assert set(engine_run["again"]["domains"]) == {"loops", "sampled", "topk", "layers"}
    assert stored["loops"].status == "ok" and stored["toolong"].status == "died"


def test_a_hung_engine_times_out_naming_the_domain_and_its_log(engine_run):
    timed = engine_run["timed"]["domains"]
    for domain in ("loops", "sampled", "topk", "toolong", "missing"):
        assert timed[domain]["status"] == "timeout" and timed[domain]["passed"] is False
        assert domain in timed[domain]["reason"] and ".log" in timed[domain]["reason"]
        assert "engine_check_timeout_s" in timed[domain]["reason"]


# --- EAGLE-3 heads: the speculators library's reading of our checkpoint, then vLLM serving it ---
def _speculators(serving):
    """The speculators library in the serving environment (make serving-env installs it): the
    serving fixture found the environment, so a missing library is a stale one, and fails."""
    try:
        return serving_env.probe("versions", {}, timeout_s=300, script=serving_env.EAGLE3_LOGITS)
    except Exception as exc:  # noqa: BLE001 - an environment made before speculators was added
        pytest.fail(f"no speculators in the serving environment: run `make serving-env` again ({exc})")


def _perturbed_eagle3_head(target, vocab_ids, norm_before_residual=True, scale=0.3, seed=7):
    """An Eagle3Head whose every own weight (fc, the layer, its norms, the final norm, the reduced
    LM head) is moved off its initialisation, so each one shows in the logits."""
    import torch

    from specdec_core.eagle3 import Eagle3Head

    head = Eagle3Head(target, vocab_ids=vocab_ids, norm_before_residual=norm_before_residual)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in head.own_named_parameters():
            spread = float(param.std()) if param.numel() > 1 and float(param.std()) > 0 else 1.0
            param.add_(torch.randn(param.shape, generator=generator) * scale * spread)
    return head.eval()


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_speculators_reads_our_eagle3_checkpoint_as_we_do(serving, tmp_path, norm_before_residual):
    """Our Eagle3Head's teacher-forced logits equal those of speculators' Eagle3DraftModel loaded
    from the checkpoint Eagle3Head.save wrote (fp32, eager attention): the file format, the
    layer's wiring, the alignment (hidden state j with token j + 1) and the reduced vocabulary."""
    import torch

    from specdec_core.head import target_features

    _speculators(serving)
    # 8 layers: the default auxiliary layers [2, 4, 5] are distinct (speculators and vLLM
    # refuse or collapse repeated ones)
    target = tiny_llama(vocab=97, hidden=64, layers=8, heads=4, seed=1)
    target_dir = save_tiny_target(target, tmp_path / "target")
    vocab = torch.tensor([t for t in range(97) if t % 5 != 2])              # 78 of 97 tokens
    head = _perturbed_eagle3_head(target, vocab, norm_before_residual)
    head.save(tmp_path / "head", k=3, verifier=str(target_dir))
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(3))
    features, _ = target_features(target, ids, head=head)          # [B, T, 3H]
    with torch.no_grad():
        ours, _ = head(features[:, :-1], ids[:, 1:])                 # position j: (h_j, x_{j+1})
    for row in range(ids.shape[0]):
        answer = serving_env.probe("logits", {
            "model": str(tmp_path / "head"), "hidden_states": features[row:row + 1, :-1].tolist(),
            "input_ids": ids[row:row + 1, 1:].tolist()}, timeout_s=300, script=serving_env.EAGLE3_LOGITS)
        assert answer["draft_vocab_size"] == len(vocab) and answer["layer_ids"] == head.layer_ids
        assert torch.equal(torch.arange(len(vocab)) + torch.tensor(answer["d2t"]), vocab)
        theirs = torch.tensor(answer["logits"])
        assert ours[row].abs().max() > 1.0                             # not a degenerate head
        # fp32 on both sides, the same operations in another order: a few 1e-6 on logits of ~20
        torch.testing.assert_close(theirs, ours[row], rtol=0, atol=1e-4)
        assert torch.equal(theirs.argmax(-1), ours[row].argmax(-1))


def _greedy_requests(model, count: int = 6, new_tokens: int = 24, vocab: int = 64):
    """Greedy requests logged as the target answered them, cut after the first end-of-sequence
    token (where vLLM stops too)."""
    import torch

    from specdec_core import SamplingParams, SpecDecoder
    from specdec_core.estimate import LoggedRequest

    prompts = torch.randint(3, vocab, (count, 9), generator=torch.Generator().manual_seed(11))
    prompts[:, 0] = 1
    out = SpecDecoder(model, None).generate_plain(prompts, new_tokens)
    requests = []
    for index in range(count):
        response = out.tokens[index, : out.num_tokens[index]].tolist()
        if 2 in response:
            response = response[: response.index(2) + 1]
        requests.append(LoggedRequest(f"eagle-{index}", prompts[index].tolist(), response,
                                      SamplingParams(temperature=0.0), "eagle"))
    return requests


@pytest.fixture(scope="module")
def eagle3_run(serving, tmp_path_factory):
    """The engine check of a run whose one domain drafts with an EAGLE-3 head: a tiny 8-layer
    target as a transformers directory, a head trained a few dozen steps on the very requests
    the check replays (so that it agrees with the target often, not always), saved with
    Eagle3Head.save, served by vLLM's eagle3 method.

    Our CPU kernels are off here (SPECDEC_CPU_KERNELS=0): the check compares two engines' float32
    sums, and this weakly trained head has near-ties between its top drafts, so a summation
    order decides some of them. With the packed weights' order one request's count differed from
    vLLM's (12 drafts accepted there, 11 in the estimate; found on an AMD EPYC machine); with
    transformers' own, every count is equal."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CPU_KERNELS", "0")
        return _eagle3_check(serving, tmp_path_factory)


def _eagle3_check(serving, tmp_path_factory) -> dict:
    import torch

    from specdec_core import load_model
    from specdec_core.eagle3 import Eagle3Head
    from specdec_core.train import TrainConfig, train_head
    from tasks.db import upgrade
    from tasks.db.engine import ensure_ready
    from tasks.db.models import DomainConfig, EvalRun
    from tasks.settings import load_settings
    from tasks.steps.drafters.candidates import build_drafters, candidate_label, parse_candidate
    from tasks.steps.checks.engine_check import engine_check
    from tasks.timeutil import utcnow

    base = tmp_path_factory.mktemp("eagle3-check")
    # 8 layers: the default auxiliary layers [2, 4, 5] are distinct and ascending, as vLLM takes
    # them (it captures a sorted set); head size 32 for vLLM's CPU kernels
    target_dir = save_tiny_target(tiny_llama(vocab=64, hidden=128, heads=4, layers=8, seed=0),
                                  base / "target")
    model, tokenizer = load_model(str(target_dir), device="cpu")
    requests = _greedy_requests(model)
    # a reduced vocabulary (d2t/t2d in the file): vLLM 0.32 refuses a checkpoint that carries
    # d2t when the draft vocabulary is the target's whole one ("no parameter named
    # draft_id_to_target_id")
    head = Eagle3Head(model, vocab_ids=torch.tensor([t for t in range(64) if t % 9 != 4]))
    train_head(head, model, requests, requests[:2],
               TrainConfig(steps=60, batch_size=6, lr=3e-3, warmup_steps=2, eval_every=1000, k_max=3),
               base / "training", costs=(0.1, [1.1, 1.2, 1.3]), progress=False)
    head_dir = head.eval().save(base / "head", k=3, verifier=str(target_dir))
    candidate = f"eagle3:model={head_dir}"
    drafters = {"eagle": build_drafters([candidate], model, tokenizer, None)}
    url = f"sqlite:///{base / 'specdec.db'}"
    upgrade(url)
    now = utcnow()
    spec = parse_candidate(candidate)
    with ensure_ready(url).begin() as connection:
        connection.execute(EvalRun.__table__.insert().values(
            run_id="r1", created_at=now, updated_at=now, status="evaluated", target_id=str(target_dir),
            target_fingerprint="sha256:test", hardware_profile="cpu"))
        connection.execute(DomainConfig.__table__.insert().values(
            run_id="r1", domain="eagle", enabled=True, drafter=candidate_label(spec), k=3,
            status="ok", drafter_spec=spec, mean_accepted_length=1.5, samples=30,
            reason="planned on", created_at=now))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_HOME", str(base / "home"))
        result = engine_check("r1", str(target_dir), model, drafters, {"eagle": requests}, Store.open(url),
                              settings=load_settings(engine_check_requests=6, live_max_new_tokens=24,
                                                     engine_check_tolerance=1.0))
    return {"result": result, "requests": requests, "head_dir": head_dir}


def test_vllm_serves_our_eagle3_head_and_its_greedy_counts_equal_the_estimate(eagle3_run):
    """vLLM loads the checkpoint Eagle3Head.save wrote (method eagle3), drafts with it, and on
    greedy requests whose output equals the log its accepted drafts and drafted steps equal our
    estimate's request by request: the same head, read the same way (auxiliary layer i = the
    input of target layer i, positions from 0, norm_before_residual), drafts the same tokens."""
    row = eagle3_run["result"]["domains"]["eagle"]
    assert row["speculative_config"] == {"method": "eagle3", "model": str(eagle3_run["head_dir"]),
                                         "num_speculative_tokens": 3}
    assert row["status"] == "ok" and row["passed"] is True, row["reason"]
    assert row["greedy_checked"] >= 5, row["per_request"]          # vLLM reproduced the logs
    assert row["greedy_equal"] == row["greedy_checked"], row["per_request"]
    accepted = sum(r["engine_accepted"] for r in row["per_request"])
    drafted = 3 * sum(r["engine_steps"] for r in row["per_request"])
    assert 0 < accepted < drafted, row["per_request"]          # accepted and rejected drafts both
    assert row["engine_e"] == pytest.approx(row["estimate_e"], rel=1e-9)
    assert row["engine_rates"] == pytest.approx(row["estimate_rates"])


def test_vllms_sampling_test_gates_the_eagle3_config_as_every_other(eagle3_run):
    """An EAGLE-3 config is not waved through on its greedy counts: the engine check ran the
    sampling test on vLLM's server with the head (continuations at sampled settings, G-tested at
    every position against the target's exact distribution), and it passed. Its power on the
    embedded default: benchmarks/results/engine_sampling_power_eagle3.md."""
    sampling = eagle3_run["result"]["sampling"]["eagle"]
    assert sampling["status"] == "passed" and sampling["passed"] is True, sampling["reason"]
    assert sampling["rows"] >= 50 and sampling["positions"] >= 3, sampling
    assert sampling["shared_from"] is None                       # its own test, not another's
