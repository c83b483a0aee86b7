"""The vLLM probe's paired timing (tasks/serving/scripts/vllm_probe.py, run in the serving
environment; its pure parts are plain Python): a pair is a K 0 batch and a batch at K timed one
after the other, every ratio still open gets one more pair a round, and the rounds stop when none
is open, the budget is spent or a neighbour stayed throughout."""

import importlib.util
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[1] / "tasks" / "serving" / "scripts" / "vllm_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("vllm_probe_under_test", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pair_rows(pair: int, k: int, k0_step: float, k_step: float, batch: int = 1, sampling="greedy",
              repeat: int = 0, contended=(False, False)) -> list[dict]:
    """The two rows of one timed pair (20 steps each)."""
    def row(kk, step, busy):
        return {"batch_size": batch, "sampling": sampling, "k": kk, "repeat": repeat, "pair": pair,
                "decode_s": step * 20, "steps": 20, "contended": busy}
    return [row(0, k0_step, contended[0]), row(k, k_step, contended[1])]


def test_a_ratio_is_the_k_batch_over_the_k0_batch_of_its_own_pair(probe):
    # the machine halves its speed between the two pairs: each pair sees it on both sides
    rows = pair_rows(0, 2, 0.040, 0.048) + pair_rows(1, 2, 0.080, 0.096, repeat=1)
    assert probe.paired_ratios(rows, (1, "greedy"), 2) == pytest.approx([1.2, 1.2])
    # a pair with a contended batch is left out, unless every pair is asked for
    rows += pair_rows(2, 2, 0.040, 0.200, repeat=2, contended=(False, True))
    assert probe.paired_ratios(rows, (1, "greedy"), 2) == pytest.approx([1.2, 1.2])
    assert len(probe.paired_ratios(rows, (1, "greedy"), 2, contended=True)) == 3


def test_open_ratios_names_the_unsettled_ones_and_both_sides_of_a_broken_shape(probe):
    groups = {(1, "greedy"): [0, 1, 2]}
    steady = [r for p in range(3) for r in pair_rows(p, 1, 0.040, 0.044, repeat=p)]
    # K 2's pairs scatter: only K 2 stays open
    scatter = [r for p, v in enumerate((0.040, 0.060, 0.052)) for r in pair_rows(10 + p, 2, 0.040, v, repeat=p)]
    assert probe.open_ratios(steady + scatter, groups, 0.05, 3) == {((1, "greedy"), 2)}
    # K 2 settled but 30% cheaper than K 1 beyond both intervals (dip 25%): both measured again
    cheap = [r for p in range(3) for r in pair_rows(20 + p, 2, 0.040, 0.030, repeat=p)]
    assert probe.open_ratios(steady + cheap, groups, 0.05, 3, dip=0.25) == {
        ((1, "greedy"), 1), ((1, "greedy"), 2)}
    # fewer clean pairs than asked: open
    assert probe.open_ratios(steady[:4], {(1, "greedy"): [0, 1]}, 0.05, 3) == {((1, "greedy"), 1)}


def test_rounds_stop_settled_on_budget_or_with_a_neighbour_that_stayed(probe):
    groups = {(1, "greedy"): [0, 1]}
    request = {"halfwidth": 0.05, "min_repeats": 3, "max_repeats": 30, "budget_s": 100.0, "dip": 0.25}
    steady = [r for p in range(3) for r in pair_rows(p, 1, 0.040, 0.044, repeat=p)]
    assert probe._stop_reason(request, steady, groups, 3, 10.0) == "settled"
    assert probe._stop_reason(request, steady[:4], groups, 2, 10.0) is None       # two clean pairs
    assert probe._stop_reason(request, steady[:4], groups, 2, 150.0) == "budget"
    assert probe._stop_reason(request, steady[:2], groups, 1, 150.0) is None      # two rounds always
    # a round its pairs' last timings say would end past the budget is not begun; one that ends
    # inside it is
    assert probe._stop_reason(request, steady[:4], groups, 2, 90.0, 45.0) == "budget"
    assert probe._stop_reason(request, steady[:4], groups, 2, 90.0, 5.0) is None
    assert probe._stop_reason(request, steady[:2], groups, 1, 90.0, 45.0) is None  # two rounds always
    # an engine asked for three rounds (the ngram engine: profile_repeats) gets them whatever the budget
    thrice = dict(request, min_rounds=3)
    assert probe._stop_reason(thrice, steady[:4], groups, 2, 150.0, 45.0) is None
    assert probe._stop_reason(thrice, steady, groups, 3, 150.0, 45.0) == "budget"
    # every pair contended, all alike: after 2 x min_repeats rounds they are used, and said
    busy = [r for p in range(6) for r in pair_rows(p, 1, 0.040, 0.044, repeat=p, contended=(True, True))]
    assert probe._stop_reason(request, busy[:10], groups, 5, 10.0) is None
    assert probe._stop_reason(request, busy, groups, 6, 10.0) == "settled_contended"


