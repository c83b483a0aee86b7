"""Offline acceptance estimate: the round simulation by hand, and agreement with live decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_core import DraftModel, LayerSkip, PromptLookup, SamplingParams, SpecDecoder
from specdec_core.estimate import (LoggedRequest, estimate_acceptance, walk_rounds,
                                   simulate_rounds)

from .helpers.models import VOCAB, tiny_llama


def test_all_accepted_rounds_emit_k_plus_one():
    # L = 9: token 0 from the prefill, then rounds at t = 1 and t = 5 each emit 4 tokens
    totals = simulate_rounds(np.ones(9), 3)
    assert (totals.tokens, totals.rounds) == (8.0, 2.0)
    assert totals.reached.tolist() == [2, 2, 2] and totals.accepted.tolist() == [2, 2, 2]


def test_nothing_accepted_gives_one_token_per_round():
    totals = simulate_rounds(np.zeros(9), 4)
    assert totals.rounds == 8.0 and totals.expected_tokens_per_round == 1.0
    assert totals.reached.tolist() == [7, 0, 0, 0]  # the last round has one token left: no draft


def test_half_acceptance_by_hand():
    # L = 3, K = 1, beta = 0.5: a round at t = 1 drafts 1 token (2 left to emit)
    # accepted (0.5): emits 2, done; rejected (0.5): emits 1, then a round at t = 2 drafts 0
    totals = simulate_rounds(np.array([0.0, 0.5, 0.5]), 1)
    assert totals.rounds == pytest.approx(1.5)
    assert totals.reached.tolist() == [1.0] and totals.accepted.tolist() == [0.5]


def test_walk_rounds_by_hand():
    # prompt 5 6 7 5 6 ; response 7 5 6 9: at t = 1 the suffix "7" ... proposals copy "5 6 7 ..."
    drafter = PromptLookup(max_ngram=2, min_ngram=1)
    totals = walk_rounds([5, 6, 7, 5, 6], [7, 5, 6, 9], 3, drafter)
    # round at t=1: context ...5 6 7, suffix (6,7)->continuation "5 6" (2 drafts allowed): both match,
    # bonus 9 -> done in one round
    assert totals.rounds == 1 and totals.accepted.tolist() == [1, 1, 0]


def greedy_logged(target, prompts, new):
    out = SpecDecoder(target, None).generate_plain(prompts, new)
    return [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), SamplingParams(),
                          "d") for i in range(prompts.shape[0])]


@pytest.mark.parametrize("name", ["draft_model", "layer_skip", "prompt_lookup"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_estimate_equals_live_rounds_exactly(target, draft, name, k):
    # under greedy decoding acceptance is deterministic: the offline rounds ARE the live rounds
    torch.manual_seed(11)
    chunk = torch.randint(3, VOCAB, (5,))
    prompts = torch.stack([torch.cat([chunk, torch.randint(3, VOCAB, (4,)), chunk[:3]])
                           for _ in range(3)])
    logged = greedy_logged(target, prompts, 20)
    drafter = {"draft_model": DraftModel(draft), "layer_skip": LayerSkip(target, 2),
               "prompt_lookup": PromptLookup(max_ngram=3, min_ngram=1)}[name]
    estimate = estimate_acceptance(target, drafter, logged, ks=[k], progress=False)["d"][k]
    live = SpecDecoder(target, drafter, k=k).generate(prompts, 20).stats
    assert estimate.rounds == live.rounds
    assert estimate.expected_tokens_per_round == pytest.approx(live.mean_accepted_length)
    summed = estimate.per_request[0]
    for item in estimate.per_request[1:]:
        summed = summed + item
    assert summed.reached.tolist() == live.reached_at_position
    assert summed.accepted.tolist() == live.accepted_at_position


# ---------------------------------------------------------------------------------------------
# sampling: the offline estimate against live speculative sampling over many seeded runs
class GatedDraft(torch.nn.Module):
    """A draft built so that acceptance at one position predicts acceptance at the next.

    After a token in `good`, q = p (the target itself: always accepted). After any other token,
    q is uniform over `good`: accepted with probability ~p(good), and an accepted token is good,
    so the next draft is accepted too. Along a path drawn from p the next token is good only with
    probability p(good): multiplying sum_v min(p, q) along logged paths underestimates E(K),
    while beta_t = min(1, q(x_t) / p(x_t)) is exact (docs/design.md, "Estimating acceptance offline").
    """

    def __init__(self, target, good: torch.Tensor):
        super().__init__()
        self.inner = target
        self.config = target.config
        self.register_buffer("good", good)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids=None, **kwargs):
        out = self.inner(input_ids=input_ids, **kwargs)
        logits = out.logits
        after_good = self.good[input_ids[:, -logits.shape[1]:]]          # [B, T] per position
        uniform_good = torch.where(self.good, 0.0, float("-inf")).to(logits.dtype)
        out.logits = torch.where(after_good[..., None], logits, uniform_good.expand_as(logits))
        return out


def sum_min_rounds(target, draft_model, logged, k, sampling):
    """The biased estimator: alpha_t = sum_v min(p_t, q_t) along each logged path, in rounds of K.
    (Logged rows here share one prompt length and response length: one batched pass.)"""
    from specdec_core.sampling import logits_to_probs

    ids = torch.tensor([list(r.prompt_ids) + list(r.response_ids) for r in logged])
    n = len(logged[0].response_ids)
    with torch.inference_mode():
        p = logits_to_probs(target(ids).logits[:, -n - 1:-1], sampling)
        q = logits_to_probs(draft_model(input_ids=ids).logits[:, -n - 1:-1], sampling)
    alpha = torch.minimum(p, q).sum(-1).double().numpy()
    totals = simulate_rounds(alpha[0], k)
    for row in alpha[1:]:
        totals = totals + simulate_rounds(row, k)
    return totals.expected_tokens_per_round


def live_interval(target, drafter, prompts, new, k, sampling, seeds):
    """Mean E(K) of live speculative decoding over seeded runs, and its standard error."""
    values = []
    decoder = SpecDecoder(target, drafter, k=k)
    for seed in range(seeds):
        stats = decoder.generate(prompts, new, sampling=sampling, seed=1000 + seed).stats
        values.append(stats.mean_accepted_length)
    values = np.array(values)
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))


def sampled_logged(target, prompts, new, sampling, seed):
    out = SpecDecoder(target, None).generate_plain(prompts, new, sampling=sampling, seed=seed)
    return [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), sampling, "d")
            for i in range(prompts.shape[0])]


@pytest.fixture(scope="module")
def spread_pair():
    target = tiny_llama(seed=3, initializer_range=0.05)
    good = torch.arange(VOCAB) % 2 == 0
    return target, GatedDraft(target, good)


def estimate_and_live(target, drafter, logged, prompts, new, k, sampling, seeds):
    """(offline estimate at K, live mean tokens per round, 3-sigma bound of their difference)."""
    estimate = estimate_acceptance(target, drafter, logged, ks=[k], progress=False)["d"][k]
    est_se = (estimate.ci95[1] - estimate.ci95[0]) / (2 * 1.96)
    live_mean, live_se = live_interval(target, drafter, prompts, new, k, sampling, seeds=seeds)
    return estimate, live_mean, 3.0 * np.hypot(live_se, est_se)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0),
                                      SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7-top_p0.9"])
def test_sampling_estimate_agrees_with_live_where_sum_min_is_biased(spread_pair, sampling):
    target, gated = spread_pair
    k, new = 3, 24
    torch.manual_seed(5)
    prompts = torch.randint(3, VOCAB, (128, 6))
    # logged responses: the target's own samples (plain decoding), scored under their params
    logged = sampled_logged(target, prompts.repeat(8, 1), new, sampling, seed=7)
    estimate, live_mean, bound = estimate_and_live(target, DraftModel(gated), logged, prompts, new,
                                                   k, sampling, seeds=24)
    assert abs(estimate.expected_tokens_per_round - live_mean) <= bound, (
        estimate.expected_tokens_per_round, live_mean, bound)
    # the product of sum(min(p, q)) along the same paths falls outside it (it overestimates here:
    # after a rejection the correction comes from p - q, so live rounds start after "bad" tokens
    # more often than positions along p-distributed paths do)
    biased = sum_min_rounds(target, gated, logged, k, sampling)
    assert abs(biased - live_mean) > bound, (biased, live_mean, bound)


def test_sampling_estimate_agrees_with_live_on_a_model_pair(spread_pair):
    target, draft = spread_pair[0], tiny_llama(hidden=32, layers=2, heads=2, seed=4,
                                               initializer_range=0.05)
    sampling = SamplingParams(temperature=1.0)
    k, new = 2, 16
    torch.manual_seed(6)
    prompts = torch.randint(3, VOCAB, (48, 5))
    logged = sampled_logged(target, prompts.repeat(4, 1), new, sampling, seed=3)
    estimate, live_mean, bound = estimate_and_live(target, DraftModel(draft), logged, prompts, new,
                                                   k, sampling, seeds=12)
    assert abs(estimate.expected_tokens_per_round - live_mean) <= bound
    # the agreement discriminates: the interval is narrower than the distance to either extreme
    # (1 token per round: nothing accepted; K + 1: everything accepted)
    e = estimate.expected_tokens_per_round
    assert bound < min(e - 1.0, k + 1.0 - e), (e, bound)


def test_bootstrap_interval_depends_on_the_requests_not_their_order():
    from specdec_core.estimate import bootstrap_ratio

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 60, 25).astype(float)
    rounds = rng.integers(1, 30, 25).astype(float)
    interval = bootstrap_ratio(tokens, rounds, n_boot=300)
    order = rng.permutation(25)
    assert bootstrap_ratio(tokens[order], rounds[order], n_boot=300) == interval
    assert interval[0] < tokens.sum() / rounds.sum() < interval[1]
    # another seed draws other resamples: the interval moves (the test above is not vacuous)
    assert bootstrap_ratio(tokens, rounds, n_boot=300, seed=1) != interval


def test_model_drafter_scores_come_back_in_the_requests_order_whatever_the_batching(target, draft):
    """token_acceptance batches sampled requests before greedy ones and like lengths together;
    each request's beta_t must still be its own: equal to scoring it alone, in the given order."""
    from specdec_core.estimate import token_acceptance

    generator = torch.Generator().manual_seed(5)
    requests = []
    for i, (prompt, response) in enumerate([(9, 6), (3, 12), (14, 4), (5, 9), (11, 7), (4, 5), (7, 10)]):
        sampling = SamplingParams() if i % 3 == 0 else SamplingParams(temperature=0.8, top_p=0.9)
        requests.append(LoggedRequest(
            f"r{i}", torch.randint(3, VOCAB, (prompt,), generator=generator).tolist(),
            torch.randint(3, VOCAB, (response,), generator=generator).tolist(), sampling, "d"))
    drafter = DraftModel(draft)
    batched = token_acceptance(target, drafter, requests, batch_size=3, progress=False)
    alone = [token_acceptance(target, drafter, [r], batch_size=1, progress=False)[0] for r in requests]
    assert [len(b) for b in batched] == [len(r.response_ids) for r in requests]
    for got, want in zip(batched, alone):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the requests differ, so a mix-up of order would show
    assert len({tuple(np.round(b, 4)) for b in alone}) == len(requests)


