"""Compile scope "layer" (specdec_core/layer_compile.py): one compiled decoder layer shared by every
layer of a static cache's model, against the general path and the whole-forward scope."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from specdec_core import DraftModel, LayerSkip, PromptLookup, SpecDecoder, static_cache
from specdec_core.layer_compile import StackedStaticCache, stack_layers
from specdec_core.static_cache import StaticSequenceCache

from .helpers.models import left_padded_batch, repetitive_prompt, tiny_llama


def _traced(scope: str, layers: int, monkeypatch) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(bodies, operators traced) of a speculative decode with compile on in `scope` (eager
    backend: the same tracing, no code generation), its tokens and the general path's."""
    monkeypatch.setattr(static_cache, "COMPILE_SCOPE", scope)
    monkeypatch.setattr(static_cache, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama(layers=layers, seed=4)
    want = SpecDecoder(model, PromptLookup(max_ngram=3), k=3, static_cache=False, cpu_kernels=False)
    got = SpecDecoder(model, PromptLookup(max_ngram=3), k=3, static_cache=True, cuda_graphs=False,
                      compile=True, cpu_kernels=False)
    prompt = repetitive_prompt()
    tokens = got.generate(prompt, 16).tokens
    assert [cache["compile_scope"] for cache in got.engine_state()["caches"]] == [scope]
    return (counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"], tokens,
            want.generate(prompt, 16).tokens)


def test_the_layer_scope_traces_one_layer_whatever_the_depth(monkeypatch):
    # the whole-forward scope traces every layer (its compile time grows with depth: 31 s and
    # 46 s for the first two bodies of a 30-layer model on an H100); the layer scope traces one
    # layer, shared by all, so 2 and 6 layers trace the same operators
    traced = {}
    for scope in ("model", "layer"):
        for layers in (2, 6):
            bodies, ops, tokens, want = _traced(scope, layers, monkeypatch)
            assert torch.equal(tokens, want), (scope, layers)
            assert bodies > 0
            traced[scope, layers] = ops
    # four more layers: at least ten more operators each (norms, projections, attention, MLP)
    assert traced["model", 6] - traced["model", 2] >= 4 * 10, traced
    assert traced["layer", 6] <= traced["layer", 2], traced
    assert traced["layer", 6] < traced["model", 6] / 2, traced


@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "draft_model", "layer_skip"])
def test_the_layer_scope_keeps_greedy_outputs_under_inductor(name, monkeypatch):
    # inductor's C++ backend, rounds replayed (the CPU stand-in of CUDA graphs), a left-padded
    # batch whose rows stop at EOS: the tokens of the general path, the caches' layers stacked
    monkeypatch.setattr(static_cache, "COMPILE_SCOPE", "layer")
    target = tiny_llama(seed=6)
    draft = tiny_llama(hidden=32, layers=2, heads=2, seed=7)
    drafters = {"plain": lambda: None, "prompt_lookup": lambda: PromptLookup(max_ngram=3),
                "draft_model": lambda: DraftModel(draft), "layer_skip": lambda: LayerSkip(target, num_layers=2)}
    ids, mask = left_padded_batch()
    general = SpecDecoder(target, drafters[name](), k=2, static_cache=False, cpu_kernels=False)
    compiled = SpecDecoder(target, drafters[name](), k=2, static_cache=True, cuda_graphs=True,
                           compile=True, cpu_kernels=False)
    for decoder in (general, compiled):
        decoder.run = decoder.generate if name != "plain" else decoder.generate_plain
    want = general.run(ids, 20, attention_mask=mask, eos_token_id=5)
    for _ in range(2):                       # the second call replays the captured rounds
        got = compiled.run(ids, 20, attention_mask=mask, eos_token_id=5)
        assert torch.equal(got.tokens, want.tokens)
    caches = compiled.engine_state()["caches"]
    assert caches and all(c["compiled"] and c["compile_scope"] == "layer" for c in caches)
    pool = compiled.static_pool
    assert all(isinstance(cache.cache, StackedStaticCache) for cache in pool._caches.values())


