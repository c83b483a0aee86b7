"""Eager work and host reads per decode round, outside captured graphs, counted on the CPU.

On the static cache with `cuda_graphs=True` the CPU runs the CUDA path's stand-in graphs
(graphs.RecordedGraph for rounds): what CUDA would replay as graphs runs here as recorded
operators, left out of the count (graphs.replaying()). Everything else the round does --
drafting outside graphs, acceptance, write-back, rollback, bookkeeping -- is counted:

- eager operator calls: every ATen operator dispatched outside a replay (a TorchDispatchMode);
  on CUDA each is at least one kernel launch from the host;
- host reads: calls that bring device values to the host (`Tensor.cpu`, `.item`, `.tolist`,
  `bool()`/`int()`/`float()` of a tensor), counted where the decode loop and drafters call them.

Per round = (count over a long call - count over a short call) / (their difference in rounds), so
prefill and per-call setup drop out. Greedy, batch 1, a small random Llama (the counts do not
depend on its size). `tests/test_round_ops.py` keeps them from creeping back.

    python benchmarks/round_ops.py [--write]
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_core import DraftModel, LayerSkip, PromptLookup, SpecDecoder
from specdec_core.graphs import replaying
from specdec_core.head import DraftHead, HeadDrafter

RESULTS = Path(__file__).parent / "results" / "round_ops.md"
READS = ("cpu", "item", "tolist", "__bool__", "__int__", "__float__")


class EagerOps(TorchDispatchMode):
    """Counts ATen operator calls outside stand-in graph replays, by operator."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not replaying():
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads(names=READS):
    """Counts calls of the Tensor methods (`names`) that read device values on the host."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name, original):
        def method(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def tiny_llama(seed: int = 0, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def count_call(decoder: SpecDecoder, ids: torch.Tensor, new_tokens: int, plain: bool) -> dict:
    mode = EagerOps()
    with torch.no_grad(), host_reads() as reads, mode:
        if plain:
            result = decoder.generate_plain(ids, new_tokens)
        else:
            result = decoder.generate(ids, new_tokens)
    return {"ops": mode.ops, "reads": reads, "rounds": int(result.stats.rounds) or new_tokens - 1}


def per_round(decoder: SpecDecoder, ids: torch.Tensor, plain: bool, short: int = 9, long: int = 41) -> dict:
    """{"eager_ops", "host_reads", "top"} per round (long call minus short call)."""
    # warm-up: graphs and caches of every round shape the long call meets (a shape is captured
    # from its second sighting on, and the long call's later rounds may draft widths the short
    # call never did)
    for _ in range(2):
        count_call(decoder, ids, long, plain)
    a, b = count_call(decoder, ids, short, plain), count_call(decoder, ids, long, plain)
    rounds = b["rounds"] - a["rounds"]
    if rounds <= 0:
        raise RuntimeError("no more rounds in the long call than in the short one")
    ops = b["ops"] - a["ops"]
    reads = b["reads"] - a["reads"]
    return {"eager_ops": sum(ops.values()) / rounds, "host_reads": sum(reads.values()) / rounds,
            "rounds": rounds, "top": ops.most_common(6), "reads": dict(reads)}


def contenders():
    target = tiny_llama(0)
    draft = tiny_llama(1, layers=1)
    prompt = torch.tensor([[1] + [5, 6, 7, 8, 9, 10, 11, 12] * 4])    # repetitive: lookup matches
    return target, prompt, [("plain", None, True), ("prompt lookup", PromptLookup(3, 1), False),
                            ("draft model", DraftModel(draft), False),
                            ("LayerSkip(2)", LayerSkip(target, num_layers=2), False),
                            ("draft head", HeadDrafter(DraftHead(target).eval()), False)]


def measure(k: int = 4) -> list[dict]:
    target, prompt, drafters = contenders()
    rows = []
    for label, drafter, plain in drafters:
        decoder = SpecDecoder(target, drafter, k=k, static_cache=True, cuda_graphs=True,
                              phase_timing=False)
        rows.append({"drafter": label, **per_round(decoder, prompt, plain)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/round_ops.md")
    args = parser.parse_args()
    rows = measure()
    lines = [f"# Eager operator calls and host reads per round ({dt.date.today()}, CPU stand-in graphs)",
             "", "`python benchmarks/round_ops.py --write`: static cache, cuda_graphs=True (graphs.RecordedGraph "
             "on the CPU), greedy, batch 1, K = 4; per round = (41-token call - 9-token call) / rounds.",
             "", "| drafter | eager operator calls per round | host reads per round | most frequent operators |",
             "|---|---|---|---|"]
    for row in rows:
        top = ", ".join(f"{name} {count / row['rounds']:.1f}" for name, count in row["top"])
        lines.append(f"| {row['drafter']} | {row['eager_ops']:.1f} | {row['host_reads']:.2f} | {top} |")
        print(f"{row['drafter']:>14}: {row['eager_ops']:6.1f} eager ops/round, {row['host_reads']:.2f} host "
              f"reads/round {row['reads']}; top: {top}")
    if args.write:
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
