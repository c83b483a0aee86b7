"""The two KV cache kinds behind the decode loop, on this CPU: dynamic vs static (no graphs).

SpecDecoder decodes on dynamic caches (cache.py: they grow with the sequence, finished rows leave
the batch) or static ones (static_cache.py: preallocated, fixed shapes, finished rows stay as
inactive holes). This script decides which should be the CPU default. On the embedded default,
a few built-in prompts per domain, greedy, EOS on; for plain decoding, prompt lookup (K = 8) and
LayerSkip(8) (K = 2), at batch 1 and with a domain's prompts as one left-padded batch, it times
both kinds interleaved (the order alternates from prompt to prompt, so drift hits both alike),
checks that both emit identical tokens, and prints decode-phase tokens/s and the ratio
static / dynamic as a Markdown table (also written to benchmarks/results/cache_kinds_cpu.md).

    python benchmarks/cache_kinds_cpu.py [--max-new-tokens 64] [--per-domain 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_core import LayerSkip, PromptLookup, SpecDecoder, load_model
from specdec_core.models import DEFAULT_MODEL
from tasks.cli.prompts import builtin_prompts, encode

RESULTS = Path(__file__).parent / "results" / "cache_kinds_cpu.md"
KINDS = ("dynamic", "static")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--per-domain", type=int, default=2, help="built-in prompts per domain")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model, device="cpu")
    by_domain: dict[str, list] = defaultdict(list)
    for prompt in builtin_prompts():
        if len(by_domain[prompt.domain]) < args.per_domain:
            by_domain[prompt.domain].append(prompt)
    drafters = {"plain": lambda: None, "prompt_lookup": lambda: PromptLookup(max_ngram=3),
                "layer_skip": lambda: LayerSkip(model, num_layers=8)}
    ks = {"plain": 1, "prompt_lookup": 8, "layer_skip": 2}
    decoders = {(name, kind): SpecDecoder(model, make(), k=ks[name], tokenizer=tokenizer,
                                          static_cache=kind == "static")
                for name, make in drafters.items() for kind in KINDS}
    eos, new = tokenizer.eos_token_id, args.max_new_tokens

    def run(name: str, kind: str, ids, mask):
        decoder = decoders[name, kind]
        fn = decoder.generate_plain if name == "plain" else decoder.generate
        return fn(ids, new, attention_mask=mask, eos_token_id=eos)

    # the inputs: each prompt alone, and each domain's prompts as one left-padded batch
    inputs = [(domain, 1, *encode(tokenizer, [p.text])) for domain, ps in by_domain.items()
              for p in ps]
    inputs += [(domain, len(ps), *encode(tokenizer, [p.text for p in ps]))
               for domain, ps in by_domain.items()]
    for name in drafters:          # warm-up: first-call paths and allocations, not timed
        for kind in KINDS:
            run(name, kind, *inputs[0][2:])
    seconds, tokens = defaultdict(float), defaultdict(int)
    mismatches = []
    bar = tqdm(total=args.repeats * len(inputs) * len(drafters) * 2, desc="cache kinds")
    order = 0
    for _ in range(args.repeats):
        for domain, batch, ids, mask in inputs:
            for name in drafters:
                order += 1
                results = {}
                for kind in (KINDS if order % 2 else KINDS[::-1]):
                    results[kind] = result = run(name, kind, ids, mask)
                    for key in ((name, batch, kind, domain), (name, batch, kind, "all")):
                        seconds[key] += result.stats.decode_s
                        tokens[key] += sum(result.num_tokens) - batch   # after the prefill's
                    bar.update(1)
                if not torch.equal(results["static"].tokens, results["dynamic"].tokens):
                    mismatches.append((domain, batch, name))
    bar.close()

    header = "| drafter | batch | domain | dynamic tok/s | static tok/s | static / dynamic |"
    lines = [header, "|---|---|---|---|---|---|"]
    for name in drafters:
        for batch in sorted({b for _, b, _, _ in inputs}):
            for domain in [*by_domain, "all"]:
                rates = {}
                for kind in KINDS:
                    key = (name, batch, kind, domain)
                    rates[kind] = tokens[key] / seconds[key] if seconds[key] else float("nan")
                if domain != "all" and batch != 1 and not seconds[name, batch, "static", domain]:
                    continue
                lines.append(f"| {name} | {batch if batch == 1 else 'domain'} | {domain} "
                             f"| {rates['dynamic']:.1f} | {rates['static']:.1f} "
                             f"| {rates['static'] / rates['dynamic']:.2f}x |")
    meta = (f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, {args.model} fp32, greedy, EOS on, max_new_tokens {new}, "
            f"{args.per_domain} built-in prompts per domain x {args.repeats}; prompt_lookup K=8 "
            f"(max_ngram 3), layer_skip 8 layers K=2; static caches without CUDA graphs. Decode "
            "phase: tokens after the prefill's first, per second of the decoder's decode phase.")
    outputs = ("Both cache kinds emitted identical tokens on every input." if not mismatches else
               f"Outputs differed on {mismatches}.")
    text = f"# KV cache kinds on CPU\n\n{meta}\n\n" + "\n".join(lines) + f"\n\n{outputs}\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
