"""Our engine against vLLM's CPU build: the same model, the same requests, this CPU, ratios taken in
one run.

    python benchmarks/vs_vllm.py [--requests 8] [--k 4] [--max-new-tokens 64] [--rounds 2]
                                 [--out benchmarks/results/vs_vllm.md]

Contenders: plain decoding, and n-gram speculation at K with the same proposals (our
PromptLookup with vLLM's ngram rule, min/max n = 1/3, against vLLM's `ngram`), each at batch 1
(the requests one at a time) and batch 8 (the requests sent at once: vLLM batches them itself;
ours decodes them as one left-padded batch). Greedy, every request decodes exactly
--max-new-tokens tokens (vLLM: ignore_eos; ours: no end token). Requests: the first greedy rows
of the shipped traffic's json and code domains, their logged prompts.

Interleaved: each round runs vLLM plain, ours plain, vLLM ngram, ours ngram (vLLM in its own
process per engine, from the serving environment: `make serving-env`); figures are medians over
rounds. Decode phase: vLLM from its engine-core timestamps (the batch's last first token to its
last token), ours from the decoder's own stats (everything after the prefill); end to end: wall
time of the whole call, prefill included. Where ours is slower, the table of our decoder's own
phases (draft, verify, other) says where its time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from eagle3_train import shipped_requests  # noqa: E402
from specdec_core import SamplingParams, SpecDecoder, cpu_kernels, load_model  # noqa: E402
from specdec_core.drafters import PromptLookup  # noqa: E402
from tasks.serving import environment as serving_env  # noqa: E402
from tasks.settings import load_settings  # noqa: E402
from tasks.steps.costs.costs import cpu_model  # noqa: E402

TARGET = "smollm2-135m-instruct"


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def ours(decoder: SpecDecoder, batches: list, new_tokens: int, speculative: bool, pad: int) -> dict:
    """Our engine over the batches: {decode tok/s, end-to-end tok/s, phase seconds}."""
    decode_tokens = tokens = 0
    decode_s = wall_s = draft_s = verify_s = 0.0
    for batch in batches:
        ids, mask = left_padded(batch, pad)
        run = decoder.generate if speculative else decoder.generate_plain
        result = run(ids, max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0), seed=0,
                     attention_mask=mask, eos_token_id=None)
        stats = result.stats
        made = int(sum(result.num_tokens))
        tokens += made
        decode_tokens += made - len(batch)
        decode_s += stats.decode_s
        wall_s += stats.total_s
        draft_s += stats.draft_s
        verify_s += stats.verify_s
    return {"decode": decode_tokens / decode_s, "e2e": tokens / wall_s, "decode_s": decode_s,
            "draft_s": draft_s, "verify_s": verify_s}


def vllm(batches: list, new_tokens: int, spec: dict | None, model_dir: Path, log: Path) -> dict:
    answer = serving_env.run_engine(
        {"model": str(model_dir), "speculative_config": spec, "batches": batches,
         "max_tokens": new_tokens, "repeats": 1, "dtype": "float32"},
        log, 900, f"vs_vllm {'ngram' if spec else 'plain'}", load_settings(), command="time-steps")
    if answer.get("refused"):
        raise SystemExit(f"vLLM refused {spec}: {answer['refused']}")
    rows = answer["timings"]
    return {"decode": sum(r["decode_tokens"] for r in rows) / sum(r["decode_s"] for r in rows),
            "e2e": sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows),
            "version": answer["vllm"], "mends": answer.get("mends") or []}


def report(lines: list[str], out: str | None) -> None:
    """Print a benchmark's markdown lines, and write them to `out` where given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)


