"""Static KV caches: preallocated, fixed shapes, rows with holes, CUDA graphs per width.

At batch 1 on a GPU a decoding step of a small model is bound by reading the weights, and Python
and kernel-launch overhead easily costs as much as the math. A static cache removes both:

* `StaticSequenceCache` -- a transformers `StaticCache` of fixed batch and length behind the same
  interface as the dynamic `SequenceCache`. Rows hold different numbers of tokens the same way
  (rejected positions become holes hidden by the mask), but every shape is fixed: the attention
  mask is a 4-D [B, 1, T, L] tensor built on the device from a [B, L] validity buffer, the write
  position lives in a device scalar, and rollback only edits the validity buffer and moves the
  write position. A forward over T new tokens is the same kernels every time, and on CUDA it is
  captured once per width as a CUDA graph and replayed (graphs.py).
* `StaticCachePool` -- the caches (and their graphs) of one target model, kept across generate
  calls and shared by its decoders.

The batch never shrinks: finished rows turn inactive and write holes. Columns are only appended
until a rollback, and a row's kept columns stay in order, so the causal rule "a query sees valid
columns up to its own" holds for every row. When the write position would pass the end of the
cache (rows that accept very different numbers of drafts), the valid columns of each row are
compacted to the front -- keys are stored after RoPE, so moving them keeps their positions -- at
the cost of one synchronisation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import OrderedDict

import torch
import transformers
from transformers import StaticCache

from .errors import UnsupportedArchitecture
from .graphs import CapturedGraph, RerunGraph

log = logging.getLogger(__name__)

# modes of the forwards on this thread (each a nesting depth)
_MODES = threading.local()


@contextlib.contextmanager
def _mode(name: str):
    depth = getattr(_MODES, name, 0)
    setattr(_MODES, name, depth + 1)
    try:
        yield
    finally:
        setattr(_MODES, name, depth)


def _in_mode(name: str) -> bool:
    return getattr(_MODES, name, 0) > 0


def device_only():
    """Forwards of static caches inside this block do device work only: no host bookkeeping, no
    per-forward graph, no compaction. The decode loop runs a whole round this way (captured as one
    graph per shape) and does the host part itself (`reserve` before, `follow` after)."""
    return _mode("device_only")


def eager_forwards():
    """Forwards inside this block run their eager body even where compile is on (a forward hook
    that hands out a tensor, as the draft head's tap does, needs the eager module calls)."""
    return _mode("eager")


# Widths of at most this many tokens are captured as CUDA graphs (draft steps and verify passes);
# prefill runs eagerly.
MAX_GRAPH_WIDTH = 33
# Cache lengths are rounded up to this multiple, so prompts of similar lengths share caches and graphs.
LENGTH_BUCKET = 256


def supports_static(model: torch.nn.Module) -> bool:
    """True when transformers' StaticCache for this model has full-attention layers only, each
    writing at its own device-side position counter (`cumulative_length`, transformers >= 5.2x;
    older StaticLayers take a cache_position argument instead, which this path does not pass)."""
    try:
        cache = StaticCache(config=model.config, max_cache_len=8)
    except Exception:  # noqa: BLE001 - any construction failure means "not supported"
        return False
    return all(type(layer).__name__ == "StaticLayer"
               and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
               for layer in cache.layers)


def static_by_default(model: torch.nn.Module) -> bool:
    """What static_cache="auto" means for a model: on CUDA, where the model allows it."""
    return next(model.parameters()).device.type == "cuda" and supports_static(model)


def bucket_length(needed: int) -> int:
    return -(-needed // LENGTH_BUCKET) * LENGTH_BUCKET


class StaticSequenceCache:
    """model + StaticCache [batch, max_len] + validity [B, L] + valid count per row [B].

    forward(tokens [B, T], valid [B, T] | None, logits_to_keep=0) -> logits [B, T', V]
    rollback_to(keep [B], width=None): keep each row's first keep[b] valid tokens; `width` (host
    int) is where writing resumes -- pass it when the caller knows it, else it is read from the
    device (a synchronisation).
    Logits returned by a captured width are the graph's output buffer: valid until the next call
    of the same width.
    """

    fixed_shapes = True

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, cuda_graphs: bool = False,
                 compile: bool = False):
        if not supports_static(model):
            raise UnsupportedArchitecture(
                f"{type(model).__name__}: the static-cache fast path needs full attention in every "
                "layer (no sliding-window or recurrent layers) and a transformers whose StaticCache "
                f"layers keep a device-side write position (5.23 is tested; this is "
                f"{transformers.__version__}); use static_cache=False")
        weight = next(model.parameters())
        self._model = weakref.ref(model)     # held weakly: a model's pool must not keep it alive
        self.device, self.dtype = weight.device, weight.dtype
        self.batch, self.max_len = batch, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        for layer in self.cache.layers:
            # the write counters start on the CPU and would move to the device inside the first
            # forward; moved now, every counter is on the device from the start (on CPU and CUDA)
            layer.cumulative_length = layer.cumulative_length.to(self.device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=self.device)
        self.count = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.w = 0                  # host: next column to write (== self._w on the device)
        self.last_start = 0                          # host: first column of the latest forward
        self._w = torch.zeros((), dtype=torch.long, device=self.device)
        self._cols = torch.arange(max_len, device=self.device)
        self._min = torch.finfo(self.dtype).min
        self.cuda_graphs = bool(cuda_graphs)     # off CUDA: RerunGraph stands in (tests)
        # decode-width forwards run a compiled body; "auto": fall back to eager ones (with a
        # warning) if compiling fails on this setup
        self.compile = bool(compile)
        self._compile_fallback = compile == "auto"
        self._compiled = None
        self._graph_cls = CapturedGraph if self.device.type == "cuda" else RerunGraph
        self._graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.compactions = 0
        # what the decode loop keeps with this cache across calls: its persistent buffers and its
        # captured rounds (loop.py), keyed by the loop
        self.extras: dict = {}

    @property
    def write_column(self) -> torch.Tensor:
        """The next column to write, on the device (a 0-dim tensor): what captured work reads."""
        return self._w

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this static cache was deleted")
        return model

    # -- SequenceCache interface ---------------------------------------------------------------
    # Every method that writes the cache's tensors runs under inference mode: the StaticCache
    # allocates (or moves to the device) its tensors inside the first forward, and a forward may
    # run under torch.inference_mode(), which makes them inference tensors -- updating those in
    # place outside inference mode is an error. The cache serves inference only.
    @property
    def width(self) -> int:
        return self.w

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty the cache for a new batch of prompts (buffers and graphs are kept)."""
        self.valid.zero_()
        self.count.zero_()
        self._set_w(0, absolute=True)
        self.last_start = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                logits_to_keep: int = 0, graphed: bool = True,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Append tokens [B, T] (valid: False = a hole) and return logits [B, T', V]; graphed=False
        runs eagerly (prefill: its width changes with every prompt, not worth a capture).
        inputs_embeds [B, T, H]: input vectors instead of the tokens' embeddings (runs eagerly)."""
        batch, width = tokens.shape
        if batch != self.batch:
            raise ValueError(f"batch {batch} != the static cache's {self.batch}")
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        if _in_mode("device_only"):   # the caller reserved the columns (and follows them)
            return self._run(tokens, valid.bool(), logits_to_keep, inputs_embeds)
        self.reserve(width)
        if graphed and self.cuda_graphs and width <= MAX_GRAPH_WIDTH and inputs_embeds is None:
            logits = self._replay(tokens, valid.bool(), logits_to_keep)
        else:
            logits = self._run(tokens, valid.bool(), logits_to_keep, inputs_embeds, decode=graphed)
        return logits

    def _run(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
             inputs_embeds: torch.Tensor | None = None, decode: bool = True) -> torch.Tensor:
        """The body, compiled for decode widths when compile is on. Prefills (graphed=False:
        their width changes with every prompt, and the first one initialises the cache) and
        input vectors run eagerly."""
        if (self.compile and decode and inputs_embeds is None and tokens.shape[1] <= MAX_GRAPH_WIDTH
                and not _in_mode("eager")):
            if self._compiled is None:
                self._compiled = compiled_body(self)
            if not self._compile_fallback:
                return self._compiled(tokens, valid, logits_to_keep)
            try:                  # compiling traces before it runs: a failure wrote nothing
                return self._compiled(tokens, valid, logits_to_keep)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
                log.warning("torch.compile of %s's forward failed (%s: %s); running it eagerly "
                            "(pass compile=False to skip the attempt)", type(self.model).__name__,
                            type(error).__name__, str(error).splitlines()[0] if str(error) else "")
                self.compile = False
        return self._body(tokens, valid, logits_to_keep, inputs_embeds)

    def reserve(self, width: int) -> int:
        """The host part of forwards over `width` columns in all: compact first when they would
        not fit, then move the host's write column past them. Returns the first column."""
        if self.w + width > self.max_len:
            self._compact()
            if self.w + width > self.max_len:
                raise ValueError(f"static cache of {self.max_len} columns is full ({self.w} used, "
                                 f"{width} more needed): size it for prompt + max_new_tokens + K + 1")
        self.last_start = start = self.w
        self.w += width
        return start

    @torch.inference_mode()
    def rollback_device(self, keep: torch.Tensor, width: torch.Tensor) -> None:
        """rollback_to as device work only (capturable): `width` is a device scalar; the host
        follows with follow(the same width) once it knows it."""
        kept = self.valid & (self.valid.long().cumsum(1) <= keep[:, None])
        self.valid.copy_(kept)
        torch.minimum(self.count, keep, out=self.count)
        positions = self._positions()
        torch._foreach_copy_(positions, [torch.minimum(width, self._w)] * len(positions))

    def follow(self, width: int) -> None:
        """The host part of rollback_device: writing resumes at `width` (as on the device)."""
        self.w = min(int(width), self.w)

    @torch.inference_mode()
    def rollback_to(self, keep: torch.Tensor, width: int | None = None) -> None:
        kept = self.valid & (self.valid.long().cumsum(1) <= keep[:, None])
        self.valid.copy_(kept)
        torch.minimum(self.count, keep, out=self.count)
        if width is None:   # the last column any row still uses (a synchronisation)
            used = kept.any(0).nonzero()
            width = int(used.max()) + 1 if used.numel() else 0
        self._set_w(min(int(width), self.w))

    def select_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError("a static cache keeps its batch: mark finished rows inactive")

    # -- internals -----------------------------------------------------------------------------
    def _set_w(self, w: int, absolute: bool = False) -> None:
        """Move the write column (host and device) and every layer's StaticCache write position.

        Normally the device counters equal the host's `w` and move by the difference in one
        launch; absolute=True writes the value into each (after runs whose device-side advance the
        host did not follow: graph warm-ups and captures; and on reset)."""
        delta, self.w = w - self.w, w
        positions = self._positions()
        if absolute:
            for tensor in positions:
                tensor.fill_(w)
        elif delta:
            torch._foreach_add_(positions, delta)          # one launch for all layers

    def _positions(self) -> list[torch.Tensor]:
        """The device-side write positions: every layer's StaticCache counter, then our own."""
        positions = [layer.cumulative_length for layer in self.cache.layers
                     if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        positions.append(self._w)
        return positions

    def _body(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One forward, device-side only (capturable): write validity, positions, mask, run."""
        width = tokens.shape[1]
        columns = self._w + self._cols[:width]                                    # [T]
        self.valid.index_copy_(1, columns, valid)
        valid_l = valid.long()
        position_ids = (self.count[:, None] + valid_l.cumsum(1) - 1).clamp_(min=0)
        self.count.add_(valid_l.sum(1))
        seen = self._cols[None, :] <= columns[:, None]                            # [T, L] causal
        itself = self._cols[None, :] == columns[:, None]    # a hole query sees itself: no empty row
        allowed = (self.valid[:, None, :] & seen[None]) | itself[None]            # [B, T, L]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, self._min)
        inputs = {"input_ids": tokens} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        out = self.model(**inputs, attention_mask=mask[:, None], position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        self._w.add_(width)
        return out.logits

    def _replay(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        key = (tokens.shape[1], logits_to_keep)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(tokens, valid, logits_to_keep)
            self._graphs[key] = graph
        graph.tokens.copy_(tokens)
        graph.valid.copy_(valid)
        graph.replay()
        return graph.out

    def _capture(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> CapturedGraph:
        """Capture the body for this width; the cache state is the same afterwards."""
        graph = self._graph_cls(tokens.clone(), valid.clone())
        # the host has reserved the columns already (forward): the device is at last_start
        saved = (self.valid.clone(), self.count.clone(), self.last_start, self.w)

        def restore():
            self.valid.copy_(saved[0])
            self.count.copy_(saved[1])
            self._set_w(saved[2], absolute=True)    # the body moved the device counters
            self.w = saved[3]

        graph.capture(lambda: self._run(graph.tokens, graph.valid, logits_to_keep), restore,
                      self.device)
        log.debug("captured width %d of %s", tokens.shape[1], type(self.model).__name__)
        return graph

    @torch.inference_mode()
    def _compact(self) -> None:
        """Move each row's valid columns to the front, in order (one synchronisation)."""
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)    # valid first
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                    index = order[:, None, :, None].expand_as(tensor)
                    tensor.copy_(tensor.gather(2, index))
        self.valid.copy_(self._cols[None, :] < self.count[:, None])
        self._set_w(int(self.count.max()))
        self.compactions += 1


def compiled_body(cache: StaticSequenceCache):
    """cache._body compiled by torch.compile (inductor): mask building, the model's layers and
    the cache writes fused into few kernels. Shapes are static (dynamic=False): one compiled body
    per width, compiled on the first forward of that width and reused for the process; on CUDA
    the engine's own graphs then capture it. Every cache and width is one entry of the body's
    compile cache, so its recompile limit is raised to hold them all."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILED_ENTRIES)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, COMPILED_ENTRIES)
    return torch.compile(cache._body, dynamic=False)


# compiled bodies one process may hold: caches x widths
COMPILED_ENTRIES = 512


def compile_by_default(model: torch.nn.Module) -> bool:
    """What compile="auto" means: on CUDA. On a CPU the compiled body costs minutes of compiling
    per model and width for less than it saves there (benchmarks/engine_cpu.py)."""
    return next(model.parameters()).device.type == "cuda"


def resolve_compile(compile: bool | str, model: torch.nn.Module) -> bool | str:
    """A static cache's compile option from a decoder's: "auto" where compiling is the default
    (the cache then falls back to eager forwards if it fails), else True or False."""
    if compile == "auto":
        return "auto" if compile_by_default(model) else False
    return compile is True


# model -> {(cuda_graphs, compile): StaticCachePool}. The caches hold their models weakly, so an entry goes
# when its model is collected.
_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, StaticCachePool]]" = (
    weakref.WeakKeyDictionary())
_POOLS_LOCK = threading.Lock()


class StaticCachePool:
    """Static caches (with their graphs) kept across generate calls, per model, batch and length.

    One pool per target model (`of`), shared by its decoders; `lock` is held for a whole generate
    call, so two threads never run the same caches at once. At most `max_caches` are kept (the
    least recently used go first): each holds a KV cache of its batch x length on the device.
    """

    max_caches = 8

    def __init__(self, cuda_graphs: bool, compile: bool | str = False):
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self._caches: OrderedDict[tuple, StaticSequenceCache] = OrderedDict()
        self.lock = threading.RLock()

    @classmethod
    def of(cls, model: torch.nn.Module, cuda_graphs: bool,
           compile: bool | str = False) -> "StaticCachePool":
        """The pool of `model` (created on first use; it goes when the model goes). Pools live
        beside the model, keyed weakly, not in it: the model stays copyable and picklable."""
        with _POOLS_LOCK:
            pools = _POOLS.setdefault(model, {})
            key = (bool(cuda_graphs), compile if compile == "auto" else bool(compile))
            if key not in pools:
                pools[key] = cls(*key)
            return pools[key]

    def get(self, model: torch.nn.Module, batch: int, needed_len: int,
            role: str = "target") -> StaticSequenceCache:
        """A reset cache; `role` keeps the target's and a drafter's apart (a draft may be the target)."""
        length = bucket_length(needed_len)
        key = (role, id(model), batch, length)
        cache = self._caches.get(key)
        if cache is None or cache._model() is not model:
            cache = StaticSequenceCache(model, batch, length, self.cuda_graphs, self.compile)
            self._caches[key] = cache
        self._caches.move_to_end(key)
        while len(self._caches) > self.max_caches:
            self._caches.popitem(last=False)
        cache.reset()
        return cache

    @contextlib.contextmanager
    def session(self, target: torch.nn.Module, batch: int, needed_len: int):
        """For one generate call: (the target's cache, a factory of drafter caches), with the
        pool's lock held throughout."""
        with self.lock:
            yield (self.get(target, batch, needed_len),
                   lambda model: self.get(model, batch, needed_len, role="draft"))
