"""Compiling one decoder layer instead of the whole forward (a static cache's compile scope
"layer"; static_cache.COMPILE_SCOPE).

torch.compile of a whole forward traces every layer in turn: the body of a 30-layer model is 30
layers long, and its first compile took 31 s (a step) and 46 s (a verify) on an H100 -- the most
of a short GPU run. Every decoder layer of a model runs the same code on weights of the same
shapes, so one compiled body can serve all of them; two things stop torch.compile from seeing it
that way, and this module removes both:

- a layer's attention writes the cache through `past_key_values.update(k, v, self.layer_idx)`,
  and transformers' StaticCache picks the layer's tensors from a Python list by that index: a
  body per index. StackedStaticCache keeps every layer's keys (values, write positions) in one
  tensor, writes into it by the index and reads layer i as a view, `stacked[i]`; with the index
  traced as a symbolic integer (torch._dynamo's `allow_unspec_int_on_nn_module`, and named a
  dynamic source so that the first compile does not specialise on layer 0) that is one body for
  all layers.
  The layers' own `keys`, `values` and `cumulative_length` become views of the stacked tensors,
  so everything that reads or moves them (compaction, rollback, the write counters) still works.
- the layers must run compiled inside the cache's decode forwards only (prefills run eagerly,
  and other users of the model see it unchanged): `compiled_layers` gives each layer a compiled
  forward for the duration of one call and takes it away again.

The model's embedding, mask building, final norm and output projection run eagerly around the
layers (on CUDA inside the engine's captured graphs, where an eager kernel costs its launch).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from transformers import StaticCache


class StackedStaticCache(StaticCache):
    """A StaticCache whose layers' tensors are views of three stacked tensors (stack_layers):
    an update picks its layer by indexing them, which a compiled layer traces for any index."""

    stacked_keys: torch.Tensor       # [layers, batch, heads, length, head_dim]
    stacked_values: torch.Tensor
    stacked_lengths: torch.Tensor    # [layers]: each layer's next column to write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # what transformers' StaticLayer.update does on an initialised layer, written into the
        # stacked tensors themselves (index_put_ on them, not index_copy_ on a layer's view:
        # inductor's in-place pass would specialise on the index to rule out overlaps)
        width = key_states.shape[-2]
        device = key_states.device
        layer = torch.full((1,), layer_idx, dtype=torch.long, device=device)
        columns = torch.arange(width, device=device) + self.stacked_lengths.index_select(0, layer)
        self.stacked_lengths.index_add_(0, layer, torch.full((1,), width, dtype=torch.long, device=device))
        # advanced indices apart (layer, column): the written values go [T, B, H, D]
        self.stacked_keys[layer, :, :, columns] = key_states.permute(2, 0, 1, 3)
        self.stacked_values[layer, :, :, columns] = value_states.permute(2, 0, 1, 3)
        return self.stacked_keys[layer_idx], self.stacked_values[layer_idx]


def stackable(cache: StaticCache) -> bool:
    """Whether every layer of `cache` is initialised with tensors of one shape (after a first
    forward: transformers allocates a StaticCache's layers lazily, in the prefill). A stacked
    cache answers at once: this runs before every compiled forward and after every eager one."""
    if isinstance(cache, StackedStaticCache):
        return True
    layers = cache.layers
    if not layers or not all(getattr(layer, "is_initialized", False) for layer in layers):
        return False
    first = layers[0]
    return all(layer.keys.shape == first.keys.shape and layer.values.shape == first.values.shape
               and layer.keys.dtype == first.keys.dtype for layer in layers)


@torch.inference_mode()
def stack_layers(cache: StaticCache) -> None:
    """Turn `cache` (initialised, stackable) into a StackedStaticCache in place, contents kept.
    Earlier tensors of its layers are replaced: call it before any graph captures them."""
    if isinstance(cache, StackedStaticCache):
        return
    layers = cache.layers
    cache.stacked_keys = torch.stack([layer.keys for layer in layers])
    cache.stacked_values = torch.stack([layer.values for layer in layers])
    cache.stacked_lengths = torch.stack([layer.cumulative_length.reshape(()) for layer in layers])
    for index, layer in enumerate(layers):
        layer.keys = cache.stacked_keys[index]
        layer.values = cache.stacked_values[index]
        layer.cumulative_length = cache.stacked_lengths[index]
    for tensor in (cache.stacked_keys, cache.stacked_values, cache.stacked_lengths):
        torch._dynamo.mark_static_address(tensor)     # fixed addresses, as StaticLayer's own
    cache.__class__ = StackedStaticCache
    if cache.stacked_keys.is_cuda and not torch.cuda.is_current_stream_capturing():
        # the layers' own tensors go back to the allocator now: the copies must have read them
        torch.cuda.current_stream(cache.stacked_keys.device).synchronize()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' causal LMs: model.model.layers), or []."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return []
    kinds = {type(layer) for layer in layers}
    return list(layers) if len(kinds) == 1 else []


@functools.cache
def _compiled_forward(layer_type: type, backend: str, options: tuple = ()):
    """One compiled forward per decoder-layer class (and backend and options: torch.compile's
    options as sorted pairs), shared by all its layers."""
    return torch.compile(layer_type.forward, dynamic=None, backend=backend, options=dict(options) or None)


def index_sources(layer: torch.nn.Module) -> list[str]:
    """torch.compile's names of the layer-index attributes in a decoder layer's forward (`self`
    and its submodules' `layer_idx`): marked dynamic, the first compile already serves every layer
    (else it specialises on layer 0 and compiles again for layer 1)."""
    sources = []
    for name, module in layer.named_modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            path = "".join(f"._modules['{part}']" for part in name.split(".")) if name else ""
            sources.append(f"L['self']{path}.layer_idx")
    return sources


@contextlib.contextmanager
def compiled_layers(layers: list[torch.nn.Module], backend: str, options: tuple = ()):
    """Within: each layer's forward is its class's compiled forward (the layer index traced as a
    symbolic integer, so every layer shares the body). Outside: the layers are as before."""
    compiled = _compiled_forward(type(layers[0]), backend, options)
    settings = torch.compiler.config
    # a torch without dynamic_sources specialises on the first layer's index, then compiles once more
    sources = (settings.patch(dynamic_sources=",".join(filter(None, [
        settings.dynamic_sources, *index_sources(layers[0])])))
        if hasattr(settings, "dynamic_sources") else contextlib.nullcontext())
    for layer in layers:
        layer.forward = functools.partial(compiled, layer)
    try:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), sources:
            yield
    finally:
        for layer in layers:
            del layer.forward