def arguments(description: str, rounds: int) -> argparse.Namespace:
    """The decode benchmarks' command line: --requests, --k, --max-new-tokens, --rounds, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__.splitlines()[0], rounds=2)
    model, tokenizer = load_model(TARGET, device="cpu")
    model_dir = serving_env.served_model_dir(TARGET)
    picked = [r for r in shipped_requests() if r.domain in ("json", "code") and r.sampling.greedy]
    prompts = [list(r.prompt_ids) for r in picked[:args.requests]]
    shapes = {1: [[p] for p in prompts], 8: [prompts[i:i + 8] for i in range(0, len(prompts), 8)]}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    plain = SpecDecoder(model, None, k=args.k, tokenizer=tokenizer)
    ngram = SpecDecoder(model, PromptLookup(max_ngram=3, min_ngram=1), k=args.k, tokenizer=tokenizer)
    vllm_ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 1}
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for batch, batches in shapes.items():
                for name, run in (("vLLM plain", lambda: vllm(batches, args.max_new_tokens, None, model_dir,
                                                              Path(tmp) / f"plain{round_}-{batch}.log")),
                                  ("ours plain", lambda: ours(plain, batches, args.max_new_tokens, False, pad)),
                                  ("vLLM ngram", lambda: vllm(batches, args.max_new_tokens, vllm_ngram,
                                                              model_dir, Path(tmp) / f"ngram{round_}-{batch}.log")),
                                  ("ours ngram", lambda: ours(ngram, batches, args.max_new_tokens, True, pad))):
                    result = run()
                    figures.setdefault((name, batch), []).append(result)
                    print(f"round {round_ + 1}, batch {batch}, {name}: decode {result['decode']:.1f} tok/s, "
                          f"end to end {result['e2e']:.1f} tok/s", flush=True)
    version = figures[("vLLM plain", 1)][0]["version"]
    kernels = plain.engine()["cpu_kernels"]
    plan = cpu_kernels.packed_rows(model)

    def median(name, batch, key):
        return statistics.median(r[key] for r in figures[(name, batch)])

    lines = [f"# Our engine vs vLLM {version} (CPU build) on this CPU: {TARGET}", "",
             f"`python benchmarks/vs_vllm.py --requests {args.requests} --k {args.k} "
             f"--max-new-tokens {args.max_new_tokens} --rounds {args.rounds}`", "",
             f"{len(prompts)} greedy json/code requests of the shipped traffic, {args.max_new_tokens} new "
             f"tokens each, n-gram K = {args.k} (min/max n 1/3, the same proposals), CPU {cpu_model()}, "
             f"{torch.get_num_threads()} threads; medians over "
             f"{args.rounds} interleaved rounds. Our engine's CPU kernels: "
             f"{kernels['packed_linear']} linear layers routed by rows ({plan.text()}; timed on this "
             f"CPU), grouped-query attention "
             f"{'on' if kernels['gqa_attention'] else 'off'} (specdec_core.cpu_kernels).", "",
             "| batch | contender | decode tok/s ours | decode tok/s vLLM | ours / vLLM (decode) | "
             "end-to-end tok/s ours | end-to-end tok/s vLLM | ours / vLLM (end to end) |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in shapes:
        for what in ("plain", "ngram"):
            o_d, v_d = median(f"ours {what}", batch, "decode"), median(f"vLLM {what}", batch, "decode")
            o_e, v_e = median(f"ours {what}", batch, "e2e"), median(f"vLLM {what}", batch, "e2e")
            lines.append(f"| {batch} | {what} | {o_d:.1f} | {v_d:.1f} | {o_d / v_d:.2f} | {o_e:.1f} | "
                         f"{v_e:.1f} | {o_e / v_e:.2f} |")
    lines += ["", "Where our decode time goes (seconds over all requests, median round):", "",
              "| batch | contender | decode s | draft s | verify s | other s |", "|---|---|---|---|---|---|"]
    for batch in shapes:
        for what in ("plain", "ngram"):
            d = median(f"ours {what}", batch, "decode_s")
            dr = median(f"ours {what}", batch, "draft_s")
            ve = median(f"ours {what}", batch, "verify_s")
            lines.append(f"| {batch} | {what} | {d:.2f} | {dr:.2f} | {ve:.2f} | {max(d - dr - ve, 0):.2f} |")
    mends = sorted({m for rows in figures.values() for r in rows for m in r.get("mends", [])})
    if mends:
        lines += ["", f"vLLM ran with {len(mends)} mend(s) of its CPU sampler (no effect on greedy requests)."]
    report(lines, args.out)


if __name__ == "__main__":
    main()
