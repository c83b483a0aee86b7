"""Runs inside the serving environment (vLLM's own virtual environment), never in the pipeline's:
`SERVING_PYTHON vllm_probe.py COMMAND` reads a JSON request on stdin and writes one JSON answer on
stdout (vLLM's logs go to stderr). It imports vLLM, numpy (one of vLLM's own requirements) and the
standard library only.

Commands:
  versions        {} -> {vllm, torch, transformers}
  check-configs   {model, configs: {name: speculative_config}} -> {name: {ok, error}}: each config
                  through vLLM's own engine-argument validation (what `vllm serve
                  --speculative-config` does before it starts an engine)
  ngram           {min_n, max_n, k, sequences: [[token, ...], ...]} -> {proposals: [[...], ...]}:
                  what vLLM's `ngram` proposer proposes after each whole sequence
  replay          {model, speculative_config (null: plain), requests: [{id, prompt_ids, max_tokens,
                  temperature, top_k, top_p, seed, k, group}], history: [...], max_model_len,
                  max_num_seqs, dtype, together, budget_s}
                  -> {start_s, vllm, requests: {id: {token_ids, seconds, decode_s, drafted,
                  accepted}},
                  counters: {drafts, draft_tokens, accepted_tokens, accepted_per_pos}, refused,
                  died: {request, error}, mends: [line, ...], left_out: [ids]}: one engine
                  started with the config, the history served first in one call (batched up to
                  max_num_seqs, not measured), then the requests one at a time (together: all
                  in one call, batched, answering only their token_ids); per request, vLLM's
                  own per-step drafted/accepted counts (--per-request-spec-decode-metrics
                  detailed) and the engine's spec_decode counters from LLM.get_metrics(); a
                  request that kills the engine ends the replay there, with vLLM's error (the
                  caller starts a fresh process for the requests after it); the parts of vLLM's
                  CPU sampler found broken are mended by the specdec_vllm_mends plugin (its lines
                  in "mends"), unless the request says "mend": false; a pair (a request and
                  its "plain::" K 0 twin) not started within its group's share of budget_s
                  (budget_shares) is left out
  time-steps      decode steps of one engine timed at batch sizes (see time_steps)
  time-paired     decode steps of one engine timed at K 0 and every K in alternating batches,
                  K per request (the plugin), repeated until the ratios settle (see time_paired)
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np


def versions(_request: dict) -> dict:
    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def _error_line(exc: BaseException) -> str:
    """vLLM's own error in one line: its first two lines (a validation error's header and what
    failed), without pydantic's links and input dumps."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and "errors.pydantic.dev" not in line and not line.strip().startswith("[type=")]
    return f"{type(exc).__name__}: {' | '.join(lines[:2])}"[:1000]


def check_configs(request: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    out = {}
    for name, spec in request["configs"].items():
        try:
            EngineArgs(model=request["model"], speculative_config=spec,
                       max_model_len=request.get("max_model_len"),   # None: the model's own
                       enforce_eager=True).create_engine_config()
            out[name] = {"ok": True, "error": None}
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusal, reported as it is
            out[name] = {"ok": False, "error": _error_line(exc)}
    return out


def ngram(request: dict) -> dict:
    from vllm.v1.spec_decode import ngram_proposer

    find = ngram_proposer._find_longest_matched_ngram_and_propose_tokens
    proposals = []
    for sequence in request["sequences"]:
        tokens = np.asarray(sequence, dtype=np.int32)
        found = find(tokens, int(request["min_n"]), int(request["max_n"]),
                     int(request.get("max_model_len", 1 << 20)), int(request["k"]))
        proposals.append([] if found is None else [int(t) for t in found])
    return {"proposals": proposals}


def _counters(llm) -> dict:
    """vLLM's own vllm:spec_decode_* counters (summed over label sets)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            have = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(have + [0] * len(values),
                                                             values + [0] * len(have))][:max(len(have), len(values))]
    return out


PLUGIN_DIR = Path(__file__).resolve().parents[1] / "vllm_plugin"


def _mends():
    """specdec_vllm_mends: the mends of vLLM's CPU build (a vLLM general plugin, installed into
    the serving environment by `make serving-env`; read from the repository where it is not)."""
    try:
        import specdec_vllm_mends
    except ImportError:
        sys.path.append(str(PLUGIN_DIR))
        import specdec_vllm_mends
    return specdec_vllm_mends


def _with_mends(command):
    """The command's answer with the mends made in this process ("mends": lines)."""
    def run(request: dict) -> dict:
        answer = command(request)
        answer["mends"] = list(_mends().MADE)
        return answer
    return run


