"""Candidates, cost profiles (measure, store, load, export/import, timing lock) and the per-domain
plan (round cost, speedup interval, on/off, max batch size) computed by hand from built cost tables."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime

import pytest
import torch
from sqlalchemy import insert, select

from tasks.steps.drafters.candidates import CandidateError, build_drafters, candidate_label, parse_candidate
from tasks.steps.costs.costs import (CostProfileError, CostTable, describe_hardware, load_costs,
                                     profile_costs, timing_lock)
from tasks.steps.costs.transfer import FILE_FORMAT, export_costs, import_costs
from tasks.db.models import AcceptanceEstimate, CostProfile, DomainConfig, HardwareProfile
from tasks.db.store import Store
from tasks.serving.paired_answer import PairedAnswer
from tasks.steps.plan.plan import plan_domain, round_cost, speedups
from tasks.settings import load_settings

from .helpers import REPO
from .helpers.costs import (LS, LS_SPEC, PL, PL_SPEC, STEP, VERIFY, add_estimate, configs,
                            cost_table)
from .helpers.db import execute, fetch
from .helpers.models import save_tiny_target, tiny_llama
from .helpers.processes import specdec


# ------------------------------------------------------------------------------------------------
# helpers (the shared ones, and the hand-built costs: helpers/costs.py)
def estimates(db_url, run_id, domain):
    return {(row["drafter"], row["k"]): row for row in fetch(db_url, select(AcceptanceEstimate).where(
        (AcceptanceEstimate.run_id == run_id) & (AcceptanceEstimate.domain == domain)))}


def seed_qa(db_url, run_id="plan-run"):
    # b=1 costs: LS K=1: 0.25 + 1.2 = 1.45; LS K=2: 2*0.25 + 1.4 = 1.9;
    # PL K=2 (half the rounds draft nothing): 0.5*(0.05 + 1) + 0.5*(0.05 + 1.4) = 1.25
    add_estimate(db_url, run_id, "qa", LS_SPEC, 1, 1.6, 1.5, 1.7, [0.0, 1.0])
    add_estimate(db_url, run_id, "qa", LS_SPEC, 2, 2.2, 2.0, 2.4, [0.0, 0.0, 1.0])
    add_estimate(db_url, run_id, "qa", PL_SPEC, 2, 2.0, 1.9, 2.1, [0.5, 0.0, 0.5])
    # K=3 is beyond the profiled K (2): never chosen, however good
    add_estimate(db_url, run_id, "qa", PL_SPEC, 3, 3.9, 3.8, 4.0, [0.0, 0.0, 0.0, 1.0])


def settings(**overrides):
    return load_settings({}, **overrides)


# ------------------------------------------------------------------------------------------------
# candidates
def test_parse_candidate_text_and_dict_forms():
    assert parse_candidate("prompt_lookup") == {"kind": "prompt_lookup", "params": {}}
    assert parse_candidate("prompt_lookup:max_ngram=4:min_ngram=2") == {
        "kind": "prompt_lookup", "params": {"max_ngram": 4, "min_ngram": 2}}
    # `,` separates parameters too; spaces around names and values are dropped
    assert parse_candidate(" layer_skip:num_layers = 8, scale=0.5 ") == {
        "kind": "layer_skip", "params": {"num_layers": 8, "scale": 0.5}}
    spec = parse_candidate("draft_model:model=/models/my-draft")
    assert spec == {"kind": "draft_model", "params": {"model": "/models/my-draft"}}
    params = parse_candidate("prompt_lookup:a=3,b=2.5,c=x")["params"]
    assert type(params["a"]) is int and type(params["b"]) is float and params["c"] == "x"
    # dict form: the config form {kind, params}; params are copied
    source = {"kind": "layer_skip", "params": {"num_layers": 2}}
    parsed = parse_candidate(source)
    assert parsed == source and parsed["params"] is not source["params"]
    assert parse_candidate({"kind": "prompt_lookup"}) == {"kind": "prompt_lookup", "params": {}}


def test_candidate_label_sorts_params():
    assert candidate_label(parse_candidate("prompt_lookup")) == "prompt_lookup"
    assert candidate_label(parse_candidate("prompt_lookup:min_ngram=2:max_ngram=4")) == \
        "prompt_lookup(max_ngram=4,min_ngram=2)"
    assert candidate_label({"kind": "layer_skip", "params": {"num_layers": 8}}) == "layer_skip(num_layers=8)"


@pytest.mark.parametrize("candidate, words", [
    ("bogus:x=1", ["'bogus:x=1'", "unknown drafter kind 'bogus'"]),
    ({"kind": "medusa", "params": {}}, ["medusa", "unknown drafter kind"]),
    ("prompt_lookup:max_ngram", ["'prompt_lookup:max_ngram'", "'max_ngram'", "NAME=VALUE"]),
    ("prompt_lookup:=3", ["'prompt_lookup:=3'", "NAME=VALUE"]),
    ("layer_skip:num_layers=", ["'layer_skip:num_layers='", "NAME=VALUE"]),
    ("draft_model", ["'draft_model'", "model="]),
    ({"kind": "draft_model", "params": {}}, ["draft_model", "model="]),
    ("", ["KIND[:NAME=VALUE...]"]),
    (42, ["42", "KIND[:NAME=VALUE...]"]),
])
def test_malformed_candidates_are_errors_naming_the_candidate(candidate, words):
    with pytest.raises(CandidateError) as caught:
        parse_candidate(candidate)
    assert isinstance(caught.value, ValueError)
    for word in words:
        assert word in str(caught.value)


def test_build_drafters_on_the_target(target):
    from specdec_core.drafters import LayerSkip, PromptLookup

    built = build_drafters(["prompt_lookup", "layer_skip:num_layers=2",
                            {"kind": "layer_skip", "params": {"num_layers": 2}}], target)
    assert list(built) == [PL, LS]   # the repeated candidate is built once
    spec, drafter = built[PL]
    assert spec == PL_SPEC and isinstance(drafter, PromptLookup)
    spec, drafter = built[LS]
    assert spec == LS_SPEC and isinstance(drafter, LayerSkip) and drafter.num_layers == 2


def test_build_drafters_wraps_a_bad_parameter_as_candidate_error(target):
    with pytest.raises(CandidateError) as caught:
        build_drafters(["prompt_lookup:max_ngram=1:min_ngram=3"], target)
    assert "prompt_lookup(max_ngram=1,min_ngram=3)" in str(caught.value)


# ------------------------------------------------------------------------------------------------
# round cost and speedups by hand
def test_round_cost_by_hand():
    # model drafter: w drafted tokens cost w * draft ratio; no draft costs one target step
    assert round_cost([0.5, 0.0, 0.5], [1.5, 2.0], 0.1, False) == pytest.approx(0.5 * 1 + 0.5 * (2 * 0.1 + 2.0))
    assert round_cost([0.25, 0.25, 0.5], [1.5, 2.0], 0.1, False) == pytest.approx(
        0.25 * 1 + 0.25 * (0.1 + 1.5) + 0.5 * (0.2 + 2.0))
    # prompt lookup: one lookup per round, whatever it drafts (including nothing)
    assert round_cost([0.25, 0.25, 0.5], [1.5, 2.0], 0.1, True) == pytest.approx(
        0.25 * (0.1 + 1) + 0.25 * (0.1 + 1.5) + 0.5 * (0.1 + 2.0))
    assert round_cost([0.0, 0.0, 1.0], [1.5, 2.0], 0.1, False) == pytest.approx(2.2)
    assert round_cost([1.0], [], 0.3, True) == pytest.approx(1.3)


def test_cost_table_ratios_and_rows_round_trip():
    costs = cost_table()
    assert costs.batch_sizes == [1, 2, 4] and costs.k_max(1) == 2 and costs.k_max(8) == 0
    assert costs.verify_ratios(2) == pytest.approx([1.5, 2.0])
    assert costs.draft_ratio(LS, 4) == pytest.approx(0.4)
    with pytest.raises(CostProfileError) as caught:
        costs.draft_ratio("layer_skip(num_layers=9)", 1)
    assert "layer_skip(num_layers=9)" in str(caught.value) and "test-gpu" in str(caught.value)
    rows = costs.rows()
    assert len(rows) == 3 * (1 + 2) + 2 * 3
    again = CostTable.from_rows("test-gpu", "costs-run", rows)
    assert again == costs


def test_speedups_of_an_estimate_by_hand():
    estimate = {"drafter": PL, "drafter_spec": PL_SPEC, "draft_width_share": [0.5, 0.0, 0.5],
                "mean_accepted_length": 2.0, "mean_accepted_length_lo": 1.9, "mean_accepted_length_hi": 2.1}
    cost_b2 = 0.5 * (0.1 + 1) + 0.5 * (0.1 + 2.0)
    assert speedups(estimate, cost_table(), 2) == pytest.approx((2.0 / cost_b2, 1.9 / cost_b2, 2.1 / cost_b2))
    # the same widths with a model drafter pay per drafted token
    estimate.update(drafter=LS, drafter_spec=LS_SPEC)
    cost_b2 = 0.5 * 1 + 0.5 * (2 * 0.3 + 2.0)
    assert speedups(estimate, cost_table(), 2)[0] == pytest.approx(2.0 / cost_b2)


def test_a_host_drafters_own_rounds_price_it_in_place_of_verify_plus_its_draft_step():
    suffix = "suffix(max_depth=24)"
    estimate = {"drafter": suffix, "drafter_spec": {"kind": "suffix", "params": {"max_depth": 24}},
                "draft_width_share": [0.25, 0.25, 0.5], "k": 2, "mean_accepted_length": 2.0,
                "mean_accepted_length_lo": 1.9, "mean_accepted_length_hi": 2.1}
    costs = cost_table()
    costs.draft_step[suffix] = {b: 0.3 * STEP[b] for b in STEP}     # the two-engine difference
    costs.check = {"status": "ok", "details": {"paired": True}}
    costs.spread.update({("verify", None, 2, 1): 0.02, ("verify", None, 1, 1): 0.02})
    by_difference = 0.25 * (0.3 + 1) + 0.25 * (0.3 + 1.2) + 0.5 * (0.3 + 1.4)
    assert speedups(estimate, costs, 1)[0] == pytest.approx(2.0 / by_difference)
    # its rounds timed in its own engine: r(1) 1.1, r(2) 1.25 over its K 0 step, search inside
    costs.draft_round = {suffix: {1: {1: 1.1 * STEP[1], 2: 1.25 * STEP[1]}}}
    costs.spread.update({("draft_round", suffix, 1, 1): 0.03, ("draft_round", suffix, 2, 1): 0.07})
    assert costs.round_ratios(suffix, 1) == pytest.approx([1.1, 1.25])
    assert costs.round_ratios(suffix, 2) is None and costs.round_ratios(PL, 1) is None
    own = 0.25 * 1.0 + 0.25 * 1.1 + 0.5 * 1.25
    predicted, lo, hi = speedups(estimate, costs, 1)
    assert predicted == pytest.approx(2.0 / own)
    # the interval carries its own rounds' half-width, not verify's
    assert costs.cost_halfwidth(2, 1, suffix) == pytest.approx(0.07)
    assert costs.cost_halfwidth(2, 1) == pytest.approx(0.02)
    assert lo == pytest.approx(1.9 / own * (1 - 0.07)) and hi == pytest.approx(2.1 / own * 1.07)
    # where it has none (batch 2), verify plus its draft step, as before
    assert speedups(estimate, costs, 2)[0] == pytest.approx(
        2.0 / (0.25 * (0.3 + 1) + 0.25 * (0.3 + 1.5) + 0.5 * (0.3 + 2.0)))
    again = CostTable.from_rows(costs.hardware_profile, costs.run_id, costs.rows())
    assert again.draft_round == costs.draft_round
    assert again.spread[("draft_round", suffix, 2, 1)] == pytest.approx(0.07)
    # sampled requests pay on its rounds the extra the ngram engine's verify paid
    costs.sampled_step = {1: STEP[1]}
    costs.sampled_verify = {1: {1: 1.3 * STEP[1], 2: 1.6 * STEP[1]}}
    sampled = costs.for_sampling(0.5)
    assert sampled.round_ratios(suffix, 1) == pytest.approx([1.1 + 0.05, 1.25 + 0.1])
    assert costs.round_ratios(suffix, 1) == pytest.approx([1.1, 1.25])     # the table is not changed


def _answer(timings: list[dict]) -> PairedAnswer:
    """One engine's time-paired answer with these rows, as _time_engines hands it to _table."""
    return PairedAnswer.from_json({"timings": timings})


