"""The counters of benchmarks/round_ops.py (eager operator calls and host reads per round outside
captured graphs, CPU stand-in graphs) stay at or below the figures recorded when they were added
(benchmarks/results/round_ops.md), with a margin: work creeping back into the round fails here."""

from __future__ import annotations

import pytest

from .conftest import load_script

# today's counts (benchmarks/results/round_ops.md) and the most each may grow to
BOUNDS = {"plain": (42, 0), "prompt lookup": (75.2, 3.12), "draft model": (107, 1), "LayerSkip(2)": (107, 1)}
MARGIN = 1.15


@pytest.fixture(scope="module")
def counted():
    return {row["drafter"]: row for row in load_script("benchmarks/round_ops.py", "round_ops").measure()}


@pytest.mark.parametrize("drafter", sorted(BOUNDS))
def test_eager_work_and_host_reads_per_round_do_not_creep_back(counted, drafter):
    ops, reads = BOUNDS[drafter]
    row = counted[drafter]
    assert row["rounds"] >= 5
    assert 0 < row["eager_ops"] <= ops * MARGIN, row
    assert row["host_reads"] <= reads * MARGIN, row


def test_plain_decoding_without_eos_never_reads_the_device_in_a_round(counted):
    assert counted["plain"]["host_reads"] == 0
    for drafter in ("draft model", "LayerSkip(2)"):          # the round's one read: emitted counts
        assert counted[drafter]["host_reads"] == 1
