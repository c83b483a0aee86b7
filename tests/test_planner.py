"""Planner math against hand-computed values."""

import pytest

from specdec_core.planner import expected_tokens_per_round, optimal_k, predicted_speedup


def test_constant_alpha_closed_form():
    # (1 - a^(K+1)) / (1 - a): a = 0.5, K = 3 -> 1 + .5 + .25 + .125
    assert expected_tokens_per_round(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / (1 - 0.8))


def test_alpha_one_gives_k_plus_one():
    assert expected_tokens_per_round(1.0, 7) == 8.0


def test_k_zero_emits_one_token():
    assert expected_tokens_per_round(0.9, 0) == 1.0


def test_per_position_rates_and_last_repeats():
    # a = (0.9, 0.5): 1 + .9 + .45 + .225 (a_3 = a_2 = 0.5)
    assert expected_tokens_per_round([0.9, 0.5], 3) == pytest.approx(2.575)


def test_rates_outside_unit_interval_are_refused():
    with pytest.raises(ValueError):
        expected_tokens_per_round([0.5, 1.2], 2)


def test_optimal_k_with_flat_verify_cost():
    # alpha = 0.8, c = 0.05, v = 1: speedup(K) = E(K) / (0.05 K + 1); hand-checked best K = 8
    k, speedup = optimal_k(0.8, 0.05, k_max=16)
    expected = {kk: ((1 - 0.8 ** (kk + 1)) / 0.2) / (0.05 * kk + 1) for kk in range(1, 17)}
    assert k == max(expected, key=expected.get) == 8
    assert speedup == pytest.approx(expected[8])


def test_optimal_k_with_measured_verify_costs():
    # a CPU-like verify cost: v = 1.45, 1.55, 1.6, 1.7 for K = 1..4; prompt lookup: c = 0
    k, speedup = optimal_k(0.9, 0.0, verify_cost_ratios=[1.45, 1.55, 1.6, 1.7])
    assert k == 4   # 4.0951 / 1.7 = 2.409 beats 3.439 / 1.6 = 2.149
    assert speedup == pytest.approx(expected_tokens_per_round(0.9, 4) / 1.7)


def test_optimal_k_off_when_nothing_pays():
    # low acceptance, expensive drafts: no K beats plain decoding
    assert optimal_k(0.1, 0.5, k_max=8) == (0, 1.0)
    assert optimal_k(0.3, 0.0, verify_cost_ratios=[1.5, 1.6]) == (0, 1.0)


def test_predicted_speedup_matches_design_example():
    # the seed table: alpha 0.8 at a draft cost ratio 0.07 -> about 2.8x at its best K
    k, speedup = optimal_k(0.8, 0.07, k_max=16)
    assert 2.7 < speedup < 2.9 and k in (5, 6, 7)
    assert predicted_speedup(0.8, k, 0.07) == speedup
