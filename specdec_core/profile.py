"""Measuring costs on the hardware at hand: target step and verify(K) passes.

On CUDA the passes are timed on static caches with CUDA graphs (static_cache.py), the caches
SpecDecoder decodes on there; on CPU on the dynamic cache (cache.py).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from .cache import SequenceCache
from .decoder import SpecDecoder, prepare_for_decoding
from .drafters import DraftModel, HostDrafter
from .graphs import synchronize
from .records import DecodeState
from .sampling import SamplingParams
from .static_cache import StaticSequenceCache, bucket_length, resolve_compile, static_by_default


def use_static(model: torch.nn.Module, static: bool | str = "auto") -> bool:
    """Whether costs are measured on a static cache: "auto" -- where SpecDecoder decodes on one by
    default, so the planner gets the costs decoding will have."""
    return static_by_default(model) if static == "auto" else bool(static)


class _TimedCache:
    """A model's cache holding `context_len` random tokens; times cached forward passes of random
    tokens and rolls the cache back after each (`vocab` bounds the ids). static: a
    StaticSequenceCache with room for widths up to max_width; cuda_graphs: "auto" replays captured
    graphs on CUDA only, True also off CUDA (the stand-in that reruns the body), False never."""

    def __init__(self, model: torch.nn.Module, context_len: int, batch_size: int, generator,
                 vocab: int, static: bool = False, max_width: int = 64,
                 cuda_graphs: bool | str = "auto", inputs_fn=None, compile: bool | str = "auto"):
        self.device = next(model.parameters()).device
        self.generator, self.vocab, self.batch_size = generator, vocab, batch_size
        self.context_len = context_len
        if static:
            self.cache = StaticSequenceCache(
                model, batch_size, bucket_length(context_len + max_width + 1),
                cuda_graphs=cuda_graphs is True or (cuda_graphs == "auto"
                                                    and self.device.type == "cuda"),
                compile=resolve_compile(compile, model))
        else:
            self.cache = SequenceCache(model)
        self.inputs_fn = inputs_fn      # tokens -> input vectors (a draft head's fused inputs)
        with torch.inference_mode():   # one context for every row: a dynamic cache prefills it once
            self._forward(self._tokens(context_len)[:1].expand(batch_size, -1), graphed=False)
        self.keep = torch.full((batch_size,), context_len, device=self.device)

    def _forward(self, tokens: torch.Tensor, graphed: bool = True) -> None:
        embeds = self.inputs_fn(tokens) if self.inputs_fn is not None else None
        self.cache.forward(tokens, graphed=graphed, inputs_embeds=embeds)

    def _tokens(self, width: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.batch_size, width),
                             generator=self.generator).to(self.device)

    def time(self, width: int) -> float:
        tokens = self._tokens(width)
        synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            self._forward(tokens)
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.cache.rollback_to(self.keep, width=self.context_len)
        return elapsed


def measure_forward_costs(model: torch.nn.Module, widths, context_len: int = 256, batch_size: int = 1,
                          repeats: int = 5, seed: int = 0, static: bool | str = "auto",
                          cuda_graphs: bool | str = "auto",
                          compile: bool | str = "auto", cpu_kernels: bool | str = "auto",
                          fuse_projections: bool | str = "auto") -> dict[int, float]:
    """Median seconds of one cached forward pass over `width` new tokens, per width.

    The cache holds `context_len` tokens of random ids; widths are interleaved across repeats so
    drift of the machine's speed hits all alike. static: see use_static; cuda_graphs: replay
    captured graphs on the static cache ("auto": on CUDA; False: eager kernels, to see what graphs
    save; True off CUDA: the graph stand-in, for tests). cpu_kernels, fuse_projections: as
    SpecDecoder's; the model is first put in place on the path decoding runs it on
    (decoder.prepare_for_decoding): on this project's CPU the model as loaded took 37 ms a step
    and 1.3-1.9 steps a verify pass, the decoder's 23 ms and 1.0.
    """
    prepare_for_decoding(model, cpu_kernels, fuse_projections)
    vocab = model.get_output_embeddings().weight.shape[0]
    widths = [int(w) for w in widths]
    bench = _TimedCache(model, context_len, batch_size, torch.Generator().manual_seed(seed), vocab,
                        static=use_static(model, static), max_width=max(widths),
                        cuda_graphs=cuda_graphs, compile=compile)
    times: dict[int, list[float]] = {int(w): [] for w in widths}
    for repeat in range(repeats + 1):
        for width in times:
            elapsed = bench.time(width)
            if repeat:  # the first pass over each width is a warm-up
                times[width].append(elapsed)
    return {width: float(np.median(values)) for width, values in times.items()}


def verify_width_plan(costs: dict[int, float]) -> dict[int, int]:
    """{needed width n: the cheapest measured width >= n} (n itself when nothing wider is cheaper)."""
    widths = sorted(costs)
    plan = {}
    for n in widths:
        plan[n] = min((w for w in widths if w >= n), key=lambda w: (costs[w], w))
    return plan


def calibrate_verify_widths(model: torch.nn.Module, max_width: int, context_len: int = 256,
                            repeats: int = 5) -> dict[int, int]:
    """Measure verify passes of 1..max_width tokens and return the width plan for SpecDecoder."""
    return verify_width_plan(measure_forward_costs(model, range(1, max_width + 1), context_len,
                                                   repeats=repeats))


def measure_host_draft_cost(drafter, k: int, context_len: int = 256, batch_size: int = 1,
                            repeats: int = 5, seed: int = 0) -> float:
    """Median seconds of one proposal of up to k tokens for a batch by a host drafter (prompt
    lookup, suffix): the drafter's propose() on a decode state of batch_size rows, as the decode
    loop calls it (prompt lookup searches the whole batch in one compiled call, the suffix drafter
    row by row).

    The contexts are the expensive case: a short random pattern repeated (the search finds
    matches and copies k tokens), or -- for a drafter with a suffix index -- stretches of the
    indexed text itself (deep matches with many occurrences).
    """
    rng = np.random.default_rng(seed)
    index = drafter.index
    indexed = index.text[index.text >= 0] if index is not None else np.zeros(0)
    if len(indexed) > context_len:
        starts = rng.integers(0, len(indexed) - context_len, size=batch_size)
        sequences = [indexed[s: s + context_len].astype(np.int64) for s in starts]
    else:
        pattern = rng.integers(0, 30_000, size=max(8, context_len // 8))
        sequences = [np.resize(pattern, context_len)] * batch_size
    prompts = torch.from_numpy(np.stack(sequences).astype(np.int64))
    state = DecodeState(prompts, torch.ones_like(prompts), torch.full((batch_size,), prompts.shape[1]),
                        torch.zeros((batch_size, k + 1), dtype=torch.long),
                        torch.zeros(batch_size, dtype=torch.long), prompt_has_padding=False)
    budget = torch.full((batch_size,), k)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        drafter.propose(state, k, budget, None, None)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def relative_spread(values) -> float:
    """Interquartile range / median of repeated timings of one figure (0 for fewer than 2)."""
    values = np.asarray(list(values), dtype=float)
    if len(values) < 2:
        return 0.0
    median = float(np.median(values))
    q1, q3 = np.percentile(values, [25, 75])
    return float(q3 - q1) / median if median > 0 else 0.0


class CostSampler:
    """Repeated timings of every figure of a cost profile on this machine, all batch sizes at once.

    Figures: the target's cached forward over `width` tokens (width 1: a decode step; K + 1: a
    verify pass of K drafts), each drafter's step (a model drafter: one cached forward of one
    token through its own model; a host drafter: one proposal of up to k_max tokens per round),
    and each drafter's per-round overhead (plus plain decoding's per step) from a real decode (see
    measure_round_overhead). `sample(repeats)` times every figure once per repeat, interleaved
    across batch sizes, widths and drafters, so a slow phase of the machine (another process, a
    frequency change) spreads over all of them instead of inflating one; `costs()` gives the
    medians and `spreads()` the interquartile range over the median of each figure.
    static and cuda_graphs: see measure_forward_costs ("auto": the path SpecDecoder takes here).
    """

    def __init__(self, target: torch.nn.Module, drafters: dict, k_max: int, batch_sizes,
                 context_len: int = 256, seed: int = 0, static: bool | str = "auto",
                 cuda_graphs: bool | str = "auto", compile: bool | str = "auto",
                 overhead_tokens: int = 12):
        self.target, self.drafters, self.k_max = target, dict(drafters), int(k_max)
        for model in (target, *(m for d in self.drafters.values() for m in d.cached_models())):
            prepare_for_decoding(model)      # as the decodes below (SpecDecoder's defaults) do
        self.batch_sizes = sorted({int(b) for b in batch_sizes})
        self.context_len, self.seed = context_len, seed
        vocab = target.get_output_embeddings().weight.shape[0]
        generator = torch.Generator().manual_seed(seed)
        self.caches: dict[tuple[str, int], _TimedCache] = {}
        self.host = {label for label, d in self.drafters.items() if isinstance(d, HostDrafter)}
        self.probes: dict[tuple[str, int], _OverheadProbe] = {}
        for b in self.batch_sizes:
            self.caches[("target", b)] = _TimedCache(
                target, context_len, b, generator, vocab, static=use_static(target, static),
                max_width=self.k_max + 1, cuda_graphs=cuda_graphs, compile=compile)
            for label, drafter in self.drafters.items():
                if isinstance(drafter, DraftModel):
                    self.caches[(label, b)] = _TimedCache(
                        drafter.model, context_len, b, generator, vocab,
                        static=use_static(drafter.model, static), max_width=2,
                        cuda_graphs=cuda_graphs, compile=compile)
                elif drafter.needs_target_hidden:   # a head: fuse + layer + head
                    self.caches[(label, b)] = _head_cache(target, drafter.head, context_len, b,
                                                          generator, vocab, static)
                elif label not in self.host:
                    raise TypeError(f"no cost measurement for drafter {type(drafter).__name__}")
            for label, drafter in [("plain", None), *self.drafters.items()]:
                self.probes[(label, b)] = _OverheadProbe(
                    target, drafter, self.k_max if drafter is not None else 1, b, context_len,
                    overhead_tokens, seed)
        self._passes = 0       # passes run so far (the first: a warm-up)
        self.clear()

    def keep_last(self, passes: int) -> None:
        """Forget all but the last `passes` timings of every figure (each pass adds one to each):
        a re-measurement then pools them with its own, so a single hiccup among few timings is
        outvoted, while a slow phase that spoiled an earlier measurement ages out."""
        for store in (self.forward, self.draft, self.outside):
            for key in store:
                store[key] = store[key][max(0, len(store[key]) - passes):] if passes > 0 else []

    def clear(self) -> None:
        """Forget the timings taken so far."""
        self.forward: dict[tuple[int, int], list[float]] = {}        # (batch, width): s
        self.draft: dict[tuple[str, int], list[float]] = {}          # (label, batch): s
        self.outside: dict[tuple[str, int], list[tuple]] = {}      # _OverheadProbe.run's

    def _pass(self, repeat: int, keep: bool) -> None:
        for b in self.batch_sizes:
            # the first forward after other work (a decode at another batch size) runs slow
            # (measured in the main job: 41.7 ms against 32 ms for a step at batch 1): untimed
            self.caches[("target", b)].time(1)
            for width in range(1, self.k_max + 2):
                elapsed = self.caches[("target", b)].time(width)
                if keep:
                    self.forward.setdefault((b, width), []).append(elapsed)
            for label, drafter in self.drafters.items():
                if label in self.host:
                    elapsed = measure_host_draft_cost(drafter, self.k_max, self.context_len, b,
                                                      repeats=1, seed=self.seed + repeat)
                else:
                    elapsed = self.caches[(label, b)].time(1)
                if keep:
                    self.draft.setdefault((label, b), []).append(elapsed)
            for (label, size), probe in self.probes.items():
                if size == b:
                    sample = probe.run(self.seed + repeat)
                    if keep:
                        self.outside.setdefault((label, b), []).append(sample)

    def sample(self, repeats: int, progress=None) -> None:
        """Time every figure `repeats` more times (the first call also runs one warm-up pass).
        progress: called with 1 after each pass (a tqdm's update)."""
        if not self._passes:
            self._pass(0, keep=False)
            self._passes = 1
        for _ in range(repeats):
            gc.collect()      # as timeit does: no collection pause lands inside a timed figure
            gc.disable()
            try:
                self._pass(self._passes, keep=True)
            finally:
                gc.enable()
            self._passes += 1
            if progress is not None:
                progress(1)

    def forward_costs(self, b: int) -> dict[int, float]:
        return {w: float(np.median(self.forward[(b, w)])) for w in range(1, self.k_max + 2)}

    def _overheads(self) -> dict[tuple[str, int], list[float]]:
        """Seconds per round outside the forwards and proposals, one per decode (may be negative
        when the forwards priced at their medians took longer than the decode did)."""
        by_batch = {b: self.forward_costs(b) for b in self.batch_sizes}
        return {(label, b): [self.probes[(label, b)].per_round(sample, by_batch) for sample in samples]
                for (label, b), samples in self.outside.items()}

    def costs(self) -> dict[int, dict]:
        """{batch: {"target_step", "verify": {K: s}, "draft_step": {label: s},
        "round_overhead": {label or "plain": s}}}: medians (overheads clipped at 0)."""
        overheads = self._overheads()
        out = {}
        for b in self.batch_sizes:
            forward_s = self.forward_costs(b)
            out[b] = {"target_step": forward_s[1],
                      "verify": {k: forward_s[k + 1] for k in range(1, self.k_max + 1)},
                      "draft_step": {label: float(np.median(self.draft[(label, b)]))
                                     for label in self.drafters},
                      "round_overhead": {label: max(float(np.median(overheads[(label, size)])), 0.0)
                                         for label, size in self.probes if size == b}}
        return out

    def raw_overheads(self) -> dict[int, dict[str, float]]:
        """{batch: {label: median seconds per round}}, negative medians kept (a consistency check:
        a decode cannot take less than its own forwards)."""
        overheads = self._overheads()
        return {b: {label: float(np.median(overheads[(label, size)]))
                    for label, size in self.probes if size == b} for b in self.batch_sizes}

    def spreads(self) -> dict[int, dict]:
        """The same shape as costs(): interquartile range / median per figure. For overheads and
        draft steps the range is taken over the target step instead (their own medians can be near
        zero: what matters to the planner is their share of a step)."""
        overheads = self._overheads()
        out = {}
        for b in self.batch_sizes:
            step = float(np.median(self.forward[(b, 1)]))

            def of_step(values):
                values = np.asarray(values, dtype=float)
                if len(values) < 2 or step <= 0:
                    return 0.0
                q1, q3 = np.percentile(values, [25, 75])
                return float(q3 - q1) / step

            out[b] = {"target_step": relative_spread(self.forward[(b, 1)]),
                      "verify": {k: relative_spread(self.forward[(b, k + 1)])
                                 for k in range(1, self.k_max + 1)},
                      "draft_step": {label: of_step(self.draft[(label, b)]) for label in self.drafters},
                      "round_overhead": {label: of_step(overheads[(label, size)])
                                         for label, size in self.probes if size == b}}
        return out


def _head_cache(target, head, context_len, batch_size, generator, vocab, static) -> "_TimedCache":
    """A timed cache of a draft head's step: its fused inputs, its layer and its LM head."""
    features = torch.randn(batch_size, 1, head.feature_size, generator=generator).to(
        dtype=next(target.parameters()).dtype, device=next(target.parameters()).device)

    def fused(tokens, head=head, features=features):
        return head.inputs(features.expand(-1, tokens.shape[1], -1), tokens)

    return _TimedCache(head.body, context_len, batch_size, generator, vocab,
                       static=use_static(target, static), max_width=2, cuda_graphs=False,
                       inputs_fn=fused)


def measure_step_costs(target: torch.nn.Module, drafters: dict, k_max: int, batch_size: int = 1,
                       context_len: int = 256, repeats: int = 5, seed: int = 0,
                       static: bool | str = "auto", cuda_graphs: bool | str = "auto",
                       compile: bool | str = "auto") -> dict:
    """Seconds on this hardware at one batch size: {"target_step", "verify": {K: s},
    "draft_step": {label: s}, "round_overhead": {label or "plain": s}} for K = 1..k_max (medians
    of `repeats` interleaved timings after a warm-up; see CostSampler).

    verify(K) is one cached target pass over K + 1 tokens. A model drafter's step is one cached
    forward of one token through its own model; a host drafter's is one proposal (per round).
    """
    sampler = CostSampler(target, drafters, k_max, [batch_size], context_len, seed, static,
                          cuda_graphs, compile)
    sampler.sample(repeats)
    return sampler.costs()[batch_size]


class _OverheadProbe:
    """One real decode of a drafter (None: plain decoding) on a random prompt with a repeated
    pattern, in every row (host drafters find matches and draft); `run` times one call,
    `per_round` prices its forwards and gives the seconds per round left outside them and the
    proposals."""

    def __init__(self, target: torch.nn.Module, drafter, k: int, batch_size: int, context_len: int,
                 new_tokens: int = 12, seed: int = 0):
        device = next(target.parameters()).device
        generator = torch.Generator().manual_seed(seed)
        vocab = target.get_output_embeddings().weight.shape[0]
        # one prompt for every row: a dynamic cache prefills it once and copies it (the prefill is
        # not what is timed, and B distinct prompts cost most of a profile's time)
        pattern = torch.randint(0, vocab, (1, max(8, context_len // 8)), generator=generator)
        repeats = context_len // pattern.shape[1] + 1
        self.prompts = pattern.repeat(batch_size, repeats)[:, :context_len].to(device)
        self.decoder = SpecDecoder(target, drafter, k=max(k, 1), phase_timing=True)
        self.plain = drafter is None
        self.new_tokens, self.batch_size, self.context_len = new_tokens, batch_size, context_len
        self.priced: dict[int, float] = {}

    def run(self, seed: int) -> tuple[float, list[int], list[int]]:
        """(seconds of the decode phase minus the proposals, verify width of each round, rows of
        each round: on dynamic caches finished rows leave the batch)."""
        run = self.decoder.generate_plain if self.plain else self.decoder.generate
        result = run(self.prompts, self.new_tokens, sampling=SamplingParams(), seed=seed)
        stats = result.stats
        return ((stats.total_s - stats.prefill_s) - stats.draft_s, list(result.round_widths),
                list(result.round_rows) or [self.batch_size] * len(result.round_widths))

    def per_round(self, sample: tuple, forward_s: dict) -> float:
        """Seconds per round outside the forwards and proposals. forward_s: {width: s} at this
        probe's batch size, or {batch: {width: s}} (a round over fewer rows, after some
        finished, is priced between the two nearest batch sizes)."""
        outside, widths, rows = sample
        by_batch = forward_s if forward_s and isinstance(next(iter(forward_s.values())), dict) \
            else {self.batch_size: dict(forward_s)}
        own = {**self.priced, **by_batch.get(self.batch_size, {})}
        missing = sorted(set(widths) - set(own))
        if missing:     # widths the caller's costs lack: measured once, on the same cache kind
            self.priced.update(measure_forward_costs(
                self.decoder.target, missing, self.context_len, self.batch_size, repeats=2,
                static=self.decoder.uses_static_cache(), cuda_graphs=self.decoder.cuda_graphs,
                compile=self.decoder.compile))
            own.update(self.priced)
        by_batch = {**by_batch, self.batch_size: own}
        forwards = sum(_priced_at(by_batch, n, w) for w, n in zip(widths, rows))
        return (outside - forwards) / max(len(widths), 1)


def _priced_at(by_batch: dict[int, dict[int, float]], rows: int, width: int) -> float:
    """A forward's seconds over `rows` rows and `width` tokens, interpolated linearly between
    the nearest measured batch sizes that have the width (the nearest one outside their range)."""
    sizes = sorted(b for b, costs in by_batch.items() if width in costs)
    below = [b for b in sizes if b <= rows]
    above = [b for b in sizes if b >= rows]
    if not below or not above:
        return by_batch[(below or above)[-1 if below else 0]][width]
    low, high = below[-1], above[0]
    if low == high:
        return by_batch[low][width]
    share = (rows - low) / (high - low)
    return (1 - share) * by_batch[low][width] + share * by_batch[high][width]


def measure_round_overhead(target: torch.nn.Module, drafter, k: int, batch_size: int = 1,
                           context_len: int = 256, new_tokens: int = 12, repeats: int = 2,
                           seed: int = 0, forward_s: dict[int, float] | None = None) -> float:
    """Median seconds per round of a real decode outside the cost model's terms: the call's decode
    time minus its proposals (timed by the loop around the draft phase) and minus one target
    forward per round at that round's verify width (drafter=None: plain decoding, per step).
    What is left is sampling, acceptance, write-back, rollback, the drafter's commit and the
    loop's bookkeeping -- host work that a GPU does not hide. Where rounds are captured whole
    (static caches with CUDA graphs) a forward cannot be timed inside them: the forwards are
    priced at `forward_s` {width: seconds} (the cost profile's own step costs), and widths it
    lacks are measured here on the same cache kind.

    Prompts are random tokens with a repeated pattern (host drafters find matches and draft).
    """
    probe = _OverheadProbe(target, drafter, k, batch_size, context_len, new_tokens, seed)
    samples = [probe.run(seed + repeat) for repeat in range(repeats + 1)][1:]   # 1st: warm-up
    return float(np.median([max(probe.per_round(sample, forward_s or {}), 0.0) for sample in samples]))
