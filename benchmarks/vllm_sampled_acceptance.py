"""Does vLLM accept a sampled request's drafts as often as the rejection rule says it should?

For prompt lookup (vLLM's `ngram`, no draft probabilities) the rule accepts draft token x with
probability p_target(x) under the request's temperature and top_p. This script replays a run's
sampled requests (without top_k: vLLM 0.32's CPU build dies on those under speculation) through
vLLM in the serving environment, places each of vLLM's drafted steps along vLLM's own output
(tasks.steps.checks.engine_compare.engine_walk: the same proposer), and sets beside each step's realised
first-draft acceptance the probability the rule gives it there: p_target(first draft | vLLM's own
context), from the target in this process. Same text, same context: the two totals must agree up
to binomial noise.

    python benchmarks/vllm_sampled_acceptance.py --run-id RUN [--domains json,creative] [--count 12]

Prints one row per request and the totals with a 95% binomial band; needs `make serving-env`.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
import torch


def main() -> int:
    from specdec_core import load_model
    from specdec_core.drafters import PromptLookup
    from specdec_core.sampling import logits_to_probs
    from tasks.serving import environment as serving_env
    from tasks.steps.checks.engine_compare import engine_walk
    from tasks.db.store import Store
    from tasks.steps.estimate.offline_estimate import load_sample_requests
    from tasks.settings import load_settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--domains", default="json,creative")
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    settings = load_settings()
    model, tokenizer = load_model(args.target, device="cpu")
    requests, _ = load_sample_requests(args.run_id, Store.open(settings=settings),
                                       domains=args.domains.split(","), tokenizer=tokenizer)
    picked = [r for d in args.domains.split(",") for r in requests.get(d, [])
              if not r.sampling.greedy and not r.sampling.top_k][: args.count]
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}
    items = [{"id": r.request_id, "prompt_ids": list(r.prompt_ids),
              "max_tokens": min(args.max_tokens, len(r.response_ids)),
              "temperature": r.sampling.temperature, "top_k": 0, "top_p": r.sampling.top_p,
              "seed": i} for i, r in enumerate(picked)]
    log = Path(tempfile.mkdtemp()) / "vllm.log"
    answer = serving_env.run_engine(
        {"model": str(serving_env.served_model_dir(args.target)), "speculative_config": spec,
         "requests": items, "dtype": "float32"}, log, 900, "sampled-acceptance replay", settings)
    drafter = PromptLookup(max_ngram=3, min_ngram=2)
    print(f"vLLM {answer['vllm']}, ngram K={args.k}, {len(picked)} sampled requests (log {log})")
    print(f"{'request':<16}{'T':>5}{'top_p':>7}{'steps':>7}{'expected':>10}{'accepted':>10}")
    expected_all = realised_all = variance = 0.0
    steps_all = 0
    for request in picked:
        served = answer["requests"][request.request_id]
        output, drafted, accepted = served["token_ids"], served["drafted"], served["accepted"]
        starts = engine_walk(request.prompt_ids, output, drafted, accepted, drafter, args.k)
        if starts is None:
            print(f"{request.request_id:<16} steps could not be placed along the output")
            continue
        sequence = list(request.prompt_ids) + output
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float()
        expected = realised = 0.0
        for start, taken in zip(starts, accepted):
            context = sequence[: len(request.prompt_ids) + start]
            first = int(drafter.propose_tokens(np.asarray(context), args.k)[0])
            p = float(logits_to_probs(logits[len(context) - 1][None], request.sampling)[0, first])
            expected += p
            variance += p * (1 - p)
            realised += taken >= 1
        expected_all += expected
        realised_all += realised
        steps_all += len(starts)
        print(f"{request.request_id:<16}{request.sampling.temperature:>5.1f}"
              f"{request.sampling.top_p:>7.2f}{len(starts):>7}{expected:>10.1f}{realised:>10.0f}")
    band = 1.96 * math.sqrt(variance)
    print(f"{'all':<28}{steps_all:>7}{expected_all:>10.1f}{realised_all:>10.0f}   "
          f"(rule: {expected_all:.1f} +- {band:.1f}; realised / expected = "
          f"{realised_all / expected_all if expected_all else float('nan'):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
