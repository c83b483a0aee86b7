"""The load check's and the engine check's predictions of stored runs made again with this
checkout's pricing (issue: decisions that hold on a busy machine).

Each home benchmarks/busy_neighbour.py leaves behind holds its run's sample, suffix index, vLLM cost
profile and the levels its load check measured (their requests by id). This copies each home, loads
its run's context, and predicts every stored level again as the checkout's load check would
(tasks.steps.checks.load_check._predicted: a sampled request at the mean of the domain's logged
requests sampled as it is, tasks.steps.checks.drawn), and every engine check's "same requests"
figure likewise; beside them the predictions the run stored, the one along what vLLM served, and
the measured speedup. Nothing is timed or served.

    python benchmarks/load_repredict.py /tmp/bn24/quiet-24 /tmp/bn24/busy-22
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WITHIN = 0.15


def _copy(home: Path, work: Path) -> None:
    """The home's database, profiles and check logs into work; its models by a link."""
    shutil.copy(home / "specdec.db", work / "specdec.db")
    if (home / "models").exists():
        os.symlink((home / "models").resolve(), work / "models")
    for name in ("engine_profiles", "engine_checks"):
        if (home / name).exists():
            shutil.copytree(home / name, work / name)


def repredict(home: Path) -> dict:
    """{"levels": [...], "engine": [...]} of one home, in a copy of it."""
    with tempfile.TemporaryDirectory() as work:
        _copy(home, Path(work))
        os.environ["SPECDEC_HOME"] = work
        from tasks.steps.context import RunContext
        from tasks.steps.spec import RunSpec

        with sqlite3.connect(Path(work) / "specdec.db") as db:
            run_id = db.execute("SELECT run_id FROM eval_runs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
            levels = db.execute(
                "SELECT domain, concurrency, k, predicted_speedup, predicted_served_speedup, measured_speedup, "
                "measured_speedup_lo, measured_speedup_hi, per_request FROM load_check_levels WHERE run_id = ? "
                "ORDER BY domain, concurrency", (run_id,)).fetchall()
            checks = db.execute(
                "SELECT domain, k, predicted_speedup, measured_speedup, per_request FROM engine_checks "
                "WHERE run_id = ? AND predicted_speedup IS NOT NULL ORDER BY domain", (run_id,)).fetchall()
        context = RunContext.build(RunSpec(run_id=run_id, db_url=f"sqlite:///{work}/specdec.db"))
        out = {"levels": [_level(context, row) for row in levels],
               "engine": [_engine(context, row) for row in checks]}
        context.store.engine.dispose()
    return out


def _costs(context, domain: str):
    from tasks.db.queries_load import engine_versions
    from tasks.steps.costs.engine_costs import engine_profile

    version = (engine_versions(context.store, context.run_id).get(domain) or {}).get("engine_version")
    return engine_profile(context.store, version, context.settings.engine.profile)


def _level(context, row) -> dict:
    from tasks.db.queries_load import domains_on
    from tasks.steps.checks import load_check

    domain, level, k, stored, served, measured, lo, hi, per_request = row
    config = domains_on(context.store, context.run_id)[domain]
    cap = context.settings.load.max_tokens
    by_id = {r.request_id: r for r in context.domain_requests(domain)[0]}
    ids = dict.fromkeys(p["request_id"].split("#")[0] for p in json.loads(per_request))
    items = [{"request_id": i, "max_tokens": max(2, min(len(by_id[i].response_ids), cap))} for i in ids]
    again = load_check._predicted(context, domain, config, load_check._logged_requests(context, domain, items),
                                  k, level, _costs(context, domain), {})
    return {"domain": domain, "level": level, "k": k, "stored": stored, "again": again, "served": served,
            "measured": measured, "lo": lo, "hi": hi}


def _engine(context, row) -> dict:
    from tasks.db.queries_load import domains_on
    from tasks.steps.checks.confirm import truncated
    from tasks.steps.checks.drawn import priced_totals
    from tasks.steps.checks.engine_compare import pays_sampled, predicted_speedup
    from tasks.steps.checks.engine_replay import end_slot

    domain, k, stored, measured, per_request = row
    config = domains_on(context.store, context.run_id)[domain]
    cap = context.settings.live.max_new_tokens
    requests = context.domain_requests(domain)[0]
    by_id = {r.request_id: r for r in requests}
    picked = [end_slot(truncated(by_id[p["request_id"]], min(len(by_id[p["request_id"]].response_ids), cap)))
              for p in json.loads(per_request)]
    drafter = context.domain_drafters(domain)[config["drafter"]][1]
    priced = priced_totals(context.model, drafter, picked, requests, k, cap)
    kept = [r for r in picked if r.request_id in priced]
    again = predicted_speedup(_costs(context, domain), config["drafter"], config.get("drafter_spec"),
                              [priced[r.request_id] for r in kept], [pays_sampled(r.sampling) for r in kept])
    return {"domain": domain, "k": k, "stored": stored, "again": again, "measured": measured}


def _within(predicted, measured) -> bool:
    return bool(predicted and measured and abs(predicted / measured - 1.0) <= WITHIN)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("homes", nargs="+", type=Path)
    args = parser.parse_args()
    results = {home.name: repredict(home) for home in args.homes}
    print("| run | domain | concurrent | K | measured [95% CI] | stored prediction | this checkout's | "
          "on what vLLM served |")
    print("|---|---|---|---|---|---|---|---|")
    counts = {"stored": 0, "again": 0, "served": 0}
    total = 0
    for name, result in results.items():
        for r in result["levels"]:
            total += 1
            marks = {key: _within(r[key], r["measured"]) for key in counts}
            for key, hit in marks.items():
                counts[key] += hit
            cells = [f"{_x(r[key])}{'' if marks[key] else ' (miss)'}" for key in ("stored", "again", "served")]
            print(f"| {name} | {r['domain']} | {r['level']} | {r['k']} | {_x(r['measured'])} "
                  f"[{r['lo']:.2f}, {r['hi']:.2f}] | " + " | ".join(cells) + " |")
    print(f"\nwithin {100 * WITHIN:.0f}% of measured, of {total} levels: stored {counts['stored']}, "
          f"this checkout's {counts['again']}, on what vLLM served {counts['served']}\n")
    print("| run | domain | K | engine check measured | stored same-requests prediction | this checkout's |")
    print("|---|---|---|---|---|---|")
    errors: dict = {"stored": [], "again": []}
    for name, result in results.items():
        for r in result["engine"]:
            print(f"| {name} | {r['domain']} | {r['k']} | {_x(r['measured'])} | {_x(r['stored'])} | "
                  f"{_x(r['again'])} |")
            for key, found in errors.items():
                if r[key] and r["measured"]:
                    found.append(abs(r[key] / r["measured"] - 1.0))
    print("\nengine check, mean |predicted / measured - 1|: " + ", ".join(
        f"{'stored' if key == 'stored' else 'this checkout'} {100 * sum(v) / len(v):.1f}% ({len(v)} domains)"
        for key, v in errors.items() if v))


if __name__ == "__main__":
    main()
