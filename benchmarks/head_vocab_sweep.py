"""Pick a draft head's reduced vocabulary: what each size covers and what its step costs.

A reduced head scores only the N most frequent token ids of its training traffic. Its acceptance
is capped by the target's probability mass inside those ids (a draft token outside cannot be
proposed; under sampling, acceptance <= sum over the vocabulary of min(p, q) <= mass inside), and
its step cost falls with N. Per size this prints, in one run on this machine:

- the share of held-out response tokens inside the vocabulary;
- the target's mean probability mass inside it at held-out response positions (the ceiling);
- one head step / one target step at batch 1 (an untrained head of that size: the cost does not
  depend on the weights), the same measurement the training and the pipeline use.

The split is the one `specdec draft train` uses for --id (or --split-from) TRAIN_ID, so the
held-out rows are those the trained heads are scored on.

    python benchmarks/head_vocab_sweep.py --split-key head-sweep --out benchmarks/results/head_vocab_sweep.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_core.home import DEFAULT_MODEL  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traffic", type=Path, default=REPO / "tasks/data/sample_traffic.jsonl.gz")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--split-key", default="head-sweep",
                        help="the training id whose split to use (as --split-from)")
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--sizes", default="512,1024,2048,4096,8192,16384,full")
    parser.add_argument("--max-heldout", type=int, default=80,
                        help="held-out requests given a target pass for the mass column")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from tqdm import tqdm

    from specdec_core import load_model
    from specdec_core.drafters import output_size
    from specdec_core.estimate import LoggedRequest
    from specdec_core.head import DraftHead
    from specdec_core.train import head_vocabulary, measure_head_step
    from tasks.steps.drafters.draft_training import in_heldout

    model, _ = load_model(args.model, device="cpu")
    full = output_size(model)
    train, heldout = [], []
    with gzip.open(args.traffic, "rt") as handle:
        for line in handle:
            row = json.loads(line)
            if not (row.get("prompt_token_ids") and row.get("response_token_ids")):
                continue
            request = LoggedRequest(row["id"], row["prompt_token_ids"], row["response_token_ids"],
                                    None, row["domain"])
            (heldout if in_heldout(args.split_key, row["id"], args.heldout_fraction) else train).append(request)
    heldout.sort(key=lambda r: r.request_id)
    probs = []          # per held-out request: the target's p over the response positions [L, V]
    with torch.inference_mode():
        for request in tqdm(heldout[: args.max_heldout], desc="target passes"):
            ids = torch.tensor([list(request.prompt_ids) + list(request.response_ids)])
            n = len(request.response_ids)
            logits = model(input_ids=ids).logits[0, -n - 1: -1].float()
            probs.append((logits.softmax(-1), torch.tensor(request.response_ids)))
    sizes = [full if s == "full" else int(s) for s in args.sizes.split(",")]
    rows = []
    for size in tqdm(sizes, desc="sizes"):
        ids = None if size >= full else head_vocabulary(train, size, full)
        inside = torch.ones(full, dtype=torch.bool)
        if ids is not None:
            inside[:] = False
            inside[ids] = True
        tokens = sum(int(inside[torch.tensor(r.response_ids)].sum()) for r in heldout)
        total = sum(len(r.response_ids) for r in heldout)
        mass = torch.cat([p[:, inside].sum(-1) for p, _ in probs]).mean().item()
        step = measure_head_step(DraftHead(model, vocab_ids=ids), model, repeats=args.repeats)
        rows.append((size, tokens / total, mass, step))
    lines = [f"Head vocabulary sweep: {args.model}, {len(train)} training / {len(heldout)} held-out "
             f"requests (split {args.split_key!r}), mass over {len(probs)} held-out requests; "
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}",
             "",
             "| vocabulary | held-out tokens inside | target mass inside (acceptance cap) | head step / target step |",
             "|---|---|---|---|"]
    for size, share, mass, step in rows:
        name = "full" if size >= full else str(size)
        lines.append(f"| {name} ({size}) | {share:.4f} | {mass:.4f} | {step:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
