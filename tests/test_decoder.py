"""SpecDecoder on tiny random Llama models: greedy equivalence with transformers, cache rollback,
EOS / max_new_tokens handling, stats, reproducibility and bad input."""

from __future__ import annotations

import pytest
import torch

from specdec_core import (DraftModel, InvalidDecodeInput, LayerSkip, PromptLookup, SamplingParams,
                          SpecDecoder, TokenizerMismatch)
from specdec_core.cache import SequenceCache

from .helpers.models import VOCAB, left_padded_batch, repetitive_prompt, tiny_llama

MAX_NEW = 24


def hf_greedy(model, ids, mask=None, max_new=MAX_NEW):
    """transformers' own greedy decoding, never stopping early (the reference)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, max_length=None)
    return out[:, ids.shape[1]:]


def drafters(target, draft):
    return {
        "prompt_lookup": PromptLookup(max_ngram=3, min_ngram=1),
        "layer_skip": LayerSkip(target, num_layers=2),
        "draft_model": DraftModel(draft),
        "draft_is_target": DraftModel(target),   # every draft accepted: bonus-token path
    }


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("name", ["prompt_lookup", "layer_skip", "draft_model", "draft_is_target"])
def test_greedy_single_prompt_matches_transformers_generate(target, draft, name, k):
    # speculative greedy output == transformers generate(do_sample=False), token for token
    ids = repetitive_prompt()
    result = SpecDecoder(target, drafters(target, draft)[name], k=k).generate(ids, MAX_NEW)
    assert torch.equal(result.tokens, hf_greedy(target, ids))
    assert result.num_tokens == [MAX_NEW]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("name", ["prompt_lookup", "layer_skip", "draft_model", "draft_is_target"])
def test_greedy_left_padded_batch_matches_transformers_generate(target, draft, name, k):
    # rows of a left-padded batch accept different numbers of drafts and still match generate
    ids, mask = left_padded_batch()
    result = SpecDecoder(target, drafters(target, draft)[name], k=k).generate(
        ids, MAX_NEW, attention_mask=mask)
    assert torch.equal(result.tokens, hf_greedy(target, ids, mask))


def test_plain_decoding_matches_transformers_generate(target):
    # generate_plain is the baseline: same tokens as transformers' greedy decoding
    ids, mask = left_padded_batch()
    result = SpecDecoder(target, None).generate_plain(ids, MAX_NEW, attention_mask=mask)
    assert torch.equal(result.tokens, hf_greedy(target, ids, mask))
    assert result.stats.drafted == 0 and result.stats.rounds == 3 * (MAX_NEW - 1)


def test_rows_really_accept_different_numbers_of_tokens(target, draft):
    # the batch test above is meaningful only if rows diverge in accepted counts
    ids, mask = left_padded_batch()
    result = SpecDecoder(target, DraftModel(draft), k=3).generate(ids, MAX_NEW, attention_mask=mask)
    assert len({row.rounds for row in result.row_stats}) > 1


def test_cache_rollback_equals_fresh_forward(target):
    # after rejections (rows keep different lengths) the next logits equal a full fresh pass
    torch.manual_seed(5)
    prompts = torch.randint(3, VOCAB, (2, 7))
    proposed = torch.randint(3, VOCAB, (2, 5))
    keep = torch.tensor([7 + 1, 7 + 4])           # row 0 keeps 1 of 5, row 1 keeps 4 of 5
    nxt = torch.randint(3, VOCAB, (2, 1))
    with torch.inference_mode():
        cache = SequenceCache(target)
        cache.forward(prompts)
        cache.forward(proposed)
        cache.rollback_to(keep)
        logits = cache.forward(nxt)[:, -1]
        for row in range(2):
            kept = torch.cat([prompts[row], proposed[row]])[: int(keep[row])]
            fresh = target(torch.cat([kept, nxt[row]])[None]).logits[0, -1]
            torch.testing.assert_close(logits[row], fresh, rtol=1e-4, atol=1e-4)


def test_single_row_rollback_crops_the_cache(target):
    # a single row never keeps holes: the rolled-back cache is exactly the kept length
    with torch.inference_mode():
        cache = SequenceCache(target)
        cache.forward(torch.randint(3, VOCAB, (1, 9)))
        cache.forward(torch.randint(3, VOCAB, (1, 4)))
        cache.rollback_to(torch.tensor([10]))
    assert cache.cache.get_seq_length() == 10 and cache.width == 10 and not cache.has_holes


def test_eos_stops_a_row_keeps_eos_and_pads_after(target):
    # a row that emits EOS keeps it, is padded after it, and the other rows go on
    ids, mask = left_padded_batch()
    reference = hf_greedy(target, ids, mask)
    eos = int(reference[0, 5])                    # row 0 emits this token at step 5 (or earlier)
    stop = [int((row == eos).nonzero()[0]) + 1 if bool((row == eos).any()) else MAX_NEW
            for row in reference]
    result = SpecDecoder(target, DraftModel(target), k=3).generate(
        ids, MAX_NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert result.num_tokens == stop
    for row, n in enumerate(stop):
        assert torch.equal(result.tokens[row, :n], reference[row, :n])
        assert bool((result.tokens[row, n:] == 0).all())


def test_pad_token_defaults_to_eos(target):
    # pad_token_id=None pads with eos_token_id
    ids = repetitive_prompt()
    eos = int(hf_greedy(target, ids)[0, 2])
    result = SpecDecoder(target, PromptLookup()).generate(ids, MAX_NEW, eos_token_id=eos)
    n = result.num_tokens[0]
    assert n <= 3 and bool((result.tokens[0, n:] == eos).all())


def test_stats_with_a_perfect_drafter(target):
    # draft == target: every draft accepted; K + 1 tokens per round until the end
    ids = repetitive_prompt()
    result = SpecDecoder(target, DraftModel(target), k=3).generate(ids, 21)
    stats = result.stats
    # 20 tokens after the prefill's: 5 rounds of 4
    assert (stats.rounds, stats.drafted, stats.accepted, stats.emitted) == (5, 15, 15, 20)
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 4.0
    assert stats.reached_at_position == [5, 5, 5] == stats.accepted_at_position
    assert stats.conditional_acceptance == [1.0, 1.0, 1.0]


def test_stats_are_consistent_and_summed_over_rows(target, draft):
    # invariants of SpecStats for a batch with partial acceptance
    ids, mask = left_padded_batch()
    result = SpecDecoder(target, DraftModel(draft), k=4).generate(ids, MAX_NEW, attention_mask=mask)
    stats, rows = result.stats, result.row_stats
    assert stats.emitted == sum(result.num_tokens) - 3      # all but the prefill tokens
    assert stats.emitted == stats.accepted + stats.rounds
    assert stats.accepted == sum(stats.accepted_at_position)
    assert stats.rounds == sum(r.rounds for r in rows)
    # every round drafted >= 1 token except, at most, each row's last (one token left to emit)
    assert stats.rounds - 3 <= stats.reached_at_position[0] <= stats.rounds
    for i in range(1, 4):
        assert stats.reached_at_position[i] <= stats.accepted_at_position[i - 1]
    assert all(0.0 <= a <= 1.0 for a in stats.conditional_acceptance)


def test_no_draft_past_max_new_tokens(target):
    # a round never drafts more tokens than the row can still emit: 4 left -> 3 drafts + bonus
    ids = repetitive_prompt()
    result = SpecDecoder(target, DraftModel(target), k=8).generate(ids, 5)
    assert result.stats.drafted == 3 and result.stats.rounds == 1 and result.num_tokens == [5]


@pytest.mark.parametrize("static_cache", [False, True])
def test_stop_after_ends_rows_early_while_rounds_draft_to_max_new_tokens(target, draft, static_cache):
    # stop_after=3 of 24: every row stops once it holds 3 tokens (at most 3 - 1 + K + 1 after its
    # last round), every round still drafts a full K (the budget counts to max_new_tokens), and the
    # tokens are greedy decoding's
    ids, mask = left_padded_batch()
    reference = hf_greedy(target, ids, mask)
    decoder = SpecDecoder(target, DraftModel(draft), k=4, static_cache=static_cache)
    result = decoder.generate(ids, MAX_NEW, attention_mask=mask, stop_after=3)
    assert all(3 <= n <= 3 + 4 for n in result.num_tokens)
    for row, n in enumerate(result.num_tokens):
        assert torch.equal(result.tokens[row, :n], reference[row, :n])
    assert result.stats.drafted == 4 * result.stats.rounds
    full = decoder.generate(ids, MAX_NEW, attention_mask=mask)
    assert full.num_tokens == [MAX_NEW] * 3 and full.stats.rounds > result.stats.rounds
    with pytest.raises(InvalidDecodeInput, match="stop_after=0"):
        decoder.generate(ids, MAX_NEW, attention_mask=mask, stop_after=0)


def test_prompt_lookup_without_matches_decodes_plainly(target):
    # no repeated n-gram: prompt lookup proposes nothing and the output is still exact
    ids = torch.arange(3, 3 + 20)[None]
    result = SpecDecoder(target, PromptLookup(max_ngram=3, min_ngram=3), k=4).generate(ids, 3)
    assert result.stats.drafted == 0
    assert torch.equal(result.tokens, hf_greedy(target, ids, max_new=3))


def test_sampling_is_reproducible_by_seed(target, draft):
    # same seed -> same tokens; another seed -> other tokens
    ids, mask = left_padded_batch()
    decoder = SpecDecoder(target, DraftModel(draft), k=3)
    params = SamplingParams(temperature=1.5)
    first = decoder.generate(ids, MAX_NEW, sampling=params, seed=7, attention_mask=mask)
    again = decoder.generate(ids, MAX_NEW, sampling=params, seed=7, attention_mask=mask)
    other = decoder.generate(ids, MAX_NEW, sampling=params, seed=8, attention_mask=mask)
    assert torch.equal(first.tokens, again.tokens)
    assert not torch.equal(first.tokens, other.tokens)


def test_sampling_with_a_perfect_drafter_accepts_everything(target):
    # q == p: min(1, p/q) = 1, so every sampled draft is accepted
    ids = repetitive_prompt()
    params = SamplingParams(temperature=1.0, top_p=0.9)
    result = SpecDecoder(target, DraftModel(target), k=4).generate(ids, 21, sampling=params, seed=1)
    assert result.stats.acceptance_rate == 1.0


def test_layer_skip_shares_the_targets_weights(target):
    # LayerSkip is a view: its parameters are the target's own tensors, first N layers only
    skip = LayerSkip(target, num_layers=2)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    view_params = list(skip.model.parameters())
    assert {p.data_ptr() for p in view_params} <= target_ptrs
    assert len(skip.model.model.layers) == 2 and len(target.model.layers) == 4
    assert skip.model.lm_head is target.lm_head and skip.model.model.norm is target.model.norm


@pytest.mark.parametrize("layers", [0, 4, 9])
def test_layer_skip_rejects_impossible_depths(target, layers):
    from specdec_core.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match=f"num_layers={layers}"):
        LayerSkip(target, num_layers=layers)


def test_draft_with_another_vocabulary_is_refused(target):
    # output sizes differ (no tokenizers given): TokenizerMismatch naming both sizes
    other = tiny_llama(vocab=VOCAB + 4, hidden=32, layers=1, heads=2, seed=2)
    with pytest.raises(TokenizerMismatch, match=f"draft vocab {VOCAB + 4} != target vocab {VOCAB}"):
        SpecDecoder(target, DraftModel(other), k=2)


def test_draft_with_same_size_but_other_tokens_is_refused(target, draft):
    # both tokenizers known: equal vocabularies required, not just equal sizes
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    def tokenizer(words):
        vocab = {w: i for i, w in enumerate(words)}
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=words[0])))

    words = [f"w{i}" for i in range(VOCAB)]
    target_tok, draft_tok = tokenizer(words), tokenizer(words[:-1] + ["other"])
    with pytest.raises(TokenizerMismatch, match="pick a draft trained with the target's tokenizer"):
        SpecDecoder(target, DraftModel(draft, draft_tok), k=2, tokenizer=target_tok)
    SpecDecoder(target, DraftModel(draft, tokenizer(words)), k=2, tokenizer=target_tok)  # same: fine


@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one_is_refused(target, k):
    with pytest.raises(InvalidDecodeInput, match=f"k={k}"):
        SpecDecoder(target, PromptLookup(), k=k)


def test_empty_prompt_is_refused(target):
    with pytest.raises(InvalidDecodeInput, match="empty prompt"):
        SpecDecoder(target, PromptLookup()).generate(torch.zeros((1, 0), dtype=torch.long), 4)
    ids, mask = left_padded_batch()
    mask[2] = 0
    mask[2, -1] = 1
    mask[1] = 0
    mask[1, -1] = 0
    with pytest.raises(InvalidDecodeInput):
        SpecDecoder(target, PromptLookup()).generate(ids, 4, attention_mask=mask)


def test_right_padding_is_refused(target):
    ids, mask = left_padded_batch()
    with pytest.raises(InvalidDecodeInput, match="left-padded"):
        SpecDecoder(target, PromptLookup()).generate(ids, 4, attention_mask=mask.flip(1))


def test_verify_width_padding_keeps_outputs_exact(target, draft):
    # running verify passes wider than needed (filler after the drafts) changes no token
    ids, mask = left_padded_batch()
    widths = {2: 5, 3: 5, 4: 5, 5: 5}
    padded = SpecDecoder(target, DraftModel(draft), k=3, verify_widths=widths).generate(
        ids, MAX_NEW, attention_mask=mask)
    assert torch.equal(padded.tokens, hf_greedy(target, ids, mask))


def test_verify_width_plan_picks_the_cheapest_wider_width():
    from specdec_core.profile import verify_width_plan

    costs = {1: 1.0, 2: 1.6, 3: 2.0, 4: 1.5, 5: 1.3, 6: 1.45}
    assert verify_width_plan(costs) == {1: 1, 2: 5, 3: 5, 4: 5, 5: 5, 6: 6}
