"""CPU kernels for narrow forwards (specdec_core.cpu_kernels): packed linear weights for 4-48 rows
and grouped-query SDPA under a mask give the same logits as transformers' own path at every width,
follow weight changes, leave training alone, and the decoder turns them on by default on a CPU
with the same tokens as before."""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
from transformers import DynamicCache

from specdec_core import SpecDecoder, cpu_kernels
from specdec_core.drafters import DraftModel, PromptLookup

from .helpers.models import VOCAB, left_padded_batch, repetitive_prompt, tiny_llama

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="this torch build has no oneDNN")


def _pair(seed: int = 0):
    """Two equal tiny targets (grouped key/value heads); the second with the CPU kernels."""
    plain, fast = tiny_llama(seed=seed), tiny_llama(seed=seed)
    applied = cpu_kernels.prepare(fast)
    return plain, fast, applied


def _narrow_logits(model, ids, mask, width: int) -> torch.Tensor:
    """Logits of a pass over `width` new positions after a cached prefix (a verify pass)."""
    cache = DynamicCache(config=model.config)
    prefix = ids.shape[1] - width
    with torch.inference_mode():
        model(ids[:, :prefix], attention_mask=mask[:, :prefix], past_key_values=cache, use_cache=True)
        return model(ids[:, prefix:], attention_mask=mask, past_key_values=cache,
                     use_cache=True).logits


def test_every_width_gives_transformers_logits_and_packs_only_what_ran_narrow():
    plain, fast, applied = _pair()
    linears = sum(1 for m in fast.modules() if isinstance(m, torch.nn.Linear))
    assert applied == {"packed_linear": linears, "gqa_attention": True}
    assert fast.config._attn_implementation == cpu_kernels.ATTENTION
    assert cpu_kernels.prepare(fast) == applied                    # idempotent
    ids, mask = left_padded_batch()
    # one row at a time (widths on both sides of the first packed row count) and the padded batch of 3
    for batch_ids, batch_mask in ((ids[2:], mask[2:]), (ids, mask)):
        for width in range(1, 9):
            want = _narrow_logits(plain, batch_ids, batch_mask, width)
            got = _narrow_logits(fast, batch_ids, batch_mask, width)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    packed = [m for m in fast.modules() if isinstance(m, cpu_kernels.PackedLinear) and m._specdec_packed.tensor is not None]
    assert len(packed) == linears


def test_a_model_that_ran_no_narrow_forward_holds_no_packed_weight(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "PACKED_ROWS", (4, cpu_kernels.MAX_PACKED_ROWS))
    ids, _ = left_padded_batch()
    lazy = tiny_llama(seed=1)
    cpu_kernels.prepare(lazy)
    with torch.inference_mode():                                   # 1 row: the plain weight
        lazy(ids[2:, -1:])
    assert all(m._specdec_packed.tensor is None for m in lazy.modules() if isinstance(m, cpu_kernels.PackedLinear))


def test_the_few_row_routes_are_timed_once_on_the_models_shapes_and_padding_keeps_the_numbers(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "PACKED_ROWS", None)
    monkeypatch.setattr(cpu_kernels, "_TIMED", {})
    model = tiny_llama()
    plan = cpu_kernels.packed_rows(model)
    assert len(plan.route) == cpu_kernels.SMALL_ROWS and plan.last == cpu_kernels.MAX_PACKED_ROWS
    assert all(n == 0 or r <= n <= cpu_kernels.SMALL_ROWS for r, n in enumerate(plan.route, 1))
    assert plan.route[-1] == cpu_kernels.SMALL_ROWS                  # 4 rows: packed as they are
    assert list(cpu_kernels._TIMED.values()) == [plan]               # once per process and shapes
    assert cpu_kernels.packed_rows(tiny_llama(seed=3)) == plan and len(cpu_kernels._TIMED) == 1
    cpu_kernels.prepare(model)
    assert {m._specdec_rows for m in model.modules() if isinstance(m, cpu_kernels.PackedLinear)} == {plan}
    # every route gives F.linear's numbers: plain, packed, packed padded with zero rows
    layer = torch.nn.Linear(64, 97)
    plain = copy.deepcopy(layer)
    layer._specdec_packed = cpu_kernels.PackedWeight()
    layer.__class__ = cpu_kernels.PackedLinear
    for route in ((0, 0, 0, 4), (1, 2, 3, 4), (4, 4, 4, 4), (3, 3, 3, 4)):
        layer._specdec_rows = cpu_kernels.RowPlan(route, cpu_kernels.MAX_PACKED_ROWS)
        with torch.inference_mode():
            for shape in ((1, 64), (2, 64), (1, 3, 64), (2, 2, 64), (5, 64), (1, 49, 64)):
                x = torch.randn(*shape)
                got = layer(x)
                assert got.shape == plain(x).shape
                torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)
    assert cpu_kernels.RowPlan((4, 4, 3, 4), 48).rows_for(1) == 4
    assert cpu_kernels.RowPlan((4, 4, 3, 4), 48).rows_for(49) == 0
    assert cpu_kernels.RowPlan.from_range(2, 48).route == (0, 2, 3, 4)