def _paired_batches(engine_steps: dict[int, list[float]], b: int = 1, k_drafts: bool = True) -> list[dict]:
    """The probe's time-paired rows of one engine at batch size b: pair i times K 0 and every K
    once, each step the given seconds (every step drafting K where k_drafts)."""
    rows = []
    for pair in range(len(engine_steps[0])):
        for k, steps in engine_steps.items():
            rows.append({"batch_size": b, "sampling": "greedy", "k": k, "repeat": pair, "pair": pair,
                         "decode_s": steps[pair] * 10, "steps": 10, "contended": False,
                         "drafted": 10 * b * k if k_drafts else 0})
    return rows


def test_a_vllm_profile_prices_a_suffix_round_from_its_own_engine_not_a_difference_of_two():
    from tasks.steps.costs.engine_costs import NGRAM, _table

    suffix = "suffix(max_depth=24)"
    spec = {"kind": "suffix", "params": {"max_depth": 24}}
    # the ngram engine's process: K 0 20 ms, K 1 24 ms, K 2 26 ms; the suffix engine's process runs
    # 10% slower at every K but K 0 (another process's level): a difference of the two would read
    # its search as 0.2-0.3 steps, its own ratios say what its rounds cost in its process
    ngram = _paired_batches({0: [0.020, 0.0201, 0.0199], 1: [0.024, 0.0241, 0.0239],
                             2: [0.026, 0.0261, 0.0259]})
    own = _paired_batches({0: [0.021, 0.0211, 0.0209], 1: [0.0288, 0.0289, 0.0287],
                           2: [0.0315, 0.0316, 0.0314]})
    runs = [(NGRAM, {}, None, [1, 2]), (suffix, {}, spec, [1, 2])]
    table, reasons, _ = _table({NGRAM: _answer(ngram), suffix: _answer(own)}, runs, 2, [1], 2,
                               load_settings())
    assert not reasons
    assert table.verify_ratios(1) == pytest.approx([1.2, 1.3], rel=0.01)
    assert table.round_ratios(suffix, 1) == pytest.approx([0.0288 / 0.021, 0.0315 / 0.021], rel=0.01)
    assert table.draft_ratio(suffix, 1) == pytest.approx(0.0315 / 0.021 - 1.3, rel=0.05)
    assert table.spread[("draft_round", suffix, 2, 1)] < 0.05
    # a model drafter (one K) gets no rounds of its own
    model = {"kind": "draft_model", "params": {"model": "d"}}
    runs = [(NGRAM, {}, None, [1, 2]), ("draft", {}, model, [2])]
    table, _, _ = _table({NGRAM: _answer(ngram), "draft": _answer(own)}, runs, 2, [1], 2,
                         load_settings())
    assert table.draft_round == {} and table.round_ratios("draft", 1) is None


def test_a_serving_profile_without_a_suffix_drafters_own_rounds_is_not_reused():
    from tasks.steps.costs.reuse import _coverage_gaps

    suffix = "suffix(max_depth=24)"
    costs = cost_table()
    costs.draft_step[suffix] = {b: 0.0 for b in STEP}
    assert _coverage_gaps(costs, [1, 2, 4], 2, [suffix]) == ""         # our engine's profile
    costs.sampled_step = {1: STEP[1]}                                   # a serving engine's
    assert _coverage_gaps(costs, [1, 2, 4], 2, [suffix]) == f"no rounds of its own timed for {[suffix]}"
    costs.draft_round = {suffix: {b: {1: 1.1 * STEP[b], 2: 1.2 * STEP[b]} for b in STEP}}
    assert _coverage_gaps(costs, [1, 2, 4], 2, [suffix]) == ""


def test_a_stored_paired_profile_reads_back_paired_so_the_plan_carries_its_intervals(db_url):
    # a serving engine's profile stores paired ratios with their 95% half-widths: read back from
    # the database, it must still say so, or the plan's interval drops the cost's
    from tasks.steps.costs.costs import store_costs

    costs = cost_table(name="vllm-test")
    costs.spread.update({("verify", None, 1, 1): 0.04, ("verify", None, 2, 1): 0.06})
    costs.check = {"status": "ok", "reasons": [], "attempts": 3, "max_spread": 0.06,
                   "details": {"paired": True, "engines": [{"config": "ngram", "timings": []}]}}
    hardware = {"name": "vllm-test", "device": "vLLM 0 cpu", "dtype": "float32", "details": {}}
    store_costs(Store.open(db_url), "costs-run", hardware, costs)
    again = load_costs("vllm-test", Store.open(db_url))
    assert again.paired and again.check["details"] == {"paired": True}
    assert again.cost_halfwidth(2, 1) == pytest.approx(0.06)
    costs.check = {"status": "ok", "reasons": [], "attempts": 3, "max_spread": 0.06, "details": {}}
    store_costs(Store.open(db_url), "costs-run", hardware, costs)
    assert not load_costs("vllm-test", Store.open(db_url)).paired


def test_a_rounds_halfwidth_takes_the_sampled_verifys_by_the_share_of_requests_that_pay_it():
    # a noisy sampled verify at K 1 widens a plan's interval only as far as its traffic samples
    # with top-p: greedy traffic keeps verify's own half-width, at every K
    costs = cost_table(name="vllm-test")
    costs.check = {"status": "ok", "details": {"paired": True}}
    costs.spread.update({("verify", None, 1, 1): 0.02, ("verify", None, 4, 1): 0.03,
                         ("sampled_verify", None, 1, 1): 0.20, ("sampled_verify", None, 4, 1): 0.04})
    costs.sampled_step = {1: 1.5 * STEP[1]}
    costs.sampled_verify = {1: {1: 1.6 * STEP[1], 4: 2.0 * STEP[1]}}
    assert costs.cost_halfwidth(2, 1) == pytest.approx(0.03)            # not blended: greedy
    assert costs.for_sampling(0.0).cost_halfwidth(2, 1) == pytest.approx(0.03)
    assert costs.for_sampling(0.25).cost_halfwidth(2, 1) == pytest.approx(0.75 * 0.03 + 0.25 * 0.20)
    assert costs.for_sampling(1.0).cost_halfwidth(4, 1) == pytest.approx(0.04)
    assert costs.for_sampling(1.0).cost_halfwidth(0, 1) == 0.0


