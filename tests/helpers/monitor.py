"""A champion to monitor, without an evaluation: two evaluated runs (the rows an evaluation leaves,
written straight into specdec's database: domain configs, acceptance estimates with their
intervals, the cost profile planned with), registered in an MLflow store and promoted in turn,
so the champion (version 2) has a version to roll back to (version 1).

Both runs serve the domains json and qa with prompt lookup at K = 3 (vLLM's ngram, n from 1 to
3): one deployment, `vllm-json-qa`. The promise: E 3.8 [3.5, 4.0] per domain; the cost profile:
a verify pass of 3 drafts costs 1.6 target steps and a lookup 0.05, so the break-even E is 1.65.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import create_engine, insert

from tasks.db.models import AcceptanceEstimate, CostProfile, DomainConfig, EvalRun
from tasks.registry.config_schema import config_model_name

from .registry import promote_, register

LOOKUP = "prompt_lookup(max_ngram=3,min_ngram=1)"
LOOKUP_SPEC = {"kind": "prompt_lookup", "params": {"max_ngram": 3, "min_ngram": 1}}
SERVED = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DEPLOYMENT = "vllm-json-qa"
PROMISE = (3.8, 3.5, 4.0)
BREAK_EVEN = 1.65
PROFILE = "cpu-monitor"
STEP_S = 0.01
COSTS = [("target_step", None, None, STEP_S), ("verify", None, 1, 0.012), ("verify", None, 2, 0.014),
         ("verify", None, 3, 0.016), ("draft_step", LOOKUP, None, 0.0005)]


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def scrape_times(count: int, step_s: int = 60, after_s: int = 120) -> list[datetime]:
    """`count` instants `step_s` apart, from a second from now, all in one UTC day with `after_s`
    seconds to spare (the daily report groups by day: a run crossing midnight would split its
    rows); near midnight they start a second past it."""
    start = now() + timedelta(seconds=1)
    last = start + timedelta(seconds=step_s * (count - 1) + after_s)
    if last.date() != start.date():
        start = datetime.combine(last.date(), datetime.min.time()) + timedelta(seconds=1)
    return [start + timedelta(seconds=step_s * i) for i in range(count)]


def evaluated_run(db_url: str, run_id: str, target_id: str, domains=("json", "qa")) -> None:
    at = now()
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(EvalRun).values(
            run_id=run_id, created_at=at, updated_at=at, status="evaluated", target_id=target_id,
            target_fingerprint="sha256:monitor", hardware_profile=PROFILE,
            params={"min_per_domain": 20, "max_per_domain": 30}))
        e, lo, hi = PROMISE
        for domain in domains:
            connection.execute(insert(DomainConfig).values(
                run_id=run_id, domain=domain, enabled=True, status="ok", samples=25, created_at=at,
                reason="test row", drafter=LOOKUP, drafter_spec=LOOKUP_SPEC, k=3,
                predicted_speedup=e / BREAK_EVEN, mean_accepted_length=e,
                conditional_acceptance=[0.95, 0.95, 0.9], validation="passed", promotable=True))
            connection.execute(insert(AcceptanceEstimate).values(
                run_id=run_id, domain=domain, drafter=LOOKUP, k=3, requests=25, tokens=400,
                acceptance_rate=0.93, mean_accepted_length=e, mean_accepted_length_lo=lo,
                mean_accepted_length_hi=hi, conditional_acceptance=[0.95, 0.95, 0.9],
                predicted_speedup=e / BREAK_EVEN, draft_width_share=[0.0, 0.0, 0.0, 1.0],
                created_at=at, drafter_spec=LOOKUP_SPEC))
        for component, drafter, k, seconds in COSTS:
            connection.execute(insert(CostProfile).values(
                run_id=run_id, hardware_profile=PROFILE, component=component, drafter=drafter,
                k=k, batch_size=1, seconds=seconds, created_at=at))
    engine.dispose()


def monitored_champion(db_url: str, uri: str, target_id: str) -> str:
    """Versions 1 and 2 registered and promoted in turn; the registered model's name."""
    name = config_model_name(target_id)
    for number in (1, 2):
        evaluated_run(db_url, f"monitor-run-{number}", target_id)
        register(f"monitor-run-{number}", db_url, uri)
        assert promote_(name, str(number), db_url, uri)["promoted"]
    return name
