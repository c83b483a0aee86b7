"""Tiny random transformers models (built here, no downloads) and the prompts the decoder tests
share."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 97
SPREAD_VOCAB = 24
# for the spread_target / spread_draft fixtures (conftest.py)
PROMPT = torch.tensor([3, 7, 1, 9, 4])


def tiny_llama(vocab: int = VOCAB, hidden: int = 64, layers: int = 4, heads: int = 4, seed: int = 0,
               initializer_range: float = 0.5) -> LlamaForCausalLM:
    """A random Llama-style causal LM. A large initializer range gives peaked logits, so greedy
    decoding has no near-ties and batched vs single-token passes agree exactly on the argmax."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 2, 1), max_position_embeddings=512,
                         initializer_range=initializer_range, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def save_tiny_target(model, directory: Path) -> Path:
    """Save a tiny model with a word-level tokenizer (t0..tN) as a local model directory that
    load_model reads like any other."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(directory)
    return directory


def repetitive_prompt():
    """A prompt with repeated n-grams, so prompt lookup finds matches."""
    torch.manual_seed(3)
    chunk = torch.randint(3, VOCAB, (6,))
    return torch.cat([chunk, torch.randint(3, VOCAB, (3,)), chunk, chunk[:2]])[None]


def left_padded_batch():
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (3, 14))
    mask = torch.ones_like(ids)
    for row, pad in ((0, 5), (1, 2)):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def greedy_requests(target, count: int, prompt_len: int = 6, new_tokens: int = 16, seed: int = 2,
                    domain: str = "qa") -> list:
    """LoggedRequests whose responses are the target's own greedy continuations of random prompts."""
    from specdec_core import SamplingParams, SpecDecoder
    from specdec_core.estimate import LoggedRequest

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, target.config.vocab_size, (count, prompt_len), generator=generator)
    out = SpecDecoder(target, None).generate_plain(prompts, new_tokens)
    return [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), SamplingParams(), domain)
            for i in range(count)]


def trained_eagle3_head(target, requests: list, checkpoint_dir: Path, steps: int = 150,
                        vocab_ids: torch.Tensor | None = None):
    """An EAGLE-3 head trained (unrolled 3 steps) on `requests` themselves: on those rows it drafts
    right part of the time, so live rounds see accepted and rejected drafts."""
    from specdec_core.eagle3 import Eagle3Head
    from specdec_core.train import TrainConfig, train_head

    vocab_ids = torch.arange(target.config.vocab_size) if vocab_ids is None else vocab_ids
    head = Eagle3Head(target, vocab_ids)
    config = TrainConfig(steps=steps, eval_every=steps, k_max=3, warmup_steps=2, lr=3e-3, batch_size=8)
    train_head(head, target, requests, requests[:4], config, checkpoint_dir,
               costs=(0.1, [1.2, 1.3, 1.4]), progress=False, unroll=3)
    return head.eval()


@torch.no_grad()
def chain_pass_checks(head, target) -> int:
    """Check the unrolled training pass (train.head_chain_passes) of `head` against the live chain:
    step w at position j must give the logits of a live round that started after j - w (the
    teacher-forced head positions up to there, then its own steps fed on its output g via
    `head.chained`). Asserts each; returns how many were compared."""
    from specdec_core.head import HiddenTap, target_features
    from specdec_core.train import head_chain_passes

    ids = torch.randint(3, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    valid = torch.ones(2, 11, dtype=torch.long)
    valid[1, 8:] = 0                                         # a shorter, right-padded row
    features, _ = target_features(target, ids, head=head)
    feats, nxt = features[:, :-1], ids[:, 1:]
    passes = head_chain_passes(head, feats, nxt, valid, 3)
    checked = 0
    for b, last in ((0, 10), (1, 7)):
        for s in range(0, last - 1):
            live = [head.inputs(feats[b:b + 1, : s + 1], nxt[b:b + 1, : s + 1])]
            g_live = passes[0][1][b:b + 1, s: s + 1]
            for w in (1, 2):
                if s + w > last:
                    break
                live.append(head.chained(g_live, nxt[b:b + 1, s + w: s + w + 1]))
                with HiddenTap(head.body.model.norm) as tap:
                    out = head.body(inputs_embeds=torch.cat(live, 1), use_cache=False)
                    g_live = tap.value[:, -1:]
                torch.testing.assert_close(out.logits[0, -1], passes[w][0][b, s + w],
                                           rtol=1e-4, atol=1e-4)
                checked += 1
    return checked


def copying_llama(vocab: int = 64, hidden: int = 128, layers: int = 2, heads: int = 4,
                  p_next: float = 0.6, seed: int = 0):
    """A tiny Llama that is a bigram model by construction: its attention and MLP outputs are zero,
    so the logits read the last token's embedding only, and after token x the token x + 1 (mod
    vocab) has probability about `p_next` at temperature 1, the rest spread. A context that counts
    up makes n-gram drafters propose what the model finds likely: drafts accepted and rejected,
    corrections and bonus tokens all occur. Embeddings are orthonormal directions (vocab <= hidden)."""
    import math

    model = tiny_llama(vocab=vocab, hidden=hidden, heads=heads, layers=layers, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=generator))
        embed = basis[:vocab] * math.sqrt(hidden)          # RMSNorm leaves each row as it is
        model.model.embed_tokens.weight.copy_(embed)
        model.model.norm.weight.fill_(1.0)
        # logit of x + 1 after x: log(p_next / (1 - p_next) * (vocab - 1)); the rest small noise
        strength = math.log(p_next / (1 - p_next) * (vocab - 1)) / hidden
        head = torch.roll(embed, shifts=1, dims=0) * strength
        head += torch.randn(vocab, hidden, generator=generator) * 0.5 * strength
        model.lm_head.weight.copy_(head)
    return model.eval()
