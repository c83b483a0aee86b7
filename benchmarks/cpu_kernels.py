"""The CPU kernels (specdec_core.cpu_kernels) on and off, interleaved in one run on this machine.

    python benchmarks/cpu_kernels.py [--requests 8] [--k 4] [--max-new-tokens 64] [--rounds 3]
                                     [--out benchmarks/results/cpu_kernels.md]

Two copies of the embedded default: one as loaded (`SpecDecoder(..., cpu_kernels=False)`), one
with the packed linear weights and grouped-query attention (the default on a CPU). Figures:
1. one target forward over W new positions after a 200-token cached context (W = 1, 2, 3, 4, 5,
   6, 9: plain decoding is W = 1, a verify pass at K is W = K + 1), best of --rounds x 10 passes;
2. decode-phase tokens/s of plain decoding and prompt lookup at K (max n 3), batch 1 (the
   requests one at a time) and batch 8 (one left-padded batch), on the first greedy json/code
   requests of the shipped traffic, medians over --rounds; the tokens of on and off are compared.
Contenders alternate within every round. Run it alone: a neighbour process on 2 cores skews it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from eagle3_train import shipped_requests  # noqa: E402
from specdec_core import SamplingParams, SpecDecoder, cpu_kernels, load_model  # noqa: E402
from specdec_core.drafters import PromptLookup  # noqa: E402
from tasks.steps.costs.costs import cpu_model  # noqa: E402
from vs_vllm import TARGET, arguments, left_padded, report  # noqa: E402

WIDTHS = (1, 2, 3, 4, 5, 6, 9)


def forward_ms(model, width: int, passes: int = 10) -> float:
    """Best time of one forward over `width` positions after a 200-token cache, in ms."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(100, 20000, (1, 200), generator=generator)
    new = torch.randint(100, 20000, (1, width), generator=generator)
    cache = DynamicCache(config=model.config)
    best = float("inf")
    with torch.inference_mode():
        model(context, past_key_values=cache, use_cache=True)
        for _ in range(passes + 2):
            start = time.perf_counter()
            model(new, past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - start)
            cache.crop(-width)
    return best * 1000


def decode(decoder: SpecDecoder, batches: list, new_tokens: int, speculative: bool, pad: int):
    """(decode-phase tokens/s, the tokens) over the batches."""
    tokens, seconds, outputs = 0, 0.0, []
    for batch in batches:
        ids, mask = left_padded(batch, pad)
        run = decoder.generate if speculative else decoder.generate_plain
        result = run(ids, max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0),
                     attention_mask=mask, eos_token_id=None)
        tokens += int(sum(result.num_tokens)) - len(batch)
        seconds += result.stats.decode_s
        outputs.append(result.tokens)
    return tokens / seconds, outputs


def main() -> None:
    args = arguments(__doc__.splitlines()[0], rounds=3)
    models = {}
    for name in ("off", "on"):
        model, tokenizer = load_model(TARGET, device="cpu")
        models[name] = model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    decoders = {name: {"plain": SpecDecoder(model, None, k=args.k, cpu_kernels=name == "on"),
                       "prompt lookup": SpecDecoder(model, PromptLookup(max_ngram=3, min_ngram=1),
                                                    k=args.k, cpu_kernels=name == "on")}
                for name, model in models.items()}
    engine = decoders["on"]["plain"].engine()["cpu_kernels"]
    picked = [r for r in shipped_requests() if r.domain in ("json", "code") and r.sampling.greedy]
    prompts = [list(r.prompt_ids) for r in picked[:args.requests]]
    shapes = {1: [[p] for p in prompts], 8: [prompts[i:i + 8] for i in range(0, len(prompts), 8)]}
    widths: dict = {}
    rates: dict = {}
    same = True
    for round_ in range(args.rounds):
        for width in WIDTHS:
            for name in ("off", "on"):
                widths.setdefault((name, width), []).append(forward_ms(models[name], width))
        print(f"round {round_ + 1}: forward ms off/on "
              + ", ".join(f"W{w} {widths[('off', w)][-1]:.1f}/{widths[('on', w)][-1]:.1f}" for w in WIDTHS),
              flush=True)
        for batch, batches in shapes.items():
            for what in ("plain", "prompt lookup"):
                outputs = {}
                for name in ("off", "on"):
                    rate, outputs[name] = decode(decoders[name][what], batches, args.max_new_tokens,
                                                 what != "plain", pad)
                    rates.setdefault((name, batch, what), []).append(rate)
                same = same and all(torch.equal(a, b) for a, b in zip(outputs["off"], outputs["on"]))
                print(f"round {round_ + 1}, batch {batch}, {what}: off {rates[('off', batch, what)][-1]:.1f}"
                      f" on {rates[('on', batch, what)][-1]:.1f} tok/s", flush=True)

    lines = [f"# CPU kernels on vs off: {TARGET}, float32, {torch.get_num_threads()} threads", "",
             f"`python benchmarks/cpu_kernels.py --requests {args.requests} --k {args.k} "
             f"--max-new-tokens {args.max_new_tokens} --rounds {args.rounds}`", "",
             f"On: {engine['packed_linear']} linear layers with packed weights for "
             f"rows {cpu_kernels.packed_rows(models['on']).text()} (timed on this CPU: {cpu_model()}), "
             f"grouped-query attention {'on' if engine['gqa_attention'] else 'off'}. "
             f"Interleaved, {args.rounds} rounds; greedy tokens of on and off "
             f"{'equal in every case' if same else 'DIFFER in at least one case'}.", "",
             "One target forward over W new positions after a 200-token context (best, ms):", "",
             "| W | off ms | on ms | off / on |", "|---|---|---|---|"]
    for width in WIDTHS:
        off, on = min(widths[("off", width)]), min(widths[("on", width)])
        lines.append(f"| {width} | {off:.1f} | {on:.1f} | {off / on:.2f} |")
    lines += ["", f"Decode-phase tokens/s ({len(prompts)} greedy json/code requests of the shipped "
              f"traffic, {args.max_new_tokens} new tokens, prompt lookup K = {args.k}; medians):", "",
              "| batch | contender | off tok/s | on tok/s | on / off |", "|---|---|---|---|---|"]
    for batch in shapes:
        for what in ("plain", "prompt lookup"):
            off = statistics.median(rates[("off", batch, what)])
            on = statistics.median(rates[("on", batch, what)])
            lines.append(f"| {batch} | {what} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
    report(lines, args.out)


if __name__ == "__main__":
    main()
