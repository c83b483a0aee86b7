"""Where the load check's predictions miss: acceptance or cost (issue: decisions that hold on a
busy machine).

The load check predicts each level's speedup from our engine's offline acceptance of the level's
requests, priced with vLLM's cost profile at the level's batch size, and measures it on vLLM.
Each level also stores vLLM's own per-request spec-decode counters (drafts, draft tokens,
accepted tokens). This re-prices every stored level with those counters in place of the offline
acceptance: the same cost profile, the same requests, the acceptance vLLM actually had. Where
that figure is close to the measured speedup and the stored prediction is not, the miss is the
offline acceptance estimate; where both miss, it is the cost model at that batch size, and the
last two columns set the level's measured costs beside the priced ones: the plain step (the K 0
side's decode seconds per token) against the profile's, and a round at K over the plain step
against the ratio the re-priced prediction implies.

Nothing is timed or served: it reads the homes benchmarks/busy_neighbour.py left behind.

    python benchmarks/load_decompose.py /tmp/bn16/quiet-7 /tmp/bn16/busy-4
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def served_totals(row: dict, k: int):
    """RoundTotals of one request as vLLM served it: each drafting round emits 1 + its accepted
    tokens, every other round 1 (the first token is prefill's); drafting rounds drafted the
    request's mean draft width (split between its floor and ceiling)."""
    from specdec_core.estimate import RoundTotals

    spec = row.get("spec") or {}
    tokens = float(row["spec_tokens"] - 1)
    drafts, drafted, accepted = (float(spec.get(key) or 0) for key in ("drafts", "draft_tokens", "accepted_tokens"))
    rounds = max(tokens - accepted, drafts, 1.0)
    widths = np.zeros(k + 1)
    widths[0] = rounds - drafts
    if drafts:
        mean = min(drafted / drafts, k)
        low = int(np.floor(mean))
        widths[low] += drafts * (1 - (mean - low))
        if low < k:
            widths[low + 1] += drafts * (mean - low)
    return RoundTotals(tokens=tokens, rounds=rounds, reached=np.zeros(k), accepted=np.zeros(k), widths=widths)


def levels(home: Path) -> list[dict]:
    """The home's load-check levels re-priced with vLLM's own acceptance."""
    from tasks.db.store import Store
    from tasks.steps.checks.engine_compare import predicted_speedup
    from tasks.steps.costs.cost_table import pays_sampled_steps, run_costs

    db = home / "specdec.db"
    with sqlite3.connect(db) as connection:
        connection.row_factory = sqlite3.Row
        run_id = connection.execute("SELECT run_id FROM eval_runs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
        configs = {r["domain"]: (r["drafter"], json.loads(r["drafter_spec"] or "null")) for r in connection.execute(
            "SELECT domain, drafter, drafter_spec FROM domain_configs WHERE run_id = ?", (run_id,))}
        sampled_ids = {r["id"] for r in connection.execute("SELECT id, temperature, top_k, top_p FROM traffic_requests")
                       if pays_sampled_steps(r["temperature"], r["top_k"], r["top_p"])}
        stored = [dict(r) for r in connection.execute(
            "SELECT domain, concurrency, k, measured_speedup, predicted_speedup, per_request "
            "FROM load_check_levels WHERE run_id = ? ORDER BY domain, concurrency", (run_id,))]
    store = Store.open(f"sqlite:///{db}")
    costs = run_costs(run_id, store)
    store.engine.dispose()
    out = []
    for level in stored:
        label, spec = configs[level["domain"]]
        served = [r for r in json.loads(level["per_request"] or "[]") if r.get("spec_tokens", 0) >= 2]
        totals = [served_totals(r, level["k"]) for r in served]
        sampled = [r["request_id"] in sampled_ids for r in served]
        served_e = sum(t.tokens for t in totals) / max(sum(t.rounds for t in totals), 1e-9)
        with_served = predicted_speedup(costs, label, spec, totals, sampled, level["concurrency"])
        out.append(dict(level, home=home.name, served_e=served_e, with_served=with_served,
                        **step_costs(served, totals, costs, sampled, level["concurrency"], served_e, with_served)))
    return out


def step_costs(served: list[dict], totals: list, costs, sampled: list[bool], batch: int, served_e: float,
               with_served: float | None) -> dict:
    """The level's cost side, measured beside priced: the plain step (decode seconds per token of
    the K 0 side) against the profile's at the level's batch size and top-p mix, and a round at K
    over the plain step (the config side's decode seconds per round, rounds = tokens - accepted)
    against the one the re-priced prediction implies (E over the predicted speedup)."""
    plain_tokens = sum(r["plain_tokens"] for r in served)
    rounds = sum(t.rounds for t in totals)
    if not served or not plain_tokens or not rounds:
        return {"plain_ms": None, "profile_plain_ms": None, "round_ratio": None, "profile_round_ratio": None}
    plain_step = sum(r["plain_decode_s"] for r in served) / plain_tokens
    mixed = costs.for_sampling(sum(sampled) / len(sampled)) if sampled else costs
    return {"plain_ms": 1000 * plain_step,
            "profile_plain_ms": 1000 * mixed.target_step[batch] if batch in mixed.target_step else None,
            "round_ratio": sum(r["spec_decode_s"] for r in served) / rounds / plain_step,
            "profile_round_ratio": served_e / with_served if with_served else None}


def within(predicted, measured, share=0.15) -> str:
    if predicted is None or measured is None:
        return "-"
    return "yes" if abs(predicted - measured) <= share * measured else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("homes", nargs="+", type=Path)
    args = parser.parse_args()
    rows = [row for home in args.homes for row in levels(home)]
    print("| run | domain | concurrent | K | measured | predicted (offline acceptance) | within 15% "
          "| predicted (vLLM's acceptance) | within 15% | vLLM tokens/round | plain step ms, measured "
          "/ profile | round / plain step, measured / priced |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"    # noqa: E731
        num = lambda x, f: "-" if x is None else format(x, f)    # noqa: E731
        print(f"| {r['home']} | {r['domain']} | {r['concurrency']} | {r['k']} | {fmt(r['measured_speedup'])} "
              f"| {fmt(r['predicted_speedup'])} | {within(r['predicted_speedup'], r['measured_speedup'])} "
              f"| {fmt(r['with_served'])} | {within(r['with_served'], r['measured_speedup'])} | {r['served_e']:.2f} "
              f"| {num(r['plain_ms'], '.1f')} / {num(r['profile_plain_ms'], '.1f')} "
              f"| {num(r['round_ratio'], '.2f')} / {num(r['profile_round_ratio'], '.2f')} |")
    for key, name in (("predicted_speedup", "offline acceptance"), ("with_served", "vLLM's acceptance")):
        hits = sum(within(r[key], r["measured_speedup"]) == "yes" for r in rows)
        print(f"\npredicted from {name}: within 15% at {hits} of {len(rows)} levels")


if __name__ == "__main__":
    main()
