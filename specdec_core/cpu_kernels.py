"""Faster narrow forwards on a CPU: the verify pass of K + 1 positions and small decode batches.

A speculative round on a CPU costs one target forward over K + 1 positions. Two kernels make that
forward dearer than it need be (measured on this project's 2-core CPU, float32, MKL and oneDNN,
the embedded default at a 200-token context):

- `nn.Linear` over 4 to about 48 rows. MKL's sgemm takes a gemv-like path for 1 to 3 rows and a
  packing gemm from 4 rows on, which reorders the whole weight on every call: the model's
  matmuls went from 20 ms at 1 row to 34 ms at 4 and 35 ms at 5. A weight packed once for oneDNN
  (`torch.ops.mkldnn._reorder_linear_weight`, what torch's inductor does on a CPU) costs 29 ms at
  4 rows and 31 ms at 5, but more than plain `F.linear` at 1 to 3 (25 ms at 1). So the packed weight
  is used for 4 to 48 rows only, and the plain weight otherwise (prefill, plain decoding).
- Attention over more than one new position after a cache. transformers hands grouped key/value
  heads to SDPA (`enable_gqa`) only when there is no mask, and a pass after a cache always has one,
  so it copies every layer's keys and values once per group first. torch's CPU SDPA takes
  `enable_gqa` with a mask; this module's attention function does exactly that, and hands every
  other case (one position, no mask, position bias, soft-capping, another device) to transformers'
  own SDPA function.

Together: a verify forward over 5 positions went from 50 ms to 42 ms, over 9 from 62 ms to 47 ms;
one position is unchanged (`benchmarks/cpu_kernels.py` measures it on the machine at hand).
Both give the same numbers up to float32 rounding (a different summation order).

`prepare(model)` turns both on for a float32 model on a CPU whose attention is SDPA; it is
idempotent and returns what it did. Packed weights are made lazily, on a module's first narrow
forward, and made again when the weight changes (training, loading): a model that never runs a
narrow forward holds no second copy. Under autograd (a forward that records gradients) the plain
path runs, so training is unaffected.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACKED_ROWS = (4, 48)           # rows (tokens x batch) for which the packed weight is faster
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
    for oneDNN (`_specdec_packed`); every other call is nn.Linear's. prepare() turns a model's
    nn.Linear modules into this class in place (same parameters, state dict and pickles)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if (PACKED_ROWS[0] <= rows <= PACKED_ROWS[1] and x.device.type == "cpu"
                and x.dtype == torch.float32 and weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            packed = self.__dict__.get("_specdec_packed")
            if packed is None:                      # unpickled or built without prepare()
                packed = self._specdec_packed = PackedWeight()
            return torch.ops.mkldnn._linear_pointwise(x, packed.of(weight), self.bias, "none", [], "")
        return F.linear(x, weight, self.bias)


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
              **kwargs):
    """transformers' SDPA attention, except that a masked pass over several positions with grouped
    key/value heads lets SDPA broadcast the groups (enable_gqa) instead of copying them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
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
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not available():
        return applied
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
            module._specdec_packed = PackedWeight()
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
