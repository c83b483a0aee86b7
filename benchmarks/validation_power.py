"""False-alarm rate and power of the sampling losslessness check (specdec_core.validation).

On a tiny random target (vocabulary 24, spread distributions) and a perturbed copy as the draft,
runs sampling_check (K in {1, 2}, 3-token continuations, T = 1, T = 0.7, T = 1.3 with top-p 0.9,
alpha = 0.01 Bonferroni-corrected) over many seeds with the exact engine and with each broken
verifier of specdec_core.faults, and prints the fraction of seeds flagged.

    python benchmarks/validation_power.py [--seeds 20] [--rows 3000]
"""

from __future__ import annotations

import argparse
import copy

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_core import DraftModel
from specdec_core.faults import BROKEN_VARIANTS
from specdec_core.validation import sampling_check

PROMPT = torch.tensor([3, 7, 1, 9, 4])


def models():
    torch.manual_seed(31)
    config = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std())
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--alpha", type=float, default=0.01)
    args = parser.parse_args()
    target, draft = models()
    variants = {"exact": {}, **BROKEN_VARIANTS}
    flagged = {name: 0 for name in variants}
    with tqdm(total=len(variants) * args.seeds, desc="validation power") as bar:
        for seed in range(args.seeds):
            for name, kwargs in variants.items():
                report = sampling_check(target, DraftModel(draft), PROMPT, rows=args.rows,
                                        alpha=args.alpha, seed=1000 + seed, **kwargs)
                flagged[name] += not report.passed
                bar.update(1)
    print(f"\nsampling_check, alpha={args.alpha}, rows={args.rows}, {args.seeds} seeds")
    print("| verifier | flagged | rate | meaning |\n|---|---|---|---|")
    for name, count in flagged.items():
        meaning = "false-alarm rate (<= alpha)" if name == "exact" else "power (target >= 0.99)"
        print(f"| {name} | {count}/{args.seeds} | {count / args.seeds:.2f} | {meaning} |")


if __name__ == "__main__":
    main()