def replay(request: dict) -> dict:
    import vllm

    spec = request.get("speculative_config")
    answer = {"vllm": vllm.__version__, "start_s": None, "requests": {}, "counters": None,
              "refused": None, "died": None, "mends": []}
    llm = _start(request, spec, int(request.get("max_num_seqs", 1)), answer)
    if llm is None:
        return answer
    history = request.get("history", [])
    items = []
    if history:      # served first, not measured
        if _generate_all(llm, history, answer, blame=history[-1]["id"]) is None:
            return answer
    elif request["requests"] and (spec or {}).get("method") != "suffix":
        # a warm-up (not measured): the first request's prompt, a few tokens; the proposer's
        # first call compiles (vLLM's ngram search is JIT-compiled) and must not be timed. Not
        # for suffix decoding, whose tree grows from every request served
        items = [(dict(request["requests"][0], id="warm-up", max_tokens=4), False)]
    items += [(item, True) for item in request["requests"]]
    if request.get("together"):
        # all in one call (batched up to max_num_seqs): the outputs, not timed
        results = _generate_all(llm, [item for item, _ in items], answer, blame=items[0][0]["id"])
        if results is None:
            return answer
        for (item, measured), result in zip(items, results):
            if measured:
                answer["requests"][str(item["id"])] = {
                    "token_ids": [int(t) for t in result.outputs[0].token_ids]}
        answer["counters"] = _counters(llm) if spec else None
        return answer
    hz = os.sysconf("SC_CLK_TCK")
    limit = float(request.get("contention_cores", 0.25)) + float(request.get("spare_cores", 0.0))
    shares = budget_shares(request["requests"], request.get("budget_s"))
    began, leaving = time.perf_counter(), False
    answer["left_out"] = []
    for item, measured in items:
        if measured and not str(item["id"]).startswith(PLAIN):
            # a pair starts only inside its group's share of the budget (its K 0 twin follows it)
            leaving = time.perf_counter() - began > shares.get(str(item.get("group")), float("inf"))
            if leaving:
                answer["left_out"].append(str(item["id"]))
        if measured and leaving:
            continue
        try:
            served = _served_one(llm, item, hz, limit)
        except Exception as exc:  # noqa: BLE001 - the engine died on this request: said, and stop
            traceback.print_exc()             # into the engine's log
            # the warm-up shares the first request's prompt: what killed it is that request's
            dead = request["requests"][0]["id"] if item["id"] == "warm-up" else item["id"]
            answer["died"] = {"request": str(dead), "error": _error_line(exc)}
            break
        if measured:
            answer["requests"][str(item["id"])] = served
    if not answer["died"]:
        slack = request.get("slowed")
        mark_slowed(request["requests"], answer["requests"], slack)
        if not answer["left_out"]:        # a spent budget serves nothing more
            _serve_contended_again(llm, request, answer, hz, limit, slack)
    answer["counters"] = _counters(llm) if spec else None
    return answer


PLAIN = "plain::"      # the id prefix of a request's K 0 twin (tasks/steps/checks/engine_replay.py)


def budget_shares(items: list[dict], budget_s: float | None) -> dict[str, float]:
    """Per group of the replayed items (its domain), in their order, the seconds from the
    replay's first measured request past which none of its pairs starts: the budget shared out
    evenly and cumulatively, so a group that ends early leaves its time to the next ones. None:
    no budget (every pair is served)."""
    if budget_s is None:
        return {}
    groups = list(dict.fromkeys(str(item.get("group")) for item in items))
    return {group: float(budget_s) * (i + 1) / len(groups) for i, group in enumerate(groups)}


def replay_step(served: dict | None) -> float | None:
    """A replayed request's decode-phase seconds per engine step (its drafted steps from vLLM's
    per-request metrics, else its tokens after the first); None without a timing."""
    if not served or not served.get("decode_s"):
        return None
    steps = len(served["drafted"]) if served.get("drafted") else len(served["token_ids"]) - 1
    return served["decode_s"] / steps if steps > 0 else None


