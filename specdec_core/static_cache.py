"""Static KV caches: preallocated, fixed shapes, rows with holes, CUDA graphs per width.

At batch 1 on a GPU a decoding step of a small model is bound by reading the weights, and Python
and kernel-launch overhead easily costs as much as the math. A static cache removes both:

* `StaticSequenceCache` -- a transformers `StaticCache` of fixed batch and length, a KVCache
  (cache.py) like the dynamic `SequenceCache`. Rows hold different numbers of tokens the same way
  (rejected positions become holes hidden by the mask), but every shape is fixed: the attention
  mask is a 4-D [B, 1, T, L] tensor built on the device from a [B, L] validity buffer, the write
  position lives in a device scalar, and rollback only edits the validity buffer and moves the
  write position. A forward over T new tokens is the same kernels every time; `ForwardRuns`
  captures it once per width as a CUDA graph and replays it (graphs.py), optionally compiled.
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
import os
import threading
import time
import weakref
from collections import OrderedDict

import torch
import transformers
from transformers import StaticCache

from .errors import UnsupportedArchitecture
from .graphs import CapturedGraph, RerunGraph
from .layer_compile import compiled_layers, decoder_layers, stack_layers, stackable
from .records import LoopBuffers

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
    """Storage: model + StaticCache [batch, max_len] + validity [B, L] + valid count per row [B],
    and the write position (the host's `width`, the device's `write_column`). A KVCache (cache.py)
    with fixed shapes; its forwards run through `runs` (ForwardRuns: graphs per width, compile).

    Logits returned by a captured width are the graph's output buffer: valid until the next call
    of the same width.
    """

    fixed_shapes = True

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, cuda_graphs: bool = False,
                 compile: bool | str = False):
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
        # every tensor of the cache is an inference tensor, wherever the cache is made (inside a
        # decode, which runs in inference mode, or outside): a compiled body guards on the
        # tensors' dispatch keys, and a cache made outside would compile every body again
        with torch.inference_mode():
            self.cache = StaticCache(config=model.config, max_cache_len=max_len)
            for layer in self.cache.layers:
                # the write counters start on the CPU and would move to the device inside the
                # first forward; moved now, every counter is on the device from the start
                layer.cumulative_length = layer.cumulative_length.to(self.device)
            self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=self.device)
            self.count = torch.zeros(batch, dtype=torch.long, device=self.device)
            # the device's next column to write (a 0-dim tensor): what captured work reads
            self.write_column = torch.zeros((), dtype=torch.long, device=self.device)
            self._cols = torch.arange(max_len, device=self.device)
        self._width = 0                  # host: the next column to write
        self.last_start = 0              # host: first column of the latest forward
        self._min = torch.finfo(self.dtype).min
        self.runs = ForwardRuns(self, cuda_graphs, compile)
        self.compactions = 0
        # the decode loop's buffers and captured rounds kept with this cache across calls
        self.loop: LoopBuffers | None = None

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this static cache was deleted")
        return model

    @property
    def cuda_graphs(self) -> bool:
        return self.runs.cuda_graphs

    @property
    def width(self) -> int:
        return self._width

    # Every method that writes the cache's tensors runs under inference mode: the StaticCache
    # allocates (or moves to the device) its tensors inside the first forward, and a forward may
    # run under torch.inference_mode(), which makes them inference tensors -- updating those in
    # place outside inference mode is an error. The cache serves inference only.
    @torch.inference_mode()
    def reset(self) -> None:
        """Empty the cache for a new batch of prompts (buffers and graphs are kept)."""
        self.valid.zero_()
        self.count.zero_()
        self._set_width(0, absolute=True)
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
        if logits_to_keep >= width:    # every position either way: one compiled body, one graph
            logits_to_keep = 0
        if _in_mode("device_only"):   # the caller reserved the columns (and follows them)
            return self.runs.run(tokens, valid.bool(), logits_to_keep, inputs_embeds)
        self.reserve(width)
        return self.runs.forward(tokens, valid.bool(), logits_to_keep, inputs_embeds, graphed)

    def mark(self) -> torch.Tensor:
        return self.write_column.clone()

    def reserve(self, width: int) -> int:
        """The host part of forwards over `width` columns in all: compact first when they would
        not fit, then move the host's write column past them. Returns the first column."""
        if self._width + width > self.max_len:
            self._compact()
            if self._width + width > self.max_len:
                raise ValueError(f"static cache of {self.max_len} columns is full ({self._width} "
                                 f"used, {width} more needed): size it for prompt + max_new_tokens + K + 1")
        self.last_start = start = self._width
        self._width += width
        return start

    @torch.inference_mode()
    def rollback(self, keep: torch.Tensor, width: torch.Tensor) -> None:
        """A round's rollback as device work only (capturable): `width` is a device scalar; the
        host follows with follow(the same width) once it knows it."""
        self._keep_first(keep)
        positions = self._positions()
        torch._foreach_copy_(positions, [torch.minimum(width, self.write_column)] * len(positions))

    def follow(self, width: int) -> None:
        """The host part of rollback: writing resumes at `width` (as on the device)."""
        self._width = min(int(width), self._width)

    @torch.inference_mode()
    def rollback_to(self, keep: torch.Tensor, width: int | None = None) -> None:
        """A rollback outside rounds; `width` (host int) is where writing resumes -- pass it when
        the caller knows it, else it is read from the device (a synchronisation)."""
        kept = self._keep_first(keep)
        if width is None:   # the last column any row still uses
            used = kept.any(0).nonzero()
            width = int(used.max()) + 1 if used.numel() else 0
        self._set_width(min(int(width), self._width))

    def state(self) -> dict:
        """What engine_state() reports of this cache: its size, the write positions (host, device,
        every layer's: they must agree between rounds), compactions and compiled forwards."""
        return {"batch": self.batch, "length": self.max_len, "width": self._width,
                "device_positions": [int(p) for p in self._positions()],
                "compactions": self.compactions, "compiled": self.runs.compiled is not None,
                "compile_scope": self.runs.scope, "inductor_options": dict(self.runs.options),
                "forward_graphs": sorted(self.runs.graphs)}

    # -- internals -----------------------------------------------------------------------------
    def _keep_first(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep each row's first keep[b] valid columns (the rest become holes); returns them."""
        kept = self.valid & (self.valid.long().cumsum(1) <= keep[:, None])
        self.valid.copy_(kept)
        torch.minimum(self.count, keep, out=self.count)
        return kept

    def _set_width(self, width: int, absolute: bool = False) -> None:
        """Move the write column (host and device) and every layer's StaticCache write position.

        Normally the device counters equal the host's width and move by the difference in one
        launch; absolute=True writes the value into each (after runs whose device-side advance the
        host did not follow: graph warm-ups and captures; and on reset)."""
        delta, self._width = width - self._width, width
        positions = self._positions()
        if absolute:
            for tensor in positions:
                tensor.fill_(width)
        elif delta:
            torch._foreach_add_(positions, delta)          # one launch for all layers

    def _positions(self) -> list[torch.Tensor]:
        """The device-side write positions: every layer's StaticCache counter, then our own."""
        positions = [layer.cumulative_length for layer in self.cache.layers
                     if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        positions.append(self.write_column)
        return positions

    def body(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
             inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One forward, device-side only (capturable): write validity, positions, mask, run."""
        width = tokens.shape[1]
        columns = self.write_column + self._cols[:width]                          # [T]
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
        self.write_column.add_(width)
        return out.logits

    def snapshot(self):
        """The state a capture's warm-up runs change (restore() puts it back)."""
        return self.valid.clone(), self.count.clone(), self.last_start, self._width

    def restore(self, saved) -> None:
        valid, count, last_start, width = saved
        self.valid.copy_(valid)
        self.count.copy_(count)
        self._set_width(last_start, absolute=True)    # the body moved the device counters
        self._width = width

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
        self._set_width(int(self.count.max()))
        self.compactions += 1


class ForwardRuns:
    """How a static cache's forwards run: decode widths captured as one graph per width (CUDA
    graphs; RerunGraph off CUDA) and, with compile on, through a compiled body -- falling back to
    eager forwards (with a warning) when compile="auto" and compiling fails on this setup."""

    def __init__(self, cache: StaticSequenceCache, cuda_graphs: bool, compile: bool | str):
        self.cache = cache
        self.cuda_graphs = bool(cuda_graphs)     # off CUDA: RerunGraph stands in (tests)
        self.compile = bool(compile)
        self.fallback = compile == "auto"
        self.compiled = None
        self.scope = compile_scope() if self.compile else None
        self.options = compile_options() if self.compile else ()
        self.graph_cls = CapturedGraph if cache.device.type == "cuda" else RerunGraph
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
                inputs_embeds: torch.Tensor | None, graphed: bool) -> torch.Tensor:
        """A forward whose columns the host reserved: replayed, compiled or eager."""
        if graphed and self.cuda_graphs and tokens.shape[1] <= MAX_GRAPH_WIDTH and inputs_embeds is None:
            return self._replay(tokens, valid, logits_to_keep)
        return self.run(tokens, valid, logits_to_keep, inputs_embeds, decode=graphed)

    def run(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
            inputs_embeds: torch.Tensor | None = None, decode: bool = True) -> torch.Tensor:
        """The body, compiled for decode widths when compile is on. Prefills (their width changes
        with every prompt, and the first one initialises the cache) and input vectors run eagerly."""
        if (self.compile and decode and inputs_embeds is None and tokens.shape[1] <= MAX_GRAPH_WIDTH
                and not _in_mode("eager")):
            if self.compiled is None:
                self.compiled = (compiled_body(self.cache, self.options) if self.scope == "model"
                                 else LayerBody(self.cache, self.options))
            # a validity mask broadcast from the active rows and a materialised one would be two
            # bodies (their strides differ): the body always gets a contiguous one
            valid = valid.contiguous()
            # inputs made outside inference mode (a cost measurement's random tokens) differ from
            # a decode's in their dispatch keys, which a compiled body guards on: copied here
            tokens, valid = (t if t.is_inference() else t.clone() for t in (tokens, valid))
            if tokens.shape[1] > 1:   # one body for every verify width (a width of 1 is its own)
                for tensor in (tokens, valid):
                    torch._dynamo.maybe_mark_dynamic(tensor, 1)
            if not self.fallback:
                return self._compiled(tokens, valid, logits_to_keep)
            try:                  # compiling traces before it runs: a failure wrote nothing
                return self._compiled(tokens, valid, logits_to_keep)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
                log.warning("torch.compile of %s's forward failed (%s: %s); running it eagerly "
                            "(pass compile=False to skip the attempt)", type(self.cache.model).__name__,
                            type(error).__name__, str(error).splitlines()[0] if str(error) else "")
                self.compile = False
        logits = self.cache.body(tokens, valid, logits_to_keep, inputs_embeds)
        if self.scope == "layer" and stackable(self.cache.cache):
            # stacked right after the eager forward that made the layers (a prefill, on the
            # current stream), not later inside a capture's warm-up on a side stream
            stack_layers(self.cache.cache)
        return logits

    def _compiled(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """The compiled body; a call that compiled (a new body) adds its seconds to COMPILES."""
        before = compiled_bodies()
        started = time.perf_counter()
        logits = self.compiled(tokens, valid, logits_to_keep)
        if compiled_bodies() != before:
            seconds = time.perf_counter() - started
            COMPILES["bodies"] += compiled_bodies() - before
            COMPILES["seconds"] += seconds
            log.info("compiled %s's forward (batch %d, width %d) in %.1f s; %d bodies, %.1f s in all",
                     type(self.cache.model).__name__, tokens.shape[0], tokens.shape[1], seconds,
                     COMPILES["bodies"], COMPILES["seconds"])
        return logits

    def _replay(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        key = (tokens.shape[1], logits_to_keep)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(tokens, valid, logits_to_keep)
        graph.tokens.copy_(tokens)
        graph.valid.copy_(valid)
        graph.replay()
        return graph.out

    def _capture(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> CapturedGraph:
        """Capture the body for this width; the cache state is the same afterwards (the host has
        reserved the columns already: the device is at last_start)."""
        graph = self.graph_cls(tokens.clone(), valid.clone())
        saved = self.cache.snapshot()
        graph.capture(lambda: self.run(graph.tokens, graph.valid, logits_to_keep),
                      lambda: self.cache.restore(saved), self.cache.device)
        log.debug("captured width %d of %s", tokens.shape[1], type(self.cache.model).__name__)
        return graph


class LayerBody:
    """cache.body with the model's decoder layers compiled (compile scope "layer",
    layer_compile.py): one compiled body serves every layer. The cache's layers are stacked after
    the prefill that made them (ForwardRuns.run), else on the first call here; a model without
    uniform decoder layers, or a call before the cache has any, runs the body eagerly."""

    def __init__(self, cache: StaticSequenceCache, options: tuple = ()):
        self.cache = cache
        self.options = options
        self.layers = decoder_layers(cache.model)
        _raise_recompile_limits()
        if not self.layers:
            log.warning("compile scope 'layer': %s has no uniform decoder layers (model.model.layers); "
                        "its forwards run eagerly", type(cache.model).__name__)

    def __call__(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        if not self.layers or not stackable(self.cache.cache):
            return self.cache.body(tokens, valid, logits_to_keep)
        stack_layers(self.cache.cache)
        with compiled_layers(self.layers, COMPILE_BACKEND, self.options):
            return self.cache.body(tokens, valid, logits_to_keep)


def compile_scope() -> str:
    """COMPILE_SCOPE, checked (the environment sets it: SPECDEC_COMPILE_SCOPE)."""
    if COMPILE_SCOPE not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {COMPILE_SCOPE!r} (SPECDEC_COMPILE_SCOPE): use one of "
                         f"{', '.join(COMPILE_SCOPES)}")
    return COMPILE_SCOPE


def compile_options() -> tuple[tuple[str, object], ...]:
    """COMPILE_OPTIONS checked against inductor's settings and given their types, as sorted
    (name, value) pairs (the environment sets them: SPECDEC_INDUCTOR_OPTIONS)."""
    options = (parse_inductor_options(COMPILE_OPTIONS) if isinstance(COMPILE_OPTIONS, str)
               else dict(COMPILE_OPTIONS))
    if not options:
        return ()
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"inductor option(s) {', '.join(unknown)} (SPECDEC_INDUCTOR_OPTIONS): not "
                         f"settings of torch {torch.__version__}'s inductor "
                         "(torch._inductor.config), e.g. coordinate_descent_tuning=1")
    return tuple(sorted((name, _typed(name, value, known[name])) for name, value in options.items()))


def parse_inductor_options(text: str) -> dict[str, str]:
    """"name=value,name=value" (SPECDEC_INDUCTOR_OPTIONS) as a dict of texts."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise ValueError(f"inductor option {item!r} (SPECDEC_INDUCTOR_OPTIONS): write "
                             "name=value, e.g. coordinate_descent_tuning=1")
        options[name] = value
    return options


def _typed(name: str, value: object, default: object) -> object:
    """An option given as text, in the type of inductor's default for it (1/true/on for a flag)."""
    if not isinstance(value, str) or isinstance(default, str) or default is None:
        return value
    try:
        if isinstance(default, bool):
            flag = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
            return flag[value.lower()]
        if isinstance(default, (int, float)):
            return type(default)(value)
    except (KeyError, ValueError):
        pass
    raise ValueError(f"inductor option {name}={value!r} (SPECDEC_INDUCTOR_OPTIONS): inductor's "
                     f"{name} is a {type(default).__name__} (default {default!r})")


def compiled_body(cache: StaticSequenceCache, options: tuple = ()):
    """cache.body compiled by torch.compile (inductor): mask building, the model's layers and
    the cache writes fused into few kernels; on CUDA the engine's own graphs then capture it.

    The forward width is a dynamic dimension from 2 up (ForwardRuns.run marks it), so one body
    serves every verify width and a single-token step has its own: two compilations, not one per
    width (each costs seconds to tens of seconds on a GPU). Other shapes -- a cache of another
    batch or length -- recompile once and then stay dynamic too (torch.compile's automatic
    dynamic shapes). The recompile limit is raised to hold every cache's entries. `options`
    (compile_options()) go to the backend as torch.compile's options."""
    _raise_recompile_limits()
    return torch.compile(cache.body, dynamic=None, backend=COMPILE_BACKEND,
                         options=dict(options) or None)


def _raise_recompile_limits() -> None:
    """torch.compile's recompile limits raised to hold every cache's entries (past the limit a
    function runs eagerly, silently)."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILED_ENTRIES)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, COMPILED_ENTRIES)


# torch.compile's backend for the forward bodies (tests trace with "eager": same bodies, no codegen)
COMPILE_BACKEND = "inductor"
# what compile on compiles: "model", the whole forward (mask building, every layer, the output
# projection fused), a body per kind of forward; "layer", one decoder layer's forward shared by
# every layer (layer_compile.py: a fraction of the compile time, the rest of the forward eager)
COMPILE_SCOPES = ("model", "layer")
COMPILE_SCOPE = os.environ.get("SPECDEC_COMPILE_SCOPE", "model").strip().lower() or "model"
# inductor's options for the compiled bodies (torch.compile's `options`; none: inductor's
# defaults), e.g. coordinate_descent_tuning=True (Triton block sizes tuned per kernel on a GPU:
# longer compiles, faster small matrix-vector products); SPECDEC_INDUCTOR_OPTIONS sets them as
# text ("coordinate_descent_tuning=1"), read where a cache is made (compile_options()). Set before
# the process compiles: torch.compile keeps bodies per function, and one compiled earlier with
# other options may still serve a call (torch._dynamo.reset() drops them)
COMPILE_OPTIONS: dict[str, object] | str = os.environ.get("SPECDEC_INDUCTOR_OPTIONS", "")
# compiled bodies one process may hold: caches x kinds of width
COMPILED_ENTRIES = 512
# what compiling has cost this process: bodies compiled and the seconds of the calls that compiled
COMPILES = {"bodies": 0, "seconds": 0.0}


def compiled_bodies() -> int:
    """Bodies torch.compile has made so far in this process (every cache's, every model's)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


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
            options = (bool(cuda_graphs), compile if compile == "auto" else bool(compile))
            # a scope or inductor options set later: other caches (their bodies compiled their way)
            key = (*options, compile_scope() if compile else None, compile_options() if compile else ())
            if key not in pools:
                pools[key] = cls(*options)
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

    def caches(self) -> list[tuple[str, StaticSequenceCache]]:
        """(role, cache) of the caches kept now, least recently used first."""
        return [(key[0], cache) for key, cache in self._caches.items()]

    @contextlib.contextmanager
    def session(self, target: torch.nn.Module, batch: int, needed_len: int):
        """For one generate call: (the target's cache, a factory of drafter caches), with the
        pool's lock held throughout."""
        with self.lock:
            yield (self.get(target, batch, needed_len),
                   lambda model: self.get(model, batch, needed_len, role="draft"))
