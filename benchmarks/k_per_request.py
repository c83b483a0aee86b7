"""K per request on one vLLM server (the project's plugin), on the embedded default: one ngram
server started at K 8 with a plan (json K 8, chat K 0) serves a mixed batch, and the sampling test
runs on that same server at K 0, 1 and 8 (each request asking its K); then what a K 0 request
costs on that server and on a suffix server against a plain server (the host search vLLM still
runs for it), the same requests one at a time on the three, the order rotating. Prints and writes
benchmarks/results/k_per_request.md: per request of the mixed batch, the K it asked and vLLM's own
per-request figures (steps, drafts, accepted, the longest draft of a step); per K, the sampling
test's G-tests and smallest p against its bound, and the drafts the server made meanwhile.

    .venv/bin/python benchmarks/k_per_request.py --rows 300
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NGRAM_8 = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PLAN = {"method": "ngram", "domains": {"json": 8, "chat": 0}, "default": 0}
SUFFIX_8 = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
            "suffix_decoding_min_token_prob": 0.1, "suffix_decoding_max_spec_factor": 1.0}


def mixed_batch(server, requests: dict, tokens: int) -> list[dict]:
    """Every domain's requests at once (json and chat by their domain, two more by their own K)."""
    asks = [(r, {"domain": domain}) for domain, rs in requests.items() for r in rs]
    asks += [(requests["json"][0], {"k": 2}), (requests["json"][0], {"k": 0})]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: server.complete(ask[0].prompt_ids, max_tokens=tokens, **ask[1]),
                                asks))
    rows = []
    for (request, ask), answer in zip(asks, answers):
        spec = answer["metrics"]["speculative_decoding"]
        histogram = spec["acceptance_histogram"]
        rows.append({"request": request.request_id, "asked": json.dumps(ask), "steps": spec["num_spec_steps"],
                     "drafts": spec["num_draft_tokens"], "accepted": spec["num_accepted_draft_tokens"],
                     "longest": (spec["num_draft_tokens"] // spec["num_spec_steps"]) if spec["num_spec_steps"] else 0,
                     "histogram": histogram})
    return rows


@contextlib.contextmanager
def skip_off(variable: str, servers):
    """Start the servers with the plugin's skip of K 0 requests off (the variable at "0" while
    they start; each server reads it once), and stop them at the end."""
    os.environ[variable] = "0"
    try:
        with contextlib.ExitStack() as stack:
            for server in servers:
                stack.enter_context(server)
            os.environ.pop(variable, None)
            yield
    finally:
        os.environ.pop(variable, None)


def k0_against_plain(spec_servers: dict, plain_server, requests: list, tokens: int, rounds: int) -> dict:
    """Decode-phase seconds per token of the same requests at K 0 on each speculative server and on
    the plain one, one at a time, the order rotating; per server, the ratio (K 0 over plain) per
    pair: {name: {pairs, median, low, high}}."""
    from tasks.serving.load import run_level

    ratios: dict = {name: [] for name in spec_servers}
    servers = [(name, server, 0) for name, server in spec_servers.items()] + [(None, plain_server, None)]
    for n in range(rounds):
        for request in requests:
            item = {"id": request.request_id, "prompt_ids": request.prompt_ids, "max_tokens": tokens,
                    "temperature": 0.0}
            seconds = {}
            shift = n % len(servers)
            for name, server, k in servers[shift:] + servers[:shift]:
                [done] = run_level(server, [dict(item, k=k)], 1, 300.0)["requests"]
                seconds[name] = done["decode_s"] / max(len(done["token_ids"]) - 1, 1)
            for name in spec_servers:
                ratios[name].append(seconds[name] / seconds[None])
    out = {}
    for name, values in ratios.items():
        values.sort()
        out[name] = {"pairs": len(values), "median": values[len(values) // 2], "low": values[0],
                     "high": values[-1]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k0-rounds", type=int, default=4, help="rounds of the K 0 against plain pairs")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "k_per_request.md"))
    args = parser.parse_args()

    from specdec_core import load_model
    from tasks.serving.environment import served_model_dir
    from tasks.serving.server import VllmServer
    from tasks.serving.vllm_plugin.specdec_vllm_mends import SKIP_VARIABLE
    from tasks.settings import load_settings
    from tasks.steps.checks.engine_validate import BLOCK_SIZE, engine_report
    from tasks.steps.checks.validate import validation_context, validation_samplings

    from engine_sampling_power import domain_requests

    settings = load_settings()
    target, _ = load_model("smollm2-135m-instruct", device="cpu")
    model_dir = served_model_dir("smollm2-135m-instruct")
    requests = {domain: domain_requests(domain, 3) for domain in ("json", "chat")}
    _, context = validation_context(target, requests["json"])
    samplings = validation_samplings(requests["json"], 2)
    work = Path(tempfile.mkdtemp(prefix="k-per-request-"))
    (work / "plan.json").write_text(json.dumps(PLAN))
    server = VllmServer(str(model_dir), NGRAM_8, work / "server.log", dtype="float32",
                        max_num_seqs=16, block_size=BLOCK_SIZE, settings=settings,
                        plan_path=work / "plan.json")
    began = time.perf_counter()
    with server:
        batch = mixed_batch(server, requests, args.tokens)
        tests = []
        for k in (0, 1, 8):
            before = server.metrics()["draft_tokens"]
            report = engine_report(server, target, context, samplings, rows=args.rows, length=3,
                                   alpha=settings.validation.alpha, seed=k, k=k)
            worst = min(report.tests, key=lambda t: t.p_value)
            tests.append({"k": k, "passed": report.passed, "tests": len(report.tests),
                          "min_p": worst.p_value, "bound": worst.threshold,
                          "drafts": server.metrics()["draft_tokens"] - before})
        log_lines = [line for line in server.log_path.read_text().splitlines() if "k-per-request" in line][:1]
    # K 0 against plain, one method at a time (three servers alive at once: each holds about 5 GB,
    # and five at once left vLLM too little memory for its KV cache): the method's server with
    # the plugin's skip and with it off (K 0 requests searched, as vLLM does), and plain
    plain = VllmServer(str(model_dir), None, work / "plain.log", dtype="float32", max_num_seqs=16,
                       block_size=BLOCK_SIZE, settings=settings)
    k0 = {}
    with plain:
        for method, config in (("ngram", NGRAM_8), ("suffix", SUFFIX_8)):
            skipping = VllmServer(str(model_dir), config, work / f"{method}.log", dtype="float32",
                                  max_num_seqs=16, block_size=BLOCK_SIZE, settings=settings)
            searched = VllmServer(str(model_dir), config, work / f"{method}-searched.log", dtype="float32",
                                  max_num_seqs=16, block_size=BLOCK_SIZE, settings=settings)
            with skipping, skip_off(SKIP_VARIABLE, [searched]):
                k0.update(k0_against_plain({method: skipping, f"{method}, K 0 searched": searched}, plain,
                                           requests["json"] + requests["chat"], args.tokens, args.k0_rounds))
    seconds = time.perf_counter() - began
    lines = ["# K per request on one vLLM server", "",
             f"Command: `.venv/bin/python benchmarks/k_per_request.py --rows {args.rows} --tokens {args.tokens} "
             f"--k0-rounds {args.k0_rounds}`; "
             f"vLLM's CPU build, the embedded default, one ngram server at K 8 with the plan "
             f"`{json.dumps(PLAN)}`; {seconds:.0f} s; load average at the end "
             + " / ".join(f"{v:.2f}" for v in os.getloadavg()) + " (1, 5, 15 minutes).", "",
             "The server's log: `" + (log_lines[0].split("specdec k-per-request: ")[-1] if log_lines else "-") + "`", "",
             "## One mixed batch (all requests in flight at once)", "",
             "| request | asked (vllm_xargs) | steps | drafts | accepted | drafts per step | acceptance histogram |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['request']} | {r['asked']} | {r['steps']} | {r['drafts']} | {r['accepted']} | "
              f"{r['longest']} | {r['histogram']} |" for r in batch]
    lines += ["", "## The sampling test on the same server, each request asking its K", "",
              f"{args.rows} rows per test, {len(samplings)} sampling settings x 3 positions, alpha "
              f"{settings.validation.alpha} (Bonferroni).", "",
              "| K | G-tests | smallest p | bound | passed | drafts during the test |", "|---|---|---|---|---|---|"]
    lines += [f"| {t['k']} | {t['tests']} | {t['min_p']:.3g} | {t['bound']:.2g} | {t['passed']} | {t['drafts']} |"
              for t in tests]
    lines += ["", "## A K 0 request on a speculative server against a plain server", "",
              f"The same {len(requests['json']) + len(requests['chat'])} requests, greedy, {args.tokens} tokens, one "
              f"at a time on each of five servers (ngram at K 8 and suffix at K 8 `{json.dumps(SUFFIX_8)}`, "
              f"each with the plugin's skip of K 0 requests and with it off ({SKIP_VARIABLE}=0: "
              f"K 0 requests searched, as vLLM does), and plain), the order rotating; decode "
              f"seconds per token at K 0 over plain's, per pair:", "",
              "| server | pairs | median | range |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['pairs']} | {r['median']:.3f} | {r['low']:.3f}-{r['high']:.3f} |"
              for name, r in k0.items()]
    lines += ["", "This is what the engine check's and the load check's plain control (K 0 on the "
              "config's own server) pays beside a plain deployment, with the plugin's skip and "
              "without it (vLLM runs the proposer's host search for the whole batch and the cut "
              "comes after)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0 if all(t["passed"] for t in tests) else 1


if __name__ == "__main__":
    sys.exit(main())