def test_one_top_p_request_makes_its_whole_batch_pay_the_sampled_steps():
    # vLLM's sampler sorts every row's logits where any request of the batch samples with top-p:
    # at batch b a share s of top-p requests is paid by 1 - (1 - s)^b of the batches
    import numpy as np

    from specdec_core.estimate import RoundTotals
    from tasks.steps.checks.engine_compare import predicted_speedup
    from tasks.steps.costs.cost_table import batch_share

    assert batch_share(0.25, 1) == pytest.approx(0.25)
    assert batch_share(0.25, 8) == pytest.approx(1 - 0.75 ** 8)
    assert batch_share(0.0, 8) == 0.0 and batch_share(1.0, 2) == 1.0
    costs = cost_table(name="vllm-test")
    costs.check = {"status": "ok", "details": {"paired": True}}
    costs.sampled_step = {b: 1.5 * STEP[b] for b in STEP}
    # a sampled round costs 1.3 times a greedy one's share of its own step
    costs.sampled_verify = {b: {k + 1: 1.3 * r * 1.5 * STEP[b] for k, r in enumerate(VERIFY[b])} for b in STEP}
    costs.spread.update({("verify", None, 2, 4): 0.02, ("sampled_verify", None, 2, 4): 0.10})
    mixed = costs.for_sampling(0.25)
    for b in (1, 2, 4):
        share = 1 - 0.75 ** b
        assert mixed.target_step[b] == pytest.approx((1 - share) * STEP[b] + share * 1.5 * STEP[b])
        assert mixed.verify[b][2] == pytest.approx((1 - share) * costs.verify[b][2]
                                                   + share * costs.sampled_verify[b][2])
    assert mixed.cost_halfwidth(2, 4) == pytest.approx((0.75 ** 4) * 0.02 + (1 - 0.75 ** 4) * 0.10)
    # the engine and load checks: at batch 1 each request at its own sampling, above it every
    # request at its batches' mix (a greedy request beside a top-p one pays the sampled steps)
    label, spec = "prompt_lookup(max_ngram=3,min_ngram=1)", {"kind": "prompt_lookup", "params": {}}
    totals = [RoundTotals(tokens=30.0, rounds=15.0, reached=np.zeros(2), accepted=np.zeros(2),
                          widths=np.array([0.0, 0.0, 15.0])) for _ in range(4)]
    sampled = [True, False, False, False]
    one_each = [predicted_speedup(costs, label, spec, [t], [s], 1) for t, s in zip(totals, sampled)]
    steps = [(1.5 if s else 1.0) * STEP[1] for s in sampled]           # each request's own plain step
    assert predicted_speedup(costs, label, spec, totals, sampled, 1) == pytest.approx(
        sum(30 * step for step in steps) / sum(30 * step / x for step, x in zip(steps, one_each)))
    assert one_each[0] < one_each[1] == one_each[2]
    mixed_four = predicted_speedup(costs, label, spec, totals, sampled, 4)
    assert mixed_four == pytest.approx(predicted_speedup(costs.for_sampling(0.25), label, spec, totals,
                                                         [False] * 4, 4))
    assert mixed_four < predicted_speedup(costs, label, spec, totals, [False] * 4, 4)
    assert mixed_four > predicted_speedup(costs, label, spec, totals, [True] * 4, 4)


def test_speedups_include_the_round_overhead_and_plain_decodings_own():
    estimate = {"drafter": PL, "drafter_spec": PL_SPEC, "draft_width_share": [0.5, 0.0, 0.5],
                "mean_accepted_length": 2.0, "mean_accepted_length_lo": 1.9, "mean_accepted_length_hi": 2.1}
    costs = cost_table()
    without = speedups(estimate, costs, 2)[0]
    # overhead per round 0.2 steps for the drafter, 0.05 per plain step (t_step at b=2: 25 ms)
    costs.round_overhead = {PL: {2: 0.2 * STEP[2]}, "plain": {2: 0.05 * STEP[2]}}
    assert costs.overhead_ratios(PL, 2) == pytest.approx((0.05, 0.2))
    cost_b2 = 0.5 * (0.1 + 1) + 0.5 * (0.1 + 2.0)
    assert speedups(estimate, costs, 2)[0] == pytest.approx(2.0 * 1.05 / (cost_b2 + 0.2))
    assert speedups(estimate, costs, 2)[0] < without
    # no overhead measured at a batch size (older profiles): planned as before
    assert speedups(estimate, costs, 1)[0] == pytest.approx(speedups(estimate, cost_table(), 1)[0])
    again = CostTable.from_rows(costs.hardware_profile, costs.run_id, costs.rows())
    assert again.round_overhead == costs.round_overhead


def test_round_overhead_is_the_decode_time_outside_forwards_and_proposals(target, monkeypatch):
    import numpy as np

    from specdec_core import SpecDecoder
    from specdec_core.drafters import PromptLookup
    from specdec_core.profile import measure_round_overhead

    decodes = []       # every decode the measurement makes, as it returned it
    for method in ("generate", "generate_plain"):
        def recorded(self, *args, _real=getattr(SpecDecoder, method), **kwargs):
            decodes.append(_real(self, *args, **kwargs))
            return decodes[-1]
        monkeypatch.setattr(SpecDecoder, method, recorded)

    k = 3
    for drafter in (None, PromptLookup(3, 1)):
        # forwards priced at nothing, at 10 us, and far above a whole decode of the tiny model
        for forward in (0.0, 1e-5, 10.0):
            forward_s = dict.fromkeys(range(1, k + 2), forward)    # every verify width 1..K+1
            decodes.clear()
            seconds = measure_round_overhead(target, drafter, k, batch_size=2, context_len=32,
                                             repeats=2, forward_s=forward_s)
            # a warm-up decode, then one per repeat: the median of their seconds per round after
            # the prefill, the proposals and one priced forward per round
            assert len(decodes) == 3
            per_round = []
            for result in decodes[1:]:
                widths, stats = list(result.round_widths), result.stats
                assert widths and set(widths) <= set(forward_s)     # no width measured again
                outside = stats.total_s - stats.prefill_s - stats.draft_s
                per_round.append(max((outside - forward * len(widths)) / len(widths), 0.0))
            assert seconds == pytest.approx(float(np.median(per_round)), rel=1e-9, abs=1e-12)
            if forward == 0.0:
                assert seconds > 0                  # a real decode: host work in every round
            if forward == 10.0:
                assert seconds == 0.0               # never below zero


# ------------------------------------------------------------------------------------------------
# plan_domain
def test_plan_picks_the_best_drafter_and_k_and_the_largest_paying_batch(db_url):
    seed_qa(db_url)
    row = plan_domain("plan-run", "qa", cost_table(), Store.open(db_url), settings=settings())
    # PL K=2 at b=1: 2.0 / 1.25 = 1.6 [1.52, 1.68] beats LS K=1 (1.6/1.45) and LS K=2 (2.2/1.9)
    assert (row["drafter"], row["k"]) == (PL, 2)
    assert row["drafter_spec"] == PL_SPEC
    assert row["predicted_speedup"] == pytest.approx(2.0 / 1.25)
    assert row["predicted_speedup_lo"] == pytest.approx(1.9 / 1.25)
    assert row["predicted_speedup_hi"] == pytest.approx(2.1 / 1.25)
    # lower end at b=2: 1.9 / (0.5*1.1 + 0.5*2.1) = 1.19 >= 1.1; at b=4: 1.9 / (0.5*1.2 + 0.5*3.2) = 0.86
    assert row["enabled"] is True and row["max_batch_size"] == 2
    assert row["status"] == "ok" and row["samples"] == 30
    assert row["mean_accepted_length"] == 2.0 and row["conditional_acceptance"] == [0.6, 0.6]
    assert "on:" in row["reason"] and "test-gpu" in row["reason"]
    [stored] = configs(db_url)
    assert (stored["run_id"], stored["domain"], stored["enabled"], stored["drafter"], stored["k"],
            stored["max_batch_size"], stored["status"]) == ("plan-run", "qa", True, PL, 2, 2, "ok")
    assert stored["predicted_speedup"] == pytest.approx(1.6)
    assert stored["drafter_spec"] == PL_SPEC and stored["reason"] == row["reason"]


