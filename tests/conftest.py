"""Shared fixtures: tiny random transformers models (built here, no downloads) and, for slow tests,
the embedded default. Models are session-scoped: build once, share across tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 97


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


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft():
    """A smaller, unrelated model with the target's vocabulary (partial acceptance)."""
    return tiny_llama(hidden=32, layers=2, heads=2, seed=1)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded default, fetched into $SPECDEC_HOME/models once."""
    from specdec_core import load_model

    return load_model("smollm2-135m-instruct", device="cpu")