def mark_slowed(items: list[dict], served: dict, slack: float | None) -> None:
    """Mark "slowed" each served request whose step is more than `slack` over the fastest step of
    the requests asking the same K on this engine (one request's step is about another's: the
    same model, one request at a time). A neighbour working in bursts stalls a request 2 to 3
    times over without /proc showing another process's CPU above the limit (busy 1 of the last
    series: json's twins at 4.5 s against 1.8 s, none marked contended). None: never."""
    steps = {str(item["id"]): (item.get("k"), replay_step(served.get(str(item["id"])))) for item in items}
    fastest: dict = {}
    for k, step in steps.values():
        if step is not None:
            fastest[k] = min(fastest.get(k, step), step)
    for key, (k, step) in steps.items():
        if key in served:
            served[key]["slowed"] = bool(slack is not None and step is not None
                                         and step > fastest[k] * (1 + slack))


def _served_one(llm, item: dict, hz: int, limit: float) -> dict:
    """One request served alone and timed: its tokens, wall and decode-phase seconds (vLLM's own
    timestamps), its drafts per step, and the CPU other processes took meanwhile (cores; over
    `limit`: contended)."""
    cpu0, began = cpu_jiffies(), time.perf_counter()
    [result] = llm.generate([_prompt(item)], _sampling_params(item), use_tqdm=False)
    cpu1, wall = cpu_jiffies(), time.perf_counter() - began
    other = max((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]), 0) / hz / max(wall, 1e-9)
    completion = result.outputs[0]
    metrics = completion.spec_decode_metrics
    phase = _decode_phase(result)
    return {"token_ids": [int(t) for t in completion.token_ids], "seconds": wall,
            "decode_s": None if phase["first_token_ts"] is None
            else phase["last_token_ts"] - phase["first_token_ts"],
            "drafted": None if metrics is None else [int(v) for v in metrics.per_step_drafted],
            "accepted": None if metrics is None else [int(v) for v in metrics.per_step_accepted],
            "other_cores": round(other, 3), "contended": other > limit, "served": 1,
            # the engine's own CPU meanwhile (cores): a stalled request's falls with its speed
            "own_cores": round((cpu1[1] - cpu0[1]) / hz / max(wall, 1e-9), 3)}


def _serve_contended_again(llm, request: dict, answer: dict, hz: int, limit: float,
                           slack: float | None = None) -> None:
    """The K 0 items timed while other processes took CPU, or slowed (mark_slowed), served again
    (up to request["retries"] times each, after the replay), the better timing kept: one not
    contended over one that was, else the faster step. Only K 0 items: they draft nothing, so
    the engine's acceptance counters and a suffix tree's drafts for the measured requests stay
    as the replay left them."""
    for _ in range(int(request.get("retries", 0))):
        again = [item for item in request["requests"] if item.get("k") == 0
                 and any((answer["requests"].get(str(item["id"])) or {}).get(flag)
                         for flag in ("contended", "slowed"))]
        for item in again:
            kept = answer["requests"][str(item["id"])]
            try:
                served = _served_one(llm, item, hz, limit)
            except Exception:  # noqa: BLE001 - a retry that fails keeps the first timing
                return
            better = ((served["contended"], replay_step(served) or float("inf"))
                      < (kept["contended"], replay_step(kept) or float("inf")))
            if served["token_ids"] == kept["token_ids"] and better:
                answer["requests"][str(item["id"])] = dict(served, served=kept["served"] + 1)
            else:
                kept["served"] += 1
        mark_slowed(request["requests"], answer["requests"], slack)


