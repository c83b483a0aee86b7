"""One training step of an EAGLE-3 head, as benchmarks/eagle3_gpu.py trains it on the GPU: its
tensor operations and seconds, with the batch gathered from the packed target passes, the same
batch built a row at a time, and the gathered batch's forward and backward captured as graphs
(torch.cuda.make_graphed_callables; its CPU stand-in elsewhere) -- contenders interleaved, one
run, one machine.

The target is a random-weight model of the embedded default's architecture (the step's cost does
not depend on the weights), its passes cached once for `--rows` rows whose lengths are those of
the shipped traffic's requests (prompt + response, cut to --max-length); the head and its recipe
are eagle3_gpu.py's (draft vocabulary 8192, unroll 3, batch 48, AdamW). A step: loss, backward,
optimizer step, then a device synchronisation.

    python benchmarks/head_step.py [--device cuda] [--repeats 10] [--out head_step.md]
    python benchmarks/head_step.py --smoke      # a tiny target, a few seconds on a CPU

Prints a table; --out writes it as Markdown and --json the figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import eagle3_gpu  # noqa: E402  -- the GPU run's trainee (batched target passes)
import gpu_decode  # noqa: E402  -- the model shapes and builder
from specdec_core import SamplingParams  # noqa: E402
from specdec_core.eagle3 import Eagle3Head  # noqa: E402
from specdec_core.estimate import LoggedRequest  # noqa: E402
from specdec_core.train import TrainConfig, autocast, head_vocabulary  # noqa: E402

CONTENDERS = ("packed", "rowwise", "graphs")
LABELS = {"packed": "gathered from the packed rows", "rowwise": "a row at a time",
          "graphs": "gathered, forward and backward captured"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (as eagle3_gpu.py)")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(gpu_decode.TARGET_SHAPES))
    parser.add_argument("--rows", type=int, default=256, help="cached training rows")
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=160)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per contender")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"which steps to time, in this order (of {', '.join(CONTENDERS)})")
    parser.add_argument("--smoke", action="store_true", help="a tiny target and batch (tests)")
    parser.add_argument("--out", type=Path, help="the table as Markdown")
    parser.add_argument("--json", type=Path, help="the figures as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.batch, args.max_length, args.vocab = 16, 4, 24, 64
        args.repeats = min(args.repeats, 3)
    args.device = torch.device(args.device)
    args.contenders = [name.strip() for name in args.contenders.split(",") if name.strip()]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown or not args.contenders:
        parser.error(f"--contenders {','.join(unknown) or '(none)'}: choose from {', '.join(CONTENDERS)}")
    return args


def row_lengths(count: int, max_length: int, seed: int) -> list[int]:
    """Prompt + response lengths of shipped requests, drawn with replacement, cut to max_length."""
    with gzip.open(REPO / "tasks/data/sample_traffic.jsonl.gz", "rt", encoding="utf-8") as handle:
        lengths = [len(row["prompt_token_ids"]) + len(row["response_token_ids"])
                   for row in map(json.loads, handle)]
    rng = random.Random(seed)
    return [max(3, min(rng.choice(lengths), max_length)) for _ in range(count)]


def build(args) -> tuple[eagle3_gpu.BatchedHeadTrainee, torch.optim.Optimizer]:
    shape = gpu_decode.TARGET_SMOKE if args.smoke else gpu_decode.TARGET_SHAPES[args.shape]
    target = gpu_decode.build_model(shape, args.device, getattr(torch, args.dtype), args.seed)
    vocab_size = shape["vocab_size"]
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for i, length in enumerate(row_lengths(args.rows, args.max_length, args.seed)):
        ids = torch.randint(3, vocab_size, (length,), generator=generator).tolist()
        half = max(1, length // 2)
        rows.append(LoggedRequest(f"r{i}", ids[:half], ids[half:], SamplingParams(), "json"))
    vocab = head_vocabulary(rows, args.vocab, vocab_size, responses_only=True)
    head = Eagle3Head(target, vocab)
    config = TrainConfig(steps=1, eval_every=1, k_max=3, batch_size=args.batch, max_length=args.max_length)
    trainee = eagle3_gpu.BatchedHeadTrainee(head, target, rows, rows[:2], config, (0.05, [1.1] * 3),
                                            unroll=args.unroll,
                                            pass_batch=64 if args.device.type == "cuda" else 4)
    trainee.prepare(config, False)
    return trainee, torch.optim.AdamW(trainee.parameters(), lr=1e-3)


def use(trainee, name: str) -> None:
    trainee.rowwise, trainee.graphs = name == "rowwise", name == "graphs"


def step(trainee, optimizer, picks, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    with autocast(device):
        loss = trainee.loss(picks)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def operations(trainee, optimizer, picks, device) -> int:
    """Top-level tensor operations of one step (torch.profiler, host side)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(trainee, optimizer, picks, device)
    return sum(1 for event in prof.events() if event.cpu_parent is None)


def measure(args) -> dict:
    trainee, optimizer = build(args)
    trainee.module.train()
    rng = random.Random(args.seed)
    batches = [rng.sample(range(len(trainee.cache)), min(args.batch, len(trainee.cache)))
               for _ in range(args.repeats + 1)]
    seconds = {name: [] for name in args.contenders}
    ops = {}
    for name in args.contenders:                 # warm-up, a capture (and the operation count)
        use(trainee, name)
        step(trainee, optimizer, batches[0], args.device)
        ops[name] = operations(trainee, optimizer, batches[0], args.device)
    for picks in batches[1:]:                    # interleaved, the same batches for each
        for name in args.contenders:
            use(trainee, name)
            seconds[name].append(step(trainee, optimizer, picks, args.device))
    use(trainee, "packed")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {"device": (torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
                       else f"cpu ({torch.get_num_threads()} threads)"),
            "torch": torch.__version__, "shape": "smoke" if args.smoke else args.shape,
            "dtype": args.dtype, "rows": len(trainee.cache), "batch": args.batch,
            "max_length": args.max_length, "unroll": args.unroll, "repeats": args.repeats,
            "operations": ops, "step_ms": {k: round(v * 1000, 2) for k, v in median.items()},
            **{f"{a}_over_{b}": round(median[a] / median[b], 3)
               for a, b in (("rowwise", "packed"), ("packed", "graphs")) if {a, b} <= set(median)},
            "graph_error": trainee.graph_error}


def table(result: dict) -> str:
    lines = [f"EAGLE-3 head training step on {result['device']}, torch {result['torch']}: "
             f"{result['shape']} target ({result['dtype']}), batch {result['batch']}, "
             f"max length {result['max_length']}, unroll {result['unroll']}, "
             f"{result['rows']} cached rows, median of {result['repeats']} interleaved steps",
             "", "| batch built | top-level ops per step | step ms |", "|---|---|---|"]
    for name in result["step_ms"]:
        lines.append(f"| {LABELS[name]} | {result['operations'][name]} | {result['step_ms'][name]} |")
    ratios = [f"{text}: {result[key]}x" for key, text in (("rowwise_over_packed", "a row at a time / gathered"),
                                                          ("packed_over_graphs", "gathered / captured"))
              if key in result]
    if ratios:
        lines += ["", "Step time, " + "; ".join(ratios) + "."]
    if result.get("graph_error"):
        lines += ["", f"The capture failed (the captured row is the eager step): {result['graph_error'][:300]}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = measure(args)
    text = table(result)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
