"""A run's sample (eval_samples) drawn from the stored traffic: the reads and the write of the
sample step (tasks.steps.traffic.traffic_sample). Each takes the Unit of the transaction the step
opened, so the draw sees one state of the traffic and records its rows atomically."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, insert, select

from .models import EvalRun, EvalSample, QualityResult, TrafficRequest, production_traffic
from .store import Unit


def window_condition(start: datetime, end: datetime, model: str | None = None):
    """Production traffic (never rows the target generated for training) requested in
    [start, end], answered by `model` when given."""
    condition = (production_traffic() & (TrafficRequest.requested_at >= start)
                 & (TrafficRequest.requested_at <= end))
    if model is not None:
        condition = condition & (TrafficRequest.model == model)
    return condition


def domains_where(tx: Unit, condition) -> list[str]:
    """The distinct domains of the requests matching `condition`, sorted."""
    return sorted(tx.execute(select(TrafficRequest.domain).where(condition).distinct()).scalars())


def request_ids_where(tx: Unit, condition, domain: str):
    """The ids of the domain's requests matching `condition`, streamed (yield_per 5000)."""
    return tx.execute(
        select(TrafficRequest.id).where(condition & (TrafficRequest.domain == domain))
        .execution_options(yield_per=5000)).scalars()


def record_sample(tx: Unit, run_id: str, values: dict, rows: list[dict],
                  suite: str, now: datetime) -> None:
    """In the caller's transaction: the run's eval_runs row inserted (created_at `now`) or updated
    with `values`, its earlier sample replaced by `rows` and its results of quality `suite`
    cleared (a re-run of the run id replaces its own rows and nothing else)."""
    existing = tx.execute(select(EvalRun.run_id).where(EvalRun.run_id == run_id)).scalar()
    if existing is None:
        tx.execute(insert(EvalRun).values(run_id=run_id, created_at=now, **values))
    else:
        tx.execute(EvalRun.__table__.update().where(EvalRun.run_id == run_id).values(**values))
    tx.execute(delete(EvalSample).where(EvalSample.run_id == run_id))
    tx.execute(delete(QualityResult).where((QualityResult.run_id == run_id)
                                                   & (QualityResult.suite == suite)))
    if rows:
        tx.execute(insert(EvalSample), rows)