def test_a_changed_weight_is_packed_again():
    plain, fast, _ = _pair()
    ids, mask = left_padded_batch()
    _narrow_logits(fast, ids[2:], mask[2:], 5)
    with torch.no_grad():
        for model in (plain, fast):
            model.lm_head.weight.mul_(-1.0)                        # in place: same storage
            model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
                model.model.layers[0].mlp.down_proj.weight * 0.5)  # a new tensor
    torch.testing.assert_close(_narrow_logits(fast, ids[2:], mask[2:], 5),
                               _narrow_logits(plain, ids[2:], mask[2:], 5), rtol=1e-4, atol=1e-4)


def test_a_forward_that_records_gradients_takes_transformers_path():
    plain, fast, _ = _pair()
    ids, mask = left_padded_batch()
    grads = []
    for model in (plain, fast):
        model.zero_grad()
        loss = model(ids, attention_mask=mask).logits[:, -5:].logsumexp(-1).sum()
        loss.backward()
        grads.append(model.model.layers[1].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    assert all(m._specdec_packed.tensor is None for m in fast.modules() if isinstance(m, cpu_kernels.PackedLinear))


def test_a_copy_of_a_prepared_model_packs_its_own_weights():
    _, fast, _ = _pair()
    ids, mask = left_padded_batch()
    want = _narrow_logits(fast, ids, mask, 5)
    restored = pickle.loads(pickle.dumps(fast))                     # pickles carry no packed weight
    assert all(m._specdec_packed.tensor is None for m in restored.modules()
               if isinstance(m, cpu_kernels.PackedLinear))
    torch.testing.assert_close(_narrow_logits(restored, ids, mask, 5), want)
    twin = copy.deepcopy(fast)
    assert all(m._specdec_packed.tensor is None for m in twin.modules() if isinstance(m, cpu_kernels.PackedLinear))
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    assert _narrow_logits(twin, ids, mask, 5).abs().max() == 0      # the copy's own weight
    torch.testing.assert_close(_narrow_logits(fast, ids, mask, 5), want)


def test_the_environment_can_turn_them_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    model = tiny_llama()
    assert cpu_kernels.prepare(model) == {"packed_linear": 0, "gqa_attention": False}
    assert SpecDecoder(model, None).engine()["cpu_kernels"] == {"packed_linear": 0, "gqa_attention": False}
    assert model.config._attn_implementation == "sdpa"


def test_another_dtype_is_left_alone():
    model = tiny_llama().to(torch.bfloat16)
    assert cpu_kernels.prepare(model) == {"packed_linear": 0, "gqa_attention": False}
    assert not any(isinstance(m, cpu_kernels.PackedLinear) for m in model.modules())


def test_the_decoder_uses_them_by_default_with_the_same_tokens():
    plain, fast, _ = _pair()
    prompt = repetitive_prompt()
    # a draft model equal to the target: every draft accepted, so every round verifies K + 1 rows
    off = SpecDecoder(plain, DraftModel(tiny_llama(seed=0)), k=4, cpu_kernels=False)
    on = SpecDecoder(fast, DraftModel(tiny_llama(seed=0)), k=4)
    assert off.engine()["cpu_kernels"] == {"packed_linear": 0, "gqa_attention": False}
    assert on.engine()["cpu_kernels"]["gqa_attention"] is True
    assert plain.config._attn_implementation == "sdpa"            # False left it alone
    want = off.generate(prompt, max_new_tokens=24)
    got = on.generate(prompt, max_new_tokens=24)
    assert torch.equal(got.tokens, want.tokens)
    assert got.stats.accepted == got.stats.drafted > 0             # rounds of width K + 1 ran
    assert torch.equal(got.tokens, on.generate_plain(prompt, max_new_tokens=24).tokens)
    lookup = SpecDecoder(fast, PromptLookup(max_ngram=3), k=4)
    assert torch.equal(lookup.generate(prompt, max_new_tokens=24).tokens, want.tokens)


def test_a_cost_measurement_times_the_forward_the_decoder_runs():
    # the training's costs (train.measured_costs, measure_head_step) time measure_forward_costs;
    # on the model as loaded they priced a verify pass at 1.3-1.9 steps where the decoder's is 1.0
    from specdec_core.profile import CostSampler, measure_forward_costs

    def packed(model) -> int:
        return sum(isinstance(m, cpu_kernels.PackedLinear) for m in model.modules())

    linears = sum(isinstance(m, torch.nn.Linear) for m in tiny_llama().modules())
    model = tiny_llama()
    measure_forward_costs(model, [1, 3], context_len=16, repeats=1)
    assert packed(model) == linears
    assert model.config._attn_implementation == cpu_kernels.ATTENTION
    assert SpecDecoder(model, None).engine()["cpu_kernels"] == {"packed_linear": linears,
                                                              "gqa_attention": True}
    off = tiny_llama()
    measure_forward_costs(off, [1, 3], context_len=16, repeats=1, cpu_kernels=False)
    assert packed(off) == 0 and off.config._attn_implementation == "sdpa"
    # a cost profile prepares the target and a draft model's own model before its first timing
    target, draft = tiny_llama(), tiny_llama(seed=1)
    CostSampler(target, {"draft": DraftModel(draft)}, k_max=2, batch_sizes=[1], context_len=16)
    assert packed(target) == packed(draft) == linears


def test_a_prepared_model_compiles_with_transformers_linears_and_the_same_tokens(monkeypatch):
    # a model the CPU kernels prepared (a default decoder on a CPU does it, for good) and then
    # decoded compiled: the traced forward takes nn.Linear's path, since inductor's CPU lowering
    # of the packed op needs its weight as a graph constant ("Found from" when it was traced)
    monkeypatch.setattr(cpu_kernels, "PACKED_ROWS", (1, cpu_kernels.MAX_PACKED_ROWS))  # every row packed
    plain, fast, applied = _pair()
    assert applied["packed_linear"] > 0
    ids, mask = left_padded_batch()
    want = SpecDecoder(plain, PromptLookup(), k=2, cpu_kernels=False).generate(
        ids, 16, attention_mask=mask, eos_token_id=5)
    compiled = SpecDecoder(fast, PromptLookup(), k=2, static_cache=True, cuda_graphs=True, compile=True)
    got = compiled.generate(ids, 16, attention_mask=mask, eos_token_id=5)
    assert all(cache["compiled"] for cache in compiled.engine_state()["caches"])
    assert torch.equal(got.tokens, want.tokens)
    # outside a compiled body the packed path still runs (and packs the weights it used)
    _narrow_logits(fast, ids, mask, 4)
    assert any(m._specdec_packed.tensor is not None for m in fast.modules()
               if isinstance(m, cpu_kernels.PackedLinear))


def test_a_prepared_model_compiles_one_body_for_every_verify_width(monkeypatch):
    # the packed linear's row plan (a lookup by row count) was read before its compile check,
    # so a trace specialised the width: widths 2, 3, 4 and 5 were four verify bodies (a CPU cost
    # measurement with compile forced on compiled 10 bodies where 2 per model and batch size do)
    from specdec_core import static_cache

    monkeypatch.setattr(static_cache, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(cpu_kernels, "PACKED_ROWS", (1, cpu_kernels.MAX_PACKED_ROWS))  # every row packed
    torch._dynamo.reset()
    plain, fast, applied = _pair(seed=5)
    assert applied["packed_linear"] > 0
    logits, bodies = {}, {}
    for name, model in (("plain", plain), ("fast", fast)):
        cache = static_cache.StaticSequenceCache(model, batch=1, max_len=64, compile=True)
        before = static_cache.compiled_bodies()
        generator = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            cache.forward(torch.randint(3, VOCAB, (1, 12), generator=generator), graphed=False)
            for width in (1, 2, 3, 4, 5, 6):
                step = torch.randint(3, VOCAB, (1, width), generator=generator)
                logits[name, width] = cache.forward(step).clone()
                cache.rollback_to(cache.count.clone() - width, width=cache.width - width)
        bodies[name] = static_cache.compiled_bodies() - before
    assert bodies == {"plain": 2, "fast": 2}                   # a step and one verify
    for width in (1, 2, 3, 4, 5, 6):
        torch.testing.assert_close(logits["fast", width], logits["plain", width])


def _cache_steps(model, shared: bool) -> tuple[list, list]:
    """One prompt for 5 rows, then a pass with holes, a rollback to different lengths, two rows
    leaving and a last pass; the logits of each forward and the cache's layer types."""
    from specdec_core.cache import SequenceCache, shared_prompt_cache

    torch.manual_seed(7)
    prompt = torch.randint(3, VOCAB, (1, 11)).expand(5, -1)
    verify = torch.randint(3, VOCAB, (5, 4))
    valid = torch.ones(5, 4, dtype=torch.bool)
    valid[1, 2:] = False
    valid[3, 1:] = False
    cache = SequenceCache(model)
    logits = []
    with torch.inference_mode(), (shared_prompt_cache() if shared else contextlib.nullcontext()):
        logits.append(cache.forward(prompt, logits_to_keep=1))
        types = [type(layer).__name__ for layer in cache.cache.layers]
        logits.append(cache.forward(verify, valid))
        cache.rollback_to(torch.tensor([12, 13, 11, 12, 15]))
        cache.select_rows(torch.tensor([0, 1, 4]))
        logits.append(cache.forward(torch.randint(3, VOCAB, (3, 3))))
        logits.append(cache.forward(torch.randint(3, VOCAB, (3, 1))))
    return logits, types


def test_a_shared_prompt_cache_keeps_the_prompt_once_with_the_per_row_caches_logits():
    _, fast, _ = _pair()
    per_row, per_row_types = _cache_steps(fast, shared=False)
    shared, shared_types = _cache_steps(fast, shared=True)
    assert set(per_row_types) == {"DynamicLayer"}                 # off by default: B copies
    assert set(shared_types) == {"SharedPrefixLayer"}
    for want, got in zip(per_row, shared, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_shared_prompt_cache_holds_the_prompt_once_and_refuses_to_crop_into_it():
    from specdec_core.cache import SequenceCache, shared_prompt_cache

    _, fast, _ = _pair()
    cache = SequenceCache(fast)
    with torch.inference_mode(), shared_prompt_cache():
        cache.forward(torch.arange(3, 12)[None].expand(6, -1))
        cache.forward(torch.randint(3, VOCAB, (6, 2)))
    layer = cache.cache.layers[0]
    assert layer.prefix_keys.shape[0] == 1 and layer.prefix_keys.shape[2] == 9
    assert layer.keys.shape[:3] == (6, layer.prefix_keys.shape[1], 2)
    assert cache.cache.get_seq_length() == 11
    with pytest.raises(ValueError, match="after the prefix"):
        layer.crop(-3)
    # a model that does not attend through the CPU kernels copies the prompt per row
    plain = SequenceCache(tiny_llama())
    with torch.inference_mode(), shared_prompt_cache():
        plain.forward(torch.arange(3, 12)[None].expand(6, -1))
    assert {type(layer).__name__ for layer in plain.cache.layers} == {"DynamicLayer"}


def test_samples_of_one_prompt_are_the_same_with_the_prompt_cached_once():
    from specdec_core import SamplingParams
    from specdec_core.cache import shared_prompt_cache

    _, fast, _ = _pair()
    draft = tiny_llama(seed=5)
    cpu_kernels.prepare(draft)
    decoder = SpecDecoder(fast, DraftModel(draft), k=3)
    prompt = repetitive_prompt().expand(40, -1)
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    want = decoder.generate(prompt, max_new_tokens=10, sampling=sampling, seed=11)
    with shared_prompt_cache():
        got = decoder.generate(prompt, max_new_tokens=10, sampling=sampling, seed=11)
    assert want.stats.drafted > want.stats.accepted > 0            # rounds accepted and rejected
    assert torch.equal(got.tokens, want.tokens)
