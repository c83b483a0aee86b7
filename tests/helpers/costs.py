"""Cost tables built by hand and acceptance estimates written straight into the database, for the
planner's tests (ratios to one target step; no timing)."""

from __future__ import annotations

from datetime import datetime

from .db import execute, fetch

LS = "layer_skip(num_layers=2)"
LS_SPEC = {"kind": "layer_skip", "params": {"num_layers": 2}}
PL = "prompt_lookup"
PL_SPEC = {"kind": "prompt_lookup", "params": {}}

# Hand-built costs: ratios to one target step grow with the batch size.
STEP = {1: 0.020, 2: 0.025, 4: 0.040}
VERIFY = {1: [1.2, 1.4], 2: [1.5, 2.0], 4: [2.0, 3.0]}     # v(1), v(2)
LS_DRAFT = {1: 0.25, 2: 0.3, 4: 0.4}                       # per drafted token
PL_DRAFT = {1: 0.05, 2: 0.1, 4: 0.2}                       # per round


def cost_table(step=STEP, verify=VERIFY, ls=LS_DRAFT, pl=PL_DRAFT, name="test-gpu"):
    from tasks.steps.costs.costs import CostTable

    return CostTable(name, "costs-run", dict(step),
                     {b: {k + 1: r * step[b] for k, r in enumerate(ratios)} for b, ratios in verify.items()},
                     {LS: {b: r * step[b] for b, r in ls.items()}, PL: {b: r * step[b] for b, r in pl.items()}})


def add_estimate(db_url, run_id, domain, spec, k, e, lo, hi, share, requests=30) -> None:
    from sqlalchemy import insert

    from tasks.steps.drafters.candidates import candidate_label
    from tasks.db.models import AcceptanceEstimate

    execute(db_url, insert(AcceptanceEstimate).values(
        run_id=run_id, domain=domain, drafter=candidate_label(spec), drafter_spec=spec, k=k,
        requests=requests, tokens=20 * requests, acceptance_rate=0.5, mean_accepted_length=e,
        mean_accepted_length_lo=lo, mean_accepted_length_hi=hi, conditional_acceptance=[0.6] * k,
        draft_width_share=share, created_at=datetime(2025, 1, 1)))


def configs(db_url) -> list[dict]:
    """Every domain_configs row, by run id and domain."""
    from sqlalchemy import select

    from tasks.db.models import DomainConfig

    return fetch(db_url, select(DomainConfig).order_by(DomainConfig.run_id, DomainConfig.domain))


# The embedded default's cost profile at batch 1 on this project's 2-core CPU machine, one thread
# (a `make test` worker's share), seconds per component: what tests/test_embedded.py's evaluation
# measured in its own profile step on 2026-12-01 beside the other worker. Measured anew in that
# test, one timing under the suite's load decided which domains turned on (once a step timed at
# 0.50 s against verify passes of 0.13-0.15 s made every verify "free" and turned creative on,
# adding its engine check and sampling tests: 593 s against 414 s).
EMBEDDED_CPU_STEP = 0.09733
EMBEDDED_CPU_VERIFY = {1: 0.09397, 2: 0.1, 3: 0.11322, 4: 0.10701}
EMBEDDED_CPU_DRAFT = {PL: 2.0e-05}
EMBEDDED_CPU_OVERHEAD = {"plain": 0.01037, PL: 0.02662}


def store_embedded_cpu_profile(store, model, name: str = "embedded-cpu") -> str:
    """Store the profile above as the hardware `model` runs on here (so confirm times against it)
    under `name`, as `specdec profile import` would; returns the name to plan with."""
    from tasks.steps.costs.costs import CostTable, describe_hardware, store_costs

    table = CostTable(name, f"{name}-profile", {1: EMBEDDED_CPU_STEP}, {1: dict(EMBEDDED_CPU_VERIFY)},
                      {drafter: {1: s} for drafter, s in EMBEDDED_CPU_DRAFT.items()},
                      {drafter: {1: s} for drafter, s in EMBEDDED_CPU_OVERHEAD.items()})
    store_costs(store, table.run_id, describe_hardware(model, name), table)
    return name
