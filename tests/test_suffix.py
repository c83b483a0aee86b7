"""Suffix decoding: the index (matching, continuations, files), the drafter through the decode loop
(greedy exactness, the sampling distribution test) and the offline estimate against live rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_core import SpecDecoder, TokenizerMismatch
from specdec_core.drafters import SuffixDrafter
from specdec_core.factory import make_drafter
from specdec_core.estimate import LoggedRequest, estimate_acceptance, walk_rounds
from specdec_core.suffix import (SEPARATOR, IndexFileError, SuffixIndex, context_match, greedy_path,
                                 propose_path)
from specdec_core.validation import sampling_check

from .helpers.models import PROMPT, VOCAB, left_padded_batch


def brute_force_match(sequences, context, depth):
    """The longest suffix of context (<= depth) found in any sequence, and what followed each
    occurrence (the next token, or None at a sequence's end)."""
    for length in range(min(depth, len(context)), 0, -1):
        pattern = list(context[len(context) - length:])
        followers = []
        for seq in sequences:
            for start in range(len(seq) - length + 1):
                if list(seq[start:start + length]) == pattern:
                    end = start + length
                    followers.append(seq[end] if end < len(seq) else None)
        if followers:
            return length, followers
    return 0, []


def test_match_finds_the_longest_suffix_and_every_occurrence():
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 6, size=rng.integers(5, 40)).tolist() for _ in range(30)]
    index = SuffixIndex.build(sequences, depth=8)
    for trial in range(200):
        context = rng.integers(0, 6, size=rng.integers(1, 12))
        length, lo, hi = index.match(context)
        expected_length, followers = brute_force_match(sequences, context, 8)
        assert length == expected_length, (trial, context)
        if length:
            assert hi - lo == len(followers)
            nexts = index.continuations(lo, hi, 1)[:, 0]
            assert sorted(int(t) for t in nexts) == sorted(SEPARATOR if f is None else f
                                                           for f in followers)


def test_greedy_path_follows_counts_and_stops_below_min_token_prob():
    windows = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 8], [5, 9, 1], [4, 0, 0]])
    tokens, score = greedy_path(windows, 3, min_token_prob=0.1)
    assert tokens.tolist() == [5, 6, 8]                     # 4/5, then 3/4, then 2/3
    assert score == pytest.approx(0.8 + 0.8 * 0.75 + 0.8 * 0.75 * 2 / 3)
    assert greedy_path(windows, 3, min_token_prob=0.7)[0].tolist() == [5, 6]
    assert greedy_path(windows, 1, min_token_prob=0.1)[0].tolist() == [5]
    # a continuation that ends (separator) counts in the denominator, not as a token
    ended = np.array([[3, SEPARATOR], [3, SEPARATOR], [3, 4]])
    assert greedy_path(ended, 2, min_token_prob=0.5)[0].tolist() == [3]


def test_context_match_and_the_adaptive_draft_length():
    sequence = np.array([1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 2, 3, 4])
    length, positions = context_match(sequence, max_depth=24)
    assert length == 3 and positions.tolist() == [4, 9]      # after "2 3 4": 9 and 5
    # max_spec_factor caps the draft at factor x match length; the index's match wins when it
    # is better supported
    index = SuffixIndex.build([[2, 3, 4, 5, 6, 7, 8]] * 3, depth=16)
    found = propose_path(sequence, 8, index, max_depth=24, min_token_prob=0.1, max_spec_factor=1.0)
    assert found.tolist() == [5, 6, 7]
    assert propose_path(sequence, 8, index, 24, 0.1, max_spec_factor=0.5).tolist() == [5]
    assert propose_path(sequence, 8, None, 24, 0.1, 1.0).tolist()[:1] in ([9], [5])


def test_index_files_round_trip_and_bad_files_name_the_file(tmp_path):
    index = SuffixIndex.build([[1, 2, 3], [2, 3, 4, 5]], request_ids=["a", "b"], depth=8,
                              meta={"vocab_size": VOCAB, "domain": "json"})
    path = index.save(tmp_path / "json.npz")
    loaded = SuffixIndex.load(path)
    assert loaded.request_ids == ["a", "b"] and loaded.meta["domain"] == "json"
    assert loaded.match([9, 2, 3]) == index.match([9, 2, 3])
    assert len(loaded) == 2 and loaded.tokens == 7
    # corrupted: a byte flipped inside the archive
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken = tmp_path / "broken.npz"
    broken.write_bytes(bytes(data))
    with pytest.raises(IndexFileError, match="broken.npz"):
        SuffixIndex.load(broken)
    # foreign: an .npz of other arrays, a text file, a missing file
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.zeros(3))
    with pytest.raises(IndexFileError, match="foreign.npz.*not a specdec suffix index"):
        SuffixIndex.load(foreign)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(IndexFileError, match="notes.txt"):
        SuffixDrafter(index=text)
    with pytest.raises(IndexFileError, match="missing.npz.*does not exist"):
        SuffixIndex.load(tmp_path / "missing.npz")