def test_a_budget_cut_still_gives_the_smallest_batch_its_first_rounds(probe):
    # busy 20's suffix engine: cut by the budget after two rounds, its batch 1 ratios 17-37% wide
    # and summarize off; with first_rounds 3 the open batch 1 pairs get a third round, and only they
    groups = {(1, "greedy"): [0, 1, 2], (8, "greedy"): [0, 1, 2]}
    todo = [((b, "greedy"), k) for b in (1, 8) for k in (1, 2)]
    rows, pair = [], 0
    for repeat, wobble in enumerate((1.0, 1.3)):
        for b in (1, 8):
            for k in (1, 2):
                rows += pair_rows(pair, k, 0.040, 0.040 * (1 + 0.1 * k) * wobble, batch=b, repeat=repeat)
                pair += 1
    request = {"halfwidth": 0.05, "min_repeats": 3, "max_repeats": 30, "budget_s": 70.0, "dip": 0.25}
    took = {item: 10.0 for item in todo}
    assert probe._next_round(request, rows, groups, 2, todo, 78.0, took, 1) == ("budget", todo)
    third = dict(request, first_rounds=3)
    assert probe._next_round(third, rows, groups, 2, todo, 78.0, took, 1) == (None, todo[:2])
    # after the third round the budget stops them
    rows += [r for k in (1, 2) for r in pair_rows(pair + k, k, 0.040, 0.040 * (1 + 0.1 * k), repeat=2)]
    assert probe._next_round(third, rows, groups, 3, todo[:2], 81.0, took, 1)[0] == "budget"
    # inside the budget nothing changes: every open pair goes on
    assert probe._next_round(third, rows[:-4], groups, 2, todo, 10.0, took, 1) == (None, todo)


def test_the_next_round_times_only_the_ratios_still_open(probe):
    groups = {(1, "greedy"): [0, 1, 2]}
    request = {"halfwidth": 0.05, "min_repeats": 3, "dip": 0.25}
    todo = [((1, "greedy"), 1), ((1, "greedy"), 2)]
    steady = [r for p in range(3) for r in pair_rows(p, 1, 0.040, 0.044, repeat=p)]
    scatter = [r for p, v in enumerate((0.050, 0.060, 0.056)) for r in pair_rows(10 + p, 2, 0.040, v, repeat=p)]
    assert probe._still_open(request, steady + scatter, groups, 3, todo) == [((1, "greedy"), 2)]


def test_a_batch_a_burst_stalled_is_left_out_though_proc_saw_nothing(probe):
    # busy 2's ngram engine, CPU 1 to itself: a K 0 batch read 406 ms a step against 36-42 for
    # the others, with no contention in /proc; its pair gave 0.09. More than `slack` over the
    # fastest batch of its cell, it is left out
    rows = (pair_rows(0, 2, 0.040, 0.048) + pair_rows(1, 2, 0.406, 0.046, repeat=1)
            + pair_rows(2, 2, 0.041, 0.049, repeat=2))
    assert len(probe.paired_ratios(rows, (1, "greedy"), 2)) == 3
    assert probe.paired_ratios(rows, (1, "greedy"), 2, slack=1.0) == pytest.approx([1.2, 49 / 41])
    # a quiet machine's spread (up to 1.5x the fastest) stays in
    calm = pair_rows(3, 2, 0.055, 0.066, repeat=3)
    assert len(probe.paired_ratios(rows + calm, (1, "greedy"), 2, slack=1.0)) == 3


