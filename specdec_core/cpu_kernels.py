"""Faster narrow forwards on a CPU: the verify pass of K + 1 positions and small decode batches.

A speculative round on a CPU costs one target forward over K + 1 positions. Two kernels make that
forward dearer than it need be (measured on this project's 2-core CPU, float32, MKL and oneDNN,
the embedded default at a 200-token context):

- `nn.Linear` over a few rows. MKL's sgemm takes a gemv-like path for 1 to 3 rows and a packing
  gemm from 4 rows on, which reorders the whole weight on every call. A weight packed once for
  oneDNN (`torch.ops.mkldnn._reorder_linear_weight`, what torch's inductor does on a CPU) avoids
  that. Where it starts to pay depends on the CPU: on an Intel development machine the model's
  matmuls took 20 ms at 1 row plain and 25 ms packed, 34 ms at 4 rows plain and 29 ms packed; on
  an AMD EPYC (Zen 4) machine MKL's small-row paths are slow (a whole forward: 55 ms at 1 row,
  91 ms at 2, 110 ms at 3, against 38, 43 and 36 ms packed). So the first row count from which the
  packed weight is used is timed once per process on the model's own layer shapes
  (`packed_rows()`; 1 to 4, about a tenth of a second for the embedded default), and the packed weight serves up to 48 rows; wider passes (prefill)
  keep the plain weight.
- Attention over more than one new position after a cache. transformers hands grouped key/value
  heads to SDPA (`enable_gqa`) only when there is no mask, and a pass after a cache always has one,
  so it copies every layer's keys and values once per group first. torch's CPU SDPA takes
  `enable_gqa` with a mask; this module's attention function does exactly that, and hands every
  other case (one position, no mask, position bias, soft-capping, another device) to transformers'
  own SDPA function.

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

import logging
import os
import time

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# rows (tokens x batch) for which the packed weight is used, (first, last): set here, it holds for
# every model; None: packed_rows() times the first on this CPU, once per process and layer shapes
PACKED_ROWS: tuple[int, int] | None = None
MAX_PACKED_ROWS = 48
_TIMED: dict[tuple, tuple[int, int]] = {}
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
        first, last = PACKED_ROWS or self.__dict__.get("_specdec_rows") or (4, MAX_PACKED_ROWS)
        if (first <= rows <= last and x.device.type == "cpu"
                and x.dtype == torch.float32 and weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            packed = self.__dict__.get("_specdec_packed")
            if packed is None:                      # unpickled or built without prepare()
                packed = self._specdec_packed = PackedWeight()
            return torch.ops.mkldnn._linear_pointwise(x, packed.of(weight), self.bias, "none", [], "")
        return F.linear(x, weight, self.bias)


def _best_ms(run, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def packed_rows(model: torch.nn.Module) -> tuple[int, int]:
    """(first, last) rows for which the packed weight is used in `model` (PACKED_ROWS where set).
    The first is timed once per process and model shapes: for 1, 2 and 3 rows, plain `F.linear`
    against the packed weight on the model's largest linear layer and its commonest shape (best of
    5 each); the packed weight starts at the fewest rows from which it is faster at every count up
    to 3 (4 if it never is)."""
    if PACKED_ROWS is not None:
        return PACKED_ROWS
    shapes: dict[tuple, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            shapes[tuple(module.weight.shape)] = shapes.get(tuple(module.weight.shape), 0) + 1
    if not shapes:
        return (4, MAX_PACKED_ROWS)
    key = (max(shapes, key=lambda shape: shape[0] * shape[1]), max(shapes, key=shapes.get))
    if key in _TIMED:
        return _TIMED[key]
    faster = {}
    with torch.inference_mode():
        for rows in (1, 2, 3):
            plain = packed = 0.0
            for out_features, in_features in set(key):
                weight = torch.randn(out_features, in_features)
                x = torch.randn(rows, in_features)
                reordered = torch.ops.mkldnn._reorder_linear_weight(weight)
                plain += _best_ms(lambda: F.linear(x, weight))
                packed += _best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], ""))
            faster[rows] = packed < plain
    first = next((r for r in (1, 2, 3) if all(faster[n] for n in range(r, 4))), 4)
    _TIMED[key] = (first, MAX_PACKED_ROWS)
    log.info("CPU kernels: packed linear weights from %d to %d rows for layers %s on this CPU "
             "(timed)", first, MAX_PACKED_ROWS, sorted(set(key)))
    return _TIMED[key]


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
