"""Losslessness checks: they pass the exact engine and catch broken verifiers."""

from __future__ import annotations


import pytest
import torch

from specdec_core import DraftModel, PromptLookup, SpecDecoder
from specdec_core.faults import BROKEN_VARIANTS
from specdec_core.validation import (chi2_sf, compare_fingerprints, g_test, greedy_check,
                                     monte_carlo_p, sampling_check, target_fingerprint)
from specdec_core.verify import relaxed_verify

from .helpers.models import PROMPT, tiny_llama


def test_greedy_check_passes_the_exact_engine(target, draft):
    # speculative == plain for a prompt-lookup and a draft-model drafter
    ids = torch.randint(3, 97, (3, 10), generator=torch.Generator().manual_seed(2))
    for drafter in (PromptLookup(min_ngram=1), DraftModel(draft)):
        report = greedy_check(target, drafter, 3, ids, max_new_tokens=20)
        assert report.passed and report.exact_rows == 3 and not report.divergences


def test_greedy_check_reports_a_divergence_with_its_margin(target, draft):
    # a verifier that accepts anything (relaxed, huge gap) diverges; the report names row and step
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(3))

    class AcceptsAll(SpecDecoder):
        def __init__(self, *a, **kw):
            kw["verifier"] = lambda *args, **kws: relaxed_verify(*args, top_k=97, log_gap=1e9, **kws)
            super().__init__(*a, **kw)

    report = greedy_check(target, DraftModel(draft), 3, ids, max_new_tokens=12, decoder_cls=AcceptsAll)
    assert not report.passed and report.divergences
    assert all(d.margin >= 1e-4 and not d.acceptable for d in report.divergences)


def test_g_test_flags_an_impossible_token():
    from collections import Counter

    statistic, _, _ = g_test(Counter({0: 10, 2: 1}), torch.tensor([0.5, 0.5, 0.0]))
    assert statistic == float("inf")


def test_monte_carlo_p_keeps_the_false_alarm_rate_at_small_samples():
    # 100 tokens from the target's own distribution, many near-threshold bins: the chi-square
    # p-value rejects more often than alpha says; the simulated one does not (binomial 3-sigma)
    from collections import Counter

    probs = torch.tensor([0.06] * 10 + [0.4 / 80] * 80)
    nulls, alpha = 3000, 0.01
    samples = torch.multinomial(probs.expand(nulls, -1).contiguous(), 100, replacement=True,
                                generator=torch.Generator().manual_seed(1))
    chi2_hits = simulated_hits = 0
    for index in range(nulls):
        counts = Counter(samples[index].tolist())
        statistic, dof, _ = g_test(counts, probs)
        p_chi2 = chi2_sf(statistic, dof)
        chi2_hits += p_chi2 < alpha
        if p_chi2 < 10 * alpha:    # far from the threshold both agree it passes
            simulated_hits += monte_carlo_p(counts, probs, statistic, draws=4000, seed=index) < alpha
    sigma = (alpha * (1 - alpha) / nulls) ** 0.5
    assert simulated_hits / nulls <= alpha + 3 * sigma
    assert chi2_hits > simulated_hits       # the case the simulation is there for


def test_monte_carlo_p_still_flags_a_wrong_distribution():
    from collections import Counter

    probs = torch.tensor([0.5, 0.3, 0.2])
    counts = Counter({0: 30, 1: 30, 2: 40})     # 100 tokens from (0.3, 0.3, 0.4)
    statistic, _, _ = g_test(counts, probs)
    assert monte_carlo_p(counts, probs, statistic, draws=20000, seed=0) == 1 / 20001
    assert monte_carlo_p(Counter({0: 1, 2: 1}), torch.tensor([0.5, 0.5, 0.0]), float("inf"), 10) == 0.0


def test_sampling_check_passes_the_exact_verifier(spread_target, spread_draft):
    # the exact engine passes every position, K in {1, 2}, three sampling settings
    report = sampling_check(spread_target, DraftModel(spread_draft), PROMPT, rows=3000, seed=1)
    assert report.passed, [t for t in report.tests if not t.passed]
    assert len(report.tests) == 2 * 3 * 3
    assert min(t.bins for t in report.tests) >= 5      # every test has bins to compare
    assert min(t.rows for t in report.tests) >= 300    # and enough rows on the most frequent path


def test_sampling_check_simulates_the_p_values_near_its_threshold(spread_target, spread_draft):
    # alpha 0.5 over 18 tests: threshold 0.028, so p-values in [0.00028, 0.28) are simulated
    report = sampling_check(spread_target, DraftModel(spread_draft), PROMPT, rows=300, seed=3,
                            alpha=0.5)
    threshold = report.tests[0].threshold
    simulated = [t for t in report.tests if t.method == "monte_carlo"]
    assert simulated                  # (at alpha 0.5 a correct engine may fail a test: not asserted)
    assert all(t.passed == (t.p_value >= threshold) for t in report.tests)
    assert all(t.p_value >= 1 / (1 + 50 / threshold) for t in simulated)
    assert all(t.p_value >= 10 * threshold or t.p_value < threshold / 100
               for t in report.tests if t.method == "chi2")


@pytest.mark.parametrize("broken", sorted(BROKEN_VARIANTS))
def test_sampling_check_catches_broken_verifiers(spread_target, spread_draft, broken):
    # each broken verifier fails the check (power measured in benchmarks/validation_power.py)
    report = sampling_check(spread_target, DraftModel(spread_draft), PROMPT, rows=3000, seed=1,
                            **BROKEN_VARIANTS[broken])
    assert not report.passed
    worst = min(report.tests, key=lambda t: t.p_value)
    assert worst.p_value < worst.threshold and worst.position >= 0


def test_fingerprint_changes_with_one_weight_and_not_on_reload(tmp_path):
    # changing one weight changes the digest; an identical reload does not
    model = tiny_llama(seed=5)
    first = target_fingerprint(model)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    again = target_fingerprint(reloaded)
    assert again["weights_sha256"] == first["weights_sha256"]
    assert compare_fingerprints(first, again)["same_model"]
    with torch.no_grad():
        reloaded.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    changed = target_fingerprint(reloaded)
    assert changed["weights_sha256"] != first["weights_sha256"]
    assert not compare_fingerprints(first, changed)["same_weights"]


def test_fingerprint_across_dtypes_matches_within_tolerance():
    # a bf16 copy of the same model: other digest, canaries within the 16-bit tolerance
    model = tiny_llama(seed=6, initializer_range=0.05)
    fp32 = target_fingerprint(model)
    bf16 = target_fingerprint(tiny_llama(seed=6, initializer_range=0.05).to(torch.bfloat16))
    verdict = compare_fingerprints(fp32, bf16)
    assert not verdict["same_weights"] and verdict["same_model"]
    other = target_fingerprint(tiny_llama(seed=7, initializer_range=0.05))
    assert not compare_fingerprints(fp32, other)["same_model"]