def test_what_callers_ask_a_drafter_is_a_member_of_the_protocol():
    # kind, index, indexed requests, digest and identity: asked of every drafter alike
    import hashlib

    from specdec_core.drafters import PromptLookup

    index = SuffixIndex.build([[1, 2, 3], [2, 3, 4]], request_ids=["r2", "r1"], depth=8)
    bare = SuffixDrafter(max_depth=6, min_token_prob=0.3, max_spec_factor=2.0)
    assert bare.kind == "suffix" and bare.takes_index and bare.walks_text
    assert bare.index is None and bare.indexed_requests() == frozenset()
    assert bare.index_digest() is None and bare.identity("suffix") == "suffix"
    indexed = bare.with_index(index)
    assert indexed is not bare and indexed.index is index and bare.index is None
    assert indexed.describe() == bare.describe()          # same parameters, another index
    assert indexed.indexed_requests() == {"r1", "r2"}
    digest = hashlib.sha256(b"r1\nr2").hexdigest()[:12]
    assert indexed.index_digest() == digest and indexed.identity("suffix") == f"suffix/index:{digest}"
    lookup = PromptLookup()
    assert lookup.kind == "prompt_lookup" and lookup.walks_text and not lookup.takes_index
    assert lookup.index is None and lookup.identity("pl") == "pl" and not lookup.indexed_requests()
    with pytest.raises(NotImplementedError, match="PromptLookup searches no suffix index"):
        lookup.with_index(index)


def test_an_index_of_another_vocabulary_is_a_tokenizer_mismatch(target):
    other = SuffixIndex.build([[1, 2, 3]], meta={"vocab_size": VOCAB + 5})
    with pytest.raises(TokenizerMismatch, match="vocabulary"):
        SpecDecoder(target, SuffixDrafter(other), k=3)
    too_large = SuffixIndex.build([[1, 2, VOCAB + 3]])
    with pytest.raises(TokenizerMismatch, match="token id"):
        SpecDecoder(target, SuffixDrafter(too_large), k=3)


def greedy_reference(target, ids, mask, new):
    return SpecDecoder(target, None).generate_plain(ids, new, attention_mask=mask)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_greedy_suffix_decoding_equals_plain_decoding(target, static):
    ids, mask = left_padded_batch()
    reference = greedy_reference(target, ids, mask, 24)
    # the index holds these prompts' own continuations, perturbed: drafts are accepted and rejected
    rng = np.random.default_rng(1)
    sequences = []
    for row in range(ids.shape[0]):
        full = ids[row][mask[row].bool()].tolist() + reference.tokens[row].tolist()
        noisy = [t if rng.random() > 0.15 else int(rng.integers(3, VOCAB)) for t in full]
        sequences += [full[: len(full) // 2], noisy]
    index = SuffixIndex.build(sequences, depth=16, meta={"vocab_size": VOCAB})
    for eos in (None, 5):
        plain = SpecDecoder(target, None).generate_plain(ids, 24, attention_mask=mask,
                                                         eos_token_id=eos)
        decoder = SpecDecoder(target, make_drafter("suffix", {"max_depth": 16}, target), k=4,
                              static_cache=static)
        decoder.drafter.index = index
        result = decoder.generate(ids, 24, attention_mask=mask, eos_token_id=eos)
        assert torch.equal(result.tokens, plain.tokens), eos
        assert result.num_tokens == plain.num_tokens
        assert 0 < result.stats.accepted < result.stats.drafted


def test_suffix_sampling_keeps_the_target_distribution(spread_target):
    # index over samples of the target itself: proposals are often right, often wrong
    torch.manual_seed(0)
    samples = SpecDecoder(spread_target, None).generate_plain(
        PROMPT.expand(200, -1), 6, sampling=__import__("specdec_core").SamplingParams(temperature=1.0),
        seed=3).tokens
    index = SuffixIndex.build([PROMPT.tolist() + row for row in samples.tolist()], depth=16)
    report = sampling_check(spread_target, SuffixDrafter(index, min_token_prob=0.05), PROMPT,
                            rows=1200, seed=4)
    assert report.passed, [t for t in report.tests if not t.passed]


def test_the_offline_estimate_equals_live_rounds_for_greedy(target):
    # logged responses = the target's greedy outputs; the index holds OTHER requests' outputs
    torch.manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (1, 10)) for _ in range(6)]
    outputs = [greedy_reference(target, p, None, 20).tokens[0].tolist() for p in prompts]
    index = SuffixIndex.build([p[0].tolist() + o for p, o in zip(prompts[3:], outputs[3:])],
                              depth=16)
    drafter = SuffixDrafter(index, max_depth=16)
    for k in (2, 4):
        for prompt, output in zip(prompts[:3], outputs[:3]):
            live = SpecDecoder(target, drafter, k=k).generate(prompt, 20).stats
            offline = walk_rounds(prompt[0].tolist(), output, k, drafter)
            assert offline.rounds == live.rounds
            assert offline.accepted.tolist() == live.accepted_at_position
            assert offline.reached.tolist() == live.reached_at_position
    requests = [LoggedRequest(str(i), p[0].tolist(), o, domain="d")
                for i, (p, o) in enumerate(zip(prompts[:3], outputs[:3]))]
    estimate = estimate_acceptance(target, drafter, requests, ks=[4], progress=False)["d"][4]
    live_rounds = sum(SpecDecoder(target, drafter, k=4).generate(p, 20).stats.rounds
                      for p in prompts[:3])
    assert estimate.rounds == live_rounds
