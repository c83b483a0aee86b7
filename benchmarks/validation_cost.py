"""What a domain's sampling test costs with the prompt cached once per row or once for all rows.

Per domain of the shipped traffic: the domain's requests in the order of a hash
of their id, the first --sample of them as the run's sample, the rest as the suffix index the
drafter searches (the drafter the main job plans everywhere on this machine). The test is the
pipeline's own: its context (tasks.steps.checks.validate.validation_context, the highest-entropy point of
the first requests), its sampling settings (validation_samplings, the two most frequent), K in
{1, --k}, 300 rows. Each domain's test runs with the prompt copied per row (share_prompt=False,
as before) and kept once (share_prompt=True), interleaved, --rounds times; both draw the same
tokens, which the script checks. Prints a Markdown table: seconds per domain (median over
rounds) and the ratio.

    python benchmarks/validation_cost.py --rounds 1 --out benchmarks/results/validation_cost.md
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from eagle3_train import shipped_requests  # noqa: E402
from specdec_core.home import DEFAULT_MODEL  # noqa: E402
from vs_vllm import report  # noqa: E402


def domain_requests() -> dict[str, list]:
    """{domain: [LoggedRequest]} of the shipped traffic, in the order of a hash of the id."""
    domains = defaultdict(list)
    for request in shipped_requests():
        if len(request.response_ids) >= 2:
            domains[request.domain].append(request)
    return {d: sorted(rows, key=lambda r: hashlib.sha1(r.request_id.encode()).hexdigest())
            for d, rows in sorted(domains.items())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--sample", type=int, default=30, help="requests per domain in the 'sample'")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--domains", default="", help="comma-separated; empty: every domain")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch

    from specdec_core import cpu_kernels, load_model
    from specdec_core.drafters import SuffixDrafter
    from specdec_core.suffix import SuffixIndex
    from specdec_core.validation import sampling_check
    from tasks.steps.checks.validate import validation_context, validation_samplings

    target, _ = load_model(args.model)
    cpu_kernels.prepare(target)
    requests = domain_requests()
    chosen = [d for d in args.domains.split(",") if d] or list(requests)
    tests = {}
    for domain in chosen:
        sample, history = requests[domain][:args.sample], requests[domain][args.sample:]
        index = SuffixIndex.build([list(r.prompt_ids) + list(r.response_ids) for r in history],
                                  [r.request_id for r in history])
        _, context = validation_context(target, sample)
        tests[domain] = (SuffixDrafter(index), context, tuple(validation_samplings(sample, 2)))
    seconds = {(d, share): [] for d in tests for share in (False, True)}
    for round_ in range(args.rounds):
        for domain, (drafter, context, samplings) in tests.items():
            stats = {}
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for share in order:
                began = time.perf_counter()
                result = sampling_check(target, drafter, torch.tensor(context), ks=(1, args.k),
                                        samplings=samplings, rows=args.rows, chunk=args.rows,
                                        seed=round_, share_prompt=share)
                seconds[(domain, share)].append(time.perf_counter() - began)
                stats[share] = [(t.statistic, t.p_value) for t in result.tests]
                print(f"round {round_ + 1}, {domain}, prompt {'once' if share else 'per row'}: "
                      f"{seconds[(domain, share)][-1]:.1f} s", flush=True)
            if stats[False] != stats[True]:
                print(f"  {domain}: the two draws differ (float rounding moved a sample)", flush=True)
    lines = ["# The sampling test's cost: prompt per row vs once for all rows\n",
             f"`python benchmarks/validation_cost.py --rounds {args.rounds}` on {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}, K in {{1, {args.k}}}, "
             f"{args.rows} rows, the suffix drafter; medians over {args.rounds} round(s), contenders interleaved.\n",
             "| domain | context tokens | sampling settings | prompt per row (s) | prompt once (s) | per row / once |",
             "|---|---|---|---|---|---|"]
    totals = [0.0, 0.0]
    for domain, (_, context, samplings) in tests.items():
        copy = statistics.median(seconds[(domain, False)])
        once = statistics.median(seconds[(domain, True)])
        totals[0] += copy
        totals[1] += once
        lines.append(f"| {domain} | {len(context)} | {len(samplings)} | {copy:.1f} | {once:.1f} | {copy / once:.2f} |")
    lines.append(f"| all | | | {totals[0]:.1f} | {totals[1]:.1f} | {totals[0] / totals[1]:.2f} |")
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
