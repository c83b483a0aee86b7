"""Faster narrow forwards on a CPU: the verify pass of K + 1 positions and small decode batches.

A speculative round on a CPU costs one target forward over K + 1 positions. Two kernels make that
forward dearer than it need be (measured on this project's 2-core CPU, float32, MKL and oneDNN,
the embedded default at a 200-token context):

- `nn.Linear` over a few rows. MKL's sgemm takes a gemv-like path for 1 to 3 rows and a packing
  gemm from 4 rows on, which reorders the whole weight on every call. A weight packed once for
  oneDNN (`torch.ops.mkldnn._reorder_linear_weight`, what torch's inductor does on a CPU) avoids
  that. How a few rows are best multiplied depends on the CPU: on an Intel development machine
  the model's matmuls took 20 ms at 1 row plain and 25 ms packed, 34 ms at 4 rows plain and 29 ms
  packed; on an AMD EPYC (Zen 4) machine MKL's small-row paths are slow (a whole forward: 55 ms at
  1 row, 91 ms at 2, 110 ms at 3) and oneDNN's are not monotone either (38, 43, 36 and 35 ms at 1
  to 4 rows), so one token costs less padded to three or four rows. The route of 1 to 4 rows
  (plain, packed, or packed padded with zero rows) is timed once per process on the model's own
  layer shapes (`packed_rows()`, a RowPlan; under a second for the embedded default), and the
  packed weight serves 5 to 48 rows; wider passes (prefill) keep the plain weight. A cost profile
  then sees costs that grow with the rows, as its checks expect.
- Attention over more than one new position after a cache. transformers hands grouped key/value
  heads to SDPA (`enable_gqa`) only when there is no mask, and a pass after a cache always has one,
  so it copies every layer's keys and values once per group first. torch's CPU SDPA takes
  `enable_gqa` with a mask; this module's attention function does exactly that (one position of
  a left-padded batch included: otherwise a batch's plain step copied what its verify pass did not,
  and cost more than it), and hands every other case (no mask, position bias, soft-capping, another
  device) to transformers' own SDPA function.

- Many rows after one prompt (the sampling test's 300 continuations of one context). A cache
  that copies the prompt's keys and values per row reads all B copies in every later forward,
  and concatenates them again at every step. Under cache.shared_prompt_cache the prompt is kept
  once and `shared_prefix_attention` reads it for all rows at once: per key/value head, one
  matrix product of every row's queries with the prompt's keys, one softmax over the prompt's and
  the row's own columns, one product with the prompt's values. A sampling test of the embedded
  default (K 1 and 8, two sampling settings, 300 rows) took 43 s with copies and 27 s with the
  prompt kept once at a 265-token context, 33 s and 29 s at 65 tokens (the same draws).

Together, on the Intel machine: a verify forward over 5 positions went from 50 ms to 42 ms, over 9
from 62 ms to 47 ms, one position unchanged; on the AMD one, 5 positions from 87 to 36 ms and one
from 55 to 38 ms (`benchmarks/cpu_kernels.py` measures it on the machine at hand).
Both give the same numbers up to float32 rounding (a different summation order).

`prepare(model)` turns both on for a float32 model on a CPU whose attention is SDPA (unless the
environment sets SPECDEC_CPU_KERNELS=0); it is idempotent and returns what it did. Packed weights are made lazily, on a module's first narrow
forward, and made again when the weight changes (training, loading): a model that never runs a
narrow forward holds no second copy. Under autograd (a forward that records gradients) the plain
path runs, so training is unaffected.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# rows (tokens x batch) for which the packed weight is used, (first, last): set here, it holds for
# every model (no padding); None: packed_rows() times the few-row routes on this CPU, once per
# process and layer shapes
PACKED_ROWS: tuple[int, int] | None = None
MAX_PACKED_ROWS = 48
SMALL_ROWS = 4                  # row counts 1..SMALL_ROWS are routed by RowPlan.route


class RowPlan(NamedTuple):
    """How a PackedLinear multiplies a few rows. route[r - 1], for r = 1..SMALL_ROWS rows: 0 = plain
    F.linear, n >= r = the packed weight over the rows padded with zeros to n (oneDNN's small-row
    kernels are not monotone in the row count on every CPU: on an AMD EPYC one token cost more
    than four). From SMALL_ROWS + 1 to `last` rows: the packed weight; beyond: plain."""

    route: tuple[int, ...]
    last: int

    @classmethod
    def from_range(cls, first: int, last: int) -> "RowPlan":
        return cls(tuple(r if r >= first else 0 for r in range(1, SMALL_ROWS + 1)), last)

    def rows_for(self, rows: int) -> int:
        """The rows to multiply packed (padding if more than `rows`), 0 for plain F.linear."""
        if rows <= 0:
            return 0
        if rows <= SMALL_ROWS:
            return self.route[rows - 1]
        return rows if rows <= self.last else 0

    def text(self) -> str:
        parts = [f"{r}: {'plain' if n == 0 else 'packed' if n == r else f'packed as {n}'}"
                 for r, n in enumerate(self.route, 1)]
        return ", ".join(parts) + f", {SMALL_ROWS + 1}-{self.last}: packed"


_TIMED: dict[tuple, RowPlan] = {}
ATTENTION = "specdec_cpu_sdpa"  # the attention implementation's registered name
_MARK = "_specdec_cpu_kernels"


def available() -> bool:
    """Whether this torch build has the oneDNN packed linear (x86 CPU builds do)."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """A linear layer's weight packed for oneDNN, made on first use and again when the weight
    changes (its storage or its in-place version). Copies and pickles of the model carry none."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.key: tuple | None = None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if self.key != key:
            self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self.key = key
        return self.tensor

    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {"tensor": None, "key": None}


