"""Fused projections (specdec_core/fused_projections.py): a decoder layer's q/k/v and gate/up
projections multiplied as one matrix each, with the model's parameters, state dict, training and
greedy tokens as before, on every engine path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from specdec_core import DraftModel, LayerSkip, PromptLookup, SpecDecoder, static_cache
from specdec_core.errors import InvalidDecodeInput
from specdec_core.fused_projections import FusedProjection, fuse_projections, fused_projections

from .helpers.models import left_padded_batch, repetitive_prompt, tiny_llama

LAYERS = 4


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products (aten mm / addmm) that reach the kernels."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def fused_copy(model):
    other = copy.deepcopy(model)
    assert fuse_projections(other) == {"attention": LAYERS, "mlp": LAYERS}
    return other


def test_a_fused_model_keeps_its_parameters_state_dict_and_logits():
    model = tiny_llama(layers=LAYERS, seed=1)
    fused = fused_copy(model)
    before, after = model.state_dict(), fused.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in model.named_parameters()]
    # no second copy of the weights: the projections' Parameters are rows of the group's tensor
    attention = fused.model.layers[0].self_attn
    group = attention.q_proj.group
    assert group is attention.k_proj.group is attention.v_proj.group
    rows = attention.q_proj.out_features
    assert attention.k_proj.weight.data_ptr() == group.weight.data_ptr() + rows * group.weight.stride(0) * group.weight.element_size()
    assert sum(b.numel() for b in fused.buffers()) == sum(b.numel() for b in model.buffers()) + sum(
        p.numel() for layer in fused.model.layers
        for p in (*layer.self_attn.q_proj.group.buffers(), *layer.mlp.gate_proj.group.buffers()))
    ids, mask = left_padded_batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = fused(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fused_model_saves_and_loads_as_transformers_checkpoint(tmp_path):
    # the projections' weights share one storage; save_pretrained must still write each of them
    model = fused_copy(tiny_llama(layers=LAYERS, seed=1))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved, read = model.state_dict(), loaded.state_dict()
    assert list(read) == list(saved)
    assert all(torch.equal(read[name], saved[name]) for name in saved)


def test_a_decode_step_runs_four_matrix_products_per_layer_instead_of_seven():
    # q, k, v, o, gate, up, down -> qkv, o, gate_up, down; plus the output projection
    model = tiny_llama(layers=LAYERS, seed=1)
    fused = fused_copy(model)
    ids = repetitive_prompt()
    counts = {}
    for name, m in (("plain", model), ("fused", fused)):
        with torch.no_grad(), MatrixProducts() as products:
            m(ids)
        counts[name] = products.count
    assert counts == {"plain": 7 * LAYERS + 1, "fused": 4 * LAYERS + 1}, counts


def test_a_projection_called_on_another_input_multiplies_by_its_own_rows():
    attention = fused_copy(tiny_llama(layers=LAYERS, seed=1)).model.layers[0].self_attn
    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    with torch.no_grad():
        q = attention.q_proj(x)
        k = attention.k_proj(y)                 # not q's input: its own rows, not q's product
        v = attention.v_proj(x)                 # q's input again: its columns of the product
        for out, proj, inp in ((q, attention.q_proj, x), (k, attention.k_proj, y), (v, attention.v_proj, x)):
            torch.testing.assert_close(out, F.linear(inp, proj.weight), rtol=1e-6, atol=1e-6)
        # out of order after the last one dropped the product: each multiplies by its own rows
        torch.testing.assert_close(attention.v_proj(x), F.linear(x, attention.v_proj.weight))
    assert attention.q_proj.group.output is None and attention.q_proj.group.input is None


@pytest.mark.parametrize("how", ["in_place", "deep_copy"])
def test_training_a_fused_model_updates_the_weights_it_multiplies_by(how):
    # under autograd the projections are nn.Linear (gradients reach their Parameters); an
    # optimizer's in-place step writes through to the fused tensor the next no-grad pass reads.
    # A deep copy gives every Parameter and the fused tensor storage of their own: the copy's
    # next forward links them again, so it multiplies by the trained weights too
    model = tiny_llama(layers=LAYERS, seed=2)
    fused = fused_copy(model)
    ids = repetitive_prompt()
    if how == "deep_copy":
        with torch.no_grad():
            fused(ids)
        fused = copy.deepcopy(fused)
        group = fused.model.layers[1].self_attn.k_proj.group
        assert not group.linked()
    for m in (model, fused):
        m.train()
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        m(ids, labels=ids).loss.backward()
        optimizer.step()
        m.eval()
    projection = fused.model.layers[1].self_attn.k_proj
    assert projection.weight.grad is not None
    torch.testing.assert_close(projection.weight, model.model.layers[1].self_attn.k_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert projection.group.linked()


def test_a_cast_fused_model_multiplies_by_its_cast_weights():
    model = tiny_llama(layers=LAYERS, seed=3)
    fused = fused_copy(model).to(torch.float64)
    ids = repetitive_prompt()
    with torch.no_grad():
        want = model.to(torch.float64)(ids).logits
        got = fused(ids).logits
    assert got.dtype == torch.float64 and fused.model.layers[0].mlp.up_proj.group.weight.dtype == torch.float64
    torch.testing.assert_close(got, want)
    assert fused.model.layers[0].mlp.up_proj.group.linked()


def test_fusing_is_idempotent_and_leaves_other_linears_alone():
    model = tiny_llama(layers=LAYERS, seed=1)
    assert fused_projections(model) == {"attention": 0, "mlp": 0}
    assert fuse_projections(model) == {"attention": LAYERS, "mlp": LAYERS}
    assert fuse_projections(model) == {"attention": LAYERS, "mlp": LAYERS}
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert kinds == {"q_proj": FusedProjection, "k_proj": FusedProjection, "v_proj": FusedProjection,
                     "gate_proj": FusedProjection, "up_proj": FusedProjection,
                     "o_proj": torch.nn.Linear, "down_proj": torch.nn.Linear, "lm_head": torch.nn.Linear}


def test_the_decoder_fuses_on_cuda_by_default_and_says_so():
    model = tiny_llama(layers=LAYERS, seed=1)
    with pytest.raises(InvalidDecodeInput, match="fuse_projections='yes'"):
        SpecDecoder(model, None, fuse_projections="yes")
    auto = SpecDecoder(model, None)
    cuda = next(model.parameters()).is_cuda
    expected = LAYERS if cuda else 0
    assert auto.engine()["fused_projections"] == {"attention": expected, "mlp": expected}
    draft = tiny_llama(hidden=32, layers=2, heads=2, seed=7)
    forced = SpecDecoder(tiny_llama(layers=LAYERS, seed=1), DraftModel(draft), fuse_projections=True)
    assert forced.engine()["fused_projections"] == {"attention": LAYERS, "mlp": LAYERS}
    assert fused_projections(draft) == {"attention": 2, "mlp": 2}        # the drafter's model too


ENGINES = {
    "dynamic": dict(static_cache=False),
    "static_graphs": dict(static_cache=True, cuda_graphs=True, compile=False),
    "static_graphs_inductor": dict(static_cache=True, cuda_graphs=True, compile=True),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "draft_model", "layer_skip"])
def test_fused_projections_keep_greedy_tokens_on_every_engine_path(name, engine):
    # a left-padded batch whose rows stop at EOS, the rounds replayed where graphs are on (the
    # CPU stand-in of CUDA graphs), inductor's C++ backend where compile is on
    target = tiny_llama(seed=6)
    draft = tiny_llama(hidden=32, layers=2, heads=2, seed=7)

    def drafter(model, small):
        return {"plain": lambda: None, "prompt_lookup": lambda: PromptLookup(max_ngram=3),
                "draft_model": lambda: DraftModel(small),
                "layer_skip": lambda: LayerSkip(model, num_layers=2)}[name]()

    ids, mask = left_padded_batch()
    general = SpecDecoder(target, drafter(target, draft), k=2, static_cache=False, cpu_kernels=False,
                          fuse_projections=False)
    ftarget, fdraft = copy.deepcopy(target), copy.deepcopy(draft)
    fused = SpecDecoder(ftarget, drafter(ftarget, fdraft), k=2, cpu_kernels=False, fuse_projections=True,
                        **ENGINES[engine])
    assert fused.engine()["fused_projections"] == {"attention": LAYERS, "mlp": LAYERS}
    run = {d: (d.generate if name != "plain" else d.generate_plain) for d in (general, fused)}
    want = run[general](ids, 20, attention_mask=mask, eos_token_id=5)
    for _ in range(2):                   # the second call replays the captured rounds
        got = run[fused](ids, 20, attention_mask=mask, eos_token_id=5)
        assert torch.equal(got.tokens, want.tokens)
        assert got.num_tokens == want.num_tokens


def test_fused_projections_and_cpu_kernels_keep_greedy_tokens():
    # the CPU kernels pack the linears fusing left (o, down, lm_head); tokens as the plain model's
    target = tiny_llama(seed=6)
    ids = repetitive_prompt()
    want = SpecDecoder(target, PromptLookup(max_ngram=3), k=3, cpu_kernels=False).generate(ids, 24).tokens
    model = copy.deepcopy(target)
    both = SpecDecoder(model, PromptLookup(max_ngram=3), k=3, fuse_projections=True)
    if both.engine()["cpu_kernels"]["packed_linear"]:
        assert both.engine()["cpu_kernels"]["packed_linear"] == 2 * LAYERS + 1
    assert torch.equal(both.generate(ids, 24).tokens, want)


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_a_compiled_body_multiplies_fused_and_fusing_compiles_no_more_bodies(scope, monkeypatch):
    # traced by torch.compile, a fused layer makes 4 matrix products, not 7 (a trace that took
    # each projection's own rows would be as correct, and pointless); the group's tensors are the
    # layer's inputs, not constants, so with the layer scope one compiled layer still serves every
    # layer (a body per layer would fail the count)
    traced: list[torch.fx.GraphModule] = []

    def recording(graph_module, example_inputs):
        traced.append(graph_module)
        return graph_module.forward

    monkeypatch.setattr(static_cache, "COMPILE_SCOPE", scope)
    monkeypatch.setattr(static_cache, "COMPILE_BACKEND", recording)
    prompt = repetitive_prompt()
    bodies, products, tokens = {}, {}, {}
    for fuse in (False, True):
        torch._dynamo.reset()
        counters.clear()
        traced.clear()
        model = tiny_llama(layers=LAYERS, seed=4)
        decoder = SpecDecoder(model, PromptLookup(max_ngram=3), k=3, static_cache=True, cuda_graphs=False,
                              compile=True, cpu_kernels=False, fuse_projections=fuse)
        tokens[fuse] = decoder.generate(prompt, 16).tokens
        bodies[fuse] = counters["stats"]["unique_graphs"]
        assert sum(counters["graph_break"].values()) == 0, counters["graph_break"]
        products[fuse] = sorted({sum(1 for node in graph.graph.nodes if node.op == "call_function"
                                     and node.target is torch._C._nn.linear) for graph in traced})
    assert bodies[True] == bodies[False] > 0, bodies
    per_body = {"model": {False: [7 * LAYERS + 1], True: [4 * LAYERS + 1]},
                "layer": {False: [7], True: [4]}}[scope]
    assert products == per_body, products
    assert torch.equal(tokens[True], tokens[False])


def test_the_benchmark_compares_fused_and_unfused_on_the_same_weights(tmp_path):
    from .helpers.scripts import load_script

    bench = load_script("benchmarks/fused_projections.py", "fused_projections_bench")
    raw = bench.main(["--smoke", "--out", str(tmp_path / "f.md"), "--json", str(tmp_path / "f.json")])
    layers = bench.gpu_decode.TARGET_SMOKE["num_hidden_layers"]
    assert raw["products_per_step"] == {"fused": 4 * layers + 1, "unfused": 7 * layers + 1}
    assert raw["same_tokens"] is True
    assert raw["engines"]["fused"]["fused_projections"] == {"attention": layers, "mlp": layers}
    assert raw["engines"]["unfused"]["fused_projections"] == {"attention": 0, "mlp": 0}
    assert set(raw["forward_ms"]["fused"]) == {1, 5, 9}
    text = (tmp_path / "f.md").read_text()
    assert "| matrix products per decode step | 9 | 15 | 1.67 |" in text
