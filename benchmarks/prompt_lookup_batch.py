"""Host drafters over a batch: one Python search per row (HostDrafter.propose_host, the old path)
against one compiled call for the whole batch (PromptLookup / SuffixDrafter.propose_host ->
specdec_core.lookup), both on the host view the decode loop keeps (records.HostView).

Rows of 2k tokens (a 2000-token prompt and 48 generated tokens) over a 49152-token vocabulary, at
batch sizes 1, 16 and 64, in two cases:
- repetitive: the rows repeat 12-token phrases (JSON keys, boilerplate), so the latest earlier
  occurrence of the last 3 tokens is found a few phrases back;
- no match: random tokens, so every n from 3 down to 1 scans the whole row (the worst case).
Prompt lookup (max_ngram 3, min_ngram 1), then the suffix drafter with an index over 500 logged
responses of 200 tokens made of the same phrases (deep matches, many occurrences).
The contenders alternate call by call; each figure is the median over `--repeats` calls, and the
ratio is taken within the same run. The goal of the GPU path: a batch of 64 in under 150 us
(5% of an H100 step of the Llama-3.2-1B shape).

    python benchmarks/prompt_lookup_batch.py [--repeats 200] [--write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specdec_core.drafters import HostDrafter, PromptLookup, SuffixDrafter, host_view
from specdec_core.records import DecodeState
from specdec_core.suffix import SuffixIndex

RESULTS = Path(__file__).parent / "results" / "prompt_lookup_batch.md"
VOCAB = 49152
PROMPT, GENERATED, K = 2000, 48, 8


def phrase_bank(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(40, 12))


def phrase_text(rng, length: int) -> np.ndarray:
    phrases = phrase_bank()
    return np.concatenate([phrases[i] for i in rng.integers(0, 40, length // 12 + 1)])[:length]


def suffix_index(responses: int = 500, length: int = 200) -> SuffixIndex:
    rng = np.random.default_rng(1)
    return SuffixIndex.build([phrase_text(rng, length) for _ in range(responses)], depth=32)


def make_state(batch: int, repetitive: bool, seed: int = 0) -> DecodeState:
    rng = np.random.default_rng(seed)
    width = PROMPT + GENERATED
    if repetitive:
        rows = np.stack([phrase_text(rng, width) for _ in range(batch)])
    else:
        rows = rng.integers(0, VOCAB, size=(batch, width))
    prompts = torch.from_numpy(rows[:, :PROMPT].astype(np.int64))
    out = torch.zeros((batch, GENERATED + K + 1), dtype=torch.long)
    out[:, :GENERATED] = torch.from_numpy(rows[:, PROMPT:].astype(np.int64))
    return DecodeState(prompts, torch.ones_like(prompts), torch.full((batch,), PROMPT),
                       out, torch.full((batch,), GENERATED), prompt_has_padding=False)


def timed(call, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(Path.cwd())}"
                        if RESULTS.is_relative_to(Path.cwd()) else "write the results file")
    args = parser.parse_args()
    drafters = {"prompt lookup": PromptLookup(max_ngram=3, min_ngram=1),
                "suffix": SuffixDrafter(suffix_index())}
    rows = []
    for label, drafter in drafters.items():
        for repetitive in (True, False):
            for batch in (1, 16, 64):
                host = host_view(make_state(batch, repetitive), torch.full((batch,), K))
                batched = lambda: drafter.propose_host(host, K)                          # noqa: E731
                per_row = lambda: HostDrafter.propose_host(drafter, host, K)             # noqa: E731
                a, b = batched(), per_row()            # warm-up (compiles the kernel once)
                assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
                new, old = [], []
                for _ in range(args.repeats // 10):     # interleaved blocks of 10 calls
                    new += timed(batched, 10)
                    old += timed(per_row, 10)
                new_us, old_us = statistics.median(new) * 1e6, statistics.median(old) * 1e6
                rows.append((label, "repetitive" if repetitive else "no match", batch, old_us, new_us,
                             old_us / new_us, float(a[1].mean())))
                print(f"{label:>13} {rows[-1][1]:>10} batch {batch:>3}: per row {old_us:9.1f} us, batched "
                      f"{new_us:8.1f} us ({old_us / new_us:5.1f}x), drafts/row {rows[-1][6]:.2f}", flush=True)
    lines = [f"# Host drafters over a batch ({dt.date.today()}, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads)", "",
             f"`python benchmarks/prompt_lookup_batch.py --repeats {args.repeats} --write`: rows of "
             f"{PROMPT} prompt + {GENERATED} generated tokens, K = {K}; prompt lookup max_ngram 3, "
             "min_ngram 1; suffix drafter with defaults and an index of 500 x 200 tokens; median "
             "per call, contenders interleaved.", "",
             "| drafter | rows | batch | per row (old) | batched (new) | ratio | drafts per row |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {label} | {case} | {batch} | {old:.1f} us | {new:.1f} us | {ratio:.1f}x | {drafts:.2f} |"
              for label, case, batch, old, new, ratio, drafts in rows]
    if args.write:
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
