"""EAGLE-3 heads (specdec_core.eagle3): the taps read the layers vLLM's ids name, exact greedy
decoding on every engine, the offline estimate against live rounds, the unrolled training pass
against the live chain, the sampling distribution, and the speculators-format files.

The head under test is trained briefly on the tiny target's own greedy outputs and decodes those
prompts, so its drafts are accepted part of the time: every catch-up path (0..K accepted) runs.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec_core import SpecDecoder, TokenizerMismatch
from specdec_core.eagle3 import Eagle3Head, default_layer_ids, is_eagle3_dir
from specdec_core.estimate import estimate_acceptance
from specdec_core.factory import make_drafter
from specdec_core.head import HeadDrafter, HeadFileError, HiddenTap
from specdec_core.tap import LayerInputsTap
from specdec_core.validation import sampling_check

from .helpers.models import VOCAB, chain_pass_checks, greedy_requests, tiny_llama, trained_eagle3_head

DRAFT_VOCAB = torch.tensor([t for t in range(VOCAB) if t % 5 != 4])      # 78 of 97 tokens


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=8, seed=3)       # default aux layers: inputs of 2, 4, 5


@pytest.fixture(scope="module")
def requests(target):
    return greedy_requests(target, 40)


@pytest.fixture(scope="module")
def head(target, requests, tmp_path_factory):
    return trained_eagle3_head(target, requests, tmp_path_factory.mktemp("eagle3"), steps=150,
                               vocab_ids=DRAFT_VOCAB)


def test_default_layer_ids_are_vllms():
    assert default_layer_ids(30) == [2, 15, 27]        # SmolLM2-135M: inputs of layers 2, N/2, N-3
    assert default_layer_ids(32) == [2, 16, 29]
    assert default_layer_ids(4) == [1, 2]              # shallow: clamped, distinct, ascending
    assert default_layer_ids(2) == [0, 1]


def test_the_tap_reads_the_inputs_of_the_named_layers(target):
    # transformers' hidden_states[i] is the input of layer i (and [N] the last layer's output,
    # before the final norm's own output replaces it): vLLM's id convention
    head = Eagle3Head(target, DRAFT_VOCAB, layer_ids=[0, 2, 3])
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), head.tap(target) as tap:
        out = target(ids, output_hidden_states=True)
        value = tap.value
    expected = torch.cat([out.hidden_states[i] for i in (0, 2, 3)], -1)
    torch.testing.assert_close(value, expected)
    assert value.shape[-1] == head.feature_size == 3 * target.config.hidden_size
    # id N is the last layer's output: the input of the final norm
    with torch.no_grad(), Eagle3Head(target, DRAFT_VOCAB, layer_ids=[8]).tap(target) as last, \
            HiddenTap(target.model.norm) as norm_input:
        target(ids)
        torch.testing.assert_close(last.value, norm_input.value)
    with pytest.raises(ValueError, match="0..8"):
        Eagle3Head(target, DRAFT_VOCAB, layer_ids=[1, 9])
    with pytest.raises(ValueError, match="distinct, ascending"):
        Eagle3Head(target, DRAFT_VOCAB, layer_ids=[2, 1, 3])


def test_layer_inputs_tap_is_empty_outside_its_block(target):
    tap = LayerInputsTap([target.model.layers[0], target.model.layers[1]])
    assert tap.value is None
    with tap:
        target(torch.tensor([[4, 5, 6]]))
        assert tap.value.shape == (1, 3, 2 * target.config.hidden_size)
    assert tap.value is None


@pytest.mark.parametrize("engine", ["dynamic", "static", "graphs"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_plain(target, requests, head, engine, k):
    ids = torch.tensor([r.prompt_ids for r in requests[:6]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0                                      # left padding
    decoder = SpecDecoder(target, HeadDrafter(head), k=k, static_cache=engine != "dynamic",
                          cuda_graphs=engine == "graphs")
    plain = decoder.generate_plain(ids, 16, attention_mask=mask)
    general = SpecDecoder(target, HeadDrafter(head), k=k).generate(ids, 16, attention_mask=mask)
    for _ in range(2 if engine == "graphs" else 1):      # the second call replays captured rounds
        spec = decoder.generate(ids, 16, attention_mask=mask)
        assert torch.equal(spec.tokens, plain.tokens)
        assert 0 < spec.stats.accepted < spec.stats.drafted
        assert (spec.stats.rounds, spec.stats.accepted) == (general.stats.rounds, general.stats.accepted)
    if engine == "graphs":
        caches = [c for c in decoder.engine_state()["caches"] if c["role"] == "target"]
        assert any(graph["source"] == "device" for graph in caches[0]["round_graphs"])


def test_greedy_estimate_equals_live_rounds(target, requests, head):
    rows = requests[:8]
    for k in (1, 3):
        estimate = estimate_acceptance(target, HeadDrafter(head), rows, [k], progress=False,
                                       n_boot=50)["qa"][k]
        assert estimate.conditional_acceptance[0] > 0
        for request, totals in zip(rows, estimate.per_request):
            live = SpecDecoder(target, HeadDrafter(head), k=k).generate(
                torch.tensor([request.prompt_ids]), len(request.response_ids))
            assert live.tokens[0].tolist() == list(request.response_ids)
            assert totals.rounds == live.stats.rounds, (k, request.request_id)
            assert totals.accepted.sum() == live.stats.accepted, (k, request.request_id)


def test_chain_training_pass_computes_what_the_live_chain_computes(target, head):
    """Step w of the unrolled pass at position j feeds on the head's own output g (no fc), as a
    live round that started after j - w does."""
    assert chain_pass_checks(head, target) > 20


def test_sampling_distribution_in_captured_rounds(target, head):
    # q is zero outside the draft vocabulary: the residual distribution must restore p there
    prompt = torch.tensor([5, 17, 33, 8, 61, 17, 33])
    captured = functools.partial(SpecDecoder, static_cache=True, cuda_graphs=True)
    report = sampling_check(target, HeadDrafter(head), prompt, ks=(3,), rows=1500, seed=5,
                            chunk=500, decoder_cls=captured)
    assert report.passed, [t for t in report.tests if not t.passed]


def test_speculators_files(target, head, tmp_path):
    directory = head.save(tmp_path / "e3", meta={"run": "r1"}, k=4, verifier="/models/tiny")
    assert is_eagle3_dir(directory) and not is_eagle3_dir(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny"
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["draft_vocab_size"] == len(DRAFT_VOCAB)
    assert config["norm_before_residual"] is True           # written: vLLM and speculators differ
    assert config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == default_layer_ids(8) == [2, 4, 5]
    state = load_file(str(directory / "model.safetensors"))
    hidden = 64
    assert state["fc.weight"].shape == (hidden, 3 * hidden)
    assert state["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert state["layers.0.hidden_norm.weight"].shape == (hidden,)
    assert state["lm_head.weight"].shape == (len(DRAFT_VOCAB), hidden)
    assert state["norm.weight"].shape == (hidden,)
    assert not any("embed" in name for name in state)       # the target's, shared
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(len(DRAFT_VOCAB)) + state["d2t"], DRAFT_VOCAB)
    assert torch.equal(state["t2d"].nonzero()[:, 0], DRAFT_VOCAB)
    # a full draft vocabulary has no mapping (vLLM refuses d2t then), and reads back
    full = Eagle3Head(target, torch.arange(VOCAB)).save(tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(full / "model.safetensors")))
    assert Eagle3Head.load(full, target).vocab_size == VOCAB
    # read back: the same weights, and the same drafts
    loaded = Eagle3Head.load(directory, target)
    for (name, a), (_, b) in zip(head.own_named_parameters(), loaded.own_named_parameters()):
        assert torch.equal(a, b), name
    assert loaded.layer_ids == head.layer_ids and loaded.meta == {"run": "r1"}
    drafter = make_drafter("eagle3", {"model": str(directory)}, target)
    assert drafter.describe() == {"kind": "eagle3", "params": {"vocab_size": len(DRAFT_VOCAB)}}


def test_bad_checkpoints_name_the_file(target, head, tmp_path):
    directory = head.save(tmp_path / "good")
    # corrupt weights
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((directory / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HeadFileError, match="corrupt"):
        Eagle3Head.load(bad, target)
    # another format
    (bad / "config.json").write_text(json.dumps({"speculators_model_type": "eagle"}))
    with pytest.raises(HeadFileError, match="config.json.*'eagle'"):
        Eagle3Head.load(bad, target)
    # another target: other width, other vocabulary
    with pytest.raises(TokenizerMismatch, match="model.safetensors.*train a head for this target"):
        Eagle3Head.load(directory, tiny_llama(hidden=32, layers=8, seed=3))
    with pytest.raises(TokenizerMismatch, match="vocabulary of 97"):
        Eagle3Head.load(directory, tiny_llama(vocab=120, layers=8, seed=3))
    # a layer id the target does not have (a shallower target of the same width)
    with pytest.raises(HeadFileError, match="0..1"):
        Eagle3Head.load(directory, tiny_llama(layers=1, seed=3))
    # tensors of the wrong shape
    state = load_file(str(directory / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
    shaped = tmp_path / "shaped"
    shaped.mkdir()
    (shaped / "config.json").write_text((directory / "config.json").read_text())
    save_file(state, str(shaped / "model.safetensors"))
    with pytest.raises(HeadFileError, match="fc.weight"):
        Eagle3Head.load(shaped, target)


def test_its_step_is_profiled_like_any_drafter(target, head):
    from specdec_core.profile import measure_step_costs
    from specdec_core.train import measure_head_step

    costs = measure_step_costs(target, {"eagle3": HeadDrafter(head)}, k_max=2, repeats=1,
                               context_len=32)
    assert costs["draft_step"]["eagle3"] > 0 and costs["round_overhead"]["eagle3"] >= 0
    assert measure_head_step(head, target, context_len=32, repeats=1) > 0
