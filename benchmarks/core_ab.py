"""Decode tokens/s of this checkout's engine against another revision's, interleaved in one run.

A refactor of the decode loop must not cost speed. The other revision's `specdec_core` is
extracted with `git archive` into a temporary directory under another package name (its imports
are relative), both decode the same prompts with the same model on this machine, one call of each
in turn, and the ratio of their median tokens/s is printed per case (> 1: this checkout is faster).
The outputs are compared too: a case whose tokens differ is marked.

    python benchmarks/core_ab.py --base 719fa45 [--model smollm2-135m-instruct] [--repeats 7]
                                 [--case 'draft model, static' --batch 4]

On 2 cores a single busy process elsewhere slows either contender about tenfold (torch's
threads wait on each other), so a neighbour that starts mid-run skews the medians: run it alone.

Cases: plain decoding, prompt lookup, LayerSkip and a two-layer draft model on the CPU default
(dynamic caches), and the draft model on static caches; greedy, batch 1 and 4.
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_core import load_model  # noqa: E402


def base_package(revision: str, into: Path):
    """The revision's specdec_core, importable as specdec_core_base."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "specdec_core"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "specdec_core").rename(into / "specdec_core_base")
    sys.path.insert(0, str(into))
    return importlib.import_module("specdec_core_base")


def cases(package, target, draft):
    drafters = importlib.import_module(f"{package.__name__}.drafters")
    return {
        "plain": (None, {}),
        "prompt lookup": (drafters.PromptLookup(), {}),
        "LayerSkip(4)": (drafters.LayerSkip(target, 4), {}),
        "draft model": (drafters.DraftModel(draft), {}),
        "draft model, static": (drafters.DraftModel(draft), {"static_cache": True}),
    }


def run_once(package, target, drafter, options, ids, max_new):
    decoder = package.SpecDecoder(target, drafter, k=4, phase_timing=False, **options)
    call = decoder.generate if drafter is not None else decoder.generate_plain
    start = time.perf_counter()
    result = call(ids, max_new)
    return result.tokens, ids.shape[0] * max_new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--case", action="append", help="only these cases (repeatable), e.g. "
                        "'draft model, static'; default: all")
    parser.add_argument("--batch", type=int, action="append", help="only these batch sizes")
    args = parser.parse_args()
    torch.manual_seed(0)
    target, tokenizer = load_model(args.model, device="cpu")
    draft = importlib.import_module("specdec_core.train").init_draft_from_target(target, 2)
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    prompt = torch.tensor([tokenizer(text)["input_ids"]])
    with tempfile.TemporaryDirectory() as tmp:
        base = base_package(args.base, Path(tmp))
        import specdec_core as head
        contenders = {"this": (head, cases(head, target, draft)), "base": (base, cases(base, target, draft))}
        rows = []
        for batch in args.batch or (1, 4):
            ids = prompt.expand(batch, -1)
            for name in args.case or contenders["this"][1]:
                speeds, outputs = {"this": [], "base": []}, {}
                for repeat in range(args.repeats + 1):              # the first: warm-up
                    for who in (("this", "base") if repeat % 2 else ("base", "this")):
                        package, made = contenders[who]
                        drafter, options = made[name]
                        tokens, speed = run_once(package, target, drafter, options, ids, args.max_new)
                        outputs[who] = tokens
                        if repeat:
                            speeds[who].append(speed)
                this, other = statistics.median(speeds["this"]), statistics.median(speeds["base"])
                same = torch.equal(outputs["this"], outputs["base"])
                rows.append((batch, name, other, this, this / other, same))
                print(f"batch {batch} {name:>20}: base {other:7.1f} tok/s, this {this:7.1f} tok/s, "
                      f"ratio {this / other:.3f}{'' if same else '  OUTPUTS DIFFER'}", file=sys.stderr)
    print(f"# Decode tokens/s: this checkout against {args.base} (CPU, {args.model}, greedy, K = 4, "
          f"{args.max_new} new tokens, median of {args.repeats} interleaved calls)\n")
    print("| batch | case | base tok/s | this tok/s | this / base | same tokens |")
    print("|---|---|---|---|---|---|")
    for batch, name, other, this, ratio, same in rows:
        print(f"| {batch} | {name} | {other:.1f} | {this:.1f} | {ratio:.3f} | {'yes' if same else 'NO'} |")
    ratios = [row[4] for row in rows]
    print(f"\ngeometric mean of the ratios: {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
