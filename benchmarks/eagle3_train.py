"""Train an EAGLE-3 head for the embedded default on the shipped traffic and score it on held-out
requests: the training curve, acceptance per domain at K = 1, the acceptance length at the best K,
and the head's step against a target step, on this machine.

    python benchmarks/eagle3_train.py [--steps 600] [--eval-every 100] [--vocab 8192] [--unroll 3]
                                      [--out benchmarks/results/eagle3_cpu.md]

The held-out split is by request (a hash of its id, 20%), the same rule the training step uses;
the head never sees those rows, and they do not choose the checkpoint kept: --eval-requests
validation rows taken from the training rows (each domain in turn, not trained on) do. Rows are
scored with the start-dependent offline estimate (greedy rows: argmax == logged token; sampled
rows: min(1, q/p) at the logged token), which equals live rounds for greedy rows
(tests/test_eagle3.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_core import SamplingParams, load_model  # noqa: E402
from specdec_core.drafters import output_size  # noqa: E402
from specdec_core.eagle3 import Eagle3Head  # noqa: E402
from specdec_core.estimate import LoggedRequest, estimate_acceptance  # noqa: E402
from specdec_core.head import DraftHead, HeadDrafter  # noqa: E402
from specdec_core.train import (TrainConfig, head_vocabulary, measure_head_step, measured_costs,  # noqa: E402
                                train_head)
from specdec_core.estimate import in_heldout, split_off  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import eagle3_gpu  # noqa: E402  (the held-out scoring and goals of the GPU run, the extra held-out rows)


def shipped_requests() -> list[LoggedRequest]:
    rows = [json.loads(line) for line in gzip.open(REPO / "tasks/data/sample_traffic.jsonl.gz", "rt")]
    return [LoggedRequest(row["id"], list(row["prompt_token_ids"]), list(row["response_token_ids"]),
                          SamplingParams(temperature=float(row["temperature"]), top_k=int(row["top_k"] or 0),
                                         top_p=float(row["top_p"] or 1.0)), row["domain"])
            for row in rows]


# the H100 facts of docs/design.md (SmolLM2-135M and Llama-3.2-1B shapes, batch 1, measured before
# captured rounds): verify(K) / step 1.09-1.14 for K = 1..8, prompt lookup 0.018 of a step per
# round; an EAGLE-3 head step about 0.03 of a target step at that size (the figure)
H100_VERIFY = [1.09 + 0.05 * (k - 1) / 7 for k in range(1, 9)]
H100_DRAFT = {"eagle3": 0.03, "prompt lookup": 0.018, "suffix": 0.018}


def best_speedup(by_k: dict, draft_cost: float, verify: list[float], per_round: bool,
                 overhead: float = 0.0) -> tuple[int, float]:
    """(K, E(K) / (drafting + verify(K) + overhead)) at the best K; drafting costs K x c for a
    model drafter, c once a round for a host one (all in target steps)."""
    best = (0, 1.0)
    for k, estimate in by_k.items():
        if k > len(verify):
            continue
        cost = (draft_cost if per_round else k * draft_cost) + verify[k - 1] + overhead
        speedup = estimate.expected_tokens_per_round / cost
        if speedup > best[1]:
            best = (k, speedup)
    return best


def compare(target, head, train, heldout, k_max: int) -> str:
    """The head against prompt lookup and the suffix drafter (an index per domain over the
    training rows' responses) on the same held-out rows, under this CPU's measured costs and the
    H100 facts."""
    from specdec_core.drafters import PromptLookup, SuffixDrafter
    from specdec_core.profile import measure_step_costs
    from specdec_core.suffix import SuffixIndex

    domains = sorted({r.domain for r in heldout})
    ks = list(range(1, k_max + 1))
    results = {d: {} for d in domains}
    for domain in domains:
        rows = [r for r in heldout if r.domain == domain]
        index = SuffixIndex.build([list(r.response_ids) for r in train if r.domain == domain])
        for label, drafter in (("eagle3", HeadDrafter(head)), ("prompt lookup", PromptLookup()),
                               ("suffix", SuffixDrafter(index=index))):
            results[domain][label] = estimate_acceptance(target, drafter, rows, ks, progress=False,
                                                         n_boot=200)[domain]
    drafters = {"eagle3": HeadDrafter(head), "prompt lookup": PromptLookup(), "suffix": SuffixDrafter()}
    costs = measure_step_costs(target, drafters, k_max, batch_size=1, repeats=5)
    step = costs["target_step"]
    verify = [max(costs["verify"][k] / step, 1.0) for k in ks]     # as the training scores do
    plain_overhead = costs["round_overhead"]["plain"] / step
    lines = ["## EAGLE-3 against prompt lookup and suffix, held-out rows", "",
             f"CPU costs measured here at batch 1 (target step {step * 1e3:.1f} ms): "
             + ", ".join(f"{label} {costs['draft_step'][label] / step:.3f}" for label in drafters)
             + " of a step (per draft token for eagle3, per round for the others); verify(K)/step "
             + ", ".join(f"{v:.2f}" for v in verify) + "; per-round overhead beyond plain decoding's: "
             + ", ".join(f"{label} {max(costs['round_overhead'][label] / step - plain_overhead, 0):.3f}"
                         for label in drafters) + ".",
             "H100: the facts of docs/design.md (verify 1.09-1.14, prompt lookup 0.018 per round, "
             "suffix taken as prompt lookup's, EAGLE-3 step 0.03), per-round overhead left out.",
             "Speedup = E[tokens/round] / (drafting + verify(K) + overhead) at the best K.", "",
             "| domain | drafter | acceptance K=1 | E at K=1..5 | CPU: K, speedup | H100: K, speedup |",
             "|---|---|---|---|---|---|"]
    chosen = {"CPU": {}, "H100": {}}
    for domain in domains:
        for label, by_k in results[domain].items():
            per_round = label != "eagle3"
            overhead = max(costs["round_overhead"][label] / step - plain_overhead, 0.0)
            cpu = best_speedup(by_k, costs["draft_step"][label] / step, verify, per_round, overhead)
            h100 = best_speedup(by_k, H100_DRAFT[label], H100_VERIFY, per_round)
            for where, (k, speedup) in (("CPU", cpu), ("H100", h100)):
                if speedup > chosen[where].get(domain, ("off", 0, 1.0))[2]:
                    chosen[where][domain] = (label, k, speedup)
            lines.append(f"| {domain} | {label} | {by_k[1].conditional_acceptance[0]:.3f} | "
                         + ", ".join(f"{by_k[k].expected_tokens_per_round:.2f}" for k in ks[:5])
                         + f" | {cpu[0]}, {cpu[1]:.2f}x | {h100[0]}, {h100[1]:.2f}x |")
    lines += ["", "| domain | chosen on this CPU | chosen under the H100 facts |", "|---|---|---|"]
    for domain in domains:
        cells = []
        for where in ("CPU", "H100"):
            label, k, speedup = chosen[where].get(domain, ("off", 0, 1.0))
            cells.append("off" if label == "off" else f"{label}, K={k}, {speedup:.2f}x")
        lines.append(f"| {domain} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def heldout_table(target, head, sets: dict[str, list[LoggedRequest]]) -> str:
    """First-draft acceptance per domain with its bootstrap 95% interval on each held-out set and
    on all of them, the issue's goal line (eagle3_gpu.verdict) and the acceptance length at
    K = 1..5 on all of them; one pass of the head over the rows."""
    scored = eagle3_gpu.score_sets(target, head, sets)
    names = [name for name in sets if sets[name]] + (["all"] if "all" in scored else [])
    domains = sorted({d for name in names for d in scored[name]})
    lines = ["## Held-out acceptance per domain (K = 1: accepted / reached at the first draft, "
             "bootstrap 95% interval over requests)", "",
             "| domain | " + " | ".join(f"{name} (requests)" for name in names)
             + f" | goal, on {names[-1]} | acceptance length at K=1..5, {names[-1]} | best K |",
             "|---|" + "---|" * (len(names) + 3)]
    for domain in domains:
        cells = [f"{eagle3_gpu.with_interval(scored[name][domain])} ({scored[name][domain]['requests']})"
                 if domain in scored[name] else "" for name in names]
        last = scored[names[-1]][domain]
        lengths = {int(k): v for k, v in last["length_by_k"].items()}
        lines.append(f"| {domain} | " + " | ".join(cells) + f" | {eagle3_gpu.verdict(domain, last)} | "
                     + ", ".join(f"{lengths[k]:.2f}" for k in sorted(lengths))
                     + f" | {max(lengths, key=lengths.get)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--k-max", type=int, default=5)
    parser.add_argument("--max-length", type=int, default=160,
                        help="tokens of a row trained on: its last ones (prompt end + response)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--save", default=None, help="write the best head here (speculators format)")
    parser.add_argument("--kind", choices=("eagle3", "head"), default="eagle3",
                        help="head: the earlier EAGLE-style head (specdec_core.head), same recipe")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the comparison with prompt lookup and suffix (its cost timings)")
    parser.add_argument("--head", default=None,
                        help="score this saved EAGLE-3 head instead of training one")
    parser.add_argument("--checkpoints", default=None,
                        help="checkpoint folder; a run resumes from its last checkpoint (default: a "
                             "new temporary folder, so a rerun trains from step 0)")
    parser.add_argument("--eval-requests", type=int, default=30,
                        help="validation requests scored at each checkpoint, choosing the one kept: "
                             "taken from the training rows, each domain in turn, and not trained "
                             "on; the final table scores every held-out request")
    parser.add_argument("--extra-heldout", default=None,
                        help="more held-out rows (benchmarks/eagle3_heldout.py's file), scored beside "
                             "the shipped held-out ones and never trained on; default: the shipped "
                             "file when it is there, none for no file")
    args = parser.parse_args()
    args.extra_heldout = args.extra_heldout or eagle3_gpu.default_extra_heldout()
    extra = [eagle3_gpu.logged(row) for row in eagle3_gpu.extra_heldout_rows(args.extra_heldout)]
    torch.manual_seed(0)
    target, _ = load_model("smollm2-135m-instruct", device="cpu")
    requests = [r for r in shipped_requests() if len(r.response_ids) >= 2]
    heldout = [r for r in requests if in_heldout("eagle3-bench", r.request_id, 0.2)]
    train = [r for r in requests if not in_heldout("eagle3-bench", r.request_id, 0.2)]
    vocab = head_vocabulary(train, args.vocab, output_size(target), responses_only=True)
    kind = Eagle3Head if args.kind == "eagle3" else DraftHead
    head = kind(target, vocab) if args.head is None else kind.load(args.head, target)
    config = TrainConfig(steps=args.steps, eval_every=args.eval_every, k_max=args.k_max,
                         warmup_steps=20, lr=args.lr, batch_size=8, max_length=args.max_length)
    step_ratio = measure_head_step(head, target)
    verify = measured_costs(target, None, args.k_max)[1]     # verify(K) / step, measured here
    print(f"{len(train)} train / {len(heldout)} held-out requests; draft vocabulary {len(vocab)}; "
          f"head step {step_ratio:.3f} of a target step", file=sys.stderr)
    sets = {"shipped held-out": heldout, "extra held-out": extra}
    if args.head is not None:
        print(heldout_table(target, head, sets))
        print(compare(target, head, train, heldout + extra, args.k_max))
        return
    started = time.perf_counter()
    train, curve_rows = split_off(train, args.eval_requests)
    checkpoints = Path(args.checkpoints or tempfile.mkdtemp(prefix=f"{args.kind}-bench-"))
    print(f"checkpoints: {checkpoints}" + (" (resuming from its last)" if (checkpoints / "last").exists()
                                           else ""), file=sys.stderr)
    result = train_head(head, target, train, curve_rows, config, checkpoints,
                        costs=(step_ratio, verify), unroll=args.unroll)
    minutes = (time.perf_counter() - started) / 60
    best_dir = Path(result.best_dir)
    head = kind.load(best_dir, target)
    if args.save and kind is Eagle3Head:
        head.save(args.save, k=result.best["k"], verifier="smollm2-135m-instruct")
    title = "EAGLE-3 head" if kind is Eagle3Head else "EAGLE-style head (specdec_core.head)"
    lines = [f"# {title} for smollm2-135m-instruct on the shipped traffic (CPU)", "",
             f"`python benchmarks/eagle3_train.py --kind {args.kind} --steps {args.steps} --eval-every {args.eval_every} "
             f"--vocab {args.vocab} --unroll {args.unroll} --lr {args.lr} --max-length {args.max_length}`", "",
             f"{len(train)} training / {len(heldout)} held-out requests (split by request)"
             + (f", and {len(extra)} more held-out requests ({args.extra_heldout}: new prompts the "
                "target answered, benchmarks/eagle3_heldout.py)" if extra else "") + ", draft "
             f"vocabulary {len(vocab)} (most frequent response tokens), training-time test "
             f"{args.unroll} steps, {args.steps} steps in {minutes:.1f} min. Head step "
             f"{step_ratio:.3f} of a target step (batch 1, measured here).", "",
             "## Training curve (validation: the checkpoint kept is chosen here)", "",
             f"| step | KL | first-draft acceptance ({len(curve_rows)} validation requests, not "
             "trained on) | predicted speedup |",
             "|---|---|---|---|"]
    for entry in result.history:
        lines.append(f"| {entry['step']} | {entry['heldout_kl']:.3f} | "
                     f"{entry['conditional_acceptance'][0]:.3f} | {entry['predicted_speedup']:.3f} |")
    lines += ["", f"Best checkpoint: step {result.best['step']}.", ""]
    text = "\n".join(lines) + "\n" + heldout_table(target, head, sets)
    if not args.no_compare:
        text += "\n" + compare(target, head, train, heldout + extra, args.k_max)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
