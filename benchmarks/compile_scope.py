"""What the compile scope costs and saves: "model" (the whole forward compiled, the default) against
"layer" (one decoder layer compiled and shared by every layer; specdec_core/layer_compile.py).

On the embedded default's architecture (random weights; benchmarks/gpu_decode.py's smollm2-135m
shape) and a static cache of batch 1:
- compile: each scope in a fresh process with torch.compile's caches off (a cold compile, as
  on a new GPU machine), the seconds of the first step (width 1) and the first verify (width 4),
  then a verify of width 6 (served by the same body: no new compile); `--repeats` processes per
  scope, the scopes alternating;
- steady: both scopes' caches in one process, a step and a verify of width 4 timed alternately
  (contenders interleaved), median milliseconds, and the largest logit difference against the
  same forwards run eagerly.
- profile (`--profile`): the cost measurement `specdec profile measure` makes (CostSampler: the
  target's step and verify widths up to K 8 and a layer-skip draft's step, at batch sizes 1, 2, 4
  and 8, plus prompt lookup), static caches and compile forced on as on CUDA, in a fresh process
  per scope with torch.compile's caches off: the seconds of its warm-up pass and first timed pass
  (where the compiling happens), the bodies compiled and their seconds. On a CPU it stands in for
  `profile measure --device cuda` (its 150 s goal), whose compiling took most of its time.

The report (Markdown and JSON) is written again after every cold process, so a run stopped by a
time limit keeps the processes that ended. `--scopes layer,model` sets the order of the cold
processes (the device script runs the layer scope first), `--cold-only` leaves out the steady part
(the device script's decode and decode_layer steps time both scopes' forwards), `--backend eager`
traces the bodies without generating code (tests).

    python benchmarks/compile_scope.py [--device cuda] [--repeats 2] [--out FILE.md] [--json FILE]
    python benchmarks/compile_scope.py --profile [--device cuda] [--repeats 1]
    python benchmarks/compile_scope.py --smoke [--profile]      # tiny shape, for tests
    python benchmarks/compile_scope.py --scopes layer,model --cold-only --device cuda
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCOPES = ("model", "layer")
RESULTS = Path(__file__).parent / "results" / "compile_scope_cpu.md"
PROFILE_RESULTS = Path(__file__).parent / "results" / "compile_scope_profile_cpu.md"
PROFILE_SIZES, PROFILE_K = (1, 2, 4, 8), 8
SMOKE_SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2)


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import gpu_decode

    shape = SMOKE_SHAPE if args.smoke else gpu_decode.TARGET_SHAPES["smollm2-135m"]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return LlamaForCausalLM(LlamaConfig(**shape)).eval().to(args.device, dtype)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def prefilled(model, args, compile_on: bool):
    import torch

    from specdec_core.static_cache import StaticSequenceCache

    cache = StaticSequenceCache(model, batch=1, max_len=256, compile=compile_on)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (1, 32), generator=generator).to(args.device)
    cache.forward(prompt, graphed=False)
    return cache


def tokens(model, width: int, args):
    import torch

    generator = torch.Generator().manual_seed(width)
    return torch.randint(3, model.config.vocab_size, (1, width), generator=generator).to(args.device)


def compile_child(args) -> dict:
    """In a fresh process (SPECDEC_COMPILE_SCOPE set by the parent): the first forwards' seconds."""
    import torch

    from specdec_core import static_cache

    model = build(args)
    cache = prefilled(model, args, compile_on=True)
    seconds = {}
    with torch.inference_mode():
        for width in (1, 4, 6):
            sync(args.device)
            started = time.perf_counter()
            cache.forward(tokens(model, width, args))
            sync(args.device)
            seconds[str(width)] = time.perf_counter() - started
            cache.rollback_to(cache.count.clone() - width, width=cache.width - width)
    return {"scope": static_cache.compile_scope(), "seconds": seconds,
            "bodies": static_cache.COMPILES["bodies"], "compile_s": static_cache.COMPILES["seconds"]}


def profile_child(args) -> dict:
    """In a fresh process: the cost measurement's warm-up pass and first timed pass."""
    from specdec_core import static_cache
    from specdec_core.drafters import LayerSkip, PromptLookup
    from specdec_core.profile import CostSampler

    model = build(args)
    drafters = {"prompt_lookup": PromptLookup(),
                "layer_skip": LayerSkip(model, num_layers=2 if args.smoke else 8)}
    sizes = (1, 2) if args.smoke else PROFILE_SIZES
    started = time.perf_counter()
    sampler = CostSampler(model, drafters, PROFILE_K, sizes, context_len=64 if args.smoke else 256,
                          static=True, cuda_graphs=False, compile=True)
    sampler.sample(1)                       # the warm-up pass, then one timed pass
    sync(args.device)
    return {"scope": static_cache.compile_scope(), "wall_s": time.perf_counter() - started,
            "bodies": static_cache.COMPILES["bodies"], "compile_s": static_cache.COMPILES["seconds"],
            "batch_sizes": list(sizes), "k_max": PROFILE_K}