class PackedLinear(torch.nn.Linear):
    """nn.Linear whose forward over 4 to 48 rows of float32 on a CPU multiplies by its weight packed
    for oneDNN (`_specdec_packed`); every other call, and every call torch.compile traces, is
    nn.Linear's. prepare() turns a model's nn.Linear modules into this class in place (same
    parameters, state dict and pickles)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.compiler.is_compiling():
            # traced by torch.compile: nn.Linear's (inductor packs weights its own way; the packed
            # weight here is no graph constant, and inductor's CPU lowering of this op needs one).
            # Before the row plan is read: its lookup by row count would specialise the traced
            # width (one body per verify width of 2 to 4 instead of one for all)
            return F.linear(x, weight, self.bias)
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        plan = (RowPlan.from_range(*PACKED_ROWS) if PACKED_ROWS is not None
                else self.__dict__.get("_specdec_rows") or RowPlan.from_range(SMALL_ROWS, MAX_PACKED_ROWS))
        target = plan.rows_for(rows)
        if (target and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            packed = self.__dict__.get("_specdec_packed")
            if packed is None:                      # unpickled or built without prepare()
                packed = self._specdec_packed = PackedWeight()
            if target == rows:
                return torch.ops.mkldnn._linear_pointwise(x, packed.of(weight), self.bias, "none", [], "")
            flat = x.reshape(rows, x.shape[-1])
            padded = torch.cat([flat, flat.new_zeros(target - rows, x.shape[-1])])
            out = torch.ops.mkldnn._linear_pointwise(padded, packed.of(weight), self.bias, "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, weight, self.bias)


def _best_ms(run, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def packed_rows(model: torch.nn.Module) -> RowPlan:
    """The RowPlan of `model`'s linear layers (PACKED_ROWS, where set, as a plain range). Timed
    once per process and model shapes, on the model's largest linear layer and on copies of its
    commonest shape that together outgrow the CPU's caches (as a forward streams every layer's
    weight from memory): plain `F.linear` at 1 to SMALL_ROWS - 1 rows and the packed weight at 1 to
    SMALL_ROWS rows, best of 5 each; each row count takes the cheapest of plain at its count and
    packed at its count or padded to a larger one."""
    if PACKED_ROWS is not None:
        return RowPlan.from_range(*PACKED_ROWS)
    shapes: dict[tuple, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            shapes[tuple(module.weight.shape)] = shapes.get(tuple(module.weight.shape), 0) + 1
    if not shapes:
        return RowPlan.from_range(SMALL_ROWS, MAX_PACKED_ROWS)
    key = (max(shapes, key=lambda shape: shape[0] * shape[1]), max(shapes, key=shapes.get))
    if key in _TIMED:
        return _TIMED[key]
    weights = []
    for out_features, in_features in set(key):
        copies = 1 if (out_features, in_features) == key[0] else max(
            1, min(32, (64 << 20) // (4 * out_features * in_features)))
        weights += [torch.randn(out_features, in_features) for _ in range(copies)]
    packed_weights = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    plain_ms, packed_ms = {}, {}
    with torch.inference_mode():
        for rows in range(1, SMALL_ROWS + 1):
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            packed_ms[rows] = _best_ms(lambda: [torch.ops.mkldnn._linear_pointwise(
                inputs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed_weights)])
            if rows < SMALL_ROWS:
                plain_ms[rows] = _best_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
    route = []
    for rows in range(1, SMALL_ROWS + 1):
        padded = min(range(rows, SMALL_ROWS + 1), key=lambda n: packed_ms[n])
        route.append(0 if rows in plain_ms and plain_ms[rows] <= packed_ms[padded] else padded)
    _TIMED[key] = RowPlan(tuple(route), MAX_PACKED_ROWS)
    log.info("CPU kernels: linear layers %s on this CPU (timed): %s", sorted(set(key)), _TIMED[key].text())
    return _TIMED[key]


# the cache layers of the forward running now when its rows share a prefix kept once (each with
# prefix_keys / prefix_values [1, H, P, D]; cache.SequenceCache sets it around such a forward)
_SHARED_LAYERS: contextvars.ContextVar = contextvars.ContextVar("specdec_shared_layers", default=None)


@contextlib.contextmanager
def shared_prefix_layers(layers):
    """Within: this module's attention reads layer i's shared prefix from layers[i] (a forward of
    a cache whose rows keep one copy of a common prefix; see shared_prefix_attention)."""
    token = _SHARED_LAYERS.set(layers)
    try:
        yield
    finally:
        _SHARED_LAYERS.reset(token)


def shared_prefix_ready(model: torch.nn.Module) -> bool:
    """Whether `model` attends through this module's attention function (prepare() set it), so a
    cache may keep its rows' common prefix once."""
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) == ATTENTION
            and getattr(config, "attn_logit_softcapping", None) is None)