def test_stacking_keeps_every_layers_contents_and_its_write_position():
    model = tiny_llama(seed=8)
    cache = StaticSequenceCache(model, batch=2, max_len=32)
    ids = torch.randint(3, 60, (2, 7))
    cache.forward(ids, graphed=False)                       # the prefill initialises the layers
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.cache.layers]
    stack_layers(cache.cache)
    stacked = cache.cache
    assert isinstance(stacked, StackedStaticCache)
    for index, (layer, (keys, values)) in enumerate(zip(stacked.layers, before)):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert layer.keys.data_ptr() == stacked.stacked_keys[index].data_ptr()     # a view
    assert stacked.stacked_lengths.tolist() == [7] * len(stacked.layers)
    # a rollback moves every layer's position (views of one tensor) with the cache's own
    cache.rollback_to(torch.tensor([5, 5]), width=5)
    assert stacked.stacked_lengths.tolist() == [5] * len(stacked.layers) == cache.state()["device_positions"][:-1]
    # and a forward after stacking writes where the unstacked cache would have
    plain = StaticSequenceCache(model, batch=2, max_len=32)
    plain.forward(ids, graphed=False)
    plain.rollback_to(torch.tensor([5, 5]), width=5)
    step = torch.randint(3, 60, (2, 1))
    torch.testing.assert_close(cache.forward(step, graphed=False), plain.forward(step, graphed=False))


def test_an_unknown_scope_is_refused_with_its_setting(monkeypatch):
    monkeypatch.setattr(static_cache, "COMPILE_SCOPE", "region")
    decoder = SpecDecoder(tiny_llama(seed=9), PromptLookup(), k=2, static_cache=True, compile=True,
                          cpu_kernels=False)
    with pytest.raises(ValueError, match="SPECDEC_COMPILE_SCOPE.*model, layer"):
        decoder.generate(repetitive_prompt(), 4)


def test_the_layer_scope_stacks_a_cache_right_after_its_prefill(monkeypatch):
    # on the stream of the prefill, before any capture's warm-up (on CUDA a side stream) could
    # be the first to touch the layers; the whole-forward scope and compile off leave them alone
    model = tiny_llama(seed=10)
    prompt = torch.randint(3, 60, (1, 6))
    for scope, compile_on, stacked in (("layer", True, True), ("model", True, False), ("layer", False, False)):
        monkeypatch.setattr(static_cache, "COMPILE_SCOPE", scope)
        cache = StaticSequenceCache(model, batch=1, max_len=32, compile=compile_on)
        cache.forward(prompt, graphed=False)
        assert isinstance(cache.cache, StackedStaticCache) is stacked, (scope, compile_on)


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_inductor_options_reach_the_compiler_and_other_options_compile_their_own_bodies(scope, monkeypatch):
    # SPECDEC_INDUCTOR_OPTIONS (static_cache.COMPILE_OPTIONS) goes to torch.compile's options in
    # both scopes; a decoder made after they change, on the same model, gets caches of its own,
    # compiled with them (the caches made before would run the bodies compiled without them)
    seen: list = []

    def recording(graph_module, example_inputs, options=None):
        seen.append(options)
        return graph_module.forward

    monkeypatch.setattr(static_cache, "COMPILE_SCOPE", scope)
    monkeypatch.setattr(static_cache, "COMPILE_BACKEND", recording)
    torch._dynamo.reset()
    model = tiny_llama(layers=2, seed=4)
    prompt = repetitive_prompt()
    tokens, states = {}, {}
    for options in ("", "coordinate_descent_tuning=1,max_autotune=0"):
        monkeypatch.setattr(static_cache, "COMPILE_OPTIONS", options)
        seen.clear()
        decoder = SpecDecoder(model, PromptLookup(max_ngram=3), k=3, static_cache=True,
                              cuda_graphs=False, compile=True, cpu_kernels=False)
        tokens[options] = decoder.generate(prompt, 16).tokens
        states[options] = [cache["inductor_options"] for cache in decoder.engine_state()["caches"]]
        want = {"coordinate_descent_tuning": True, "max_autotune": False} if options else None
        assert seen and all(s == want for s in seen), (options, seen)
    assert states == {"": [{}], "coordinate_descent_tuning=1,max_autotune=0": [
        {"coordinate_descent_tuning": True, "max_autotune": False}]}
    assert torch.equal(tokens[""], tokens["coordinate_descent_tuning=1,max_autotune=0"])


@pytest.mark.parametrize("text, message", [
    ("no_such_option=1", "no_such_option .*not settings of torch"),
    ("coordinate_descent_tuning=maybe", "coordinate_descent_tuning is a bool"),
    ("coordinate_descent_tuning", "write name=value")])
def test_a_bad_inductor_option_names_itself_and_the_variable(text, message, monkeypatch):
    monkeypatch.setattr(static_cache, "COMPILE_OPTIONS", text)
    with pytest.raises(ValueError, match=message) as raised:
        SpecDecoder(tiny_llama(layers=1, seed=4), PromptLookup(), k=2, static_cache=True,
                    cuda_graphs=False, compile=True, cpu_kernels=False).generate(repetitive_prompt(), 4)
    assert "SPECDEC_INDUCTOR_OPTIONS" in str(raised.value)