def test_plan_on_a_profile_with_sampled_steps_prices_the_domains_share_of_sampled_requests(db_url):
    from tasks.db.models import EvalRun, EvalSample, TrafficRequest

    seed_qa(db_url)
    now = datetime(2026, 1, 1)
    execute(db_url, insert(EvalRun), [{"run_id": "plan-run", "created_at": now, "updated_at": now,
                                      "status": "running"}])
    # 3 of the domain's 4 sampled requests sample (temperature > 0), 2 of them with top-p: those
    # pay the profile's sampled steps; one at its temperature with top-k only costs as greedy ones
    execute(db_url, insert(TrafficRequest), [
        {"id": f"r{i}", "requested_at": now, "domain": "qa", "domain_source": "row", "prompt": "p",
         "response": "r", "temperature": t, "top_p": p, "top_k": k, "model": "m", "prompt_chars": 1,
         "response_chars": 1, "content_hash": f"h{i}", "source_file": "f", "source_line": i,
         "imported_at": now}
        for i, (t, p, k) in enumerate(((0.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 0.9, 0), (0.3, 1.0, 50)))])
    execute(db_url, insert(EvalSample), [{"run_id": "plan-run", "request_id": f"r{i}", "domain": "qa",
                                          "position": i} for i in range(4)])
    greedy = cost_table()
    sampled = cost_table()
    # sampled requests: the same step, verify passes 0.4 steps dearer at every K and batch size
    sampled.sampled_step = dict(greedy.target_step)
    sampled.sampled_verify = {b: {k: v + 0.4 * greedy.target_step[b] for k, v in per_k.items()}
                              for b, per_k in greedy.verify.items()}
    plain = plan_domain("plan-run", "qa", greedy, Store.open(db_url), settings=settings())
    mixed = plan_domain("plan-run", "qa", sampled, Store.open(db_url), settings=settings())
    assert (plain["drafter"], plain["k"]) == (mixed["drafter"], mixed["k"]) == (PL, 2)
    # PL K=2 at b=1: half the rounds draft nothing (a plain step, priced alike), half verify K = 2
    # at 0.5 (the top-p share) x 0.4 = 0.2 steps more: 1.25 + 0.1
    assert mixed["predicted_speedup"] == pytest.approx(2.0 / (1.25 + 0.1))
    assert plain["predicted_speedup"] == pytest.approx(2.0 / 1.25)


def test_a_serving_engines_profile_plans_only_the_drafters_it_serves(db_url):
    # a vLLM profile has no draft step for layer skip (vLLM does not serve it): the domain is
    # planned with the drafters it prices; our engine's profile without one is an error as before
    from tasks.steps.costs.costs import CostProfileError

    seed_qa(db_url)
    served = cost_table()
    del served.draft_step[LS]
    with pytest.raises(CostProfileError, match="no draft step"):
        plan_domain("plan-run", "qa", served, Store.open(db_url), settings=settings())
    served.sampled_step = dict(served.target_step)          # a serving engine's profile
    served.sampled_verify = {b: dict(v) for b, v in served.verify.items()}
    row = plan_domain("plan-run", "qa", served, Store.open(db_url), settings=settings())
    assert row["drafter"] == PL and row["predicted_speedup"] == pytest.approx(2.0 / 1.25)
    # issue 83 item 9: the candidate left out is named in the domain's reason, not only the log
    assert row["reason"].endswith(f"; not planned with {LS}: {served.hardware_profile} does not serve "
                                  "it (no draft step in its profile)"), row["reason"]


def test_plan_stores_k_by_batch_size_and_derives_max_batch_size_from_it(db_url):
    seed_qa(db_url)
    row = plan_domain("plan-run", "qa", cost_table(), Store.open(db_url), settings=settings())
    # PL is chosen; at b=1 and b=2 its only planned K (2) pays, at b=4 it does not: 0 from there
    assert row["k_schedule"] == [[1, 1, 2], [2, 2, 2], [3, 4, 0]]
    assert row["max_batch_size"] == 2
    [stored] = configs(db_url)
    assert stored["k_schedule"] == [[1, 1, 2], [2, 2, 2], [3, 4, 0]]


def test_k_schedule_picks_the_best_paying_k_at_each_batch_size():
    from tasks.steps.plan.plan import k_schedule

    # LS K=1 and K=2 (widths all K): b=1: K=2 2.2/1.9 = 1.16 beats K=1 1.6/1.45 = 1.10;
    # b=2: K=1 1.6/1.8 = 0.89, K=2 2.2/2.6 = 0.85: neither pays at 0.5 -- hand-check via pays
    estimates = [{"drafter": LS, "drafter_spec": LS_SPEC, "k": k, "draft_width_share": share,
                  "mean_accepted_length": e, "mean_accepted_length_lo": e, "mean_accepted_length_hi": e}
                 for k, e, share in ((1, 1.6, [0.0, 1.0]), (2, 2.2, [0.0, 0.0, 1.0]))]
    assert k_schedule(estimates, cost_table(), lambda lo, hi: lo >= 1.05) == [[1, 1, 2], [2, 2, 0], [3, 4, 0]]
    assert k_schedule(estimates, cost_table(), lambda lo, hi: lo >= 0.8) == [[1, 1, 2], [2, 2, 1], [3, 4, 0]]
    assert k_schedule(estimates, cost_table(), lambda lo, hi: lo >= 5) == [[1, 1, 0], [2, 2, 0], [3, 4, 0]]


def test_the_plan_takes_the_smallest_k_within_k_tolerance_of_the_best(db_url):
    from tasks.steps.plan.plan import smallest_near_best

    # PL at b=1: K=1 costs 0.05 + 1.2 = 1.25 a round, E 1.6: 1.280x; K=2 costs 0.05 + 1.4 = 1.45,
    # E 1.87: 1.290x, 0.8% better: within the default 5%, so K=1; with plan_k_tolerance 0, K=2.
    # Neither pays at b=2 (1.00x, 0.89x)
    add_estimate(db_url, "plan-run", "json", PL_SPEC, 1, 1.6, 1.5, 1.7, [0.0, 1.0])
    add_estimate(db_url, "plan-run", "json", PL_SPEC, 2, 1.87, 1.75, 2.0, [0.0, 0.0, 1.0])
    near = plan_domain("plan-run", "json", cost_table(), Store.open(db_url), settings=settings())
    assert (near["enabled"], near["drafter"], near["k"]) == (True, PL, 1)
    assert near["k_schedule"] == [[1, 1, 1], [2, 2, 0], [3, 4, 0]]
    assert near["predicted_speedup"] == pytest.approx(1.6 / 1.25)
    best = plan_domain("plan-run", "json", cost_table(), Store.open(db_url),
                       settings=settings(plan_k_tolerance=0.0))
    assert (best["k"], best["k_schedule"]) == (2, [[1, 1, 2], [2, 2, 0], [3, 4, 0]])
    assert best["predicted_speedup"] == pytest.approx(1.87 / 1.45)
    # a K that buys more than the tolerance is taken; nothing to choose from: 0
    assert smallest_near_best([(1, 1.28), (2, 1.32), (4, 1.33)], 0.02) == 2
    assert smallest_near_best([(1, 1.28), (2, 1.32), (4, 1.33)], 0.0) == 4
    assert smallest_near_best([], 0.02) == 0


def test_plan_fills_predicted_speedups_of_the_estimates(db_url):
    seed_qa(db_url)
    plan_domain("plan-run", "qa", cost_table(), Store.open(db_url), settings=settings())
    rows = estimates(db_url, "plan-run", "qa")
    expected = {(LS, 1): (1.6, 1.5, 1.7, 1.45), (LS, 2): (2.2, 2.0, 2.4, 1.9),
                (PL, 2): (2.0, 1.9, 2.1, 1.25)}
    for key, (e, lo, hi, cost) in expected.items():
        got = rows[key]
        assert (got["predicted_speedup"], got["predicted_speedup_lo"], got["predicted_speedup_hi"]) == \
            pytest.approx((e / cost, lo / cost, hi / cost)), key
    # K beyond the profile's k_max is not planned: no prediction
    assert rows[(PL, 3)]["predicted_speedup"] is None


def test_plan_is_off_when_the_lower_end_misses_the_minimum(db_url):
    # LS K=2 alone: 2.2 / 1.9 = 1.16 > 1.1, but its lower end 2.0 / 1.9 = 1.05 is not
    add_estimate(db_url, "plan-run", "code", LS_SPEC, 2, 2.2, 2.0, 2.4, [0.0, 0.0, 1.0])
    row = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings())
    assert row["predicted_speedup"] == pytest.approx(2.2 / 1.9) and row["predicted_speedup"] > 1.1
    assert row["enabled"] is False and row["max_batch_size"] is None
    assert (row["drafter"], row["k"], row["status"]) == (LS, 2, "ok")
    assert "lower end" in row["reason"] and "1.10x" in row["reason"] and LS in row["reason"]
    [stored] = configs(db_url)
    assert stored["enabled"] is False and stored["reason"] == row["reason"]
    # a lower policy minimum (settings or argument) turns it on, at batch 1 only (b=2: 2.0/2.6)
    row = plan_domain("plan-run", "code", cost_table(), Store.open(db_url),
                      settings=settings(plan_min_speedup=1.05))
    assert row["enabled"] is True and row["max_batch_size"] == 1
    row = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings(), min_speedup=1.0)
    assert row["enabled"] is True and row["max_batch_size"] == 1