def shared_prefix_attention(query, key, value, attention_mask, scaling, prefix_keys, prefix_values):
    """Attention of every row's queries over one prefix that all rows share (keys and values
    [1, Hkv, P, D], held once) followed by the row's own keys and values [B, Hkv, S, D] (S
    includes the new positions). The prefix is visible to every query; attention_mask (boolean
    [B, 1, T, >= P + S], True = visible, or None: causal over the row's own part) is read from
    column P on. The scores over the prefix are one matrix product per key/value head for all
    rows at once, so the prefix is neither copied per row nor read once per row; the softmax runs
    over both parts together (one maximum, one sum). Output [B, T, Hq, D], as transformers'
    attention functions return it."""
    batch, heads, length, dim = query.shape
    kv_heads, prefix = prefix_keys.shape[1], prefix_keys.shape[2]
    own = key.shape[-2]
    rows = heads // kv_heads * length                      # a key/value head's queries per row
    grouped = query.reshape(batch, kv_heads, rows, dim)    # query head h*G + g reads kv head h
    on_prefix = torch.bmm(grouped.transpose(0, 1).reshape(kv_heads, batch * rows, dim),
                          prefix_keys[0].transpose(1, 2)).mul_(scaling)    # [Hkv, B*rows, P]
    on_own = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scaling)   # [B, Hkv, rows, S]
    if attention_mask is None:
        visible = (torch.arange(own, device=query.device)[None]
                   <= torch.arange(own - length, own, device=query.device)[:, None])[None, None]
    else:
        visible = attention_mask[:, :, :, prefix:prefix + own]
        if visible.dtype != torch.bool:
            visible = visible == 0                         # an additive mask: 0 = visible
    on_own = on_own.view(batch, kv_heads, heads // kv_heads, length, own).masked_fill_(
        ~visible[:, :, None], float("-inf")).view(batch, kv_heads, rows, own)
    # one maximum over both parts, per query (the prefix has at least one column: finite)
    top = torch.maximum(on_prefix.amax(-1),
                        on_own.amax(-1).transpose(0, 1).reshape(kv_heads, batch * rows))
    weights = on_prefix.sub_(top[..., None]).exp_()
    top = top.view(kv_heads, batch, rows).transpose(0, 1)[..., None]    # [B, Hkv, rows, 1]
    own_weights = on_own.sub_(top).exp_()
    total = (weights.sum(-1).view(kv_heads, batch, rows).transpose(0, 1)
             + own_weights.sum(-1))[..., None]
    out = torch.bmm(weights, prefix_values[0]).view(kv_heads, batch, rows, -1).transpose(0, 1)
    out = (out + torch.matmul(own_weights, value)).div_(total)          # [B, Hkv, rows, Dv]
    return out.reshape(batch, heads, length, -1).transpose(1, 2).contiguous()


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
              **kwargs):
    """transformers' SDPA attention, except that a masked pass over several positions with grouped
    key/value heads lets SDPA broadcast the groups (enable_gqa) instead of copying them, and that
    a forward whose rows share a prefix kept once attends over it in place
    (shared_prefix_attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # a traced forward (a static cache's, never sharing a prefix) skips the lookup: reading a
    # context variable breaks torch.compile's graph
    layers = None if torch.compiler.is_compiling() else _SHARED_LAYERS.get()
    if layers is not None and not kwargs.get("output_attentions"):
        layer = layers[module.layer_idx]
        if getattr(layer, "prefix_keys", None) is not None:
            return shared_prefix_attention(
                query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling,
                layer.prefix_keys, layer.prefix_values), None
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.device.type != "cpu"
            or key.shape[-1] != value.shape[-1] or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("cache") is not None
            or kwargs.get("output_attentions") or (torch.is_grad_enabled() and query.requires_grad)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, is_causal=False,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _gqa_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def prepare(model: torch.nn.Module) -> dict:
    """Use the CPU kernels above in `model` where they apply; returns {packed_linear: modules,
    gqa_attention: bool} (zeros where nothing applied: another device or dtype, no oneDNN)."""
    done = getattr(model, _MARK, None)
    if done is not None:
        return dict(done)
    applied = {"packed_linear": 0, "gqa_attention": False}
    try:
        weight = next(model.parameters())
    except StopIteration:
        return applied
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not available()
            or os.environ.get("SPECDEC_CPU_KERNELS", "").strip().lower() in ("0", "false", "off")):
        return applied
    rows = packed_rows(model)
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
            module._specdec_packed = PackedWeight()
            module._specdec_rows = rows
            module.__class__ = PackedLinear
            applied["packed_linear"] += 1
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa" \
            and hasattr(model, "set_attn_implementation"):
        try:
            _register_attention()
            model.set_attn_implementation(ATTENTION)
            applied["gqa_attention"] = True
        except (ImportError, ValueError, TypeError) as exc:    # an older transformers: keep sdpa
            log.info("grouped-query SDPA not set on %s: %s", type(model).__name__, exc)
    setattr(model, _MARK, dict(applied))
    return applied
