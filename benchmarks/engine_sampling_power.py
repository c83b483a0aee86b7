"""Power and false-alarm rate of the sampling test on vLLM's OpenAI server
(tasks.steps.checks.engine_validate).

On the embedded default and a domain of the shipped traffic, with the context and sampling
settings the pipeline's own test would take (validation_context, validation_samplings), each
repeat draws `--rows` continuations per sampling setting from each contender's server and runs
the test (the same G-tests, bins and Bonferroni correction as the pipeline):

- mended:    vLLM's n-gram config with the project's plugin (specdec_vllm_mends): should pass
             (its false alarms over repeats estimate the false-alarm rate, alpha by design);
- unmended:  the same config on vLLM as it ships (SPECDEC_VLLM_MENDS=0): its CPU sampler
             spreads uninitialised temperature / top-k / top-p over draft tokens;
- synthetic: vLLM's lossy synthetic acceptance (rejection_sample_method "synthetic"); this CPU
             build refuses it at the first sampled request, so it is "detected" as a server error;
- eagle3:    with --head DIR, vLLM's `eagle3` config of that head (a checkpoint in the speculators
             format, as benchmarks/eagle3_train.py --save writes it) at --k draft tokens, with the
             plugin, as the pipeline exports it: should pass as "mended" does;
- exact:     no server: continuations drawn in this process from the target's own distribution
             (teacher-forced per distinct prefix): the test's true null, whose p-values are the
             reference the others' are compared with (a G-test's p-values are not uniform where
             a position has few bins).

Every test's p-value is kept (OUT with .json for .md); the second table compares each contender's
p-values with exact's (two-sample KS) where both ran.

Contenders are interleaved repeat by repeat; every server is stopped at the end by its PID.

    .venv/bin/python benchmarks/engine_sampling_power.py --repeats 20 --domain json
    .venv/bin/python benchmarks/engine_sampling_power.py --contenders eagle3,mended --head DIR --k 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SYNTHETIC = dict(NGRAM, rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.8, 0.7, 0.6])


def domain_requests(domain: str, count: int = 30) -> list:
    """The shipped sample's logged requests of one domain (token ids as logged)."""
    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest
    from tasks.steps.traffic.traffic_import import sample_traffic_path

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


