"""KV caches for a batch whose rows hold different numbers of tokens, and the protocol both kinds keep.

Rows of one batch accept different numbers of draft tokens, so after a rollback their cached
lengths differ. Instead of rebuilding or re-padding the cache, rejected positions become holes:
their cache entries stay, and the attention mask hides them. Position ids are counted per row over
valid entries only, so RoPE sees each row's true positions.

Two kinds implement `KVCache`: `SequenceCache` here (dynamic: transformers' DynamicCache, grows as
needed, finished rows leave the batch, trailing columns no row uses are cropped) and
static_cache.StaticSequenceCache (preallocated, fixed shapes, CUDA graphs).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import ClassVar, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import cpu_kernels


class KVCache(Protocol):
    """What the decode loop and the drafters use of a model's KV cache. A round's forwards run
    between `reserve` (the host's part, before) and `follow` (the host's part, after the round's
    one read of the device); a kind that needs no host part makes them no-ops.

    fixed_shapes   static caches: the batch never shrinks (finished rows turn inactive) and a
                   round's forwards and rollbacks are device work only, capturable as graphs
    width          host: columns written so far; last_start: first column of the latest forward
    forward(tokens [B, T], valid [B, T] | None, logits_to_keep, graphed, inputs_embeds) -> logits
    mark()         where the next forward writes, as a value that stays: a device scalar (static)
                   or the host column (dynamic); a round's rollback width is computed from it
    reserve(w)     the host part of device-only forwards over w columns; returns the first one
    rollback(keep [B], width)  keep each row's first keep[b] valid tokens; writing resumes at
                   `width` (static: device work, width a device scalar, the host follows later;
                   dynamic: at once, the mask gives the width)
    follow(w)      the host part of a rollback: writing resumes at host column w
    rollback_to(keep [B], width=None)  a rollback outside rounds, host and device at once
    select_rows(rows)  finished rows leave the batch (called only where fixed_shapes is False)
    """

    fixed_shapes: ClassVar[bool]
    last_start: int

    @property
    def width(self) -> int: ...

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                logits_to_keep: int = 0, graphed: bool = True,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor: ...

    def mark(self) -> torch.Tensor | int: ...

    def reserve(self, width: int) -> int: ...

    def rollback(self, keep: torch.Tensor, width: torch.Tensor | int) -> None: ...

    def follow(self, width: int) -> None: ...

    def rollback_to(self, keep: torch.Tensor, width: int | None = None) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...


_SHARE_PREFIX = contextvars.ContextVar("specdec_share_prefix", default=False)


@contextlib.contextmanager
def shared_prompt_cache():
    """Within: a SequenceCache whose rows all start from one prompt (n samples of it, as the
    sampling test draws) keeps the prompt's keys and values once instead of once per row, where the
    model attends through the CPU kernels' attention (cpu_kernels.shared_prefix_ready). Every
    later forward then attends over the prompt in place (cpu_kernels.shared_prefix_attention)
    instead of copying and reading B copies of it: the same numbers up to float32 rounding. Off by
    default: a cost profile times B rows as B distinct requests cost."""
    token = _SHARE_PREFIX.set(True)
    try:
        yield
    finally:
        _SHARE_PREFIX.reset(token)


class SharedPrefixLayer(DynamicLayer):
    """One layer of a cache whose rows share a prefix: its keys and values once (prefix_keys,
    prefix_values [1, H, P, D]) and each row's later ones in keys / values [B, H, S, D], which
    update, crop and the batch operations act on. Its length is P + S."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, batch: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.prefix_keys, self.prefix_values = keys, values
        self.keys = keys.new_empty((batch, keys.shape[1], 0, keys.shape[3]))
        self.values = values.new_empty((batch, values.shape[1], 0, values.shape[3]))

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2] + self.keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        if tokens_to_remove > 0 or -tokens_to_remove > self.keys.shape[-2]:
            raise ValueError(f"crop({tokens_to_remove}) of a cache with a shared prefix: only the "
                             f"{self.keys.shape[-2]} positions after the prefix can be removed")
        self.keys = self.keys[..., :tokens_to_remove, :]
        self.values = self.values[..., :tokens_to_remove, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys = self.keys[indices, ...]
        self.values = self.values[indices, ...]


class SequenceCache:
    """model + DynamicCache + attention mask [B, S] over cache columns + valid count per row [B]:
    the dynamic KVCache (finished rows leave the batch: fixed_shapes is False)."""

    fixed_shapes = False

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask: torch.Tensor | None = None    # LongTensor [B, S]: 1 = valid cached token
        self.count: torch.Tensor | None = None   # LongTensor [B]: valid tokens = next position id
        self.has_holes = False                   # host-side: may the mask contain zeros?
        self.last_start = 0
        self.shared_prefix = False               # layers keep the rows' common prompt once

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                logits_to_keep: int = 0, graphed: bool = True,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Append tokens [B, T] (valid [B, T] bool: False = a hole) and return logits [B, T', V]
        (the last logits_to_keep positions; 0 = all). `graphed` has no meaning here.
        inputs_embeds [B, T, H]: the model's input vectors instead of the tokens' embeddings
        (a draft head's fused features); `tokens` then only gives the shape."""
        batch, length = tokens.shape
        self.last_start = self.width
        if (self.mask is None and valid is None and inputs_embeds is None and batch > 1
                and bool((tokens == tokens[:1]).all())):
            return self._shared_prefill(tokens, logits_to_keep)
        if valid is None:
            valid_l = torch.ones_like(tokens)
        else:
            valid_l = valid.long()
            self.has_holes = True
        if self.mask is None:
            self.mask = valid_l
            self.count = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        else:
            self.mask = torch.cat([self.mask, valid_l], dim=1)
        position_ids = (self.count[:, None] + valid_l.cumsum(1) - 1).clamp_(min=0)
        inputs = {"input_ids": tokens} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        with (cpu_kernels.shared_prefix_layers(self.cache.layers) if self.shared_prefix
              else contextlib.nullcontext()):
            out = self.model(**inputs,
                             attention_mask=self.mask if self.has_holes else None,
                             position_ids=position_ids, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=logits_to_keep)
        self.count = self.count + valid_l.sum(1)
        return out.logits

    def _shared_prefill(self, tokens: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Identical unpadded rows (n samples of one prompt): prefill one row, then copy its cache
        per row, or keep it once for all rows (shared_prompt_cache)."""
        batch = tokens.shape[0]
        logits = self.forward(tokens[:1], logits_to_keep=logits_to_keep)
        if (_SHARE_PREFIX.get() and cpu_kernels.shared_prefix_ready(self.model)
                and all(type(layer) is DynamicLayer for layer in self.cache.layers)):
            self.cache.layers = [SharedPrefixLayer(layer.keys, layer.values, batch)
                                 for layer in self.cache.layers]
            self.shared_prefix = True
        else:
            self.cache.batch_repeat_interleave(batch)
        self.mask = self.mask.expand(batch, -1).clone()
        self.count = self.count.expand(batch).clone()
        return logits.expand(batch, -1, -1)

    def mark(self) -> int:
        return self.width

    def reserve(self, width: int) -> int:
        """Nothing to reserve: a dynamic cache grows in forward."""
        return self.width

    def rollback(self, keep: torch.Tensor, width: torch.Tensor | int) -> None:
        self.rollback_to(keep)

    def follow(self, width: int) -> None:
        """Nothing to follow: rollback already cropped the cache."""

    def expand_prefixes(self, lengths: torch.Tensor) -> None:
        """The cache's one row, copied once per entry of lengths [N]: copy i keeps its first
        lengths[i] columns (the later ones become holes). Forwards then extend every copy."""
        self.cache.batch_repeat_interleave(len(lengths))
        columns = torch.arange(self.width, device=lengths.device)
        self.mask = (columns[None] < lengths[:, None]).long()
        self.count = lengths.clone()
        self.has_holes = True

    def rollback_to(self, keep: torch.Tensor, width: int | None = None) -> None:
        """Keep the first keep[b] valid tokens of each row [B]; later ones become holes or are
        cropped to the last column a row still uses (`width`, a static cache's hint, is not
        needed: the mask gives the exact width)."""
        assert self.mask is not None
        if self.mask.shape[0] == 1 and not self.has_holes:
            drop = self.mask.shape[1] - int(keep[0])
            if drop > 0:
                self.cache.crop(-drop)
                self.mask = self.mask[:, : self.mask.shape[1] - drop]
            self.count = torch.minimum(self.count, keep)
            return
        kept = self.mask * (self.mask.cumsum(1) <= keep[:, None])
        self.count = torch.minimum(self.count, keep)
        used = kept.any(0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 0
        drop = kept.shape[1] - width
        if drop > 0:
            self.cache.crop(-drop)
        self.mask = kept[:, :width]
        self.has_holes = self.mask.shape[0] > 1 or not bool(self.mask.all())

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.count = self.count[rows]
        if self.mask.shape[0] == 1:
            self.has_holes = not bool(self.mask.all())


@contextlib.contextmanager
def dynamic_session(target: torch.nn.Module, batch: int, needed_len: int):
    """For one generate call: (the target's cache, a factory of drafter caches); the dynamic
    counterpart of StaticCachePool.session (a dynamic cache grows as needed)."""
    yield SequenceCache(target), SequenceCache