def test_a_lower_end_just_below_the_bar_shows_the_digits_that_decide_it(db_url):
    """Issue 83 item 7: a lower end of 1.0976 against the minimum 1.10 reads 1.098, never
    "[1.10, ...], whose lower end does not clear the minimum 1.10x"."""
    from tasks.registry.figures import at_bar

    add_estimate(db_url, "plan-run", "code", LS_SPEC, 2, 2.2, 2.0855, 2.4, [0.0, 0.0, 1.0])
    row = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings())
    assert row["enabled"] is False and row["predicted_speedup_lo"] == pytest.approx(1.0976, abs=1e-4)
    assert "[1.098, 1.26], whose lower end does not clear the minimum 1.10x" in row["reason"], row["reason"]
    assert at_bar(1.0976, (1.1,)) == "1.098" and at_bar(1.26, (1.1,)) == "1.26"
    assert at_bar(1.1, (1.1,)) == "1.10" and at_bar(1.09999, (1.1,)) == "1.09999"


def test_plan_prefers_a_k_that_clears_the_bar_over_a_better_guess_that_does_not(db_url):
    # LS K=2: 2.4 [1.9, 2.9] / 1.9 = 1.26 [1.00, 1.53] -- best prediction, lower end misses 1.1;
    # LS K=1: 1.75 [1.7, 1.8] / 1.45 = 1.21 [1.17, 1.24] -- clears it: chosen, and on
    add_estimate(db_url, "plan-run", "code", LS_SPEC, 2, 2.4, 1.9, 2.9, [0.0, 0.0, 1.0])
    add_estimate(db_url, "plan-run", "code", LS_SPEC, 1, 1.75, 1.7, 1.8, [0.0, 1.0])
    row = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings())
    assert (row["k"], row["enabled"]) == (1, True)
    assert row["predicted_speedup"] == pytest.approx(1.75 / 1.45)


def test_hysteresis_keeps_an_on_domain_on_inside_the_band_and_only_there(db_url):
    # LS K=2 alone: 2.2 / 1.9 = 1.16 [1.05, 1.26] -- the lower end misses 1.1, the upper clears it
    add_estimate(db_url, "plan-run", "code", LS_SPEC, 2, 2.2, 2.0, 2.4, [0.0, 0.0, 1.0])
    off = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings())
    assert off["enabled"] is False                       # off before: stays off (needs lo >= 1.1)
    kept = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings(),
                       currently_on=True)
    # on in the champion: kept on while hi >= 1.1 and lo >= 1.0; at b=2 lo = 2.0/2.6 < 1.0
    assert kept["enabled"] is True and kept["max_batch_size"] == 1
    assert kept["reason"].startswith("kept on: within hysteresis")
    [stored] = configs(db_url)
    assert stored["enabled"] is True and stored["reason"] == kept["reason"]
    # the setting switches it off
    row = plan_domain("plan-run", "code", cost_table(), Store.open(db_url),
                      settings=settings(plan_hysteresis=False), currently_on=True)
    assert row["enabled"] is False
    # outside the band (lower end below 1.0) an on domain turns off
    add_estimate(db_url, "plan-run", "json", LS_SPEC, 2, 2.2, 1.8, 2.4, [0.0, 0.0, 1.0])
    row = plan_domain("plan-run", "json", cost_table(), Store.open(db_url), settings=settings(),
                      currently_on=True)
    assert row["predicted_speedup_lo"] < 1.0 and row["enabled"] is False


def test_the_config_description_says_a_domain_was_kept_on_by_hysteresis():
    from tasks.registry.config_schema import DomainSetting, DrafterSpec, SpecdecConfig
    from tasks.registry.run_view import DomainView, reason_line

    config = SpecdecConfig(target={"id": "t", "fingerprint": "sha256:0"}, hardware_profile="hw",
                           run_id="r", created_at="2026-01-01T00:00:00Z",
                           domains={"code": DomainSetting(enabled=True, drafter=DrafterSpec(kind="suffix"),
                                                          k=2, note="kept on: within hysteresis")})
    assert reason_line(DomainView("code", config.domains["code"])) == (
        "- **code** (on): kept on: within hysteresis")


def test_max_batch_size_is_contiguous_from_the_smallest(db_url):
    # b=2 is expensive, b=4 cheap again: speculation pays up to 1 only
    seed_qa(db_url)
    verify = {1: [1.2, 1.4], 2: [3.0, 4.0], 4: [1.2, 1.4]}
    row = plan_domain("plan-run", "qa", cost_table(verify=verify), Store.open(db_url), settings=settings())
    assert row["enabled"] is True and row["max_batch_size"] == 1


def test_insufficient_domain_stays_off_and_keeps_the_champion(db_url):
    seed_qa(db_url)
    row = plan_domain("plan-run", "qa", cost_table(), Store.open(db_url), settings=settings(),
                      status="insufficient")
    assert row["enabled"] is False and row["status"] == "insufficient"
    assert "champion's setting is kept" in row["reason"]
    [stored] = configs(db_url)
    assert stored["enabled"] is False and stored["status"] == "insufficient"
    assert "champion's setting is kept" in stored["reason"]


def test_domain_without_estimates_is_insufficient(db_url):
    seed_qa(db_url)
    row = plan_domain("plan-run", "json", cost_table(), Store.open(db_url), settings=settings())
    assert row["enabled"] is False and row["status"] == "insufficient" and row["drafter"] is None
    assert "no usable estimate" in row["reason"] and row["samples"] == 0


def test_replanning_replaces_the_row_and_leaves_other_runs_alone(db_url):
    seed_qa(db_url, "plan-run")
    seed_qa(db_url, "other-run")
    add_estimate(db_url, "plan-run", "code", LS_SPEC, 1, 1.6, 1.5, 1.7, [0.0, 1.0])
    execute(db_url, insert(DomainConfig).values(
        run_id="other-run", domain="qa", enabled=False, drafter=None, k=None, status="ok",
        reason="kept", created_at=datetime(2024, 1, 1)))
    plan_domain("plan-run", "qa", cost_table(), Store.open(db_url), settings=settings())
    row = plan_domain("plan-run", "qa", cost_table(), Store.open(db_url),
                      settings=settings(plan_min_speedup=2.0))
    stored = configs(db_url)
    assert [(r["run_id"], r["domain"]) for r in stored] == [("other-run", "qa"), ("plan-run", "qa")]
    assert stored[0]["reason"] == "kept" and stored[0]["created_at"] == datetime(2024, 1, 1)
    assert stored[1]["enabled"] is False and stored[1]["reason"] == row["reason"]
    # only this run's and this domain's estimates get predictions
    assert all(r["predicted_speedup"] is None for r in estimates(db_url, "other-run", "qa").values())
    assert all(r["predicted_speedup"] is None for r in estimates(db_url, "plan-run", "code").values())


def test_plan_with_a_profile_that_starts_above_batch_1(db_url):
    seed_qa(db_url)
    costs = cost_table(step={2: 0.025, 4: 0.040}, verify={2: VERIFY[2], 4: VERIFY[4]},
                       ls={2: 0.3, 4: 0.4}, pl={2: 0.1, 4: 0.2})
    row = plan_domain("plan-run", "qa", costs, Store.open(db_url), settings=settings())
    # b=2 is the smallest: PL K=2 costs 1.6 there -> 2.0 / 1.6 = 1.25 [1.19, 1.31], on up to 2
    assert (row["drafter"], row["k"]) == (PL, 2)
    assert row["predicted_speedup"] == pytest.approx(2.0 / 1.6)
    assert row["enabled"] is True and row["max_batch_size"] == 2


# ------------------------------------------------------------------------------------------------
# measured cost profiles
PROFILE_SETTINGS = dict(profile_repeats=1, profile_context_len=16, profile_checks=False)


@pytest.fixture
def drafters(target):
    return {label: drafter for label, (_, drafter) in
            build_drafters(["prompt_lookup", "layer_skip:num_layers=2"], target).items()}


def measure(db_url, target, drafters, run_id, name="tiny-cpu"):
    return profile_costs(run_id, target, drafters, Store.open(db_url), hardware_profile=name,
                         settings=settings(**PROFILE_SETTINGS), k_max=2, batch_sizes=[2, 1, 2],
                         progress=False)


def cost_rows(db_url, name=None):
    statement = select(CostProfile.run_id, CostProfile.hardware_profile, CostProfile.component,
                       CostProfile.drafter, CostProfile.k, CostProfile.batch_size, CostProfile.seconds)
    if name:
        statement = statement.where(CostProfile.hardware_profile == name)
    return fetch(db_url, statement)


def keys(rows):
    return sorted((r["component"], r["drafter"] or "", r["k"] or 0, r["batch_size"]) for r in rows)


EXPECTED_KEYS = sorted(
    [("target_step", "", 0, b) for b in (1, 2)] + [("verify", "", k, b) for k in (1, 2) for b in (1, 2)]
    + [("draft_step", d, 0, b) for d in (LS, PL) for b in (1, 2)]
    + [("round_overhead", d, 0, b) for d in (LS, PL, "plain") for b in (1, 2)])


