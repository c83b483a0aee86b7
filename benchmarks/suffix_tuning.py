"""Tune SuffixDrafter's parameters on held-out traffic: predicted speedup per domain over a grid.

Per domain the shipped traffic (or --traffic FILE) splits by a hash of the request id into a
tuning set (--tune requests) and the rest, which the domain's suffix index is built from: a
tuning request is never in the index that scores it. Each setting walks rounds along the tuning
responses (estimate.walk_rounds, the offline estimate the pipeline uses) at every K, and the
planner's formula (tasks.steps.plan.plan.round_cost, host search paid once per round) turns E and the width
shares into a predicted speedup with costs measured here, in this run, on the embedded default
(or --model). Prompt lookup runs on the same rows as the reference.

Prints (and writes with --out) a Markdown table: per domain the best K's predicted speedup of
each setting, and the setting with the best geometric mean over domains.

    python benchmarks/suffix_tuning.py --out benchmarks/results/suffix_tuning.md
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import math
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_core.home import DEFAULT_MODEL  # noqa: E402


def load_traffic(path: Path) -> dict[str, list[tuple[str, list[int], list[int]]]]:
    """{domain: [(id, prompt ids, response ids)]} of rows that carry token ids."""
    opener = gzip.open if path.suffix == ".gz" else open
    domains = defaultdict(list)
    with opener(path, "rt") as handle:
        for line in handle:
            row = json.loads(line)
            prompt, response = row.get("prompt_token_ids"), row.get("response_token_ids")
            if prompt and response and len(response) >= 2:
                domains[row["domain"]].append((row["id"], list(prompt), list(response)))
    return dict(domains)


def split(rows: list, tune: int) -> tuple[list, list]:
    """(tuning rows, index rows): the first `tune` rows in the order of a hash of their id."""
    order = sorted(rows, key=lambda r: hashlib.sha1(r[0].encode()).hexdigest())
    return order[:tune], order[tune:]


def predicted(drafter, rows: list, ks: list[int], verify: list[float], host: float):
    """{K: (speedup, E)} for a host drafter on the rows (planner formula)."""
    from specdec_core.estimate import walk_rounds
    from tasks.steps.plan.plan import round_cost

    out = {}
    for k in ks:
        totals = [walk_rounds(p, r, k, drafter) for _, p, r in rows]
        summed = totals[0]
        for item in totals[1:]:
            summed = summed + item
        e = summed.expected_tokens_per_round
        cost = round_cost(list(summed.width_share), verify, host, per_round_draft=True)
        out[k] = (e / cost, e)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traffic", type=Path, default=REPO / "tasks/data/sample_traffic.jsonl.gz")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tune", type=int, default=40, help="tuning requests per domain")
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    parser.add_argument("--min-token-prob", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--max-spec-factor", default="0.5,1,2,4")
    parser.add_argument("--max-depth", default="24")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    from specdec_core import load_model
    from specdec_core.drafters import PromptLookup, SuffixDrafter
    from specdec_core.profile import measure_forward_costs, measure_host_draft_cost
    from specdec_core.suffix import SuffixIndex

    ks = [int(k) for k in args.ks.split(",")]
    traffic = load_traffic(args.traffic)
    model, _ = load_model(args.model, device="cpu")
    started = time.perf_counter()
    costs = measure_forward_costs(model, range(1, max(ks) + 2), context_len=256, repeats=7)
    step = costs[1]
    verify = [costs[w] / step for w in range(2, max(ks) + 2)]
    print("verify(K)/step:", " ".join(f"K={k}:{v:.2f}" for k, v in zip(range(1, max(ks) + 1), verify)))

    grid = list(itertools.product([int(d) for d in args.max_depth.split(",")],
                                  [float(p) for p in args.min_token_prob.split(",")],
                                  [float(f) for f in args.max_spec_factor.split(",")]))
    results: dict[str, dict[str, tuple[int, float, float]]] = defaultdict(dict)
    for domain, rows in sorted(traffic.items()):
        tuning, indexed = split(rows, args.tune)
        index = SuffixIndex.build([r for _, _, r in indexed], request_ids=[i for i, _, _ in indexed],
                                  depth=32, meta={"domain": domain})
        contenders = {f"prompt_lookup(max_ngram=3,min_ngram={m})": PromptLookup(3, m) for m in (1, 2)}
        for depth, prob, factor in grid:
            contenders[f"suffix(max_depth={depth},min_token_prob={prob:g},max_spec_factor={factor:g})"] = \
                SuffixDrafter(index, max_depth=depth, min_token_prob=prob, max_spec_factor=factor)
        host = {}
        for label, drafter in contenders.items():
            host.setdefault(type(drafter), measure_host_draft_cost(drafter, max(ks)) / step)
            by_k = predicted(drafter, tuning, ks, verify, host[type(drafter)])
            best = max(by_k, key=lambda k: by_k[k][0])
            results[domain][label] = (best, by_k[best][0], by_k[best][1])
        print(f"{domain}: {len(tuning)} tuning rows, index over {len(indexed)} responses "
              f"({index.tokens} tokens), {time.perf_counter() - started:.0f} s", flush=True)

    labels = list(next(iter(results.values())))
    geo = {label: math.exp(np.mean([math.log(results[d][label][1]) for d in results])) for label in labels}
    best_suffix = max((lab for lab in labels if lab.startswith("suffix")), key=geo.get)
    default = "suffix(max_depth=24,min_token_prob=0.1,max_spec_factor=1)"
    shown = [lab for lab in labels if lab.startswith("prompt_lookup")] + [default]
    shown += [best_suffix] if best_suffix != default else []
    lines = [
        "# SuffixDrafter tuning on held-out traffic",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, torch "
        f"{torch.__version__}, {args.model} fp32 batch 1 on CPU; traffic `{args.traffic.name}`; per "
        f"domain {args.tune} tuning requests (by a hash of the id), index over the rest. Predicted "
        "speedup at the best K (planner formula, costs measured in this run: verify(K)/step "
        + ", ".join(f"{v:.2f}" for v in verify) + f" for K = 1..{max(ks)}). Offline walk along the "
        "logged responses, as the pipeline estimates host drafters.",
        "",
        "Best setting by geometric mean over domains: `" + best_suffix + "`.",
        "",
        "| drafter | geo. mean | " + " | ".join(results) + " |",
        "|---|---|" + "---|" * len(results),
    ]
    for label in shown + sorted((lab for lab in labels if lab not in shown), key=geo.get, reverse=True)[:8]:
        cells = [f"{results[d][label][1]:.2f}x (K={results[d][label][0]}, E={results[d][label][2]:.2f})"
                 for d in results]
        lines.append(f"| `{label}` | {geo[label]:.3f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
