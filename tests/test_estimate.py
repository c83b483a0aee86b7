"""Offline acceptance estimate: the round simulation by hand, and agreement with live decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_core import DraftModel, LayerSkip, PromptLookup, SamplingParams, SpecDecoder
from specdec_core.estimate import (LoggedRequest, estimate_acceptance, lookup_rounds,
                                   simulate_rounds)

from .conftest import VOCAB


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


def test_lookup_rounds_by_hand():
    # prompt 5 6 7 5 6 ; response 7 5 6 9: at t = 1 the suffix "7" ... proposals copy "5 6 7 ..."
    drafter = PromptLookup(max_ngram=2, min_ngram=1)
    totals = lookup_rounds([5, 6, 7, 5, 6], [7, 5, 6, 9], 3, drafter)
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