def test_profile_costs_stores_every_component_and_load_costs_reads_it(db_url, target, drafters):
    result = measure(db_url, target, drafters, "run-1")
    assert result["run_id"] == "run-1" and result["hardware_profile"]["name"] == "tiny-cpu"
    assert result["hardware_profile"]["dtype"] == "float32" and result["seconds"] >= 0
    stored = cost_rows(db_url)
    assert keys(stored) == EXPECTED_KEYS and keys(result["costs"]) == EXPECTED_KEYS
    assert all((r["seconds"] > 0 or r["component"] == "round_overhead" and r["seconds"] >= 0)
               and r["run_id"] == "run-1" and r["hardware_profile"] == "tiny-cpu" for r in stored)
    [hardware] = fetch(db_url, select(HardwareProfile))
    assert hardware["name"] == "tiny-cpu" and hardware["dtype"] == "float32"
    assert hardware["device"].startswith("cpu") and "torch" in hardware["details"]
    # the engine the costs describe: on a CPU, dynamic caches (no graphs, nothing compiled) and the
    # CPU kernels on every linear layer of the target (a float32 model with SDPA attention), and no
    # fused projections (they are fused on CUDA only by default)
    linears = sum(1 for m in target.modules() if isinstance(m, torch.nn.Linear))
    assert hardware["details"]["engine"] == {"static_cache": False, "cuda_graphs": False,
                                             "compile": False,
                                             "cpu_kernels": {"packed_linear": linears,
                                                             "gqa_attention": True},
                                             "fused_projections": {"attention": 0, "mlp": 0}}
    costs = load_costs("tiny-cpu", Store.open(db_url))
    assert (costs.hardware_profile, costs.run_id, costs.batch_sizes) == ("tiny-cpu", "run-1", [1, 2])
    assert costs.k_max(1) == costs.k_max(2) == 2 and sorted(costs.draft_step) == [LS, PL]
    by_key = {(r["component"], r["drafter"], r["k"], r["batch_size"]): r["seconds"] for r in stored}
    assert costs.target_step[2] == by_key[("target_step", None, None, 2)]
    assert costs.verify[1][2] == by_key[("verify", None, 2, 1)]
    assert costs.draft_step[LS][1] == by_key[("draft_step", LS, None, 1)]


def test_rerun_replaces_and_newest_run_wins(db_url, target, drafters):
    measure(db_url, target, drafters, "run-1")
    measure(db_url, target, drafters, "run-1")
    assert keys(cost_rows(db_url)) == EXPECTED_KEYS     # replaced, not duplicated
    assert len(fetch(db_url, select(HardwareProfile))) == 1
    measure(db_url, target, drafters, "run-2")
    assert len(cost_rows(db_url)) == 2 * len(EXPECTED_KEYS)
    assert load_costs("tiny-cpu", Store.open(db_url)).run_id == "run-2"
    older = load_costs("tiny-cpu", Store.open(db_url), run_id="run-1")
    assert older.run_id == "run-1"
    run_1 = {(r["component"], r["drafter"], r["k"], r["batch_size"]): r["seconds"]
             for r in cost_rows(db_url) if r["run_id"] == "run-1"}
    assert {(r["component"], r["drafter"], r["k"], r["batch_size"]): r["seconds"]
            for r in older.rows()} == run_1


def test_unknown_profile_or_run_names_the_known_profiles(db_url, target, drafters):
    with pytest.raises(CostProfileError) as caught:
        load_costs("nothing-yet", Store.open(db_url))
    assert "'nothing-yet'" in str(caught.value) and "none" in str(caught.value)
    measure(db_url, target, drafters, "run-1")
    measure(db_url, target, drafters, "run-1", name="other-cpu")
    with pytest.raises(CostProfileError) as caught:
        load_costs("h100-bf16", Store.open(db_url))
    assert "'h100-bf16'" in str(caught.value)
    assert "['other-cpu', 'tiny-cpu']" in str(caught.value)
    with pytest.raises(CostProfileError) as caught:
        load_costs("tiny-cpu", Store.open(db_url), run_id="run-9")
    assert "run-9" in str(caught.value) and "tiny-cpu" in str(caught.value)


def test_profile_measure_runs_where_mlflow_is_not_installed(tmp_path):
    # a GPU machine's image has torch and transformers, not MLflow: `specdec profile measure`
    # imports it nowhere on its path (an H100 run failed there on a module-level import)
    blocker = tmp_path / "blocked" / "mlflow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mlflow'\")\n")
    model = save_tiny_target(tiny_llama(seed=0), tmp_path / "tiny-target")
    env = {"PYTHONPATH": f"{blocker.parent}:{REPO}", "SPECDEC_DATABASE_URL": f"sqlite:///{tmp_path}/p.db"}
    assert specdec("db", "upgrade", home=tmp_path, env=env).returncode == 0
    done = specdec("profile", "measure", "--model", str(model), "--device", "cpu", "--name", "no-mlflow",
                   "--candidate", "prompt_lookup", "--batch-sizes", "1", "--k-max", "2",
                   home=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no-mlflow" in done.stdout
    assert len(cost_rows(env["SPECDEC_DATABASE_URL"], "no-mlflow")) > 0


def test_describe_hardware_default_name(target):
    import torch

    described = describe_hardware(target)
    assert described["name"] == f"cpu-{torch.get_num_threads()}t-float32"
    assert described["dtype"] == "float32" and described["details"]["torch"] == torch.__version__
    assert describe_hardware(target, "serving")["name"] == "serving"


# ------------------------------------------------------------------------------------------------
# export / import
def test_export_import_round_trip_under_another_name(db_url, target, drafters, tmp_path):
    measure(db_url, target, drafters, "run-1")
    path = tmp_path / "profile.json"
    document = export_costs("tiny-cpu", path, Store.open(db_url))
    on_disk = json.loads(path.read_text("utf-8"))
    assert on_disk["format"] == FILE_FORMAT == "specdec-cost-profile/1"
    assert on_disk["run_id"] == "run-1" and on_disk["hardware_profile"]["name"] == "tiny-cpu"
    assert len(on_disk["costs"]) == len(EXPECTED_KEYS) and document["costs"] == on_disk["costs"]
    result = import_costs(path, Store.open(db_url), name="serving-gpu")
    assert result["rows"] == len(EXPECTED_KEYS) and result["run_id"] == "run-1"
    assert result["hardware_profile"]["name"] == "serving-gpu"

    def without_name(rows):
        return sorted((r["run_id"], r["component"], r["drafter"] or "", r["k"] or 0, r["batch_size"],
                       r["seconds"]) for r in rows)

    assert without_name(cost_rows(db_url, "serving-gpu")) == without_name(cost_rows(db_url, "tiny-cpu"))
    expected = CostTable.from_rows("serving-gpu", "run-1", load_costs("tiny-cpu", Store.open(db_url)).rows())
    expected.check = load_costs("tiny-cpu", Store.open(db_url)).check    # the profile's check travels with it
    assert expected.check["status"] == "unchecked" and expected.spread
    assert load_costs("serving-gpu", Store.open(db_url)) == expected
    hardware = {r["name"]: r for r in fetch(db_url, select(HardwareProfile))}
    assert set(hardware) == {"tiny-cpu", "serving-gpu"}
    assert (hardware["serving-gpu"]["device"], hardware["serving-gpu"]["dtype"],
            hardware["serving-gpu"]["details"]) == (hardware["tiny-cpu"]["device"],
                                                    hardware["tiny-cpu"]["dtype"],
                                                    hardware["tiny-cpu"]["details"])
    # importing again is idempotent
    import_costs(path, Store.open(db_url), name="serving-gpu")
    assert len(cost_rows(db_url, "serving-gpu")) == len(EXPECTED_KEYS)


def good_document():
    return {"format": FILE_FORMAT, "run_id": "r", "hardware_profile": {
        "name": "x", "device": "d", "dtype": "float32", "details": None},
        "costs": [{"component": "target_step", "drafter": None, "k": None, "batch_size": 1, "seconds": 0.01},
                  {"component": "verify", "drafter": None, "k": 1, "batch_size": 1, "seconds": 0.012}]}


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps(dict(good_document(), format="specdec-cost-profile/0")),
    json.dumps([good_document()]),
    json.dumps(dict(good_document(), costs=[{"component": "verify", "k": None, "batch_size": 1,
                                             "seconds": 0.01}])),
    json.dumps(dict(good_document(), costs=[{"component": "warp", "batch_size": 1,
                                             "seconds": 0.01}])),
    json.dumps(dict(good_document(), costs=good_document()["costs"][:1])),   # no verify costs
    json.dumps(dict(good_document(), costs=[])),
], ids=["broken-json", "wrong-format", "not-an-object", "verify-without-k", "unknown-component",
        "no-verify", "no-rows"])
def test_malformed_profile_file_is_an_error_naming_the_file(db_url, tmp_path, content):
    path = tmp_path / "bad-profile.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CostProfileError) as caught:
        import_costs(path, Store.open(db_url))
    assert str(path) in str(caught.value)
    assert cost_rows(db_url) == []


def test_missing_profile_file_is_an_error_naming_the_file(db_url, tmp_path):
    with pytest.raises(CostProfileError) as caught:
        import_costs(tmp_path / "absent.json", Store.open(db_url))
    assert str(tmp_path / "absent.json") in str(caught.value)


