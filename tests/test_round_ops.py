"""The counters of benchmarks/round_ops.py (eager operator calls and host reads per round outside
captured graphs, CPU stand-in graphs) stay at or below the figures recorded when they were added
(benchmarks/results/round_ops.md), with a margin: work creeping back into the round fails here."""

from __future__ import annotations

import pytest

from .helpers.scripts import load_script

# today's counts (benchmarks/results/round_ops.md) and the most each may grow to
BOUNDS = {"plain": (0, 0), "prompt lookup": (7, 1), "draft model": (5, 1), "LayerSkip(2)": (5, 1),
          "draft head": (5, 1)}
MARGIN = 1.15
# the goal: a round is (at most) a draft replay, a verify replay and one read of the device
GOAL_OPS, GOAL_READS = 10, 1


@pytest.fixture(scope="module")
def counted():
    return {row["drafter"]: row for row in load_script("benchmarks/round_ops.py", "round_ops").measure()}


@pytest.mark.parametrize("drafter", sorted(BOUNDS))
def test_eager_work_and_host_reads_per_round_do_not_creep_back(counted, drafter):
    ops, reads = BOUNDS[drafter]
    row = counted[drafter]
    assert row["rounds"] >= 5
    assert row["eager_ops"] <= min(ops * MARGIN, GOAL_OPS), row
    assert row["host_reads"] <= min(reads * MARGIN, GOAL_READS), row


def test_plain_decoding_without_eos_is_all_captured_and_never_reads_the_device(counted):
    assert counted["plain"]["host_reads"] == 0
    assert counted["plain"]["eager_ops"] == 0
    # speculative rounds read the device exactly once: emitted counts, active rows, tokens
    for drafter in ("prompt lookup", "draft model", "LayerSkip(2)", "draft head"):
        assert counted[drafter]["host_reads"] == 1
