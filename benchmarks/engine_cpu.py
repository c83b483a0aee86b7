"""The decode engine on this CPU, on the embedded default: compiled forwards, and before/after.

1. compile: one static-cache forward of the decode widths (1 and K + 1 tokens) run eagerly and
   through torch.compile (inductor's C++ backend), interleaved, medians; with the seconds each
   width took to compile. This is the measurement behind compile="auto" (on CUDA only).
2. before/after: decode tokens/s of plain decoding, prompt lookup (K = --k-lookup) and LayerSkip
   (K = --k-skip) on the built-in prompts, for two engines -- the CPU default (dynamic caches)
   and the CUDA path's stand-in (static caches, graphs replayed by rerunning them) -- with the
   code of --base (a git revision, checked out in a temporary worktree) and with this checkout.
   The two versions run in alternating subprocesses, --repeats times each; ratios are after /
   before. Greedy outputs must be equal across versions (the script checks).

    python benchmarks/engine_cpu.py [--base 5a6ee09] [--repeats 3] [--max-new-tokens 64] [--write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "engine_cpu.md"
CONTENDERS = ("plain", "prompt_lookup", "layer_skip")
ENGINES = {"dynamic (CPU default)": {"static_cache": False},
           "static + graph stand-in": {"static_cache": True, "cuda_graphs": True}}


def compile_trial(model, widths, context_len: int, repeats: int) -> list[dict]:
    """Per width: eager and compiled forward medians (interleaved) and the compile seconds."""
    import torch

    from specdec_core.profile import _TimedCache

    vocab = model.get_output_embeddings().weight.shape[0]
    caches = {mode: _TimedCache(model, context_len, 1, torch.Generator().manual_seed(0), vocab,
                                static=True, max_width=max(widths), cuda_graphs=False,
                                compile=mode == "compiled")
              for mode in ("eager", "compiled")}
    compile_s = {}
    for width in widths:                    # the first compiled forward of a width compiles it
        start = time.perf_counter()
        caches["compiled"].time(width)
        compile_s[width] = time.perf_counter() - start
    times = {(mode, w): [] for mode in caches for w in widths}
    for _ in range(repeats + 1):
        for width in widths:
            for mode, cache in caches.items():
                times[mode, width].append(cache.time(width))
    rows = []
    for width in widths:
        eager = statistics.median(times["eager", width][1:])
        compiled = statistics.median(times["compiled", width][1:])
        rows.append({"width": width, "eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3,
                     "speedup": eager / compiled, "compile_s": compile_s[width]})
    return rows


def worker(args) -> None:
    """One version's pass over every engine, contender and prompt: JSON on stdout."""
    import torch

    from specdec_core import LayerSkip, PromptLookup, SpecDecoder, load_model
    from tasks.cli.prompts import builtin_prompts, encode

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer = load_model(args.model, device="cpu")
    prompts = [p for p in builtin_prompts() if not args.domains or p.domain in args.domains.split(",")]
    eos = tokenizer.eos_token_id
    out = {}
    for engine, options in ENGINES.items():
        decoders = {
            "plain": SpecDecoder(model, None, tokenizer=tokenizer, phase_timing=False, **options),
            "prompt_lookup": SpecDecoder(model, PromptLookup(max_ngram=3), k=args.k_lookup,
                                         tokenizer=tokenizer, phase_timing=False, **options),
            "layer_skip": SpecDecoder(model, LayerSkip(model, num_layers=args.skip_layers),
                                      k=args.k_skip, tokenizer=tokenizer, phase_timing=False, **options),
        }
        warm_ids, warm_mask = encode(tokenizer, [prompts[0].text])
        for name, decoder in decoders.items():        # warm-up: captures, first-call paths
            run = decoder.generate if name != "plain" else decoder.generate_plain
            run(warm_ids, args.max_new_tokens, attention_mask=warm_mask, eos_token_id=eos)
        for name in CONTENDERS:
            out[f"{engine}|{name}"] = {"tokens": 0, "decode_s": 0.0, "outputs": []}
        for prompt in prompts:
            ids, mask = encode(tokenizer, [prompt.text])
            for name, decoder in decoders.items():
                run = decoder.generate if name != "plain" else decoder.generate_plain
                result = run(ids, args.max_new_tokens, attention_mask=mask, eos_token_id=eos)
                entry = out[f"{engine}|{name}"]
                n = result.num_tokens[0]
                entry["tokens"] += n
                entry["decode_s"] += result.stats.total_s - result.stats.prefill_s
                entry["outputs"].append(result.tokens[0, :n].tolist())
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--base", default="5a6ee09", help="the revision to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k-lookup", type=int, default=8)
    parser.add_argument("--k-skip", type=int, default=2)
    parser.add_argument("--skip-layers", type=int, default=8)
    parser.add_argument("--domains", default="json,code,summarize,chat")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile-repeats", type=int, default=20)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(REPO)}")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    lines = [f"# The decode engine on this CPU ({dt.date.today()}, {args.model})", ""]
    if not args.skip_compile:
        sys.path.insert(0, str(REPO))
        from specdec_core import load_model

        model, _ = load_model(args.model, device="cpu")
        rows = compile_trial(model, [1, args.k_lookup + 1], context_len=256,
                             repeats=args.compile_repeats)
        del model
        lines += ["## 1. Compiled forwards (static cache, batch 1, 256 tokens of context)", "",
                  "| width | eager ms | compiled ms | eager / compiled | compile s |", "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['width']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                         f"{r['speedup']:.2f} | {r['compile_s']:.0f} |")
            print(f"width {r['width']}: eager {r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms "
                  f"({r['speedup']:.2f}x), compiled in {r['compile_s']:.0f} s", flush=True)
        lines.append("")

    passthrough = ["--model", args.model, "--max-new-tokens", str(args.max_new_tokens),
                   "--k-lookup", str(args.k_lookup), "--k-skip", str(args.k_skip),
                   "--skip-layers", str(args.skip_layers), "--domains", args.domains]
    if args.threads:
        passthrough += ["--threads", str(args.threads)]
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), args.base],
                       check=True, capture_output=True)
        try:
            trees = {"before": base_tree, "after": REPO}
            totals = {version: {} for version in trees}
            outputs = {}
            for repeat in range(args.repeats):
                for version, tree in trees.items():          # alternating: drift hits both
                    home = Path(os.environ.get("SPECDEC_HOME", REPO / ".specdec")).resolve()
                    env = dict(os.environ, PYTHONPATH=str(tree), SPECDEC_HOME=str(home))
                    done = subprocess.run([sys.executable, str(tree / "benchmarks" / "engine_cpu.py"),
                                           "--worker", *passthrough] if version == "after" else
                                          [sys.executable, "-c", WORKER_SHIM, *passthrough],
                                          env=env, cwd=tree, check=True, capture_output=True, text=True)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    for key, entry in result.items():
                        total = totals[version].setdefault(key, {"tokens": 0, "decode_s": 0.0})
                        total["tokens"] += entry["tokens"]
                        total["decode_s"] += entry["decode_s"]
                        outputs.setdefault(key, {})[version] = entry["outputs"]
                    print(f"repeat {repeat + 1}/{args.repeats}: {version} done", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                           check=False, capture_output=True)
    mismatched = [key for key, pair in outputs.items() if pair["before"] != pair["after"]]
    lines += [f"## 2. Decode tokens/s, before ({args.base}) and after (this checkout)", "",
              f"Built-in prompts of {args.domains}, batch 1, greedy, max_new_tokens {args.max_new_tokens}, "
              f"EOS on; prompt lookup K = {args.k_lookup}, LayerSkip({args.skip_layers}) K = {args.k_skip}; "
              f"{args.repeats} alternating runs of each version. Decode phase only (prefill excluded).", "",
              "| engine | contender | before tok/s | after tok/s | after / before |", "|---|---|---|---|---|"]
    for key in totals["after"]:
        engine, name = key.split("|")
        before = totals["before"][key]["tokens"] / totals["before"][key]["decode_s"]
        after = totals["after"][key]["tokens"] / totals["after"][key]["decode_s"]
        lines.append(f"| {engine} | {name} | {before:.1f} | {after:.1f} | {after / before:.2f} |")
        print(f"{engine:>26} {name:>14}: before {before:7.1f} tok/s, after {after:7.1f} tok/s "
              f"({after / before:.2f}x)")
    lines += ["", "Greedy outputs equal before and after: "
              + ("yes, every prompt" if not mismatched else f"NO: {mismatched}"), ""]
    print("\n".join(lines[-2:]))
    if args.write:
        RESULTS.write_text("\n".join(lines))
        print(f"wrote {RESULTS}")


# the base revision has no worker mode: this runs the worker of this file inside the base tree
WORKER_SHIM = (
    "import sys, runpy; sys.argv = ['engine_cpu', '--worker'] + sys.argv[1:]; "
    f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')")


if __name__ == "__main__":
    main()