def _generate_all(llm, items: list[dict], answer: dict, blame: str):
    """The items' results from one call (the engine batches them up to max_num_seqs); None when
    the engine died, with vLLM's error in answer["died"] under the request id `blame`."""
    try:
        return llm.generate([_prompt(item) for item in items],
                            [_sampling_params(item) for item in items], use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - the engine died in the batch: said, and stop
        traceback.print_exc()             # into the engine's log
        answer["died"] = {"request": str(blame), "error": _error_line(exc)}
        return None


def _sampling_params(item: dict):
    """vLLM's SamplingParams of one replayed request (its logged sampling and length)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=int(item["max_tokens"]),
                          temperature=float(item.get("temperature", 0.0)),
                          top_k=int(item.get("top_k") or 0), top_p=float(item.get("top_p", 1.0)),
                          seed=item.get("seed"), detokenize=False,
                          # the request's own K (the plugin's K per request; 0: no drafts)
                          extra_args=None if item.get("k") is None else {"specdec_k": int(item["k"])})


def _prompt(item: dict):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(item["prompt_ids"]))


def _start(request: dict, spec, max_num_seqs: int, answer: dict):
    """An engine for the request's model with `spec` (None: plain), in this process; its start
    time, and any mends, in `answer`. None when vLLM refuses the config (answer["refused"])."""
    from vllm import LLM

    mends = _mends()
    if not request.get("mend", True):
        os.environ[mends.OFF_VARIABLE] = "0"     # read by the plugin when the engine loads it
    started = time.perf_counter()
    try:
        llm = LLM(model=request["model"], speculative_config=spec, enforce_eager=True,
                  disable_log_stats=False, max_model_len=request.get("max_model_len"),
                  max_num_seqs=max_num_seqs, seed=0, dtype=request.get("dtype", "auto"),
                  per_request_spec_decode_metrics="detailed" if spec else "none")
    except Exception as exc:  # noqa: BLE001 - vLLM's own refusal, reported as it is
        answer["refused"] = _error_line(exc)
        return None
    answer["start_s"] = time.perf_counter() - started
    if request.get("mend", True) and not _plugin_installed():
        # a serving environment without the plugin: the engine runs in this process
        # (VLLM_ENABLE_V1_MULTIPROCESSING=0), so mending it here reaches it
        mends.register()
    return llm


def _plugin_installed() -> bool:
    return any(e.value.startswith("specdec_vllm_mends") for e in entry_points(group="vllm.general_plugins"))


def _decode_phase(result) -> dict:
    """One finished request's decode phase from vLLM's own engine-core timestamps: seconds from
    its first token to its last, tokens after the first, verify steps and drafts."""
    completion = result.outputs[0]
    stats = result.metrics
    metrics = completion.spec_decode_metrics
    accepted = 0 if metrics is None else sum(int(v) for v in metrics.per_step_accepted)
    drafted = 0 if metrics is None else sum(int(v) for v in metrics.per_step_drafted)
    tokens = len(completion.token_ids)
    return {"first_token_ts": None if stats is None else float(stats.first_token_ts),
            "last_token_ts": None if stats is None else float(stats.last_token_ts),
            "decode_tokens": tokens - 1, "accepted": accepted, "drafted": drafted,
            # every step after the first token yields one token plus the drafts it accepted (drafts
            # accepted past max_tokens are counted too: the steps vLLM recorded, where more)
            "steps": max(tokens - 1 - accepted, 0,
                         0 if metrics is None else len(metrics.per_step_drafted))}


def time_steps(request: dict) -> dict:
    """{model, speculative_config (null: plain), prompts: [[id, ...], ...], batch_sizes, max_tokens,
    repeats, max_model_len, dtype, samplings} -> {vllm, start_s, refused, mends, timings: [{batch,
    batch_size, sampling, repeat, wall_s, decode_s, steps, tokens, decode_tokens, drafted,
    accepted}]}: one engine; per batch size and sampling (the first batch_size prompts sent at once,
    ignore_eos; samplings: {name: {temperature, top_k, top_p, seed, batch_sizes}}, default
    {"greedy": {}}; a sampling's batch_sizes, if given, limit it to those batch sizes), one
    warm-up per sampling, then repeats timed in alternating order. Instead of batch_sizes, `batches` ([[prompt, ...], ...])
    gives the batches themselves (batch: its index). wall_s: the whole call, prefill included;
    decode_s: from the batch's last first token to its last token (vLLM's engine-core
    timestamps); steps: the most decode steps of any request of the batch (they decode
    together)."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = request.get("speculative_config")
    batches = request.get("batches") or [request["prompts"][:int(b)]
                                         for b in sorted(int(b) for b in request["batch_sizes"])]
    answer = {"vllm": vllm.__version__, "start_s": None, "refused": None, "mends": [], "timings": []}
    llm = _start(request, spec, max(len(b) for b in batches), answer)
    if llm is None:
        return answer
    samplings = request.get("samplings") or {"greedy": {}}

    def params(sampling: dict):
        return SamplingParams(max_tokens=int(request["max_tokens"]), ignore_eos=True, detokenize=False,
                              temperature=float(sampling.get("temperature", 0.0)),
                              top_k=int(sampling.get("top_k") or 0),
                              top_p=float(sampling.get("top_p", 1.0)), seed=sampling.get("seed"))

    def prompts(batch: list) -> list:
        return [TokensPrompt(prompt_token_ids=list(p)) for p in batch]

    for sampling in samplings.values():                                          # warm-up
        llm.generate(prompts(max(batches, key=len)), params(sampling), use_tqdm=False)
    # a sampling may name the batch sizes it is timed at ("batch_sizes"; default: every batch)
    order = [(index, name) for name, sampling in samplings.items() for index in range(len(batches))
             if sampling.get("batch_sizes") is None or len(batches[index]) in sampling["batch_sizes"]]
    for repeat in range(int(request["repeats"])):
        for index, name in (order if repeat % 2 == 0 else order[::-1]):
            began = time.perf_counter()
            results = llm.generate(prompts(batches[index]), params(samplings[name]), use_tqdm=False)
            wall = time.perf_counter() - began
            phases = [_decode_phase(r) for r in results]
            firsts = [p["first_token_ts"] for p in phases]
            lasts = [p["last_token_ts"] for p in phases]
            answer["timings"].append({
                "batch": index, "batch_size": len(batches[index]), "sampling": name, "repeat": repeat,
                "wall_s": wall,
                "decode_s": None if None in firsts + lasts else max(lasts) - max(firsts),
                "steps": max(p["steps"] for p in phases),
                "tokens": sum(p["decode_tokens"] + 1 for p in phases),
                **{key: sum(p[key] for p in phases) for key in ("decode_tokens", "drafted", "accepted")}})
    return answer


def cpu_jiffies() -> tuple[int, int]:
    """(jiffies the whole machine spent busy, stolen time included; jiffies of this process, all
    its threads) from /proc: their differences over a timed batch give the CPU other processes
    took meanwhile."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]
    busy = sum(values) - values[3] - values[4]           # less idle and iowait
    with open("/proc/self/stat") as own:
        fields = own.read().rsplit(")", 1)[1].split()
    return busy, int(fields[11]) + int(fields[12])       # utime + stime


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
       12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def t95(df: int) -> float:
    """Student's t for a two-sided 95% interval with `df` degrees of freedom (the table's next
    smaller entry: never narrower than the exact value)."""
    if df < 1:
        return float("inf")
    return 1.96 if df > 30 else T95[max(d for d in T95 if d <= df)]


def ratio_interval(ratios: list[float], pooled: tuple[float, int] | None = None) -> tuple[float, float]:
    """(median, 95% half-width) of paired ratios: Student's t over a robust spread (1.4826 x the
    median absolute deviation), so that one batch the machine slowed does not widen it; (median,
    inf) below two. With `pooled` (pooled_spread: the engine's relative spread over all its
    ratios and its degrees of freedom), the spread is the larger of the pooled one and the
    ratio's own, and t the pooled degrees of freedom's: two clean pairs then settle a ratio
    whose pairs agree, where t with one degree of freedom (12.7) would not, and one clean pair
    gets the pooled spread's interval."""
    n = len(ratios)
    if not n:
        return float("nan"), float("inf")
    ordered = sorted(ratios)
    middle = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    usable = pooled is not None and pooled[1] >= 4
    if n < 2:       # one pair: only the engine's pooled spread can say how far it may be off
        return middle, t95(pooled[1]) * pooled[0] * middle if usable else float("inf")
    deviations = sorted(abs(r - middle) for r in ratios)
    spread = 1.4826 * (deviations[(n - 1) // 2] + deviations[n // 2]) / 2 * (n / (n - 1)) ** 0.5
    if usable:
        return middle, t95(pooled[1]) * max(pooled[0] * middle, spread) / n ** 0.5
    return middle, t95(n - 1) * spread / n ** 0.5


def _pair_key(row: dict):
    # rows timed as one pair share its `pair` (rows without one: paired by repeat)
    return row.get("pair", row["repeat"])


def _step(row: dict) -> float:
    return row["decode_s"] / row["steps"]


def fastest_steps(timings: list[dict]) -> dict:
    """{(batch size, sampling, K): the fastest step any of its batches timed}."""
    out: dict = {}
    for row in timings:
        if row["steps"] and row["decode_s"]:
            cell = (row["batch_size"], row["sampling"], row["k"])
            out[cell] = min(out.get(cell, float("inf")), _step(row))
    return out


def slowed(row: dict, fastest: dict, slack: float | None) -> bool:
    """Whether a batch's step is more than `slack` over the fastest of its (batch size, sampling,
    K): the same prompts at the same K do the same work, and a machine that is busy only slows
    a batch, so a batch that much slower was slowed by something else (None: never)."""
    if slack is None or not row["steps"] or not row["decode_s"]:
        return False
    return _step(row) > fastest[(row["batch_size"], row["sampling"], row["k"])] * (1 + slack)


def clean_pairs(timings: list[dict], group: tuple, k: int, contended: bool = False,
                slack: float | None = None) -> list[tuple[dict, dict]]:
    """The (batch at K, K 0 batch) pairs of a group: neither batch contended (unless `contended`:
    every pair) nor slowed (slowed(): a neighbour that came and went between two batches)."""
    by_pair: dict = {}
    for row in timings:
        if (row["batch_size"], row["sampling"]) == group and row["steps"]:
            by_pair.setdefault(_pair_key(row), {})[row["k"]] = row
    fastest = fastest_steps(timings)
    return [(r[k], r[0]) for r in by_pair.values() if k in r and 0 in r and r[0]["decode_s"] > 0
            and (contended or not (r[k]["contended"] or r[0]["contended"]))
            and not (slowed(r[k], fastest, slack) or slowed(r[0], fastest, slack))]


def paired_ratios(timings: list[dict], group: tuple, k: int, contended: bool = False,
                  slack: float | None = None) -> list[float]:
    """Step at K over the K 0 step timed beside it, over the pairs neither of whose batches was
    contended (with `contended`: every pair) or slowed (with `slack`)."""
    return [_step(at_k) / _step(plain) for at_k, plain in clean_pairs(timings, group, k, contended, slack)]


def pooled_spread(timings: list[dict], groups: dict, contended: bool = False,
                  slack: float | None = None) -> tuple[float, int]:
    """(relative spread of one ratio, degrees of freedom) pooled over every ratio of an engine with
    two clean pairs or more: 1.4826 x the median absolute deviation of the log ratios from their
    own ratio's median, each widened by sqrt(n / (n - 1)); degrees of freedom: the pairs less the
    ratios. (0, 0) where no ratio has two pairs."""
    residuals, pairs, ratios = [], 0, 0
    for group, ks in groups.items():
        for k in ks:
            values = [math.log(r) for r in paired_ratios(timings, group, k, contended, slack) if r > 0]
            if k == 0 or len(values) < 2:
                continue
            values.sort()
            n = len(values)
            middle = (values[(n - 1) // 2] + values[n // 2]) / 2
            residuals += [abs(v - middle) * (n / (n - 1)) ** 0.5 for v in values]
            pairs, ratios = pairs + n, ratios + 1
    if not residuals:
        return 0.0, 0
    residuals.sort()
    m = len(residuals)
    return 1.4826 * (residuals[(m - 1) // 2] + residuals[m // 2]) / 2, pairs - ratios


def open_ratios(timings: list[dict], groups: dict, halfwidth: float, least: int,
                contended: bool = False, dip: float = 0.0, slack: float | None = None) -> set:
    """The (group, K) whose ratio is not settled yet: fewer than `least` clean pairs, an interval
    wider than `halfwidth` of it (the spread pooled over the engine's ratios: pooled_spread), or
    a step cheaper at a larger K by more than `dip` beyond both intervals (a figure that breaks
    the shape costs must have is measured again: both Ks). groups: {(batch size, sampling): its
    Ks}."""
    out = set()
    pooled = pooled_spread(timings, groups, contended, slack)
    for group, ks in groups.items():
        timed = [k for k in ks if k > 0]
        figures = {}
        for k in timed:
            ratios = paired_ratios(timings, group, k, contended, slack)
            figures[k] = ratio_interval(ratios, pooled)
            if len(ratios) < least or not figures[k][1] <= halfwidth * figures[k][0]:
                out.add((group, k))
        for a, b in zip(timed, timed[1:]):
            (ma, ha), (mb, hb) = figures[a], figures[b]
            if mb + hb < (ma - ha) * (1 - dip):
                out |= {(group, a), (group, b)}
    return out


def time_paired(request: dict) -> dict:
    """{model, speculative_config (its largest K), prompts, batch_sizes, ks, samplings, steps,
    max_model_len, dtype, budget_s, min_rounds, first_rounds, halfwidth, min_repeats, max_repeats,
    contention_cores} ->
    {vllm, start_s, refused, mends, k_per_request, stopped, seconds, timings: [{batch_size,
    sampling, k, repeat, pair, decode_s, steps, tokens, drafted, accepted, wall_s, other_cores,
    contended}]}: one engine, K per request (the plugin's vllm_xargs specdec_k), each batch asked
    for `steps` x (K + 1) + 1 tokens (about `steps` decode steps at every K). A pair is a K 0 batch
    and a batch at K timed one right after the other (which goes first alternates), so that both
    see the same machine; each batch's other processes' CPU is read from /proc (a contended
    batch's pair is not counted while clean ones are). Rounds: every ratio not settled yet
    (open_ratios) gets one more pair, until none is open after at least min_repeats clean pairs
    each, or max_repeats rounds, or budget_s of timing (checked after each whole round, and no
    round begun that its pairs' last timings say would end past it; min_rounds, at least two,
    are always made, and first_rounds of the smallest batch size's pairs: _next_round)."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = request["speculative_config"]
    sizes = sorted(int(b) for b in request["batch_sizes"])
    ks = sorted({0} | {int(k) for k in request["ks"]})
    answer = {"vllm": vllm.__version__, "start_s": None, "refused": None, "mends": [], "timings": [],
              "k_per_request": None, "stopped": None, "seconds": None}
    llm = _start(request, spec, max(sizes), answer)
    if llm is None:
        return answer
    answer["k_per_request"] = bool(getattr(getattr(_scheduler_class(), "update_draft_token_ids", None),
                                           "specdec_k_per_request", False))
    samplings = request.get("samplings") or {"greedy": {}}
    groups = [(b, name) for name, sampling in samplings.items() for b in sizes
              if sampling.get("batch_sizes") is None or b in sampling["batch_sizes"]]
    hz = os.sysconf("SC_CLK_TCK")
    # contended: other processes took more CPU than the cores this engine left them, by the limit
    limit = float(request.get("contention_cores", 0.25)) + float(request.get("spare_cores", 0.0))

    def run(b: int, name: str, k: int, max_tokens: int):
        sampling = samplings[name]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                temperature=float(sampling.get("temperature", 0.0)),
                                top_k=int(sampling.get("top_k") or 0),
                                top_p=float(sampling.get("top_p", 1.0)), seed=sampling.get("seed"),
                                extra_args={"specdec_k": k})
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"][:b]]
        return llm.generate(prompts, params, use_tqdm=False)

    def timed(b: int, name: str, k: int, repeat: int, pair: int) -> dict:
        cpu0, wall0 = cpu_jiffies(), time.perf_counter()
        # the same number of decode steps at every K (drafts accepted or not, a step verifies
        # K): a fully accepted cycle emits K + 1 tokens a step
        results = run(b, name, k, int(request["steps"]) * (k + 1) + 1)
        cpu1, wall = cpu_jiffies(), time.perf_counter() - wall0
        other = max((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]), 0) / hz / max(wall, 1e-9)
        return dict(_batch_row(results, b, name, k, repeat, wall, other, limit), pair=pair)

    group_ks = {(b, name): sorted({0} | set(samplings[name].get("ks") or ks)) for b, name in groups}
    for b, name in groups:                                                      # warm-up
        if b == sizes[-1]:
            for k in (0, ks[-1]):
                run(b, name, k, 8)
    began, repeat, pair = time.monotonic(), 0, 0
    todo = [((b, name), k) for b, name in groups for k in group_ks[(b, name)] if k > 0]
    took: dict = {}                    # each pair's seconds in the round it was last timed
    while answer["stopped"] is None:
        for item in todo:
            (b, name), k = item
            started = time.monotonic()
            for at in ((0, k) if pair % 2 == 0 else (k, 0)):
                answer["timings"].append(timed(b, name, at, repeat, pair))
            took[item] = time.monotonic() - started
            pair += 1
        repeat += 1
        answer["stopped"], todo = _next_round(request, answer["timings"], group_ks, repeat, todo,
                                              time.monotonic() - began, took, sizes[0])
    answer["seconds"] = time.monotonic() - began
    return answer


def _next_round(request: dict, timings: list[dict], group_ks: dict, repeat: int, todo: list,
                spent: float, took: dict, smallest: int) -> tuple[str | None, list]:
    """(why the rounds stop, None: they go on; the next round's pairs) after `repeat` rounds.
    Where the budget stops them before first_rounds, the smallest batch size's pairs still open
    get another round (a few seconds at batch 1): the plan turns a domain on or off on its
    prices there, and beside a busy neighbour an engine cut at two rounds left them 17-37% wide."""
    following = _still_open(request, timings, group_ks, repeat, todo)
    stopped = _stop_reason(request, timings, group_ks, repeat, spent, sum(took[i] for i in following))
    first = [item for item in following if item[0][0] == smallest]
    if stopped == "budget" and first and repeat < int(request.get("first_rounds", 0)):
        return None, first
    return stopped, following


def _still_open(request: dict, timings: list[dict], group_ks: dict, repeat: int, todo: list) -> list:
    """The pairs of the next round: the ratios still open, in the order they were timed."""
    least, dip = int(request.get("min_repeats", 3)), float(request.get("dip", 0.0))
    crowded = repeat >= 2 * least and _mostly_contended(timings)
    unsettled = open_ratios(timings, group_ks, float(request["halfwidth"]), least,
                            contended=crowded, dip=dip, slack=request.get("slowed"))
    return [item for item in todo if item in unsettled] or todo


def _mostly_contended(timings: list[dict]) -> bool:
    pairs: dict = {}
    for row in timings:
        pairs[_pair_key(row)] = pairs.get(_pair_key(row), False) or row["contended"]
    return sum(pairs.values()) > len(pairs) / 2


def _stop_reason(request: dict, timings: list[dict], group_ks: dict, repeat: int,
                 spent: float, following_s: float = 0.0) -> str | None:
    """Why time_paired stops after `repeat` whole rounds (None: it goes on). following_s: what
    the next round's pairs took when last timed; a round that would end past the budget is not
    begun (beside a busy neighbour a round of the ngram engine took 45 s, and one begun a
    second short of the budget ran 45 s past it)."""
    least, most = int(request.get("min_repeats", 3)), int(request.get("max_repeats", 30))
    halfwidth, dip = float(request["halfwidth"]), float(request.get("dip", 0.0))
    slack = request.get("slowed")
    # whole rounds only, and at least min_rounds (two: an interval needs two pairs), whatever
    # the budget
    if repeat >= max(int(request.get("min_rounds", 2)), 2) and spent + following_s > float(request["budget_s"]):
        return "budget"
    if repeat >= most:
        return "max_repeats"
    if not open_ratios(timings, group_ks, halfwidth, least, dip=dip, slack=slack):
        return "settled"
    # a neighbour that stays (most pairs contended): its load is in both batches of each pair,
    # so every pair is used, and said
    if repeat >= 2 * least and _mostly_contended(timings) and not open_ratios(
            timings, group_ks, halfwidth, least, contended=True, dip=dip, slack=slack):
        return "settled_contended"
    return None


def _batch_row(results, b: int, name: str, k: int, repeat: int, wall: float, other: float,
               limit: float) -> dict:
    """One timed batch: its decode phase from vLLM's engine-core timestamps (the batch's last
    first token to its last token), the most decode steps of any request (they decode together),
    and the CPU other processes took meanwhile (cores)."""
    phases = [_decode_phase(r) for r in results]
    firsts = [p["first_token_ts"] for p in phases]
    lasts = [p["last_token_ts"] for p in phases]
    return {"batch_size": b, "sampling": name, "k": k, "repeat": repeat, "wall_s": wall,
            "decode_s": None if None in firsts + lasts else max(lasts) - max(firsts),
            "steps": max(p["steps"] for p in phases),
            "tokens": sum(p["decode_tokens"] + 1 for p in phases),
            "other_cores": round(other, 3), "contended": other > limit,
            **{key: sum(p[key] for p in phases) for key in ("decode_tokens", "drafted", "accepted")}}


def _scheduler_class():
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler


COMMANDS = {"versions": versions, "check-configs": check_configs, "ngram": ngram,
            "replay": _with_mends(replay), "time-steps": _with_mends(time_steps),
            "time-paired": _with_mends(time_paired)}


if __name__ == "__main__":
    from fork_server import pin_cpus    # the sibling file: a script's directory is on sys.path
    from json_command import run

    pin_cpus(os.environ.get("SPECDEC_PIN_CPUS"))   # (a fork has been pinned already)

    sys.exit(run("vllm_probe.py", COMMANDS))