def test_hand_written_profile_imports(db_url, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(good_document()), encoding="utf-8")
    assert import_costs(path, Store.open(db_url))["rows"] == 2
    costs = load_costs("x", Store.open(db_url))
    assert costs.verify_ratios(1) == pytest.approx([1.2]) and costs.run_id == "r"


def test_profile_file_without_hardware_profile_is_an_error_naming_the_file(db_url, tmp_path):
    document = good_document()
    del document["hardware_profile"]
    path = tmp_path / "bad-profile.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(CostProfileError) as caught:
        import_costs(path, Store.open(db_url))
    assert str(path) in str(caught.value)


# ------------------------------------------------------------------------------------------------
# timing lock
PROBE = """
import fcntl, os, sys
path = os.path.join(os.environ["SPECDEC_HOME"], "locks", "timing.lock")
with open(path, "a") as handle:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("busy")
    else:
        print("free")
"""


def probe() -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.integration
def test_timing_lock_is_exclusive_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with timing_lock():
        assert (tmp_path / "locks" / "timing.lock").exists()
        assert probe() == "busy"
    assert probe() == "free"
    # released when the work inside raises, too
    with pytest.raises(RuntimeError):
        with timing_lock():
            assert probe() == "busy"
            raise RuntimeError("boom")
    assert probe() == "free"


# ------------------------------------------------------------------------------------------------
# CLI
@pytest.fixture
def wide_console(monkeypatch):
    """Print the CLI's tables without wrapping (capsys is not a terminal: rich would use 80 columns)."""
    from rich.console import Console

    import tasks.cli.profile

    monkeypatch.setattr(tasks.cli.profile, "console", Console(width=400))


def test_cli_profile_export_import_show(db_url, target, drafters, tmp_path, capsys, wide_console):
    from tasks.cli import main

    measure(db_url, target, drafters, "run-1")
    path = tmp_path / "exported.json"
    assert main(["profile", "export", "tiny-cpu", str(path), "--url", db_url]) == 0
    out = capsys.readouterr().out
    assert f"wrote {len(EXPECTED_KEYS)} cost rows of tiny-cpu (run run-1) to {path}" in out
    assert json.loads(path.read_text("utf-8"))["format"] == FILE_FORMAT
    assert main(["profile", "import", str(path), "--name", "serving-gpu", "--url", db_url]) == 0
    out = capsys.readouterr().out
    assert f"imported {len(EXPECTED_KEYS)} cost rows as profile serving-gpu (run run-1)" in out
    assert main(["profile", "show", "serving-gpu", "--url", db_url]) == 0
    out = capsys.readouterr().out
    assert "cost profile serving-gpu (run run-1)" in out
    for header in ("batch", "target step ms", "v(1)", "v(2)", f"draft {LS}", f"draft {PL}"):
        assert header in out
    batch_column = [line.split("│")[1].strip() for line in out.splitlines()
                    if line.count("│") >= 7 and "batch" not in line]
    assert batch_column == ["1", "2"]
    # v(K) shown as ratios: v(1) at batch 1 equals the stored ratio
    costs = load_costs("serving-gpu", Store.open(db_url))
    row_1 = [line for line in out.splitlines() if line.count("│") >= 7 and line.split("│")[1].strip() == "1"][0]
    spread = costs.spread[("verify", None, 1, 1)]
    assert row_1.split("│")[3].strip() == f"{costs.verify_ratios(1)[0]:.2f} ±{100 * spread:.0f}%"
    assert "check: unchecked (1 check(s), largest spread 0%)" in out   # one repeat: no spread


def test_cli_profile_show_unknown_is_exit_2(db_url, capsys, wide_console):
    from tasks.cli import main

    assert main(["profile", "show", "unknown", "--url", db_url]) == 2
    captured = capsys.readouterr()      # errors go to stderr, stdout stays empty
    assert "error" in captured.err and "CostProfileError" in captured.err and "'unknown'" in captured.err
    assert captured.out == ""
    assert main(["profile", "export", "unknown", "x.json", "--url", db_url]) == 2
    assert "'unknown'" in capsys.readouterr().err


def _paired(batch: int, k: int, step_s, steps: int, drafted_per_step: float, sampling: str = "greedy",
            contended=()) -> list:
    """A paired engine's timings at one K (step_s: one figure, or one per repeat)."""
    figures = step_s if isinstance(step_s, list) else [step_s] * 3
    return [{"batch_size": batch, "sampling": sampling, "k": k, "repeat": r, "wall_s": s * steps + 0.1,
             "decode_s": s * steps, "steps": steps, "tokens": steps + 1, "decode_tokens": steps,
             "drafted": drafted_per_step * steps * batch, "accepted": 0, "contended": r in contended,
             "other_cores": 0.0} for r, s in enumerate(figures)]


def test_vllm_profile_prices_verify_from_pairs_inside_one_engine_and_other_drafters_beside_it():
    """tasks.steps.costs.engine_costs._table: one ngram engine timing K 0 and each K in alternating
    batches becomes a cost profile: the K 0 step is the target step; verify(K) its paired ratio,
    solved from the share of steps whose n-gram search proposed K, interpolated between the K
    timed; a model drafter's step per token is its own engine's ratio less the ngram one's."""
    from tasks.steps.costs.engine_costs import _table

    # the machine slowed by 50% in the third repeat: each pair sees it on both sides
    ngram = (_paired(1, 0, [0.040, 0.040, 0.060], 50, 0.0) + _paired(1, 1, [0.044, 0.044, 0.066], 50, 1.0)
             # half the steps proposed 3: 0.052 = 0.5 * verify(3) + 0.5 * 0.040
             + _paired(1, 3, [0.052, 0.052, 0.078], 50, 1.5))
    # an EAGLE-3 head at K = 3: its ratio 1.75 less verify(3)'s 1.6, over 3 draft tokens
    head = _paired(1, 0, 0.040, 50, 0.0) + _paired(1, 3, 0.070, 50, 3.0)
    answers = {"ngram": _answer(ngram), "eagle3(model=/h)": _answer(head)}
    runs = [("ngram", {}, None, [1, 3]),
            ("eagle3(model=/h)", {"method": "eagle3"}, {"kind": "eagle3", "params": {"model": "/h"}}, [3])]
    table, reasons, notes = _table(answers, runs, 3, [1], 3, load_settings())
    assert table.target_step[1] == pytest.approx(0.040)
    assert table.verify[1][1] == pytest.approx(0.044)
    assert table.verify[1][3] == pytest.approx(0.064)
    assert table.verify[1][2] == pytest.approx((0.044 + 0.064) / 2)      # interpolated
    assert table.draft_step["eagle3(model=/h)"][1] == pytest.approx(0.040 * 0.15 / 3)
    assert reasons == [] and notes == []             # every pair the same ratio: settled
    assert table.spread[("verify", None, 3, 1)] == pytest.approx(0.0, abs=1e-9)
    # ratios that scatter: a note past ratio_halfwidth (the plan's interval carries it)
    answers["ngram"] = _answer(ngram[:6] + _paired(1, 3, [0.052, 0.056, 0.090], 50, 1.5))
    table, reasons, notes = _table(answers, runs, 3, [1], 3, load_settings())
    assert reasons == [] and any("ngram K=3 at batch 1" in n for n in notes), notes
    # one pair far off among agreeing ones moves neither the figure nor its interval (the median
    # and a robust spread): a batch the machine slowed is not the cost
    answers["ngram"] = _answer(ngram[:6] + _paired(1, 3, [0.052, 0.052, 0.150], 50, 1.5))
    table, reasons, notes = _table(answers, runs, 3, [1], 3, load_settings())
    assert table.verify[1][3] == pytest.approx(0.064) and reasons == [] and notes == []
    answers["ngram"] = _answer(ngram[:6] + _paired(1, 3, [0.052, 0.120, 0.060], 50, 1.5))
    table, reasons, notes = _table(answers, runs, 3, [1], 3, load_settings())
    assert reasons == [] and any("ngram K=3 at batch 1" in n for n in notes), notes
    # ... and the predicted speedup's interval widens by the cost's (a paired profile)
    table.check = {"status": "ok", "details": {"paired": True}}
    width = table.spread[("verify", None, 3, 1)]
    assert width > 0.5 and table.cost_halfwidth(3, 1) == pytest.approx(width)


def test_vllm_profile_never_prices_a_larger_k_below_a_smaller_one_beyond_their_intervals():
    from tasks.steps.costs.engine_costs import _table

    # K 2 12% cheaper than K 1, settled: within profile_verify_dip (a CPU's kernels change path
    # with the width, repeatably), priced as measured
    ngram = (_paired(1, 0, 0.040, 50, 0.0) + _paired(1, 1, 0.060, 50, 1.0)
             + _paired(1, 2, 0.053, 50, 2.0))
    table, reasons, _ = _table({"ngram": _answer(ngram)}, [("ngram", {}, None, [1, 2])], 2, [1], 2,
                               load_settings())
    assert table.verify[1][2] == pytest.approx(0.053) and reasons == []
    # 33% cheaper: beyond the dip and both intervals, priced at K 1's (the dearer: a busy machine
    # slows a batch, never speeds one up), named, and its spread covers the gap; the profile is
    # not refused for it (the plan's interval carries it)
    ngram = ngram[:6] + _paired(1, 2, 0.040, 50, 2.0)
    table, reasons, notes = _table({"ngram": _answer(ngram)}, [("ngram", {}, None, [1, 2])], 2, [1],
                                   2, load_settings())
    assert table.verify[1][2] == pytest.approx(table.verify[1][1]) == pytest.approx(0.060)
    assert reasons == [] and any("K=2" in n and "cheaper than K=1" in n for n in notes), notes
    assert table.spread[("verify", None, 2, 1)] == pytest.approx((0.060 - 0.040) / 0.060)
    table.check = {"status": "ok", "details": {"paired": True}}
    assert table.cost_halfwidth(2, 1) == pytest.approx(1 / 3)


