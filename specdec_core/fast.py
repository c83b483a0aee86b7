"""The fast path of SpecDecoder: preallocated (static) KV caches, fixed shapes, CUDA graphs.

At batch 1 on a GPU a decoding step of a small model is bound by reading the weights, and Python
and kernel-launch overhead easily costs as much as the math. The fast path removes both:

* `StaticSequenceCache` -- the `SequenceCache` interface over a transformers `StaticCache` of
  fixed batch and length. Rows hold different numbers of tokens the same way (rejected positions
  become holes hidden by the mask), but every shape is fixed: the attention mask is a 4-D
  [B, 1, T, L] tensor built on the device from a [B, L] validity buffer, the write position lives
  in a device scalar, and rollback only edits the validity buffer and moves the write position.
  So a forward over T new tokens is the same kernels every time, and on CUDA it is captured once
  per width as a CUDA graph and replayed (one launch instead of hundreds).
* `run_static` -- the decoding loop for those caches: the batch never shrinks (finished rows
  become inactive and write holes), every round drafts K and verifies K + 1 tokens (rows with
  fewer drafts are limited by num_draft), and the only host-device synchronisation in a round is
  one read of the emitted counts (needed to know which rows finished and how far the caches'
  write position may move back). Drafting, verification (greedy or rejection sampling: sampling
  never synchronises, see sampling.sample_from) and bookkeeping stay on the device.

Columns are only ever appended until a rollback; a row's kept columns stay in order, so the causal
rule "a query sees valid columns up to its own" holds for every row. When the write position would
pass the end of the cache (batches whose rows accept very different numbers of drafts), the valid
columns of each row are compacted to the front -- keys are stored after RoPE, so moving them keeps
their positions -- at the cost of one synchronisation.

The CPU runs the same code without graphs (tests compare it with the general path); on CPU the
general path is the default because the dynamic cache attends over fewer columns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
import transformers
from transformers import StaticCache

from .errors import UnsupportedArchitecture

log = logging.getLogger(__name__)

# Widths of at most this many tokens are captured as CUDA graphs (draft steps and verify passes);
# prefill runs eagerly.
MAX_GRAPH_WIDTH = 33
# Cache lengths are rounded up to this multiple, so prompts of similar lengths share caches and graphs.
LENGTH_BUCKET = 256


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


class _Graph:
    """One forward of a fixed width captured as a CUDA graph: static inputs, replay, and the same
    output tensor after every replay."""

    def __init__(self, tokens: torch.Tensor, valid: torch.Tensor):
        self.tokens = tokens
        self.valid = valid
        self.out: torch.Tensor | None = None
        self.graph = None

    def capture(self, body: Callable[[], torch.Tensor], restore: Callable[[], None],
                device: torch.device) -> None:
        """Warm up on a side stream (as torch.cuda.graphs asks), capture; restore() undoes each
        run's writes to the cache state. Each graph keeps its own memory pool: outputs of one are
        read while others replay."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
                restore()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = body()
        restore()

    def replay(self) -> None:
        self.graph.replay()


