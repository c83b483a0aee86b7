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
    # every pair contended, all alike: after 2 x min_repeats rounds they are used, and said
    busy = [r for p in range(6) for r in pair_rows(p, 1, 0.040, 0.044, repeat=p, contended=(True, True))]
    assert probe._stop_reason(request, busy[:10], groups, 5, 10.0) is None
    assert probe._stop_reason(request, busy, groups, 6, 10.0) == "settled_contended"


def test_the_next_round_times_only_the_ratios_still_open(probe):
    groups = {(1, "greedy"): [0, 1, 2]}
    request = {"halfwidth": 0.05, "min_repeats": 3, "dip": 0.25}
    todo = [((1, "greedy"), 1), ((1, "greedy"), 2)]
    steady = [r for p in range(3) for r in pair_rows(p, 1, 0.040, 0.044, repeat=p)]
    scatter = [r for p, v in enumerate((0.050, 0.060, 0.056)) for r in pair_rows(10 + p, 2, 0.040, v, repeat=p)]
    assert probe._still_open(request, steady + scatter, groups, 3, todo) == [((1, "greedy"), 2)]