def exact_draws(target, context: list[int], sampling, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] continuations drawn from the target's own next-token distributions: the
    context's cache computed once, then per position one batched forward of the distinct
    prefixes drawn so far over a copy of it -- what a lossless engine samples from."""
    import copy

    from specdec_core.sampling import logits_to_probs

    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        first = target(torch.tensor([context]), use_cache=True)
        drawn = torch.empty(rows, 0, dtype=torch.long)
        for position in range(length):
            if position == 0:
                logits, slot = first.logits[:, -1], torch.zeros(rows, dtype=torch.long)
            else:
                prefixes, slot = torch.unique(drawn, dim=0, return_inverse=True)
                cache = copy.deepcopy(first.past_key_values)
                cache.batch_repeat_interleave(len(prefixes))
                logits = target(prefixes, past_key_values=cache).logits[:, -1]
            probs = logits_to_probs(logits, sampling).double()
            drawn = torch.cat([drawn, torch.multinomial(probs[slot], 1, generator=generator)], 1)
    return drawn


def exact_report(target, context, samplings, rows: int, length: int, alpha: float, seed: int):
    """The sampling test of exact_draws, as engine_report runs it on a server."""
    from specdec_core.validation import SamplingReport, position_tests

    threshold = alpha / (len(samplings) * length)
    report = SamplingReport(alpha=alpha, rows_per_test=rows)
    for index, sampling in enumerate(samplings):
        tokens = exact_draws(target, context, sampling, rows, length, seed * 1009 + index)
        report.tests += position_tests(target, context, tokens, sampling, threshold,
                                       seed=seed * 31 + index * 7)
    return report


def p_value_table(tests: dict[str, list[tuple[int, float]]], reference: str = "exact") -> list[str]:
    """Every G-test's p-value over all repeats, per contender and position group (0: sampled
    before any draft is verified; 1-2: where speculation acts). A check flags only its smallest
    test, so a small distortion shows in these first; they are compared with the reference
    contender's (the true null) by a two-sample KS test, not with the uniform distribution: where
    a position has few bins a G-test's p-values are discrete and far from uniform."""
    from scipy.stats import ks_2samp

    lines = [f"| contender | positions | G-tests | p < 0.05 | p < 0.01 | median p | KS vs {reference}: D, p |",
             "|---|---|---|---|---|---|---|"]
    for name, found in tests.items():
        for label, keep in (("0", {0}), ("1-2", {1, 2})):
            ps = sorted(p for position, p in found if position in keep)
            if not ps:
                continue
            null = [p for position, p in tests.get(reference, []) if position in keep]
            ks = ks_2samp(ps, null) if null and name != reference else None
            lines.append(f"| {name} | {label} | {len(ps)} | {sum(p < 0.05 for p in ps) / len(ps):.1%} | "
                         f"{sum(p < 0.01 for p in ps) / len(ps):.1%} | {ps[len(ps) // 2]:.2g} | "
                         + (f"{ks.statistic:.3f}, {ks.pvalue:.2g} |" if ks else "- |"))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--domain", default="json")
    parser.add_argument("--samplings", type=int, default=2, help="validation_samplings")
    parser.add_argument("--contenders", default="mended,unmended,synthetic")
    parser.add_argument("--head", default=None, help="an EAGLE-3 checkpoint: the eagle3 contender")
    parser.add_argument("--k", type=int, default=3, help="the eagle3 contender's draft tokens per round")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine_sampling_power.md"))
    args = parser.parse_args()

    import logging

    from specdec_core import load_model
    from tasks.errors import EngineTimeout, ServingProbeError
    from tasks.serving.environment import served_model_dir
    from tasks.serving.server import ServerPool
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_validate import BLOCK_SIZE, engine_report
    from tasks.steps.checks.validate import validation_context, validation_samplings

    logging.basicConfig(level=logging.WARNING)
    target, _ = load_model("smollm2-135m-instruct", device="cpu")
    model_dir = served_model_dir("smollm2-135m-instruct")
    requests = domain_requests(args.domain)
    request_id, context = validation_context(target, requests)
    samplings = validation_samplings(requests, args.samplings)
    contenders = {"mended": (NGRAM, True), "unmended": (NGRAM, False), "synthetic": (SYNTHETIC, True),
                  "exact": (None, True)}
    if args.head:
        from tasks.registry.config_schema import DrafterSpec
        from tasks.registry.vllm_export import speculative_config

        head = str(Path(args.head).resolve())
        contenders["eagle3"] = (speculative_config(DrafterSpec(kind="eagle3", params={"model": head}), args.k), True)
    chosen = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in chosen if c not in contenders]
    if unknown:
        parser.error(f"--contenders {','.join(unknown)}: not one of {', '.join(contenders)}"
                     + ("" if args.head else " (eagle3 needs --head DIR)"))
    print(f"domain {args.domain}: context of request {request_id} ({len(context)} tokens), samplings "
          f"{[s.to_dict() for s in samplings]}, {args.rows} rows each, {args.repeats} repeats", flush=True)
    results = {name: [] for name in chosen}
    tests = {name: [] for name in chosen}       # every G-test's (position, p), all repeats
    began = time.perf_counter()
    with ServerPool("power", model_dir, dtype="float32", settings=load_settings(),
                    directory=REPO / ".specdec" / "engine_checks" / "power") as pool:
        for repeat in range(args.repeats):
            for name in (chosen if repeat % 2 == 0 else chosen[::-1]):
                spec, mended = contenders[name]
                started = time.perf_counter()
                try:
                    if name == "exact":
                        report = exact_report(target, context, samplings, args.rows, 3, 0.01, repeat)
                    else:
                        server = pool.get(spec, mended=mended, block_size=BLOCK_SIZE)
                        report = engine_report(server, target, context, samplings, args.rows, 3, 0.01,
                                               seed=repeat)
                    worst = min(report.tests, key=lambda t: t.p_value)
                    outcome = ("flagged" if not report.passed else "passed", worst.p_value,
                               f"position {worst.position}, G={worst.statistic:.1f}")
                    tests[name] += [(t.position, t.p_value) for t in report.tests]
                except (EngineTimeout, ServingProbeError) as exc:
                    outcome = ("error", None, str(exc).split(";")[0][:120])
                results[name].append(outcome)
                print(f"repeat {repeat + 1:2d} {name:9s} {outcome[0]:7s} smallest p "
                      f"{'-' if outcome[1] is None else f'{outcome[1]:.2g}'} ({outcome[2]}) "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    command = (f"python benchmarks/engine_sampling_power.py --repeats {args.repeats} --rows {args.rows} "
               f"--domain {args.domain} --contenders {args.contenders}"
               + (f" --head HEAD --k {args.k}" if args.head else ""))
    lines = ["# Sampling test on vLLM's OpenAI server: detection over repeats",
             "",
             f"`{command}`: embedded default, the {args.domain} domain's context (request "
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
    lines += ["", *p_value_table(tests)]
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"command": command, "outcomes": results, "tests": tests}) + "\n")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
