"""CPU decoding benchmark on the embedded default: ours vs transformers, plain and speculative.

Contenders, interleaved prompt by prompt (so drift of the machine hits all alike), batch 1, greedy,
the same max_new_tokens and EOS for all (greedy outputs are identical, so every contender emits
the same tokens; the script checks that):
  hf_generate       transformers model.generate(do_sample=False)
  plain             SpecDecoder.generate_plain (our baseline)
  prompt_lookup     SpecDecoder + PromptLookup, k = --k-lookup
  hf_prompt_lookup  transformers generate(prompt_lookup_num_tokens = --k-lookup)
  layer_skip        SpecDecoder + LayerSkip(num_layers = --skip-layers), k = --k-skip
Prints per domain: end-to-end tokens/s of each, ratios (ours plain / hf_generate, each drafter /
our plain, prompt_lookup / hf_prompt_lookup), acceptance figures, and writes the tables as
Markdown to benchmarks/results/decode_cpu.md.

    python benchmarks/decode_cpu.py [--max-new-tokens 96] [--repeats 1] [--domains json,summarize]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_core import LayerSkip, PromptLookup, SpecDecoder, load_model
from specdec_core.profile import calibrate_verify_widths
from tasks.cli.prompts import builtin_prompts, encode

RESULTS = Path(__file__).parent / "results" / "decode_cpu.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--k-lookup", type=int, default=8)
    parser.add_argument("--k-skip", type=int, default=2)
    parser.add_argument("--skip-layers", type=int, default=8)
    parser.add_argument("--domains", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-calibrate", action="store_true",
                        help="do not pad verify passes to the cheapest measured width")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, device="cpu")
    prompts = builtin_prompts()
    if args.domains:
        prompts = [p for p in prompts if p.domain in args.domains.split(",")]
    eos = tokenizer.eos_token_id
    new = args.max_new_tokens
    widths = None
    if not args.no_calibrate:
        # verify passes over some widths are cheaper than over fewer tokens on CPU: measure once
        widths = calibrate_verify_widths(model, max(args.k_lookup, args.k_skip) + 1)
    plain = SpecDecoder(model, None, tokenizer=tokenizer)
    lookup = SpecDecoder(model, PromptLookup(max_ngram=3), k=args.k_lookup, tokenizer=tokenizer,
                         verify_widths=widths)
    skip = SpecDecoder(model, LayerSkip(model, num_layers=args.skip_layers), k=args.k_skip,
                       tokenizer=tokenizer, verify_widths=widths)

    def ours(decoder, speculative):
        def run(ids, mask):
            fn = decoder.generate if speculative else decoder.generate_plain
            res = fn(ids, new, attention_mask=mask, eos_token_id=eos)
            return res.tokens[0, : res.num_tokens[0]], res.stats
        return run

    def hf(**extra):
        def run(ids, mask):
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                     eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                     max_length=None, **extra)[0, ids.shape[1]:]
            stop = (out == eos).nonzero()
            return (out[: int(stop[0]) + 1] if stop.numel() else out), None
        return run

    contenders = {
        "hf_generate": hf(),
        "plain": ours(plain, False),
        "prompt_lookup": ours(lookup, True),
        "hf_prompt_lookup": hf(prompt_lookup_num_tokens=args.k_lookup),
        "layer_skip": ours(skip, True),
    }
    seconds = defaultdict(float)      # (contender, domain) -> wall seconds
    decode_seconds = defaultdict(float)  # (contender, domain) -> decode-phase seconds
    hf_decode: list = []
    tokens = defaultdict(int)
    stats = {}
    mismatches = []
    warm_ids, warm_mask = encode(tokenizer, [prompts[0].text])
    for run in contenders.values():   # warm-up (allocator, first-call paths), not timed
        run(warm_ids, warm_mask)
    bar = tqdm(total=len(prompts) * len(contenders) * args.repeats, desc="decode_cpu")
    for _ in range(args.repeats):
        for prompt in prompts:
            ids, mask = encode(tokenizer, [prompt.text])
            reference = None
            prefill_s = None
            for name, run in contenders.items():
                t0 = time.perf_counter()
                out, st = run(ids, mask)
                elapsed = time.perf_counter() - t0
                if name == "plain":
                    prefill_s = st.prefill_s
                # decode phase: ours from its stats; transformers' = wall time - the same prefill
                decode_s = st.decode_s if st is not None else None
                if reference is None:
                    reference = out
                elif not torch.equal(out, reference):
                    mismatches.append((prompt.id, name))
                if st is None:
                    hf_decode.append((name, prompt.domain, elapsed))
                for domain in (prompt.domain, "all"):
                    seconds[name, domain] += elapsed
                    tokens[name, domain] += len(out)
                    if st is not None:
                        decode_seconds[name, domain] += decode_s
                    if st is not None:
                        stats[name, domain] = stats[name, domain].merge(st) if (name, domain) in stats else st
                bar.update(1)
            for name, domain, elapsed in hf_decode:
                for key in ((name, domain), (name, "all")):
                    decode_seconds[key] += max(elapsed - prefill_s, 1e-9)
            hf_decode.clear()
    bar.close()

    domains = list(dict.fromkeys(p.domain for p in prompts)) + ["all"]
    prompts_per = {d: sum(p.domain == d for p in prompts) for d in domains[:-1]}
    prompts_per["all"] = len(prompts)
    tps = {key: tokens[key] / seconds[key] for key in seconds}
    # decode phase: tokens after the first (prefill) one, per decode second
    dps = {key: (tokens[key] - prompts_per[key[1]] * args.repeats) / decode_seconds[key]
           for key in decode_seconds}
    header = ("| domain | hf_generate tok/s | plain tok/s | plain / hf_generate | prompt_lookup / plain "
              "| hf_prompt_lookup / plain | prompt_lookup / hf_prompt_lookup | layer_skip / plain "
              "| prompt_lookup accept. rate, tokens/round | layer_skip accept. rate, tokens/round |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for d in domains:
        pl, ls = stats.get(("prompt_lookup", d)), stats.get(("layer_skip", d))
        lines.append(
            f"| {d} | {tps['hf_generate', d]:.1f} | {tps['plain', d]:.1f} "
            f"| {tps['plain', d] / tps['hf_generate', d]:.2f}x "
            f"| {tps['prompt_lookup', d] / tps['plain', d]:.2f}x "
            f"| {tps['hf_prompt_lookup', d] / tps['plain', d]:.2f}x "
            f"| {tps['prompt_lookup', d] / tps['hf_prompt_lookup', d]:.2f}x "
            f"| {tps['layer_skip', d] / tps['plain', d]:.2f}x "
            f"| {pl.acceptance_rate:.2f}, {pl.mean_accepted_length:.2f} "
            f"| {ls.acceptance_rate:.2f}, {ls.mean_accepted_length:.2f} |")
    table = "\n".join(lines)
    dheader = ("| domain | plain decode tok/s | plain / hf_generate | prompt_lookup / plain "
               "| hf_prompt_lookup / plain | prompt_lookup / hf_prompt_lookup | layer_skip / plain |")
    dlines = [dheader, "|" + "---|" * (dheader.count("|") - 1)]
    for d in domains:
        dlines.append(
            f"| {d} | {dps['plain', d]:.1f} | {dps['plain', d] / dps['hf_generate', d]:.2f}x "
            f"| {dps['prompt_lookup', d] / dps['plain', d]:.2f}x "
            f"| {dps['hf_prompt_lookup', d] / dps['plain', d]:.2f}x "
            f"| {dps['prompt_lookup', d] / dps['hf_prompt_lookup', d]:.2f}x "
            f"| {dps['layer_skip', d] / dps['plain', d]:.2f}x |")
    decode_table = "\n".join(dlines)
    meta = (f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, model {args.model} fp32, "
            f"batch 1, greedy, max_new_tokens {new}, EOS on, {len(prompts)} prompts x {args.repeats}, "
            f"prompt_lookup k={args.k_lookup} (max_ngram 3, min_ngram 2), hf prompt_lookup_num_tokens="
            f"{args.k_lookup}, layer_skip {args.skip_layers} layers k={args.k_skip}. Tokens/s are "
            "end to end (prefill included) over identical outputs.")
    note = ("All contenders produced identical tokens." if not mismatches else
            f"Outputs differed from hf_generate for {mismatches} (fp32 near-ties).")
    calib = f"Verify widths run (needed -> run): {widths}." if widths else "No verify-width padding."
    text = (f"# decode_cpu\n\n{meta}\n\n## Decode phase (tokens after the first, per second after "
            f"the prefill; transformers' decode time = its wall time - our prefill of the same "
            f"prompt)\n\n{decode_table}\n\n## End to end (prefill included)\n\n{table}\n\n{note} "
            f"{calib}\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