def test_the_engines_pooled_spread_settles_two_agreeing_pairs_and_prices_one(probe):
    # twelve ratios of two pairs each, all within 2% of their own: pooled, their spread is about
    # 2% of a ratio on 12 degrees of freedom, so two pairs settle a ratio within 5%, where each
    # ratio's own t with one degree of freedom (12.7) would keep it open
    groups = {(b, "greedy"): [0, 1, 2, 4] for b in (1, 2, 4, 8)}
    rows, pair = [], 0
    for b in (1, 2, 4, 8):
        for k in (1, 2, 4):
            for wobble in (0.99, 1.01):
                rows += pair_rows(pair, k, 0.040, 0.040 * (1 + 0.1 * k) * wobble, batch=b, repeat=pair % 2)
                pair += 1
    spread, df = probe.pooled_spread(rows, groups)
    assert df == 12 and 0.01 < spread < 0.03
    alone = probe.ratio_interval(probe.paired_ratios(rows, (1, "greedy"), 1))
    pooled = probe.ratio_interval(probe.paired_ratios(rows, (1, "greedy"), 1), (spread, df))
    assert alone[1] > 0.05 * alone[0] and pooled[1] <= 0.05 * pooled[0]
    assert probe.open_ratios(rows, groups, 0.05, 2) == set()
    # one clean pair: priced with the pooled spread (a single pair cannot judge itself)
    assert probe.ratio_interval([1.1], (spread, df))[1] == pytest.approx(probe.t95(df) * spread * 1.1)
    assert probe.ratio_interval([1.1])[1] == float("inf")


def test_a_replayed_request_far_slower_a_step_than_its_ks_fastest_is_marked_slowed(probe):
    # busy 1 of the last series: json's twins stalled 2.5 times over (4.5 s against 1.8 s) by a
    # neighbour in bursts, none over the /proc limit; each K is judged against its own fastest
    def served(decode_s, tokens, drafted=None):
        return {"decode_s": decode_s, "token_ids": list(range(tokens)), "drafted": drafted}

    items = [{"id": "a", "k": 4}, {"id": "b", "k": 4}, {"id": "plain::a", "k": 0},
             {"id": "plain::b", "k": 0}, {"id": "c", "k": 4}]
    answer = {"a": served(0.60, 47, drafted=[4] * 20), "b": served(3.40, 47, drafted=[4] * 20),
              "plain::a": served(1.80, 47), "plain::b": served(4.50, 47),
              "c": served(None, 47)}
    assert probe.replay_step(answer["a"]) == pytest.approx(0.03)           # 20 drafted steps
    assert probe.replay_step(answer["plain::a"]) == pytest.approx(1.80 / 46)
    assert probe.replay_step(answer["c"]) is None and probe.replay_step(None) is None
    probe.mark_slowed(items, answer, 1.0)
    assert {key: row["slowed"] for key, row in answer.items()} == {
        "a": False, "b": True, "plain::a": False, "plain::b": True, "c": False}
    # within twice the fastest: not slowed; no slack: never
    probe.mark_slowed(items, answer, 2.0)
    assert answer["plain::b"]["slowed"] is False and answer["b"]["slowed"] is True
    probe.mark_slowed(items, answer, None)
    assert not any(row["slowed"] for row in answer.values())


def test_an_engine_timed_on_fewer_cpus_than_the_machine_is_named_as_a_smaller_engine():
    # one OpenMP thread per CPU given (environment.thread_env): an engine left one CPU by a
    # neighbour times a 1-thread engine's steps, which the profile's check notes say
    from tasks.serving.environment import choose_cpus, fewer_cpus

    shared = choose_cpus({0: 0.9, 1: 0.05})          # a neighbour on CPU 0
    assert fewer_cpus(shared) == ("timed on 1 of 2 CPUs (other processes kept 0.95 cores busy): "
                                  "a 1-thread engine's costs")
    assert fewer_cpus(choose_cpus({0: 0.02, 1: 0.05})) is None and fewer_cpus(None) is None


