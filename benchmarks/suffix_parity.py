"""Our suffix proposer against vLLM's suffix decoding, and where the load check's acceptance
misses come from (issue: decisions that hold on a busy machine).

The load check predicts each level's speedup from our offline acceptance of the level's requests
(their logged responses, our SuffixDrafter over the run's index) and measures it on a vLLM suffix
server, whose proposer is Arctic Inference's SuffixDecodingCache. Three things can part the two:

1. **the algorithm**: our proposer (specdec_core.suffix.propose_path: the longest matched
   suffix, a token kept while its own share of the occurrences is at least min_token_prob) and
   Arctic's (every match length tried, the best-scoring path kept, a path cut where its running
   probability falls under min_token_prob), on the same text and the same history;
2. **the tree**: our index holds the run's whole history; the check's server holds the
   `load_history` newest of it plus every response it has served (each level's, both waves;
   replayed here with the logged responses, one request after another);
3. **the responses**: we score each request's logged response; vLLM scores the one it
   generates, the same text for a greedy request, another draw for a sampled one.

Per stored home (benchmarks/busy_neighbour.py's --work/<run>) and level this prints the mean
accepted length E (tokens per round) of: ours (the load check's own offline_totals); Arctic on
our index's history (1: the algorithm alone); Arctic on the server's history as the load check
served it (2); and vLLM's own counters (3: what was served). Then, on the first home, position
by position along every response (teacher-forced, both on the index's history), how often the
two proposers draft the same tokens, and their mean accepted lengths.

Nothing is served or timed: the target runs on this process (our estimate), Arctic in the
serving environment (`make serving-env`), fed JSON.

    python benchmarks/suffix_parity.py /tmp/bn16/quiet-8 /tmp/bn16/busy-6 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SERVING_PYTHON = ROOT / ".venv-serving" / "bin" / "python"
DEPTH = 24        # vLLM's suffix_decoding_max_tree_depth default (our drafter's max_depth)


def dump_home(home: Path, positions: bool) -> dict:
    """The home's suffix levels as token ids: per domain its index history (oldest first), the
    load check's history count, each level's requests (prompt, logged response cut where vLLM's
    stopped, temperature, vLLM's counters, our offline totals), and with `positions` our
    proposer's draft at every response position."""
    os.environ["SPECDEC_HOME"] = str(home)
    from tasks.db.queries_suffix import run_window_and_sample
    from tasks.steps.context import RunContext
    from tasks.steps.drafters.suffix_index import _indexable
    from tasks.steps.spec import RunSpec

    db = home / "specdec.db"
    with sqlite3.connect(db) as connection:
        run_id = connection.execute("SELECT run_id FROM eval_runs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
        suffix = connection.execute("SELECT domain, drafter FROM domain_configs WHERE run_id = ? AND drafter "
                                    "LIKE 'suffix%'", (run_id,)).fetchall()
        levels = {d: connection.execute("SELECT concurrency, k, per_request FROM load_check_levels WHERE run_id = ? "
                                        "AND domain = ? ORDER BY concurrency", (run_id, d)).fetchall()
                  for d, _ in suffix}
        reasons = dict(connection.execute("SELECT domain, reason FROM load_check_domains WHERE run_id = ?", (run_id,)))
    context = RunContext.build(RunSpec(run_id=run_id, db_url=f"sqlite:///{db}",
                                       tracking_uri=f"sqlite:///{home / 'mlflow.db'}"))
    until, sampled = run_window_and_sample(context.store, run_id)
    out = {"home": home.name, "domains": {}}
    for domain, label in suffix:
        if not levels[domain]:
            continue
        drafter = context.domain_drafters(domain)[label][1]
        by_id = {r.request_id: r for r in context.domain_requests(domain)[0]}
        rows = _indexable(context.store, domain, context.fingerprint, context.tokenizer, until, None, sampled)
        primed = _primed(reasons.get(domain) or "")
        out["domains"][domain] = {
            "history": [[int(t) for t in response] for _, _, response in rows], "primed": primed,
            "params": {"min_token_prob": drafter.min_token_prob, "max_spec_factor": drafter.max_spec_factor},
            "levels": [_level(context.model, drafter, by_id, c, k, json.loads(per), positions)
                       for c, k, per in levels[domain]]}
    context.store.engine.dispose()
    return out


def _primed(reason: str) -> int:
    """How many history requests the load check served first (its reason says so)."""
    marker = "first served "
    return int(reason.split(marker, 1)[1].split()[0]) if marker in reason else 0


def _level(model, drafter, by_id, concurrency, k, per_request, positions: bool) -> dict:
    import numpy as np
    from specdec_core.suffix import propose_path
    from tasks.steps.checks.confirm import offline_totals, truncated
    from tasks.steps.checks.engine_replay import end_slot

    requests = [(r, end_slot(truncated(by_id[r["request_id"].split("#")[0]], r["spec_tokens"]))) for r in per_request]
    ours = offline_totals(model, drafter, [q for _, q in requests], k)
    items = []
    for served, request in requests:
        prompt, response = [int(t) for t in request.prompt_ids], [int(t) for t in request.response_ids]
        totals = ours.get(request.request_id)
        item = {"id": served["request_id"], "prompt": prompt, "response": response,
                "greedy": not (request.sampling.temperature or 0) > 0, "spec_tokens": served["spec_tokens"],
                "served": served.get("spec") or {},
                "ours": [float(totals.tokens), float(totals.rounds)] if totals else None}
        if positions:
            item["drafts"] = [propose_path(np.asarray(prompt + response[:t], dtype=np.int64), k, drafter.index,
                                           drafter.max_depth, drafter.min_token_prob, drafter.max_spec_factor).tolist()
                              for t in range(1, len(response))]
        items.append(item)
    return {"concurrency": concurrency, "k": k, "requests": items}


ARCTIC = r'''
import json, sys
import numpy as np
from arctic_inference.suffix_decoding import SuffixDecodingCache

DEPTH = %d
data = json.load(open(sys.argv[1]))
ids = iter(range(10 ** 9))


def learn(cache, response, prompt=()):
    """A finished request: its response in the global tree."""
    rid = next(ids)
    cache.start_request(rid, list(prompt))
    cache.add_active_response(rid, response)
    cache.stop_request(rid)


def walk(cache, prompt, response, k, params, keep):
    """vLLM's loop along `response`: the first token from prefill, then each step a draft from
    the last DEPTH tokens, its accepted prefix plus one token appended. (tokens, rounds)."""
    rid = next(ids)
    cache.start_request(rid, np.asarray(prompt, dtype=np.int32))
    out = response[:1]
    cache.add_active_response(rid, out)
    rounds = 0
    while len(out) < len(response):
        context = np.asarray(prompt + out, dtype=np.int32)[-DEPTH:]
        draft = cache.speculate(rid, context, max_spec_tokens=k, **params).token_ids
        accepted = 0
        while (accepted < len(draft) and len(out) + accepted < len(response)
               and draft[accepted] == response[len(out) + accepted]):
            accepted += 1
        new = response[len(out):len(out) + accepted + 1]
        out = out + new
        rounds += 1
        cache.add_active_response(rid, new)
    cache.stop_request(rid)
    if not keep:
        cache.evict_cached_response(rid)
    return [len(response) - 1, rounds]


def drafts(cache, prompt, response, k, params):
    """Arctic's draft at every response position (teacher-forced), on the same tree."""
    rid = next(ids)
    cache.start_request(rid, np.asarray(prompt, dtype=np.int32))
    cache.add_active_response(rid, response[:1])
    out = []
    for t in range(1, len(response)):
        context = np.asarray(prompt + response[:t], dtype=np.int32)[-DEPTH:]
        out.append(list(cache.speculate(rid, context, max_spec_tokens=k, **params).token_ids))
        cache.add_active_response(rid, response[t:t + 1])
    cache.stop_request(rid)
    cache.evict_cached_response(rid)
    return out


result = {}
for domain, d in data["domains"].items():
    params = d["params"]
    index = SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=-1)
    for response in d["history"]:
        learn(index, response)
    server = SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=-1)
    for response in d["history"][::-1][:d["primed"]]:
        learn(server, response)
    levels = []
    for level in d["levels"]:
        rows = []
        for r in level["requests"]:
            row = {"index": walk(index, r["prompt"], r["response"], level["k"], params, keep=False),
                   "server": walk(server, r["prompt"], r["response"], level["k"], params, keep=True)}
            if "drafts" in r:
                row["drafts"] = drafts(index, r["prompt"], r["response"], level["k"], params)
            rows.append(row)
        for r in level["requests"]:     # the level's K 0 wave: served after the config's
            learn(server, r["response"], r["prompt"])
        levels.append(rows)
    result[domain] = levels
json.dump(result, sys.stdout)
''' % DEPTH


def arctic(dump: dict) -> dict:
    """Arctic's figures for the dump, from the serving environment."""
    if not SERVING_PYTHON.exists():
        sys.exit(f"{SERVING_PYTHON} is missing: run `make serving-env` (Arctic Inference is vLLM's suffix proposer)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "dump.json").write_text(json.dumps(dump))
        (Path(tmp) / "arctic.py").write_text(ARCTIC)
        done = subprocess.run([str(SERVING_PYTHON), str(Path(tmp) / "arctic.py"), str(Path(tmp) / "dump.json")],
                              capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"Arctic's replay failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def served_totals(r: dict, k: int) -> list[float]:
    """(tokens, rounds) vLLM served (load_decompose.served_totals: rounds are the emitted tokens
    less the accepted, at least the drafts)."""
    from load_decompose import served_totals as totals

    served = totals({"spec": r["served"], "spec_tokens": r["spec_tokens"]}, k)
    return [served.tokens, served.rounds]


def e_of(pairs: list) -> float | None:
    pairs = [p for p in pairs if p]
    return sum(p[0] for p in pairs) / sum(p[1] for p in pairs) if pairs else None


def rows_of(dump: dict, replay: dict) -> list[dict]:
    rows = []
    for domain, d in dump["domains"].items():
        for level, arctic_rows in zip(d["levels"], replay[domain]):
            for greedy in (None, True, False):
                chosen = [(r, a) for r, a in zip(level["requests"], arctic_rows) if greedy is None or r["greedy"] == greedy]
                if not chosen:
                    continue
                rows.append({"home": dump["home"], "domain": domain, "concurrency": level["concurrency"],
                             "k": level["k"], "requests": {None: "all", True: "greedy", False: "sampled"}[greedy],
                             "n": len(chosen), "ours": e_of([r["ours"] for r, _ in chosen]),
                             "arctic_index": e_of([a["index"] for _, a in chosen]),
                             "arctic_server": e_of([a["server"] for _, a in chosen]),
                             "served": e_of([served_totals(r, level["k"]) for r, _ in chosen])})
    return rows


def accepted(draft: list, truth: list) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def position_parity(dump: dict, replay: dict) -> list[dict]:
    """Per domain: positions, drafts equal, mean draft length and mean accepted length of each."""
    out = []
    for domain, d in dump["domains"].items():
        same = total = 0
        lengths, accepts = [0, 0], [0, 0]
        for level, arctic_rows in zip(d["levels"], replay[domain]):
            for r, a in zip(level["requests"], arctic_rows):
                for t, (ours, theirs) in enumerate(zip(r["drafts"], a["drafts"]), start=1):
                    truth = r["response"][t:]
                    total += 1
                    same += ours == theirs
                    lengths[0] += len(ours)
                    lengths[1] += len(theirs)
                    accepts[0] += accepted(ours, truth)
                    accepts[1] += accepted(theirs, truth)
        if total:
            out.append({"domain": domain, "positions": total, "same": same / total,
                        "ours_len": lengths[0] / total, "arctic_len": lengths[1] / total,
                        "ours_acc": accepts[0] / total, "arctic_acc": accepts[1] / total})
    return out


def table(rows: list[dict], parity: list[dict], first: str) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"    # noqa: E731
    lines = ["| run | domain | concurrent | K | requests | ours | Arctic, index history (1) "
             "| Arctic, server's history (2) | vLLM served (3) |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['home']} | {r['domain']} | {r['concurrency']} | {r['k']} | {r['requests']} ({r['n']}) "
              f"| {f(r['ours'])} | {f(r['arctic_index'])} | {f(r['arctic_server'])} | {f(r['served'])} |" for r in rows]
    lines += ["", "Mean |log ratio| against ours, over the levels (all requests):", ""]
    everything = [r for r in rows if r["requests"] == "all" and r["ours"]]
    for key, name in (("arctic_index", "Arctic, index history"), ("arctic_server", "Arctic, server's history"),
                      ("served", "vLLM served")):
        errors = [abs(math.log(r[key] / r["ours"])) for r in everything if r[key]]
        lines.append(f"- {name}: {sum(errors) / len(errors):.1%} over {len(errors)} levels" if errors else f"- {name}: -")
    lines += ["", f"Position by position ({first}, teacher-forced, both on the index's history):", "",
              "| domain | positions | same draft | draft length ours / Arctic | accepted ours / Arctic |",
              "|---|---|---|---|---|"]
    lines += [f"| {p['domain']} | {p['positions']} | {p['same']:.1%} | {p['ours_len']:.2f} / {p['arctic_len']:.2f} "
              f"| {p['ours_acc']:.2f} / {p['arctic_acc']:.2f} |" for p in parity]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("homes", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows, parity = [], []
    for n, home in enumerate(args.homes):
        print(f"{home}: our estimate of each level", file=sys.stderr)
        dump = dump_home(home, positions=n == 0)
        print(f"{home}: Arctic's replay", file=sys.stderr)
        replay = arctic(dump)
        rows += rows_of(dump, replay)
        if n == 0:
            parity = position_parity(dump, replay)
    text = table(rows, parity, args.homes[0].name)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
