"""Suffix index at scale: build time, peak memory and lookup time at 1k, 10k and 100k requests.

Generated traffic (no model needed): each request is about 150 tokens drawn from a small set of
templates (the repeated keys, boilerplate and phrasings of real traffic) with random tokens mixed
in, over a 49152-token vocabulary (the embedded default's). For each size it builds the index
(SuffixIndex.build), reports tokens/s and bytes per indexed token (the arrays kept, and peak
traced memory during the build), then times lookups (a SuffixDrafter proposal of up to K = 8
tokens: longest match, continuation counts, the greedy path) on contexts taken from the indexed
text (deep matches, the expensive case) and on fresh random contexts, against one target step of
the embedded default on this machine (measured here, or --target-step-ms).

    python benchmarks/suffix_index.py [--sizes 1000,10000,100000] [--target-step-ms 75]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

from specdec_core.drafters import SuffixDrafter
from specdec_core.suffix import SuffixIndex

RESULTS = Path(__file__).parent / "results" / "suffix_index.md"
VOCAB = 49152


def generated_requests(count: int, seed: int = 0, mean_tokens: int = 150) -> list[np.ndarray]:
    """`count` token sequences of about mean_tokens: template pieces with random tokens between."""
    rng = np.random.default_rng(seed)
    templates = [rng.integers(0, VOCAB, size=rng.integers(4, 24)) for _ in range(400)]
    popular = rng.zipf(1.3, size=count * 16) % len(templates)
    requests, used = [], 0
    for _ in range(count):
        parts, length = [], 0
        target_len = int(rng.integers(mean_tokens // 2, mean_tokens * 3 // 2))
        while length < target_len:
            if rng.random() < 0.7:
                piece = templates[popular[used % len(popular)]]
                used += 1
            else:
                piece = rng.integers(0, VOCAB, size=rng.integers(1, 6))
            parts.append(piece)
            length += len(piece)
        requests.append(np.concatenate(parts)[:target_len])
    return requests


def target_step_seconds() -> float:
    from specdec_core import load_model
    from specdec_core.profile import measure_forward_costs

    model, _ = load_model("smollm2-135m-instruct", device="cpu")
    return measure_forward_costs(model, [1], context_len=256, repeats=10)[1]


def time_lookups(drafter: SuffixDrafter, contexts: list[np.ndarray], k: int) -> float:
    for context in contexts[:5]:
        drafter.propose_tokens(context, k)
    times = []
    for context in contexts:
        start = time.perf_counter()
        drafter.propose_tokens(context, k)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--context", type=int, default=300, help="context tokens per lookup")
    parser.add_argument("--target-step-ms", type=float, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    step_s = (args.target_step_ms / 1000 if args.target_step_ms
              else target_step_seconds())
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        print(f"{size} requests: generating", file=sys.stderr, flush=True)
        requests = generated_requests(size)
        tokens = sum(len(r) for r in requests)
        tracemalloc.start()
        start = time.perf_counter()
        index = SuffixIndex.build(requests, depth=32)
        build_s = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        kept = index.text.nbytes + index.order.nbytes
        print(f"{size} requests: built in {build_s:.1f} s; timing lookups", file=sys.stderr,
              flush=True)
        drafter = SuffixDrafter(index)
        rng = np.random.default_rng(1)
        flat = index.text[index.text >= 0]
        starts = rng.integers(0, len(flat) - args.context, size=args.lookups)
        deep = [flat[s: s + args.context].astype(np.int64) for s in starts]
        fresh = [rng.integers(0, VOCAB, size=args.context) for _ in range(args.lookups)]
        deep_s, fresh_s = time_lookups(drafter, deep, args.k), time_lookups(drafter, fresh, args.k)
        rows.append((size, tokens, build_s, tokens / build_s, kept / tokens, peak / tokens,
                     deep_s, fresh_s))
    header = ("| requests | tokens | build s | build tokens/s | index bytes/token | peak build "
              "bytes/token | lookup ms (indexed context) | lookup ms (fresh context) "
              "| lookup / target step |")
    lines = [header, "|" + "---|" * 9]
    for size, tokens, build_s, rate, kept, peak, deep_s, fresh_s in rows:
        lines.append(f"| {size:,} | {tokens:,} | {build_s:.2f} | {rate:,.0f} | {kept:.1f} "
                     f"| {peak:.1f} | {1000 * deep_s:.3f} | {1000 * fresh_s:.3f} "
                     f"| {100 * deep_s / step_s:.2f}% |")
    meta = (f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, numpy "
            f"{np.__version__}; generated requests of about 150 tokens; index depth 32; lookups: a "
            f"SuffixDrafter proposal of up to K = {args.k} (max_depth 24), {args.lookups} contexts "
            f"of {args.context} tokens, medians; target step of the embedded default "
            f"{1000 * step_s:.1f} ms (fp32, batch 1, context 256).")
    text = f"# Suffix index at scale\n\n{meta}\n\n" + "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