def test_vllm_profile_pairs_contended_repeats_only_where_no_clean_ones_are_left():
    from tasks.steps.costs.engine_costs import _table

    runs = [("ngram", {}, None, [1])]
    # repeats 0 and 1 clean; repeat 2 contended with a ratio far off: left out
    ngram = _paired(1, 0, 0.040, 50, 0.0, contended={2}) + _paired(1, 1, [0.044, 0.044, 0.090], 50, 1.0,
                                                                    contended={2})
    table, _, notes = _table({"ngram": _answer(ngram)}, runs, 1, [1], 1, load_settings())
    assert table.verify[1][1] == pytest.approx(0.044) and not any("other processes" in n for n in notes)
    # every repeat contended: all are paired, and the note says so
    ngram = _paired(1, 0, 0.040, 50, 0.0, contended={0, 1, 2}) + _paired(1, 1, 0.044, 50, 1.0,
                                                                          contended={0, 1, 2})
    table, _, notes = _table({"ngram": _answer(ngram)}, runs, 1, [1], 1, load_settings())
    assert table.verify[1][1] == pytest.approx(0.044) and any("other processes" in n for n in notes)


def test_only_requests_that_sample_with_top_p_pay_a_serving_engines_sampled_steps():
    # vLLM's top-p sorts the vocabulary at each verified position; temperature alone or top-k
    # only cost about what greedy does (benchmarks/results/sampled_costs.md)
    from specdec_core.sampling import SamplingParams
    from tasks.steps.checks.engine_compare import pays_sampled

    assert pays_sampled(SamplingParams(temperature=0.7, top_p=0.9))
    assert pays_sampled(SamplingParams(temperature=0.8, top_k=50, top_p=0.95))
    assert not pays_sampled(SamplingParams(temperature=1.0))
    assert not pays_sampled(SamplingParams(temperature=0.8, top_k=50))
    assert not pays_sampled(SamplingParams(temperature=0.0, top_p=0.9))      # greedy: argmax


def test_vllm_profile_prices_sampled_requests_apart_and_plans_a_domains_mix():
    """Sampled requests timed in the same engine become sampled_step / sampled_verify; for_sampling
    blends them by a share of sampled requests (linear in K between the K timed), the rows survive
    a store and load, and the engine check prices each request with its own sampling."""
    import numpy as np

    from specdec_core.estimate import RoundTotals
    from tasks.steps.checks.engine_compare import predicted_speedup
    from tasks.steps.costs.engine_costs import _table

    ngram = (_paired(1, 0, 0.040, 50, 0.0) + _paired(1, 1, 0.044, 50, 1.0) + _paired(1, 3, 0.048, 50, 3.0)
             + _paired(1, 0, 0.042, 50, 0.0, "sampled") + _paired(1, 1, 0.050, 50, 1.0, "sampled")
             # sampled: half the steps proposed 3, 0.059 = 0.5 * verify(3) + 0.5 * 0.042
             + _paired(1, 3, 0.059, 50, 1.5, "sampled"))
    table, reasons, _ = _table({"ngram": _answer(ngram)}, [("ngram", {}, None, [1, 3])], 3, [1], 3,
                               load_settings())
    assert reasons == []
    assert table.target_step[1] == pytest.approx(0.040) and table.verify[1][3] == pytest.approx(0.048)
    assert table.sampled_step[1] == pytest.approx(0.042)
    assert table.sampled_verify[1] == pytest.approx({1: 0.050, 3: 0.076})
    greedy, sampled = table.for_sampling(0.0), table.for_sampling(1.0)
    assert greedy is table
    assert sampled.target_step[1] == pytest.approx(0.042)
    assert sampled.verify[1] == pytest.approx({1: 0.050, 2: 0.063, 3: 0.076})   # K = 2 interpolated
    again = CostTable.from_rows("p", "r", table.rows())
    assert (again.sampled_step, again.sampled_verify) == (table.sampled_step, table.sampled_verify)
    assert CostTable("p", "r", {1: 0.04}, {1: {1: 0.05}}).for_sampling(1.0).verify == {1: {1: 0.05}}
    # the engine check prices each request with its own sampling: plain time over rounds' time
    label, spec = "prompt_lookup(max_ngram=3,min_ngram=1)", {"kind": "prompt_lookup", "params": {}}
    table.draft_step[label] = {1: 0.0}
    totals = RoundTotals(tokens=30.0, rounds=10.0, reached=np.zeros(3), accepted=np.zeros(3),
                         widths=np.array([0.0, 0.0, 0.0, 10.0]))       # every round verified K = 3
    assert predicted_speedup(table, label, spec, [totals], [False]) == pytest.approx(30 * 0.040 / (10 * 0.048))
    assert predicted_speedup(table, label, spec, [totals], [True]) == pytest.approx(30 * 0.042 / (10 * 0.076))
    both = predicted_speedup(table, label, spec, [totals, totals], [False, True])
    assert both == pytest.approx((30 * 0.040 + 30 * 0.042) / (10 * 0.048 + 10 * 0.076))


def test_a_profile_that_prices_prompt_lookup_as_a_kind_prices_every_prompt_lookup():
    # a vLLM profile stores prompt lookup once ("prompt_lookup": 0, the search is inside its
    # verify steps); a run's candidate carries its n, and a model drafter never falls back
    table = CostTable("vllm-x", "r", {1: 0.04}, {1: {1: 0.044}},
                      {"prompt_lookup": {1: 0.0}, "layer_skip": {1: 0.01}})
    assert table.draft_ratio("prompt_lookup(max_ngram=3,min_ngram=1)", 1) == 0.0
    with pytest.raises(CostProfileError):
        table.draft_ratio("layer_skip(num_layers=9)", 1)


def test_a_ladder_that_one_line_fits_is_priced_on_the_line_and_one_that_bends_as_timed():
    """tasks.steps.costs.k_ladder: where one line fits every timed K's ratio within its own
    interval, the line prices every K, narrower than any one K's interval; a ladder it misses, or
    one of two Ks, is priced as timed (linear between)."""
    from tasks.steps.costs.k_ladder import fit_line, ladder

    # a suffix engine's rounds at batch 1: 1.10 + 0.02 K, K 3 timed 4% low by chance (inside its
    # 6% interval): as timed, K 3 would look cheaper than K 2, and the plan's K follows it
    line = {k: 1.10 + 0.02 * k for k in (1, 2, 3, 4, 8)}
    timed = {**line, 3: line[3] * 0.96}
    widths = {k: 0.06 for k in timed}
    priced, spreads = ladder(timed, widths, 8)
    assert spreads is not None and set(spreads) == set(timed)
    assert priced[3] > priced[2] and all(priced[k + 1] > priced[k] for k in range(1, 8))
    assert all(abs(priced[k] / line[k] - 1) < 0.02 for k in line)
    assert all(spreads[k] < widths[k] for k in timed)        # every pair of the ladder behind each K
    # the same K 3 12% low, outside its interval: not a line; as timed, interpolated between
    bent = {**line, 3: line[3] * 0.88}
    priced, spreads = ladder(bent, widths, 8)
    assert spreads is None and priced[3] == pytest.approx(bent[3])
    assert priced[6] == pytest.approx((bent[4] + bent[8]) / 2)
    # two Ks: any line fits them, so it says nothing; an unbounded interval: no line
    assert ladder({1: 1.1, 8: 1.3}, {1: 0.05, 8: 0.05}, 8)[1] is None
    assert fit_line(timed, {**widths, 8: float("inf")}) is None


def test_vllm_profile_prices_a_straight_ladder_on_its_line_and_says_so():
    from tasks.steps.costs.engine_costs import _table

    # verify at K 1, 2, 4 and 8 on a line (1.05 + 0.025 K), every pair alike: one line, named
    ngram = _paired(1, 0, 0.040, 50, 0.0)
    for k in (1, 2, 4, 8):
        ngram += _paired(1, k, 0.040 * (1.05 + 0.025 * k), 50, float(k))
    table, reasons, notes = _table({"ngram": _answer(ngram)}, [("ngram", {}, None, [1, 2, 4, 8])], 8, [1],
                                   3, load_settings())
    assert reasons == [] and any("one line" in n and "verify at batch 1" in n for n in notes), notes
    assert table.verify[1][6] == pytest.approx(0.040 * (1.05 + 0.025 * 6), rel=1e-3)
