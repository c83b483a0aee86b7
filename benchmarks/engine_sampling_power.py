"""Power and false-alarm rate of the sampling test on vLLM's OpenAI server (tasks.steps.engine_validate).

On the embedded default and a domain of the shipped traffic, with the context and sampling
settings the pipeline's own test would take (validation_context, validation_samplings), each
repeat draws `--rows` continuations per sampling setting from each contender's server and runs
the test (the same G-tests, bins and Bonferroni correction as the pipeline):

- mended:    vLLM's n-gram config with the project's plugin (specdec_vllm_mends): should pass
             (its false alarms over repeats estimate the false-alarm rate, alpha by design);
- unmended:  the same config on vLLM as it ships (SPECDEC_VLLM_MENDS=0): its CPU sampler
             spreads uninitialised temperature / top-k / top-p over draft tokens;
- synthetic: vLLM's lossy synthetic acceptance (rejection_sample_method "synthetic"); this CPU
             build refuses it at the first sampled request, so it is "detected" as a server error.

Contenders are interleaved repeat by repeat; every server is stopped at the end by its PID.

    .venv/bin/python benchmarks/engine_sampling_power.py --repeats 20 --domain json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SYNTHETIC = dict(NGRAM, rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.8, 0.7, 0.6])


def domain_requests(domain: str, count: int = 30) -> list:
    """The shipped sample's logged requests of one domain (token ids as logged)."""
    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest
    from tasks.steps.traffic_import import sample_traffic_path

    out = []
    with gzip.open(sample_traffic_path(), "rt") as handle:
        for line in handle:
            row = json.loads(line)
            if row["domain"] != domain or not row.get("prompt_token_ids"):
                continue
            sampling = SamplingParams(temperature=row.get("temperature") or 0.0,
                                      top_k=row.get("top_k") or 0, top_p=row.get("top_p") or 1.0)
            out.append(LoggedRequest(row["id"], row["prompt_token_ids"], row["response_token_ids"],
                                     sampling, domain))
            if len(out) == count:
                break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--domain", default="json")
    parser.add_argument("--samplings", type=int, default=2, help="validation_samplings")
    parser.add_argument("--contenders", default="mended,unmended,synthetic")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine_sampling_power.md"))
    args = parser.parse_args()

    import logging

    from specdec_core import load_model
    from tasks.errors import EngineTimeout, ServingProbeError
    from tasks.serving.environment import served_model_dir
    from tasks.serving.server import ServerPool
    from tasks.settings import load_settings
    from tasks.steps.engine_validate import BLOCK_SIZE, engine_report
    from tasks.steps.validate import validation_context, validation_samplings

    logging.basicConfig(level=logging.WARNING)
    target, _ = load_model("smollm2-135m-instruct", device="cpu")
    model_dir = served_model_dir("smollm2-135m-instruct")
    requests = domain_requests(args.domain)
    request_id, context = validation_context(target, requests)
    samplings = validation_samplings(requests, args.samplings)
    contenders = {"mended": (NGRAM, True), "unmended": (NGRAM, False), "synthetic": (SYNTHETIC, True)}
    chosen = [c for c in args.contenders.split(",") if c]
    print(f"domain {args.domain}: context of request {request_id} ({len(context)} tokens), samplings "
          f"{[s.to_dict() for s in samplings]}, {args.rows} rows each, {args.repeats} repeats", flush=True)
    results = {name: [] for name in chosen}
    began = time.perf_counter()
    with ServerPool("power", model_dir, dtype="float32", settings=load_settings(),
                    directory=REPO / ".specdec" / "engine_checks" / "power") as pool:
        for repeat in range(args.repeats):
            for name in (chosen if repeat % 2 == 0 else chosen[::-1]):
                spec, mended = contenders[name]
                started = time.perf_counter()
                try:
                    server = pool.get(spec, mended=mended, block_size=BLOCK_SIZE)
                    report = engine_report(server, target, context, samplings, args.rows, 3, 0.01,
                                           seed=repeat)
                    worst = min(report.tests, key=lambda t: t.p_value)
                    outcome = ("flagged" if not report.passed else "passed", worst.p_value,
                               f"position {worst.position}, G={worst.statistic:.1f}")
                except (EngineTimeout, ServingProbeError) as exc:
                    outcome = ("error", None, str(exc).split(";")[0][:120])
                results[name].append(outcome)
                print(f"repeat {repeat + 1:2d} {name:9s} {outcome[0]:7s} smallest p "
                      f"{'-' if outcome[1] is None else f'{outcome[1]:.2g}'} ({outcome[2]}) "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    lines = [f"# Sampling test on vLLM's OpenAI server: detection over repeats",
             "",
             f"`python benchmarks/engine_sampling_power.py --repeats {args.repeats} --rows {args.rows} "
             f"--domain {args.domain}`: embedded default, the {args.domain} domain's context (request "
             f"{request_id}, {len(context)} tokens) and sampling settings "
             f"{', '.join(json.dumps(s.to_dict()) for s in samplings)}; {args.rows} rows per setting, "
             f"3 tokens, alpha 0.01 per check (Bonferroni over settings x positions); "
             f"{time.perf_counter() - began:.0f} s in all.",
             "",
             "| contender | flagged by the G-tests | server error | passed | repeats | median smallest p |",
             "|---|---|---|---|---|---|"]
    for name, outcomes in results.items():
        ps = sorted(p for _, p, _ in outcomes if p is not None)
        median = f"{ps[len(ps) // 2]:.2g}" if ps else "-"
        count = {kind: sum(1 for o in outcomes if o[0] == kind) for kind in ("flagged", "error", "passed")}
        lines.append(f"| {name} | {count['flagged']} | {count['error']} | {count['passed']} | "
                     f"{len(outcomes)} | {median} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