def test_round_robin_keeps_every_domain_and_split_off_leaves_the_rest():
    from specdec_core.estimate import round_robin, split_off

    rows = [LoggedRequest(f"{d}{i}", [1], [2, 3], domain=d) for d, n in (("qa", 5), ("code", 1), ("json", 3))
            for i in range(n)]
    taken = round_robin(rows, 5)
    # domains in turn (name order), each in its own order; a domain that runs dry drops out
    assert [r.request_id for r in taken] == ["code0", "json0", "qa0", "json1", "qa1"]
    assert round_robin(rows, None) == rows and round_robin(rows, 100) == rows
    rest, validation = split_off(rows, 4)
    assert [r.request_id for r in validation] == ["code0", "json0", "qa0", "json1"]
    assert [r.request_id for r in rest] == ["qa1", "qa2", "qa3", "qa4", "json2"]


def test_each_positions_acceptance_carries_its_95_interval_over_requests():
    """Issue 83 item 9: the acceptance plot draws each point's interval, so the estimate stores
    one per draft position: a bootstrap over requests that holds the rate, is wide where requests
    disagree (repetitive responses against random ones) and a point where they are all alike."""
    rng = np.random.default_rng(0)
    pattern = [5, 6, 7, 8, 9, 10]
    repeat = [LoggedRequest(f"rep{i}", pattern * 2, pattern * 6, domain="mixed") for i in range(10)]
    # a few tokens in random order: n-grams recur (drafts are made) and their continuations differ
    noise = [LoggedRequest(f"rnd{i}", rng.integers(5, 8, 12).tolist(), rng.integers(5, 8, 36).tolist(),
                           domain="mixed") for i in range(10)]
    alike = [LoggedRequest(f"same{i}", pattern * 2, pattern * 6, domain="alike") for i in range(6)]
    estimates = estimate_acceptance(None, PromptLookup(max_ngram=3), repeat + noise + alike,
                                    ks=[3], progress=False)
    mixed, same = estimates["mixed"][3], estimates["alike"][3]
    assert len(mixed.conditional_acceptance_ci) == 3
    for rate, (lo, hi) in zip(mixed.conditional_acceptance, mixed.conditional_acceptance_ci):
        assert lo <= rate <= hi
    lo, hi = mixed.conditional_acceptance_ci[0]
    assert hi - lo > 0.1, (lo, hi)                   # requests disagree: a wide interval
    for rate, (lo, hi) in zip(same.conditional_acceptance, same.conditional_acceptance_ci):
        assert lo == pytest.approx(rate) and hi == pytest.approx(rate)
    assert mixed.to_dict()["conditional_acceptance_ci"] == mixed.conditional_acceptance_ci
