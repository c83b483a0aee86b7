"""The plans stored main jobs would make with the planner of this checkout (issue: decisions that
hold on a busy machine).

Each home a main job left behind (benchmarks/busy_neighbour.py's --work/<run>) holds its run's
acceptance estimates and the vLLM cost profile it measured. This copies each home's database,
plans every domain of its run again on its own profile with the current planner (nothing is
timed or served; each domain as the run's sample judged it), under each `--k-tolerance` asked
for, and prints one table: per domain and home, on/off, drafter, K and the predicted speedup at
batch 1 with its interval. It says what a planner change does to the decisions of runs already
measured, with their costs as they were.

    python benchmarks/replan.py /tmp/bn14/quiet-4 /tmp/bn14/busy-2 --k-tolerance 0,0.02
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stored_run(db: Path) -> tuple[str, str, dict[str, tuple[str, bool]]]:
    """(run id, its vLLM cost profile, {domain: (the sample's status, on in its champion)})."""
    with sqlite3.connect(db) as connection:
        run_id, profile = connection.execute(
            "SELECT run_id, hardware_profile FROM eval_runs ORDER BY created_at DESC LIMIT 1").fetchone()
        domains = {domain: (status, bool(champion_on)) for domain, status, champion_on in connection.execute(
            "SELECT domain, status, champion_on FROM domain_configs WHERE run_id = ?", (run_id,))}
    return run_id, profile, domains


def replan(home: Path, tolerance: float) -> dict[str, dict]:
    """Every domain of the home's run planned again, in a copy of its database."""
    from tasks.db.store import Store
    from tasks.settings import load_settings
    from tasks.steps.costs.cost_table import load_costs
    from tasks.steps.plan.plan import plan_domain

    with tempfile.TemporaryDirectory() as work:
        copy = Path(work) / "specdec.db"
        shutil.copy(home / "specdec.db", copy)
        run_id, profile, domains = stored_run(copy)
        settings = load_settings({}, plan_k_tolerance=tolerance)
        store = Store.open(f"sqlite:///{copy}", settings=settings)
        costs = load_costs(profile, store)
        out = {domain: plan_domain(run_id, domain, costs, store, settings=settings,
                                   status=status,
                                   currently_on=champion_on)
               for domain, (status, champion_on) in sorted(domains.items())}
        store.engine.dispose()
    return out


def cell(row: dict) -> str:
    if row["drafter"] is None:
        return "off"
    state = "on" if row["enabled"] else "off"
    return (f"{state} {row['drafter'].split('(')[0]} K{row['k']} {row['predicted_speedup']:.2f}x "
            f"[{row['predicted_speedup_lo']:.2f}, {row['predicted_speedup_hi']:.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("homes", nargs="+", type=Path)
    parser.add_argument("--k-tolerance", default="0.02,0.05", help="comma-separated plan_k_tolerance values")
    args = parser.parse_args()
    tolerances = [float(t) for t in args.k_tolerance.split(",")]
    plans = {(home.name, t): replan(home, t) for home in args.homes for t in tolerances}
    domains = sorted({d for plan in plans.values() for d in plan})
    columns = list(plans)
    print("| domain | " + " | ".join(f"{name}, tolerance {t:g}" for name, t in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for domain in domains:
        print(f"| {domain} | " + " | ".join(cell(plans[c][domain]) if domain in plans[c] else "-"
                                           for c in columns) + " |")


if __name__ == "__main__":
    main()
