"""benchmarks/random_model.py: a random-weight model directory that load_model reads offline."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.models import load_model

from .helpers.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/random_model.py", "random_model")


@pytest.fixture(scope="module")
def saved(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("random_model") / "model"
    assert script.main([str(out), "--smoke"]) == out
    return out


def test_directory_holds_config_weights_and_tokenizer(saved):
    names = {p.name for p in saved.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((saved / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"


def test_load_model_reads_the_shape_and_a_full_size_tokenizer(script, saved):
    shape = script.gpu_decode.TARGET_SMOKE
    model, tokenizer = load_model(saved, device="cpu")
    assert model.config.vocab_size == shape["vocab_size"]
    assert model.config.num_hidden_layers == shape["num_hidden_layers"]
    assert model.config.hidden_size == shape["hidden_size"]
    assert model.get_input_embeddings().weight.shape[0] == shape["vocab_size"]
    assert len(tokenizer) == shape["vocab_size"]
    assert tokenizer.convert_ids_to_tokens([tokenizer.pad_token_id, tokenizer.bos_token_id,
                                            tokenizer.eos_token_id]) == list(script.SPECIALS)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert not any(torch.equal(p, torch.zeros_like(p)) for p in model.parameters()
                   if p.dim() == 2)     # random, not empty, weights


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café 123\n\tend", "你好"])
def test_text_round_trips_through_ids_below_the_vocabulary(script, saved, text):
    model, tokenizer = load_model(saved, device="cpu")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids and all(0 <= i < model.config.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)


def test_too_small_a_vocabulary_is_refused(script):
    with pytest.raises(ValueError, match="byte-level alphabet"):
        script.build_tokenizer(100)
