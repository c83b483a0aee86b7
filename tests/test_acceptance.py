"""tasks.steps.estimate.acceptance: E, per-position rates and E's interval on hand-checkable counts."""

import pytest

from tasks.steps.estimate.acceptance import (acceptance_rate, accepted_per_position, mean_accepted_length,
                                             mean_length_interval, position_rates)


def test_mean_accepted_length_is_one_plus_accepted_per_draft():
    # 300 accepted over 200 drafted steps: each step emits 1 + 1.5 tokens
    assert mean_accepted_length(300, 200) == 2.5


def test_mean_accepted_length_without_drafts_is_none():
    # no drafted step: E is undefined, not 1
    assert mean_accepted_length(0, 0) is None


def test_acceptance_rate_is_accepted_per_drafted_token():
    # 600 tokens drafted, 150 of them accepted
    assert acceptance_rate(150, 600) == 0.25


def test_acceptance_rate_without_draft_tokens_is_none():
    # nothing drafted (or no counter): no rate, not 0
    assert acceptance_rate(0, 0) is None and acceptance_rate(None, None) is None


def test_position_rates_divide_each_position_by_drafts():
    # 400 drafts; draft 0 accepted 87 times, draft 1 85, draft 2 83
    assert position_rates([87, 85, 83], 400) == [0.2175, 0.2125, 0.2075]


def test_position_rates_round_and_pad_to_a_width():
    # 3 drafts: 2/3 and 1/3 rounded to 3 digits, a third position padded with 0
    assert position_rates([2, 1], 3, width=3, digits=3) == [0.667, 0.333, 0.0]
    # a width shorter than the counts cuts them
    assert position_rates([2, 1], 4, width=1) == [0.5]


def test_position_rates_without_drafts_are_none():
    # nothing drafted: no rate, whatever the counts say
    assert position_rates([1, 2], 0) is None


def test_accepted_per_position_reads_a_histogram():
    # 5 steps accepted 0 drafts, 3 accepted 1, 2 accepted 2: position 0 accepted in 3 + 2 steps,
    # position 1 in 2
    assert accepted_per_position([5, 3, 2]) == [5, 2]
    assert accepted_per_position([4]) == [] and accepted_per_position([]) == []


def test_interval_of_identical_requests_is_a_point():
    # every request accepted 3 over 2 drafts: every resample gives E = 2.5
    assert mean_length_interval([3, 3, 3], [2, 2, 2]) == (2.5, 2.5, 2.5)


def test_interval_brackets_the_pooled_mean():
    # pooled E = 1 + (0 + 8) / (4 + 4) = 2.0; resamples range from 1.0 (both the first) to 3.0
    point, lo, hi = mean_length_interval([0, 8], [4, 4], samples=500, seed=1)
    assert point == 2.0 and lo == pytest.approx(1.0) and hi == pytest.approx(3.0)


def test_interval_without_requests_or_drafts():
    # no request: nothing; requests without drafts: no E and no interval
    assert mean_length_interval([], []) == (None, None, None)
    assert mean_length_interval([0, 0], [0, 0]) == (None, None, None)