def cold_runs(args, mode: str, on_child=None) -> list[dict]:
    """`--repeats` fresh processes per scope (alternating, in the order of `--scopes`), torch.compile's
    caches off; on_child(colds so far) after each process (the device script's limit may stop the
    run between two)."""
    child_args = ([sys.executable, __file__, mode, "--device", args.device, "--backend", args.backend]
                  + (["--smoke"] if args.smoke else []))
    colds = []
    for repeat in range(args.repeats):
        for scope in args.scopes:                       # alternating, e.g. layer, model, layer, model
            env = dict(os.environ, SPECDEC_COMPILE_SCOPE=scope, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
            done = subprocess.run(child_args, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"{mode} child ({scope}) exited {done.returncode}:\n"
                                   + done.stderr[-3000:])
            colds.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"[compile_scope] {mode[2:]} {repeat + 1}/{args.repeats}, {scope}: "
                  f"{colds[-1]['compile_s']:.1f} s compiling", flush=True)
            if on_child:
                on_child(colds)
    return colds


def median_line(colds: list[dict], key: str, lead: str = "Median") -> str:
    """"LEAD: model X s, layer Y s (Zx less)." over the scopes that ran (one alone: no ratio)."""
    medians = {scope: statistics.median(c[key] for c in colds if c["scope"] == scope)
               for scope in SCOPES if any(c["scope"] == scope for c in colds)}
    line = f"{lead}: " + ", ".join(f"{scope} {value:.1f} s" for scope, value in medians.items())
    if len(medians) == len(SCOPES):
        line += f" (**{medians['model'] / max(medians['layer'], 1e-9):.1f}x less**)"
    return line + "."


def profile_report(args, colds: list[dict]) -> str:
    first = colds[0]
    lines = [f"# Compile scope: the cost measurement's first passes ({args.device})", "",
             "`python benchmarks/compile_scope.py --profile" + (" --smoke" if args.smoke else "")
             + (f" --device {args.device}" if args.device != "cpu" else "") + "`: "
             + ("a tiny Llama" if args.smoke else "the embedded default's architecture (30 layers)")
             + f", random weights; CostSampler at batch sizes {first['batch_sizes']}, K up to "
             f"{first['k_max']}, prompt lookup and a layer-skip draft, static caches and compile "
             "forced on; cold (fresh processes, torch.compile's caches off).", "",
             "| scope | warm-up + first timed pass, s | bodies | compiling, s |", "|---|---|---|---|"]
    for cold in colds:
        lines.append(f"| {cold['scope']} | {cold['wall_s']:.1f} | {cold['bodies']} | "
                     f"{cold['compile_s']:.1f} |")
    lines += ["", median_line(colds, "wall_s")]
    return "\n".join(lines) + "\n"


def steady(args) -> dict:
    """Both scopes' caches in this process; forwards timed alternately. The engine's compile scope
    and backend (module settings) are as before when it returns: a test runs this in its process."""
    from specdec_core import static_cache

    saved = static_cache.COMPILE_SCOPE, static_cache.COMPILE_BACKEND
    static_cache.COMPILE_BACKEND = args.backend
    try:
        return timed_forwards(args)
    finally:
        static_cache.COMPILE_SCOPE, static_cache.COMPILE_BACKEND = saved


def timed_forwards(args) -> dict:
    import torch

    from specdec_core import static_cache

    model = build(args)
    models = {name: copy.deepcopy(model) for name in (*SCOPES, "eager")}   # a cache holds its model weakly
    caches = {}
    for scope in SCOPES:
        static_cache.COMPILE_SCOPE = scope
        caches[scope] = prefilled(models[scope], args, compile_on=True)
    caches["eager"] = prefilled(models["eager"], args, compile_on=False)
    times = {(name, width): [] for name in caches for width in (1, 4)}
    diffs = {scope: 0.0 for scope in SCOPES}
    with torch.inference_mode():
        for repeat in range(args.steps + 2):            # two warm-up rounds (they compile)
            for width in (1, 4):
                step = tokens(model, width, args)
                outs = {}
                for name, cache in caches.items():
                    sync(args.device)
                    started = time.perf_counter()
                    outs[name] = cache.forward(step).float()
                    sync(args.device)
                    if repeat >= 2:
                        times[name, width].append(time.perf_counter() - started)
                    cache.rollback_to(cache.count.clone() - width, width=cache.width - width)
                for scope in SCOPES:
                    diffs[scope] = max(diffs[scope], float((outs[scope] - outs["eager"]).abs().max()))
    return {"ms": {f"{name} w{width}": 1000 * statistics.median(values)
                   for (name, width), values in times.items()}, "max_logit_diff": diffs}