class _RerunGraph(_Graph):
    """Stands in for a CUDA graph off CUDA (cuda_graphs=True on CPU, for tests): a replay runs the
    body again on the same static inputs into the same output tensor, so everything around the
    graphs -- static input buffers, reused outputs, the state the body reads -- is exercised."""

    def capture(self, body, restore, device) -> None:
        self._body = body
        self.out = body()
        restore()

    def replay(self) -> None:
        self.out.copy_(self._body())


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

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, cuda_graphs: bool = False):
        if not supports_static(model):
            raise UnsupportedArchitecture(
                f"{type(model).__name__}: the static-cache fast path needs full attention in every "
                "layer (no sliding-window or recurrent layers) and a transformers whose StaticCache "
                f"layers keep a device-side write position (5.23 is tested; this is "
                f"{transformers.__version__}); use static_cache=False")
        weight = next(model.parameters())
        self.model = model
        self.device, self.dtype = weight.device, weight.dtype
        self.batch, self.max_len = batch, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=self.device)
        self.count = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.w = 0                  # host: next column to write (== self._w on the device)
        self.last_start = 0                          # host: first column of the latest forward
        self._w = torch.zeros((), dtype=torch.long, device=self.device)
        self._cols = torch.arange(max_len, device=self.device)
        self._min = torch.finfo(self.dtype).min
        self.cuda_graphs = bool(cuda_graphs)     # off CUDA: _RerunGraph stands in (tests)
        self._graph_cls = _Graph if self.device.type == "cuda" else _RerunGraph
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.compactions = 0

    # -- SequenceCache interface ---------------------------------------------------------------
    @property
    def width(self) -> int:
        return self.w

    def reset(self) -> None:
        """Empty the cache for a new batch of prompts (buffers and graphs are kept)."""
        self.valid.zero_()
        self.count.zero_()
        self._set_w(0, absolute=True)
        self.last_start = 0

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                logits_to_keep: int = 0, graphed: bool = True) -> torch.Tensor:
        """Append tokens [B, T] (valid: False = a hole) and return logits [B, T', V]; graphed=False
        runs eagerly (prefill: its width changes with every prompt, not worth a capture)."""
        batch, width = tokens.shape
        if batch != self.batch:
            raise ValueError(f"batch {batch} != the static cache's {self.batch}")
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        if self.w + width > self.max_len:
            self._compact()
            if self.w + width > self.max_len:
                raise ValueError(f"static cache of {self.max_len} columns is full ({self.w} used, "
                                 f"{width} more needed): size it for prompt + max_new_tokens + K + 1")
        self.last_start = self.w
        if graphed and self.cuda_graphs and width <= MAX_GRAPH_WIDTH:
            logits = self._replay(tokens, valid.bool(), logits_to_keep)
        else:
            logits = self._body(tokens, valid.bool(), logits_to_keep)
        self.w += width
        return logits

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
        positions = [layer.cumulative_length for layer in self.cache.layers
                     if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        positions.append(self._w)
        if absolute or any(t.device != self.device for t in positions):
            for tensor in positions:
                tensor.fill_(w)
        elif delta:
            torch._foreach_add_(positions, delta)          # one launch for all layers

    def _body(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
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
        out = self.model(input_ids=tokens, attention_mask=mask[:, None], position_ids=position_ids,
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

    def _capture(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> _Graph:
        """Capture the body for this width; the cache state is the same afterwards."""
        graph = self._graph_cls(tokens.clone(), valid.clone())
        saved = (self.valid.clone(), self.count.clone(), self.w)

        def restore():
            self.valid.copy_(saved[0])
            self.count.copy_(saved[1])
            self._set_w(saved[2], absolute=True)    # the body moved the device counters

        graph.capture(lambda: self._body(graph.tokens, graph.valid, logits_to_keep), restore,
                      self.device)
        log.debug("captured width %d of %s", tokens.shape[1], type(self.model).__name__)
        return graph

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


class StaticCachePool:
    """Static caches (with their graphs) kept across generate calls, per model, batch and length.

    One pool per target model (`of`), shared by its decoders; `lock` is held for a whole generate
    call, so two threads never run the same caches at once. At most `max_caches` are kept (the
    least recently used go first): each holds a KV cache of its batch x length on the device.
    """

    max_caches = 8

    def __init__(self, cuda_graphs: bool):
        self.cuda_graphs = cuda_graphs
        self._caches: OrderedDict[tuple, StaticSequenceCache] = OrderedDict()
        self.lock = threading.RLock()

    @classmethod
    def of(cls, model: torch.nn.Module, cuda_graphs: bool) -> "StaticCachePool":
        """The pool attached to `model` (created on first use; it goes when the model goes)."""
        pools = model.__dict__.setdefault("_specdec_static_pools", {})
        if cuda_graphs not in pools:
            pools[cuda_graphs] = cls(cuda_graphs)
        return pools[cuda_graphs]

    def get(self, model: torch.nn.Module, batch: int, needed_len: int,
            role: str = "target") -> StaticSequenceCache:
        """A reset cache; `role` keeps the target's and a drafter's apart (a draft may be the target)."""
        length = bucket_length(needed_len)
        key = (role, id(model), batch, length)
        cache = self._caches.get(key)
        if cache is None or cache.model is not model:
            cache = StaticSequenceCache(model, batch, length, self.cuda_graphs)
            self._caches[key] = cache
        self._caches.move_to_end(key)
        while len(self._caches) > self.max_caches:
            self._caches.popitem(last=False)
        cache.reset()
        return cache

    def clear(self) -> None:
        self._caches.clear()


def _plain_steps(decoder, target: StaticSequenceCache, state, done_host: np.ndarray,
                 max_new_tokens: int, sampling, generator, verifier, use_greedy_verify: bool,
                 eos_token_id: int | None, pad_token_id: int) -> float:
    """Plain decoding on the static cache: one (graphed) step per token. Without EOS every row
    emits one token per step, so the host knows when to stop and reads nothing; with EOS it reads
    which rows go on, once per step. Returns the seconds of the steps (when phase timing)."""
    device = state.out.device
    steps_s, steps = 0.0, 1                  # every row holds its first token (from the prefill)
    while not done_host.all():
        t0 = time.perf_counter()
        active = state.active
        pending = state.out.gather(1, state.n_out[:, None] - 1)
        logits = target.forward(pending, active[:, None])
        if use_greedy_verify:
            token = logits[:, 0].argmax(-1)
        else:
            token = decoder._verify_step(None, logits[:, :1], sampling, generator, verifier,
                                         False, device)[0][:, 0]
        token = torch.where(active, token, pad_token_id)
        state.out.scatter_(1, state.n_out[:, None], token[:, None])
        state.n_out = state.n_out + active
        steps += 1
        if eos_token_id is None:
            done_host = np.full_like(done_host, steps >= max_new_tokens)
        else:
            state.active = active & (token != eos_token_id) & (state.n_out < max_new_tokens)
            done_host = ~state.active.cpu().numpy()
        if decoder.phase_timing:
            synchronize(device)
            steps_s += time.perf_counter() - t0
    return steps_s


def run_static(decoder, drafter, k: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               max_new_tokens: int, sampling, seed: int, eos_token_id: int | None,
               pad_token_id: int):
    """SpecDecoder's loop on static caches (see the module docstring); same result as _run."""
    pool = decoder.static_pool
    with pool.lock:
        return _run_locked(decoder, pool, drafter, k, input_ids, attention_mask, max_new_tokens,
                           sampling, seed, eos_token_id, pad_token_id)


def _run_locked(decoder, pool: StaticCachePool, drafter, k, input_ids, attention_mask,
                max_new_tokens, sampling, seed, eos_token_id, pad_token_id):
    from .decoder import DecodeState
    from .verify import rejection_sample

    device = decoder.device
    batch, prompt_width = input_ids.shape
    needed = prompt_width + max_new_tokens + k + 3
    generator = torch.Generator(device=device).manual_seed(seed)
    use_greedy_verify = sampling.greedy and decoder.verifier is None
    verifier = decoder.verifier or rejection_sample

    synchronize(device)
    t_start = time.perf_counter()
    target = pool.get(decoder.target, batch, needed)
    prompt_len = attention_mask.sum(1)
    state = DecodeState(
        prompt_ids=input_ids, prompt_mask=attention_mask, prompt_len=prompt_len,
        out=torch.full((batch, max_new_tokens + k + 1), pad_token_id, dtype=torch.long,
                       device=device),
        n_out=torch.ones(batch, dtype=torch.long, device=device),
        prompt_has_padding=not bool(attention_mask.all()),
        active=torch.ones(batch, dtype=torch.bool, device=device),
        cache_factory=lambda model: pool.get(model, batch, needed, role="draft"))
    logits = target.forward(input_ids, attention_mask.bool(), logits_to_keep=1, graphed=False)
    first, _ = decoder._verify_step(None, logits[:, -1:], sampling, generator, verifier,
                                    use_greedy_verify, device)
    state.out[:, 0] = first[:, 0]
    if drafter is not None:
        drafter.start(state)
    done_host = np.full(batch, max_new_tokens <= 1)
    if eos_token_id is not None:
        done_host |= first[:, 0].cpu().numpy() == eos_token_id
    state.active.copy_(torch.from_numpy(~done_host))
    synchronize(device)
    prefill_s = time.perf_counter() - t_start

    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    if drafter is None:
        verify_s = _plain_steps(decoder, target, state, done_host, max_new_tokens, sampling,
                                generator, verifier, use_greedy_verify, eos_token_id, pad_token_id)
        history = torch.stack([zeros, zeros, state.n_out - 1])[None]      # one "round" of totals
        draft_s = 0.0
    else:
        history, draft_s, verify_s = _spec_rounds(
            decoder, drafter, k, target, state, done_host, max_new_tokens, sampling, generator,
            verifier, use_greedy_verify, eos_token_id, pad_token_id)
    synchronize(device)
    total_s = time.perf_counter() - t_start
    # the per-row stats, from the rounds' history [R, 3, B] (drafted, accepted, emitted; 0 for a
    # row that was no longer active) -- computed once instead of a dozen small kernels a round
    drafted, accepted, emitted = history.sum(0)
    live = history[:, 2] > 0                                                  # [R, B]
    if drafter is None:
        rounds = emitted
    else:
        rounds = live.sum(0)
    pos = torch.arange(max(k, 1), device=device)
    nd, acc = history[:, 0, :, None], history[:, 1, :, None]
    reached_at = ((pos < nd) & (pos <= acc) & live[..., None]).sum(0)        # [B, K]
    accepted_at = ((pos < acc) & live[..., None]).sum(0)
    result = state.out[:, :max_new_tokens].clone()
    return decoder._result(result, state.n_out, rounds, drafted, accepted, emitted, reached_at,
                           accepted_at, k, draft_s, verify_s, total_s, prefill_s, prompt_len)


def _greedy_accept(draft_tokens: torch.Tensor, logits: torch.Tensor, num_draft: torch.Tensor):
    """Greedy verification in few kernels: (the target's argmax [B, k+1], accepted drafts [B]).

    Accepted drafts equal the argmax at their positions, so the round's emitted tokens are the
    argmax itself up to and including position num_accepted (no assembly needed)."""
    argmax = logits.argmax(-1)
    k = draft_tokens.shape[1]
    match = (draft_tokens == argmax[:, :k]) & (torch.arange(k, device=logits.device) < num_draft[:, None])
    return argmax, match.long().cumprod(1).sum(1)


def _spec_rounds(decoder, drafter, k, target: StaticSequenceCache, state, done_host, max_new_tokens,
                 sampling, generator, verifier, use_greedy_verify, eos_token_id, pad_token_id):
    """The speculative rounds of the fast path; returns (history [R, 3, B], draft_s, verify_s)."""
    device = state.out.device
    positions = torch.arange(k + 1, device=device)
    history = torch.zeros(max_new_tokens, 3, state.out.shape[0], dtype=torch.long, device=device)
    rounds, draft_s, verify_s = 0, 0.0, 0.0
    prompt_len = state.prompt_len
    while not done_host.all():
        active = state.active
        num_draft = (max_new_tokens - 1 - state.n_out).clamp_(min=0, max=k) * active
        t0 = time.perf_counter()
        proposal = drafter.propose(state, k, num_draft, sampling, generator)
        proposal.num_draft = nd = torch.minimum(proposal.num_draft, num_draft)
        if decoder.phase_timing:
            synchronize(device)
            draft_s += time.perf_counter() - t0
        # the round's width: K, unless the drafter knows on the host that it drafted fewer
        # (prompt lookup without matches: a plain step); one graph per width
        round_k = k if proposal.max_draft is None else min(k, proposal.max_draft)
        if round_k < k:
            proposal.tokens = proposal.tokens[:, :round_k]
            if proposal.probs is not None:
                proposal.probs = proposal.probs[:, :round_k]
        t0 = time.perf_counter()
        pending = state.out.gather(1, state.n_out[:, None] - 1)
        logits = target.forward(torch.cat([pending, proposal.tokens], 1),
                                active[:, None].expand(-1, round_k + 1))
        # rows no longer active have num_draft 0, so they accept nothing
        if use_greedy_verify:
            out_tokens, num_accepted = _greedy_accept(proposal.tokens, logits, nd)
        else:
            out_tokens, num_accepted = decoder._verify_step(
                proposal if round_k else None, logits, sampling, generator, verifier, False, device)
        count = (num_accepted + 1) * active
        cols = positions[: round_k + 1]
        still = state.n_out + count < max_new_tokens
        if eos_token_id is not None:
            is_eos = (out_tokens == eos_token_id) & (cols < count[:, None])
            hit = is_eos.any(1)
            count = torch.where(hit, is_eos.long().argmax(1) + 1, count)
            still = still & ~hit
        state.out.scatter_(1, state.n_out[:, None] + cols,
                           torch.where(cols < count[:, None], out_tokens, pad_token_id))
        state.n_out = state.n_out + count
        history[rounds] = torch.stack([nd, num_accepted, count])
        rounds += 1
        state.active = active & still
        # the round's one synchronisation: how many tokens each row emitted, which rows go on
        counts_host, active_host = torch.stack([count, state.active.long()]).cpu().numpy()
        done_host = ~active_host.astype(bool)
        kept_max = max(int(counts_host.max()), 1)
        state.accepted_max = kept_max - 1
        target.rollback_to(prompt_len + state.n_out - 1, width=target.last_start + kept_max)
        drafter.commit(state, num_accepted)
        if decoder.phase_timing:
            synchronize(device)
            verify_s += time.perf_counter() - t0
    return history[:rounds], draft_s, verify_s


def measure_forward_costs(model: torch.nn.Module, widths, context_len: int = 256,
                          batch_size: int = 1, repeats: int = 20, seed: int = 0,
                          cuda_graphs: bool | str = "auto") -> dict[int, float]:
    """Median seconds of one forward over `width` new tokens on a static cache holding context_len
    random tokens (captured as CUDA graphs on CUDA); see profile.measure_forward_costs."""
    from .profile import measure_forward_costs as measure

    return measure(model, widths, context_len, batch_size, repeats, seed, static=True,
                   cuda_graphs=cuda_graphs in ("auto", True))
