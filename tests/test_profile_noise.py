"""Cost profiles that know their own noise: the consistency and spread checks (by hand on built
tables), the planner's refusal to turn a domain on from a noisy profile, and real measurements of
the tiny model, quiet and with a busy neighbour process (no mocked timings)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import select

from tasks.steps.costs.costs import (CostTable, check_costs, load_costs, measure_until_consistent,
                                     profile_costs)
from tasks.db.models import CostProfileCheck
from tasks.db.store import Store
from tasks.steps.plan.plan import plan_domain
from tasks.settings import load_settings

from .helpers.costs import LS, LS_SPEC, PL, PL_SPEC, add_estimate, configs, cost_table
from .helpers.db import fetch
from .helpers.models import tiny_llama

SIZES = (1, 2, 4)


def consistent() -> CostTable:
    # steps grow with the batch, verify grows with K and costs at least a step
    return cost_table()


def with_step(table: CostTable, batch: int, seconds: float) -> CostTable:
    table.target_step[batch] = seconds
    return table


def test_a_consistent_quiet_table_passes():
    assert check_costs(consistent(), {1: {"plain": 0.001}}, max_spread=0.15, noise_floor=0.05) == []


def test_a_step_that_falls_as_the_batch_grows_is_flagged_beyond_noise_only():
    table = with_step(consistent(), 2, 0.017)       # batch 1: 20 ms, batch 2: 17 ms (-15%)
    [reason] = check_costs(table, noise_floor=0.05)
    assert reason == "target step falls as the batch grows: 20.0 ms at batch 1, 17.0 ms at batch 2"
    # within the noise floor, or within the figures' own spread, it is not a fall
    assert check_costs(table, noise_floor=0.2) == []
    table.spread[("target_step", None, None, 2)] = 0.1
    table.spread[("target_step", None, None, 1)] = 0.16
    assert not any("falls as the batch" in r for r in check_costs(table, noise_floor=0.05, max_spread=1))


def test_verify_cheaper_than_a_step_and_falling_with_k_are_flagged():
    table = cost_table(verify={1: [0.8, 1.4], 2: [1.5, 2.0], 4: [2.0, 3.0]})
    assert check_costs(table) == ["verify cheaper than one step at batch 1: v(1) = 0.80"]
    # a verify pass a little below a step, as a CPU's padded one-token path makes it, is allowed
    # by default (step_dip 10%), and a setting narrows it
    near = cost_table(verify={1: [1.2, 1.4], 2: [1.5, 2.0], 4: [0.94, 3.0]})
    assert check_costs(near) == []
    assert check_costs(near, step_dip=0.05) == ["verify cheaper than one step at batch 4: v(1) = 0.94"]
    table = cost_table(verify={1: [1.2, 1.4], 2: [2.0, 1.4], 4: [2.0, 3.0]})
    assert check_costs(table) == ["verify falls as K grows at batch 2: v(1) = 2.00 but v(2) = 1.40"]
    # a dip as a CPU's kernels make it (-16%) is allowed by default, and a setting narrows it
    dip = cost_table(verify={1: [1.2, 1.4], 2: [2.0, 1.68], 4: [2.0, 3.0]})
    assert check_costs(dip) == []
    assert check_costs(dip, verify_dip=0.1) == [
        "verify falls as K grows at batch 2: v(1) = 2.00 but v(2) = 1.68"]


def test_negative_overheads_and_wide_spreads_are_flagged():
    table = consistent()
    [reason] = check_costs(table, {1: {"plain": -0.006}})      # -0.3 of a 20 ms step
    assert reason.startswith("negative overhead at batch 1: plain -0.30 of a step")
    assert check_costs(table, {1: {"plain": -0.002}}) == []    # -0.1 of a step: within the floor
    assert check_costs(table, {1: {"plain": -0.002}}, overhead_floor=0.05) != []
    table.spread[("verify", None, 2, 4)] = 0.4
    table.spread[("draft_step", LS, None, 1)] = 0.2
    [reason] = check_costs(table, max_spread=0.15)
    assert reason == "spread 40% > 15% (v(2) at batch 4; 2 figures in all)"
    # just over the bar: as many decimals as it takes to differ (not "spread 25% > 25%")
    table.spread = {("verify", None, 2, 4): 0.2504}
    assert check_costs(table, max_spread=0.25) == ["spread 25.04% > 25% (v(2) at batch 4)"]


# ------------------------------------------------------------------------------------------------
# the planner on a noisy profile
def noisy(table: CostTable) -> CostTable:
    table.check = {"status": "noisy", "reasons": ["target step falls as the batch grows: 130.9 ms at "
                                                  "batch 2, 110.5 ms at batch 4"], "attempts": 3}
    return table


def test_the_planner_turns_nothing_on_from_a_noisy_profile(db_url):
    # PL K=2: 2.0 [1.9, 2.1] / 1.25 = 1.6 [1.52, 1.68] at batch 1: on from a trusted profile
    add_estimate(db_url, "plan-run", "code", PL_SPEC, 2, 2.0, 1.9, 2.1, [0.5, 0.0, 0.5])
    settings = load_settings({})
    trusted = plan_domain("plan-run", "code", cost_table(), Store.open(db_url), settings=settings)
    assert trusted["enabled"] is True and trusted["reason"].startswith("on: ")
    row = plan_domain("plan-run", "code", noisy(cost_table()), Store.open(db_url), settings=settings)
    assert row["enabled"] is False and row["k_schedule"] is None and row["max_batch_size"] is None
    assert row["reason"].startswith("off: cost profile too noisy: target step falls as the batch grows")
    assert "--hardware-profile NAME" in row["reason"] and "1.60x" in row["reason"]
    assert (row["drafter"], row["k"], row["status"]) == (PL, 2, "ok")  # confirm still measures it
    [stored] = configs(db_url)
    assert stored["enabled"] is False and stored["champion_on"] is False
    # on in the champion: the noisy profile does not turn it on, it was on; it stays as planned
    row = plan_domain("plan-run", "code", noisy(cost_table()), Store.open(db_url), settings=settings,
                      currently_on=True)
    assert row["enabled"] is True and "the cost profile is noisy" in row["reason"]
    assert configs(db_url)[0]["champion_on"] is True


def test_an_unchecked_or_ok_profile_plans_as_before(db_url):
    add_estimate(db_url, "plan-run", "code", LS_SPEC, 1, 1.75, 1.7, 1.8, [0.0, 1.0])
    for status in ("ok", "unchecked"):
        table = cost_table()
        table.check = {"status": status, "reasons": [], "attempts": 1}
        assert not table.noisy
        assert plan_domain("plan-run", "code", table, Store.open(db_url), settings=load_settings({}))["enabled"]


# ------------------------------------------------------------------------------------------------
# real measurements of the tiny model
@pytest.fixture
def drafters(target):
    from tasks.steps.drafters.candidates import build_drafters

    return {label: d for label, (_, d) in build_drafters(["prompt_lookup", "layer_skip:num_layers=2"],
                                                          target).items()}


def stored_check(db_url, run_id):
    [row] = fetch(db_url, select(CostProfileCheck).where(CostProfileCheck.run_id == run_id))
    return row


@pytest.fixture(scope="module")
def small_target():
    # the tiny model with a wider hidden size: a step of a few ms instead of one, so that the
    # machine's idle jitter (a server of another test waking up) is not most of a figure
    return tiny_llama(hidden=256, layers=4, heads=4, seed=1)


def test_a_profile_of_the_tiny_model_stores_its_check_and_every_spread(db_url, small_target):
    # real measurements: whether they come out quiet depends on this machine at that moment (a
    # shared CI machine may be busy), so the test holds either way; how often a quiet machine's
    # profile passes is measured by benchmarks/busy_neighbour.py, not asserted here
    from tasks.steps.drafters.candidates import build_drafters

    drafters = {label: d for label, (_, d) in build_drafters(
        ["prompt_lookup", "layer_skip:num_layers=2"], small_target).items()}
    settings = load_settings({}, profile_repeats=5, profile_context_len=32)
    result = profile_costs("quiet", small_target, drafters, Store.open(db_url),
                           hardware_profile="tiny-quiet", settings=settings, k_max=3,
                           batch_sizes=[1, 8], progress=False)   # (1 and 2 rows cost alike here)
    row = stored_check(db_url, "quiet")
    costs = load_costs("tiny-quiet", Store.open(db_url))
    assert result["check"]["status"] == row["status"] == costs.check["status"]
    if row["status"] == "ok":     # what was stored passes every check, with its own spreads
        assert row["reasons"] == [] and not costs.noisy
        assert check_costs(costs, max_spread=settings.profile.max_spread,
                           noise_floor=settings.profile.noise_floor) == []
    else:                         # re-measured as often as allowed, then stored with its reasons
        assert row["status"] == "noisy" and costs.noisy
        # checked after 5 passes, then after each more, up to 5 x 3 passes
        assert row["attempts"] == 1 + 5 * 2 and row["details"]["passes"] == 15
        assert len(row["details"]["earlier_attempts"]) == 10
        assert row["reasons"] == result["check"]["reasons"] != []
    # every figure carries its spread, and the stored maximum is theirs
    assert len(costs.spread) == len(costs.rows())
    assert row["max_spread"] == pytest.approx(max(costs.spread.values()))


def test_a_failing_profile_gets_one_pass_at_a_time_over_a_sliding_window(target, drafters):
    # the real sampler; the verdicts are scripted: the first two checks fail, the third passes
    from specdec_core.profile import CostSampler

    sampler = CostSampler(target, drafters, 2, [1], 16)
    held, verdicts = [], [["spread 40% > 25%"], ["spread 30% > 25%"], []]

    def check():
        held.append(len(sampler.forward[(1, 1)]))
        return "table", verdicts[len(held) - 1]

    table, reasons, earlier, passes = measure_until_consistent(sampler, check, repeats=2, most=6,
                                                               progress=False)
    assert (table, reasons, passes) == ("table", [], 4)
    assert earlier == verdicts[:2]
    assert held == [2, 3, 4]            # checked after 2 passes, then after each one more

    # a check that never passes stops at `most` passes, over the last 2 x repeats of them
    held.clear()
    table, reasons, earlier, passes = measure_until_consistent(
        sampler, lambda: (held.append(len(sampler.forward[(1, 1)])) or "t", ["noisy"]),
        repeats=2, most=7, progress=False)
    assert passes == 7 and reasons == ["noisy"] and len(earlier) == 5
    assert held == [6, 4, 4, 4, 4, 4]   # the 4 kept + 2 new, then a window of 4
    assert all(len(v) == 4 for v in sampler.draft.values())


BUSY = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass\n"


@pytest.mark.integration
def test_a_profile_measured_beside_a_busy_process_is_consistent_or_marked_noisy(db_url, target, drafters):
    # two processes spinning on this machine's cores for part of the measurement (started a
    # moment after it begins, stopped before it ends), as a large pip install would
    settings = load_settings({}, profile_repeats=5, profile_context_len=32, profile_attempts=2)
    busy: list[subprocess.Popen] = []
    cpu = []

    def neighbour():
        time.sleep(0.5)
        busy.extend(subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2))
        time.sleep(3.0)
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()
        cpu.append(True)

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        result = profile_costs("busy", target, drafters, Store.open(db_url), hardware_profile="tiny-busy",
                               settings=settings, k_max=3, batch_sizes=[1, 2, 4], progress=False)
    finally:
        thread.join()
    assert cpu and len(busy) == 2 and all(p.returncode is not None for p in busy)
    costs = load_costs("tiny-busy", Store.open(db_url))
    row = stored_check(db_url, "busy")
    if row["status"] == "ok":     # what was stored passes every check, with its own spreads
        assert check_costs(costs, max_spread=settings.profile.max_spread,
                           noise_floor=settings.profile.noise_floor) == []
        assert max(costs.spread.values()) <= settings.profile.max_spread
    else:                         # re-measured as often as allowed, then stored with its reasons
        assert row["status"] == "noisy" and costs.noisy
        assert row["attempts"] == 1 + 5 and row["details"]["passes"] == 10
        assert row["reasons"] == result["check"]["reasons"] != []
    assert result["check"]["status"] == row["status"]


def test_a_noisy_profile_is_a_warning_in_the_profile_tasks_log(monkeypatch, caplog):
    """Issue 83 item 3: the profile's "noisy" verdict was logged at INFO; it is a WARNING."""
    import logging

    from tasks.steps import model_steps

    check = {"hardware_profile": "cpu-x", "profile_run": "r0", "status": "noisy", "attempts": 3,
             "max_spread": 0.4, "reasons": ["verify(4) spread 40%"], "reused_from": None,
             "measured_at": None}
    monkeypatch.setattr(model_steps, "profile_check", lambda run_id, store: check)
    with caplog.at_level(logging.INFO, logger=model_steps.log.name):
        model_steps.log_profile_check("r1", None)
    [record] = [r for r in caplog.records if "cost profile cpu-x" in r.getMessage()]
    assert record.levelno == logging.WARNING and "too noisy to turn a domain on" in record.getMessage()
    monkeypatch.setattr(model_steps, "profile_check", lambda run_id, store: dict(check, status="ok"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=model_steps.log.name):
        model_steps.log_profile_check("r1", None)
    assert [r.levelno for r in caplog.records if "cost profile cpu-x" in r.getMessage()] == [logging.INFO]