def cold_report(args, colds: list[dict]) -> list[str]:
    lines = [f"# Compile scope: whole forward vs one shared decoder layer ({args.device})", "",
             "`python benchmarks/compile_scope.py" + (" --smoke" if args.smoke else "")
             + (f" --device {args.device}" if args.device != "cpu" else "")
             + (f" --scopes {','.join(args.scopes)}" if tuple(args.scopes) != SCOPES else "")
             + (" --cold-only" if args.cold_only else "")
             + (f" --backend {args.backend}" if args.backend != "inductor" else "") + "`: "
             + ("a tiny Llama" if args.smoke else "the embedded default's architecture (30 layers)")
             + ", random weights, batch 1, cold compiles (fresh processes, caches off).", "",
             "| scope | first step s | first verify (4) s | verify 6 s | bodies | compile s |",
             "|---|---|---|---|---|---|"]
    for cold in colds:
        s = cold["seconds"]
        lines.append(f"| {cold['scope']} | {s['1']:.2f} | {s['4']:.2f} | {s['6']:.2f} | "
                     f"{cold['bodies']} | {cold['compile_s']:.1f} |")
    return lines + ["", median_line(colds, "compile_s", "Cold compile, median")]


def steady_lines(warm: dict) -> list[str]:
    ms = warm["ms"]
    lines = ["", "| forward | eager ms | model ms | layer ms | layer / model |", "|---|---|---|---|---|"]
    for width in (1, 4):
        lines.append(f"| width {width} | {ms[f'eager w{width}']:.2f} | {ms[f'model w{width}']:.2f} | "
                     f"{ms[f'layer w{width}']:.2f} | {ms[f'layer w{width}'] / ms[f'model w{width}']:.2f} |")
    return lines + ["", "Largest logit difference against eager forwards: " + ", ".join(
        f"{scope} {diff:.1e}" for scope, diff in warm["max_logit_diff"].items()) + "."]


def write(args, text: str, report: dict, default_out: Path) -> None:
    out = args.out or (None if args.smoke else default_out)
    if out:
        out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=2, help="cold-compile processes per scope")
    parser.add_argument("--steps", type=int, default=20, help="timed forwards per contender and width")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape (tests)")
    parser.add_argument("--out", type=Path, default=None, help=f"Markdown (default {RESULTS})")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="the cost measurement's first passes per scope (profile measure's compile)")
    parser.add_argument("--scopes", type=scope_list, default=SCOPES,
                        help="the cold processes' scopes, in order (default model,layer)")
    parser.add_argument("--cold-only", action="store_true", help="no steady forwards, the cold compiles only")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile's backend for the bodies (eager: traced, no code generated)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child or args.profile_child:                # a fresh process of its own
        from specdec_core import static_cache

        static_cache.COMPILE_BACKEND = args.backend
        print(json.dumps(compile_child(args) if args.child else profile_child(args)))
        return 0
    if args.profile:
        def save_profile(colds):
            write(args, profile_report(args, colds),
                  {"device": args.device, "smoke": args.smoke, "cold": colds}, PROFILE_RESULTS)

        colds = cold_runs(args, "--profile-child", save_profile)
        print(profile_report(args, colds))
        return 0

    def save_cold(colds):
        write(args, "\n".join(cold_report(args, colds)) + "\n",
              {"device": args.device, "smoke": args.smoke, "cold": colds}, RESULTS)

    colds = cold_runs(args, "--child", save_cold)
    lines, report = cold_report(args, colds), {"device": args.device, "smoke": args.smoke, "cold": colds}
    if not args.cold_only:
        report["steady"] = steady(args)
        lines += steady_lines(report["steady"])
    text = "\n".join(lines) + "\n"
    print(text)
    write(args, text, report, RESULTS)
    return 0


def scope_list(text: str) -> tuple[str, ...]:
    scopes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [scope for scope in scopes if scope not in SCOPES]
    if not scopes or unknown:
        raise argparse.ArgumentTypeError(f"--scopes {text!r}: a comma-separated list of {', '.join(SCOPES)}")
    return scopes


if __name__ == "__main__":
    sys.exit(main())
