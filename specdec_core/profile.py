"""Measuring costs on the hardware at hand: target step and verify(K) passes.

On CUDA the passes are timed on static caches with CUDA graphs (static_cache.py), the caches
SpecDecoder decodes on there; on CPU on the dynamic cache (cache.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .cache import SequenceCache
from .graphs import synchronize
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
        with torch.inference_mode():
            self._forward(self._tokens(context_len), graphed=False)
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
                          compile: bool | str = "auto") -> dict[int, float]:
    """Median seconds of one cached forward pass over `width` new tokens, per width.

    The cache holds `context_len` tokens of random ids; widths are interleaved across repeats so
    drift of the machine's speed hits all alike. static: see use_static; cuda_graphs: replay
    captured graphs on the static cache ("auto": on CUDA; False: eager kernels, to see what graphs
    save; True off CUDA: the graph stand-in, for tests).
    """
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
    index = getattr(drafter, "index", None)
    indexed = index.text[index.text >= 0] if index is not None else np.zeros(0)
    if len(indexed) > context_len:
        starts = rng.integers(0, len(indexed) - context_len, size=batch_size)
        sequences = [indexed[s: s + context_len].astype(np.int64) for s in starts]
    else:
        pattern = rng.integers(0, 30_000, size=max(8, context_len // 8))
        sequences = [np.resize(pattern, context_len)] * batch_size
    from .records import DecodeState

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


def measure_step_costs(target: torch.nn.Module, drafters: dict, k_max: int, batch_size: int = 1,
                       context_len: int = 256, repeats: int = 5, seed: int = 0,
                       static: bool | str = "auto", cuda_graphs: bool | str = "auto",
                       compile: bool | str = "auto") -> dict:
    """Seconds on this hardware at one batch size: {"target_step", "verify": {K: s},
    "draft_step": {label: s}, "round_overhead": {label or "plain": s}} for K = 1..k_max (medians;
    round_overhead: measure_round_overhead).

    verify(K) is one cached target pass over K + 1 tokens. A model drafter's step is one cached
    forward of one token through its own model; a host drafter's is one proposal (per round).
    Every component is timed once per repeat, interleaved, so drift of the machine's speed (other
    load, frequency changes) hits the ratios' numerators and denominators alike. static and
    cuda_graphs: see measure_forward_costs ("auto": the path SpecDecoder takes on this device).
    """
    from .drafters import DraftModel, HostDrafter

    vocab = target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    caches = {"target": _TimedCache(target, context_len, batch_size, generator, vocab,
                                    static=use_static(target, static), max_width=k_max + 1,
                                    cuda_graphs=cuda_graphs, compile=compile)}
    for label, drafter in drafters.items():
        if isinstance(drafter, DraftModel):
            caches[label] = _TimedCache(drafter.model, context_len, batch_size, generator, vocab,
                                        static=use_static(drafter.model, static), max_width=2,
                                        cuda_graphs=cuda_graphs, compile=compile)
        elif getattr(drafter, "needs_target_hidden", False):   # a draft head: fuse + its layer + head
            head = drafter.head
            features = torch.randn(batch_size, 1, head.config.hidden_size, generator=generator).to(
                dtype=next(target.parameters()).dtype, device=next(target.parameters()).device)

            def fused(tokens, head=head, features=features):
                return head.inputs(features.expand(-1, tokens.shape[1], -1), tokens)

            caches[label] = _TimedCache(head.body, context_len, batch_size, generator, vocab,
                                        static=use_static(target, static), max_width=2,
                                        cuda_graphs=False, inputs_fn=fused)
        elif not isinstance(drafter, HostDrafter):
            raise TypeError(f"no cost measurement for drafter {type(drafter).__name__}")

    times: dict[tuple[str, int], list[float]] = {}
    for repeat in range(repeats + 1):          # the first round is a warm-up
        for width in range(1, k_max + 2):
            elapsed = caches["target"].time(width)
            if repeat:
                times.setdefault(("target", width), []).append(elapsed)
        for label, drafter in drafters.items():
            if isinstance(drafter, HostDrafter):
                elapsed = measure_host_draft_cost(drafter, k_max, context_len, batch_size,
                                                  repeats=1, seed=seed + repeat)
            else:
                elapsed = caches[label].time(1)
            if repeat:
                times.setdefault((label, 1), []).append(elapsed)
    median = {key: float(np.median(values)) for key, values in times.items()}
    forward_s = {w: median[("target", w)] for w in range(1, k_max + 2)}
    overhead = {"plain": measure_round_overhead(target, None, 1, batch_size, context_len, seed=seed,
                                                forward_s=forward_s)}
    for label, drafter in drafters.items():
        overhead[label] = measure_round_overhead(target, drafter, k_max, batch_size, context_len,
                                                 seed=seed, forward_s=forward_s)
    return {"target_step": median[("target", 1)],
            "verify": {k: median[("target", k + 1)] for k in range(1, k_max + 1)},
            "draft_step": {label: median[(label, 1)] for label in drafters},
            "round_overhead": overhead}


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
    from .decoder import SpecDecoder
    from .sampling import SamplingParams

    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    pattern = torch.randint(0, vocab, (batch_size, max(8, context_len // 8)), generator=generator)
    prompts = pattern.repeat(1, context_len // pattern.shape[1] + 1)[:, :context_len].to(device)
    decoder = SpecDecoder(target, drafter, k=max(k, 1), phase_timing=True)
    run = decoder.generate if drafter is not None else decoder.generate_plain
    results = [run(prompts, new_tokens, sampling=SamplingParams(), seed=seed + repeat)
               for repeat in range(repeats + 1)]          # the first call is a warm-up
    forward_s = dict(forward_s or {})
    missing = sorted({w for result in results for w in result.round_widths} - set(forward_s))
    if missing:
        forward_s.update(measure_forward_costs(target, missing, context_len, batch_size,
                                               repeats=max(repeats, 2), seed=seed,
                                               static=decoder.uses_static_cache(),
                                               cuda_graphs=decoder.cuda_graphs,
                                               compile=decoder.compile))
    per_round = []
    for result in results[1:]:
        stats = result.stats
        forwards = sum(forward_s[w] for w in result.round_widths)
        outside = (stats.total_s - stats.prefill_s) - stats.draft_s - forwards
        per_round.append(max(outside, 0.0) / max(len(result.round_widths), 1))
    return float(np.median(per_round))
