"""Batched prompt lookup (specdec_core.lookup) equals the per-row search it replaces, on the
decode state's own layout: left-padded prompts, generated tokens after them, per-row limits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_core.drafters import HostDrafter, PromptLookup, find_continuation, host_view
from specdec_core.lookup import lookup_batch, suffix_batch
from specdec_core.suffix import SuffixIndex, propose_path
from specdec_core.records import DecodeState


def _random_batch(rng, batch: int, width: int, generated: int, vocab: int):
    """Left-padded prompts (pad id 0, ids >= 1), generated tokens with junk past n_out."""
    prompt_len = rng.integers(0, width + 1, batch)
    prompt_len[0] = width                          # one row without padding
    prompts = np.zeros((batch, width), dtype=np.int64)
    for b, length in enumerate(prompt_len):
        prompts[b, width - length:] = rng.integers(1, vocab, length)
    n_out = rng.integers(0, generated + 1, batch)
    out = rng.integers(1, vocab, (batch, generated + 8)).astype(np.int64)
    return prompts, prompt_len, out, n_out


@pytest.mark.parametrize("vocab", [3, 6, 50])          # small vocabularies: many matches
@pytest.mark.parametrize("ngrams", [(3, 1), (3, 2), (4, 4), (1, 1)])
@pytest.mark.parametrize("occurrence", ["earliest", "latest"])
def test_batch_lookup_equals_the_per_row_search(vocab, ngrams, occurrence):
    rng = np.random.default_rng(vocab * 10 + ngrams[0])
    max_ngram, min_ngram = ngrams
    k = 5
    for _ in range(20):
        prompts, prompt_len, out, n_out = _random_batch(rng, batch=9, width=12, generated=10, vocab=vocab)
        limits = rng.integers(-1, k + 3, 9)
        tokens, counts = lookup_batch(prompts, prompt_len, out, n_out, limits, k, max_ngram, min_ngram,
                                      earliest=occurrence == "earliest")
        assert tokens.shape == (9, k)
        for b in range(9):
            sequence = np.concatenate([prompts[b, 12 - prompt_len[b]:], out[b, :n_out[b]]])
            expected = (find_continuation(sequence, max_ngram, min(k, limits[b]), min_ngram, occurrence)
                        if limits[b] > 0 else sequence[:0])
            assert counts[b] == len(expected), (b, sequence, limits[b])
            assert tokens[b, :counts[b]].tolist() == expected.tolist()
            assert not tokens[b, counts[b]:].any()


def test_prompt_lookup_proposes_what_the_row_by_row_host_drafter_proposes():
    """PromptLookup.propose (batched) against HostDrafter.propose (one search per row)."""
    rng = np.random.default_rng(3)
    prompts, prompt_len, out, n_out = _random_batch(rng, batch=16, width=20, generated=12, vocab=5)
    mask = (np.arange(20)[None, :] >= 20 - prompt_len[:, None]).astype(np.int64)
    state = DecodeState(torch.from_numpy(prompts), torch.from_numpy(mask), torch.from_numpy(prompt_len),
                        torch.from_numpy(out), torch.from_numpy(n_out), prompt_has_padding=True)
    drafter = PromptLookup(max_ngram=3, min_ngram=1)
    num_draft = torch.from_numpy(rng.integers(0, 5, 16))
    batched = drafter.propose(state, 4, num_draft, None, None)
    tokens, counts = HostDrafter.propose_host(drafter, host_view(state, num_draft), 4)   # per row
    assert batched.num_draft.tolist() == counts.tolist() and counts.any()
    assert batched.tokens.tolist() == tokens.tolist()
    assert batched.max_draft == counts.max()


# --- suffix decoding ---------------------------------------------------------------------------
def _index(rng, vocab: int, sequences: int = 12):
    """An index over random sequences with repeated stretches (deep matches, many occurrences)."""
    motif = rng.integers(1, vocab, 6)
    rows = [np.concatenate([rng.integers(1, vocab, rng.integers(0, 6)), motif[: rng.integers(1, 7)],
                            rng.integers(1, vocab, rng.integers(1, 8))]) for _ in range(sequences)]
    return SuffixIndex.build(rows, depth=8)


@pytest.mark.parametrize("vocab", [3, 7, 40])
@pytest.mark.parametrize("with_index", [False, True])
def test_batch_suffix_search_equals_the_per_row_search(vocab, with_index):
    rng = np.random.default_rng(vocab + 100 * with_index)
    k = 6
    for trial in range(12):
        index = _index(rng, vocab) if with_index else None
        max_depth = int(rng.choice([1, 3, 24]))
        min_prob = float(rng.choice([0.0, 0.1, 0.5]))
        factor = float(rng.choice([0.5, 1.0, 2.5]))
        prompts, prompt_len, out, n_out = _random_batch(rng, batch=8, width=14, generated=10, vocab=vocab)
        limits = rng.integers(-1, k + 3, 8)
        tokens, counts = suffix_batch(prompts, prompt_len, out, n_out, limits, k, index, max_depth,
                                      min_prob, factor)
        for b in range(8):
            sequence = np.concatenate([prompts[b, 14 - prompt_len[b]:], out[b, :n_out[b]]])
            expected = propose_path(sequence, min(k, limits[b]), index, max_depth, min_prob, factor)
            assert tokens[b, :counts[b]].tolist() == expected.tolist(), (trial, b)
            assert not tokens[b, counts[b]:].any()


def test_batch_suffix_search_spreads_over_many_occurrences_as_the_per_row_search():
    # more matched occurrences than the search looks at: both spread their picks alike
    rng = np.random.default_rng(5)
    index = SuffixIndex.build([rng.integers(1, 3, 40) for _ in range(400)], depth=6)
    prompts, prompt_len, out, n_out = _random_batch(rng, batch=6, width=10, generated=6, vocab=3)
    limits = np.full(6, 5)
    tokens, counts = suffix_batch(prompts, prompt_len, out, n_out, limits, 5, index, 2, 0.0, 3.0)
    assert counts.any()
    for b in range(6):
        sequence = np.concatenate([prompts[b, 10 - prompt_len[b]:], out[b, :n_out[b]]])
        assert tokens[b, :counts[b]].tolist() == propose_path(sequence, 5, index, 2, 0.0, 3.0).tolist()


def test_the_occurrence_rule_picks_the_earliest_or_the_latest_match():
    # the longest matched n-gram [2, 3] occurs at 1 and at 5; vLLM's ngram rule copies from the first
    sequence = np.array([1, 2, 3, 7, 8, 2, 3, 9, 2, 3])
    assert find_continuation(sequence, 3, 4, 2).tolist() == [7, 8, 2, 3]
    assert find_continuation(sequence, 3, 4, 2, "latest").tolist() == [9, 2, 3]
    # a longer match wins over an earlier shorter one, whatever the rule
    sequence = np.array([5, 3, 1, 4, 5, 2, 3, 6, 2, 3])
    assert find_continuation(sequence, 3, 2, 1).tolist() == [6, 2]
    assert PromptLookup().describe() == {"kind": "prompt_lookup", "params": {"max_ngram": 3, "min_ngram": 2}}
    assert PromptLookup(occurrence="latest").describe()["params"]["occurrence"] == "latest"
    with pytest.raises(ValueError, match="occurrence"):
        PromptLookup(occurrence="nearest")