def test_a_profiles_engines_run_as_many_threads_as_its_first_and_its_name_says_how_many():
    # a suffix engine's draft step is its step less the ngram engine's: both must be the same
    # size, whatever a neighbour does between their starts; a profile of 1-thread engines is
    # keyed apart from the whole machine's, so a quiet run never reuses it
    from tasks.serving.environment import choose_cpus
    from tasks.steps.costs.costs import profile_key
    from tasks.steps.costs.vllm_hardware import engine_threads, vllm_hardware

    assert choose_cpus({0: 0.9, 1: 0.05}, count=2) == {"cpus": [0, 1], "others": 0.95, "spare": 0, "bind": None}
    assert choose_cpus({0: 0.02, 1: 0.05}, count=1) == {"cpus": [0], "others": 0.07, "spare": 1, "bind": "0"}
    assert choose_cpus({0: 0.9, 1: 0.05, 2: 0.0}, count=5)["cpus"] == [0, 1, 2]
    busy = [{"threads": choose_cpus({0: 0.9, 1: 0.05})}, {"threads": choose_cpus({0: 0.9, 1: 0.05}, count=1)}]
    assert engine_threads(busy) == 1 and engine_threads([{"threads": choose_cpus({0: 0.0, 1: 0.0})}]) is None
    whole, small = vllm_hardware("0.32.0", "float32"), vllm_hardware("0.32.0", "float32", threads=1)
    assert "cpu-1t" in small["name"] and "(1 threads)" in small["device"]
    if "cpu-1t" not in whole["name"]:       # a machine of more than one thread
        assert profile_key(small, "vllm", "0.32.0", "f") != profile_key(whole, "vllm", "0.32.0", "f")


def test_a_replays_budget_is_shared_out_over_its_domains_in_turn(probe):
    # each domain's pairs start within its cumulative share: one that ends early leaves its
    # time to the next ones; no budget, no limit
    items = [{"id": "c0", "group": "code"}, {"id": "plain::c0", "group": "code"},
             {"id": "j0", "group": "json"}, {"id": "j1", "group": "json"}, {"id": "s0", "group": "summarize"}]
    assert probe.budget_shares(items, 300.0) == {"code": 100.0, "json": 200.0, "summarize": 300.0}
    assert probe.budget_shares(items, None) == {}


def test_a_domain_whose_pairs_the_budget_left_out_is_decided_on_those_served_or_named_contended():
    from tasks.settings import load_settings
    from tasks.db.engine_records import EngineCheckRow
    from tasks.steps.checks.engine_compare import left_out

    settings = load_settings(engine_check_budget_s=240)
    row = EngineCheckRow(status="ok", passed=True, reason="engine check: vLLM E 2.10 vs estimate 2.00")
    partly = left_out(row, 3, 8, settings)
    assert (partly.status, partly.passed) == ("ok", True)
    assert partly.reason.startswith("engine check: vLLM E 2.10")
    assert "3 of 8 requests left out" in partly.reason and "engine_check_budget_s, 240 s" in partly.reason
    wholly = left_out(row, 8, 8, settings)
    assert wholly.status == "contended" and wholly.passed is None
    assert "all 8 requests left out" in wholly.reason


def test_the_ngram_engine_is_asked_for_profile_repeats_rounds_and_a_suffix_engine_for_two_beyond_batch_1():
    # the ngram engine's steps price every plain step and sampled request: a busy machine's
    # budget must not cut it to two rounds; a suffix engine's share is its own
    from tasks.settings import load_settings
    from tasks.steps.costs.engine_costs import NGRAM, VllmProfilePlan, _engine_request

    runs = [(NGRAM, {"method": "ngram"}, None, [1, 2, 4, 8]),
            ("suffix", {"method": "suffix"}, None, [1, 2, 3, 4, 8])]
    plan = VllmProfilePlan("m", "float32", 256, [1, 2, 4, 8], [1, 2, 4, 8], [1, 8], runs, set(), {})
    settings = load_settings(profile_repeats=3, profile_engine_budget_s=180)
    ngram, suffix = (_engine_request(plan, run, settings) for run in runs)
    assert (ngram["min_rounds"], suffix["min_rounds"]) == (3, 2)
    assert ngram["first_rounds"] == suffix["first_rounds"] == 3       # batch 1: where domains turn on
    assert (ngram["budget_s"], suffix["budget_s"]) == pytest.approx((108.0, 72.0))
