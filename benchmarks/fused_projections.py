"""Fused projections (specdec_core/fused_projections.py) against the same model unfused: matrix
products per step, plain decoding tokens/s and cached forward milliseconds at a few widths
(a step and verify passes), contenders interleaved, one run, one machine.

The target is a random-weight model of a real architecture (gpu_decode.py's shapes and builder;
the cost does not depend on the weights), copied before fusing so that both contenders hold the
same weights. Both run the engine's static caches (CUDA graphs at the engine's default: on CUDA,
off on a CPU), compile off, the CPU kernels at their default (on a CPU they pack the linears left
unfused: o, down and the output projection fused, all seven unfused). Greedy tokens are compared.

    python benchmarks/fused_projections.py [--device cuda] [--shape llama-3.2-1b] [--repeats 5]
    python benchmarks/fused_projections.py --smoke      # a tiny model, seconds on a CPU

Prints a Markdown table (ratios unfused / fused: above 1, fusing pays); --out and --json write it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_decode  # noqa: E402  -- the model shapes, builder, timing and table helpers
from specdec_core import SpecDecoder  # noqa: E402
from specdec_core.profile import measure_forward_costs  # noqa: E402

CONTENDERS = ("fused", "unfused")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(gpu_decode.TARGET_SHAPES))
    parser.add_argument("--new", type=int, default=32, help="new tokens per plain decode call")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--widths", default="1,5,9", help="cached forward widths (a step, verify passes)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before a timed forward")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per contender")
    parser.add_argument("--smoke", action="store_true", help="the tiny test model, few tokens (tests)")
    parser.add_argument("--out", type=Path, help="the table as Markdown")
    parser.add_argument("--json", type=Path, help="the figures as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.new, args.prompt, args.context, args.repeats = "cpu", 8, 8, 32, 2
    return args


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products (aten linear, mm, addmm and the CPU kernels' packed oneDNN linear)
    that reach the kernels."""

    KINDS = ("aten::linear", "aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket._qualified_op_name in self.KINDS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def products_per_step(model: torch.nn.Module, device: torch.device) -> int:
    """Matrix products of one single-token forward after a prompt (a decode step)."""
    ids = torch.arange(3, 11, device=device)[None]
    with torch.inference_mode():
        past = model(ids, use_cache=True).past_key_values
        with MatrixProducts() as products:
            model(ids[:, -1:], past_key_values=past, use_cache=True)
    return products.count


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda"
                                                           else torch.float32)
    shape = gpu_decode.TARGET_SMOKE if args.smoke else gpu_decode.TARGET_SHAPES[args.shape]
    widths = [int(w) for w in args.widths.split(",")]
    started = time.perf_counter()
    models = {"fused": gpu_decode.build_model(shape, device, dtype, seed=0)}
    usable = gpu_decode.sharpen_greedy(models["fused"], seed=0)
    models["unfused"] = copy.deepcopy(models["fused"])
    decoders = {name: SpecDecoder(models[name], None, static_cache=True, compile=False,
                                  phase_timing=False, fuse_projections=name == "fused")
                for name in CONTENDERS}
    engines = {name: decoders[name].engine() for name in CONTENDERS}
    ids = torch.randint(0, usable, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    products = {name: products_per_step(models[name], device) for name in CONTENDERS}
    runs = {name: (lambda d=decoders[name]: d.generate_plain(ids, args.new)) for name in CONTENDERS}
    samples = gpu_decode.interleave(runs, args.repeats, device, "plain decoding", warmup=2)
    tokens = {name: samples[name][-1][1].tokens for name in CONTENDERS}
    decode_s = {name: statistics.median(s for s, _ in samples[name]) for name in CONTENDERS}
    forward_s: dict[str, dict[int, list[float]]] = {name: {w: [] for w in widths} for name in CONTENDERS}
    for repeat in range(args.repeats):
        for name in (CONTENDERS if repeat % 2 == 0 else CONTENDERS[::-1]):
            costs = measure_forward_costs(models[name], widths, context_len=args.context, repeats=1,
                                          static=True, compile=False, fuse_projections=False)
            for width, seconds in costs.items():
                forward_s[name][width].append(seconds)
    forward_ms = {name: {w: 1e3 * statistics.median(v) for w, v in per.items()}
                  for name, per in forward_s.items()}
    raw = {
        "device": gpu_decode.device_name(device), "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "shape": "smoke" if args.smoke else args.shape,
        "target": gpu_decode.shape_label(shape), "new_tokens": args.new, "repeats": args.repeats,
        "context": args.context, "engines": engines, "products_per_step": products,
        "tokens_per_s": {name: args.new / decode_s[name] for name in CONTENDERS},
        "forward_ms": forward_ms,
        "same_tokens": bool(torch.equal(tokens["fused"].cpu(), tokens["unfused"].cpu())),
        "run_s": time.perf_counter() - started,
    }
    text = render(raw)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=2))
    return raw


def render(raw: dict) -> str:
    fused, unfused = "fused", "unfused"
    rows = [["matrix products per decode step", raw["products_per_step"][fused],
             raw["products_per_step"][unfused],
             f"{raw['products_per_step'][unfused] / raw['products_per_step'][fused]:.2f}"],
            [f"plain decoding, tokens/s ({raw['new_tokens']} new)", f"{raw['tokens_per_s'][fused]:.1f}",
             f"{raw['tokens_per_s'][unfused]:.1f}",
             f"{raw['tokens_per_s'][fused] / raw['tokens_per_s'][unfused]:.2f}"]]
    for width in raw["forward_ms"][fused]:
        f_ms, u_ms = raw["forward_ms"][fused][width], raw["forward_ms"][unfused][width]
        rows.append([f"cached forward over {width} token{'s' * (width != 1)}, ms "
                     f"(after {raw['context']})", f"{f_ms:.2f}", f"{u_ms:.2f}", f"{u_ms / f_ms:.2f}"])
    kernels = raw["engines"][fused]["cpu_kernels"]["packed_linear"], raw["engines"][unfused]["cpu_kernels"]["packed_linear"]
    return "\n".join([
        f"# Fused projections: {raw['device']}", "",
        f"torch {raw['torch']}; {raw['dtype']}; target {raw['target']} (random weights); batch 1; "
        f"static caches, CUDA graphs {'on' if raw['engines'][fused]['cuda_graphs'] else 'off'}, "
        f"compile off; CPU kernels' packed linears: {kernels[0]} fused, {kernels[1]} unfused; medians "
        f"of {raw['repeats']} interleaved calls; greedy tokens equal: {raw['same_tokens']}; "
        f"run {raw['run_s']:.0f} s.", "",
        gpu_decode.table(["", "fused", "unfused", "unfused / fused cost"], rows), "",
        "The last column is the ratio of costs (tokens/s: fused over unfused): above 1, fusing pays.",
        ""])


if __name__ == "__main__":
    main()
