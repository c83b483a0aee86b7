"""Measuring costs on the hardware at hand: target step and verify(K) passes.

On CUDA the passes are timed on the fast path's static caches with CUDA graphs (fast.py), the
path SpecDecoder takes there; on CPU on the general path's dynamic cache.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import fast
from .fast import synchronize as _sync
from .cache import SequenceCache


def use_static(model: torch.nn.Module, static: bool | str = "auto") -> bool:
    """Whether costs are measured on the fast path's static cache: "auto" -- where SpecDecoder
    runs that path by default, so the planner gets the costs decoding will have."""
    return fast.static_by_default(model) if static == "auto" else bool(static)


class _TimedCache:
    """A model's cache holding `context_len` random tokens; times cached forward passes of random
    tokens and rolls the cache back after each (`vocab` bounds the ids). static: a fast-path
    StaticSequenceCache (CUDA graphs on CUDA) with room for widths up to max_width."""

    def __init__(self, model: torch.nn.Module, context_len: int, batch_size: int, generator,
                 vocab: int, static: bool = False, max_width: int = 64, cuda_graphs: bool = True):
        self.device = next(model.parameters()).device
        self.generator, self.vocab, self.batch_size = generator, vocab, batch_size
        self.context_len = context_len
        if static:
            self.cache = fast.StaticSequenceCache(
                model, batch_size, fast.bucket_length(context_len + max_width + 1),
                cuda_graphs=cuda_graphs and self.device.type == "cuda")
        else:
            self.cache = SequenceCache(model)
        with torch.inference_mode():
            if static:
                self.cache.forward(self._tokens(context_len), graphed=False)
            else:
                self.cache.forward(self._tokens(context_len))
        self.keep = torch.full((batch_size,), context_len, device=self.device)

    def _tokens(self, width: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.batch_size, width),
                             generator=self.generator).to(self.device)

    def time(self, width: int) -> float:
        tokens = self._tokens(width)
        _sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            self.cache.forward(tokens)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        if isinstance(self.cache, fast.StaticSequenceCache):
            self.cache.rollback_to(self.keep, width=self.context_len)
        else:
            self.cache.rollback_to(self.keep)
        return elapsed


def measure_forward_costs(model: torch.nn.Module, widths, context_len: int = 256, batch_size: int = 1,
                          repeats: int = 5, seed: int = 0, static: bool | str = "auto",
                          cuda_graphs: bool = True) -> dict[int, float]:
    """Median seconds of one cached forward pass over `width` new tokens, per width.

    The cache holds `context_len` tokens of random ids; widths are interleaved across repeats so
    drift of the machine's speed hits all alike. static: see use_static; cuda_graphs: replay
    captured graphs on the static cache on CUDA (False: eager kernels, to see what graphs save).
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    widths = [int(w) for w in widths]
    bench = _TimedCache(model, context_len, batch_size, torch.Generator().manual_seed(seed), vocab,
                        static=use_static(model, static), max_width=max(widths),
                        cuda_graphs=cuda_graphs)
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


def measure_lookup_cost(drafter, k: int, context_len: int = 256, batch_size: int = 1,
                        repeats: int = 5, seed: int = 0) -> float:
    """Median seconds of one prompt-lookup proposal of up to k tokens for a batch (host-side search).

    The sequence repeats a short random pattern, so the search finds matches and copies k tokens
    (the expensive case).
    """
    from .drafters import find_continuation

    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, 30_000, size=max(8, context_len // 8))
    sequence = np.resize(pattern, context_len)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for _row in range(batch_size):
            find_continuation(sequence, drafter.max_ngram, k, drafter.min_ngram)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def measure_step_costs(target: torch.nn.Module, drafters: dict, k_max: int, batch_size: int = 1,
                       context_len: int = 256, repeats: int = 5, seed: int = 0) -> dict:
    """Seconds on this hardware at one batch size: {"target_step", "verify": {K: s},
    "draft_step": {label: s}} for K = 1..k_max (medians).

    verify(K) is one cached target pass over K + 1 tokens. A model drafter's step is one cached
    forward of one token through its own model; prompt lookup's is one proposal (per round).
    Every component is timed once per repeat, interleaved, so drift of the machine's speed (other
    load, frequency changes) hits the ratios' numerators and denominators alike.
    """
    from .drafters import DraftModel, PromptLookup

    vocab = target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    caches = {"target": _TimedCache(target, context_len, batch_size, generator, vocab,
                                    static=use_static(target), max_width=k_max + 1)}
    for label, drafter in drafters.items():
        if isinstance(drafter, DraftModel):
            caches[label] = _TimedCache(drafter.model, context_len, batch_size, generator, vocab,
                                        static=use_static(drafter.model), max_width=2)
        elif not isinstance(drafter, PromptLookup):
            raise TypeError(f"no cost measurement for drafter {type(drafter).__name__}")

    times: dict[tuple[str, int], list[float]] = {}
    for repeat in range(repeats + 1):          # the first round is a warm-up
        for width in range(1, k_max + 2):
            elapsed = caches["target"].time(width)
            if repeat:
                times.setdefault(("target", width), []).append(elapsed)
        for label, drafter in drafters.items():
            if isinstance(drafter, PromptLookup):
                elapsed = measure_lookup_cost(drafter, k_max, context_len, batch_size, repeats=1,
                                              seed=seed + repeat)
            else:
                elapsed = caches[label].time(1)
            if repeat:
                times.setdefault((label, 1), []).append(elapsed)
    median = {key: float(np.median(values)) for key, values in times.items()}
    return {"target_step": median[("target", 1)],
            "verify": {k: median[("target", k + 1)] for k in range(1, k_max + 1)},
            "draft_step": {label: median[(label, 1)] for label in drafters}}
