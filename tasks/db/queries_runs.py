"""Who is running an evaluation run, and marking the runs their process left unfinished.

A run `specdec evaluate` drives is owned by its process: eval_runs.params["owner"] holds its host,
pid and the process's start time (so a reused pid is not mistaken for it). A run still in
progress (RUNNING_STATUSES) whose owner process on this host is gone was stopped without a
chance to say so (`kill -9`, a power cut): the next start marks it "interrupted". A process that
gets SIGTERM or Ctrl-C marks its own run (tasks.cli.evaluation). Reports leave interrupted runs
out. Runs driven by Airflow have no owner here: Airflow records their tasks' failures.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from sqlalchemy import func, select, update

from ..timeutil import utcnow
from .models import DomainConfig, EngineCheck, EvalRun, EvalSample, LiveMeasurement, Validation
from .store import Store, Unit

RUNNING_STATUSES = ("sampled", "checked", "profiled")
INTERRUPTED = "interrupted"


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc); None: unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def this_process() -> dict:
    """The owner record of the calling process."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_ticks(os.getpid())}


def _alive(owner: dict) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True         # unknown: never marked
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                # someone else's process: it exists
    started = _start_ticks(pid)
    return started is None or owner.get("started") in (None, started)


def record_owner(store: Store, run_id: str, owner: dict) -> None:
    """Stamp the run as driven by `owner` (this_process())."""
    with store.begin() as connection:
        params = connection.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).scalar()
        connection.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
            params={**(params or {}), "owner": owner}))


def mark_interrupted(store: Store, run_id: str, how: str) -> bool:
    """Mark the run interrupted (`how`: "SIGTERM", "owner process gone", ...) when it is still in
    progress; True when it was marked."""
    with store.begin() as connection:
        params = connection.execute(select(EvalRun.params).where(
            (EvalRun.run_id == run_id) & EvalRun.status.in_(RUNNING_STATUSES))).scalar()
        if params is None and connection.execute(select(EvalRun.run_id).where(
                (EvalRun.run_id == run_id) & EvalRun.status.in_(RUNNING_STATUSES))).scalar() is None:
            return False
        done = connection.execute(update(EvalRun).where(
            (EvalRun.run_id == run_id) & EvalRun.status.in_(RUNNING_STATUSES)).values(
            status=INTERRUPTED, updated_at=utcnow(),
            params={**(params or {}), "interrupted": {"how": how, "at": utcnow().isoformat()}}))
    return done.rowcount > 0


def mark_abandoned_runs(store: Store) -> list[str]:
    """Mark interrupted every run in progress whose owner process on this host is gone; their ids."""
    host = socket.gethostname()
    with store.connect() as connection:
        rows = connection.execute(select(EvalRun.run_id, EvalRun.params).where(
            EvalRun.status.in_(RUNNING_STATUSES))).all()
    gone = [run_id for run_id, params in rows
            if isinstance((params or {}).get("owner"), dict) and params["owner"].get("host") == host
            and not _alive(params["owner"])]
    return [run_id for run_id in gone if mark_interrupted(store, run_id, "owner process gone")]


def evaluation_rows(store: Store, run_id: str, live_columns, engine_columns) -> tuple:
    """(the run's domain_configs rows by domain, {domain: its live measurement's live_columns},
    {domain: its engine check's engine_columns}): what the run's per-domain table joins."""
    with store.connect() as connection:
        configs = connection.execute(select(DomainConfig).where(DomainConfig.run_id == run_id)
                                     .order_by(DomainConfig.domain)).mappings().all()
        live = {row["domain"]: row for row in connection.execute(
            select(LiveMeasurement.domain, *[getattr(LiveMeasurement, c) for c in live_columns])
            .where(LiveMeasurement.run_id == run_id)).mappings()}
        checked = {row["domain"]: row for row in connection.execute(
            select(EngineCheck.domain, *[getattr(EngineCheck, c) for c in engine_columns])
            .where(EngineCheck.run_id == run_id)).mappings()}
    return configs, live, checked


def run_target(store: Store, run_id: str) -> str | None:
    """The run's target id; None when the run does not exist."""
    with store.connect() as connection:
        return connection.execute(select(EvalRun.target_id).where(EvalRun.run_id == run_id)).scalar()


def run_params(store: Store, run_id: str) -> dict:
    """The run's eval_runs.params ({} when it has none or there is no such run)."""
    with store.connect() as connection:
        return connection.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).scalar() or {}


def merge_run_params(tx: Unit, run_id: str, values: dict) -> None:
    """In the caller's transaction: `values` merged into the run's eval_runs.params."""
    params = tx.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).scalar()
    tx.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
        params={**(params or {}), **values}))


def set_run_status(tx: Unit, run_id: str, status: str, **values) -> None:
    """In the caller's transaction: the run's status (and other eval_runs columns) set."""
    tx.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
        status=status, updated_at=utcnow(), **values))


def domain_config(store: Store, run_id: str, domain: str):
    """The run's domain_configs row of the domain (a mapping), or None."""
    with store.connect() as connection:
        return connection.execute(select(DomainConfig).where(
            (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain))).mappings().first()


def run_hardware_profile(store: Store, run_id: str) -> str | None:
    """The name of the cost profile the run plans with (None: not profiled yet)."""
    with store.connect() as connection:
        return connection.execute(select(EvalRun.hardware_profile).where(
            EvalRun.run_id == run_id)).scalar()


def fail_domain(tx: Unit, run_id: str, domain: str, reason: str) -> None:
    """In the caller's transaction: the domain's config made (or set) off, status failed."""
    exists = tx.execute(select(DomainConfig.domain).where(
        (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain))).scalar()
    if exists is None:
        tx.execute(DomainConfig.__table__.insert().values(
            run_id=run_id, domain=domain, enabled=False, status="failed", reason=reason,
            created_at=utcnow()))
    else:
        tx.execute(update(DomainConfig).where(
            (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain)).values(
            enabled=False, status="failed", reason=reason, validation=None, promotable=None))


def finish_inputs(store: Store, run_id: str) -> tuple[dict[str, int], dict[str, dict], str | None]:
    """({domain: requests sampled}, {domain: its domain_configs row}, the run's cost profile)."""
    with store.connect() as connection:
        sampled = dict(connection.execute(select(EvalSample.domain, func.count()).where(
            EvalSample.run_id == run_id).group_by(EvalSample.domain)).all())
        configs = {row["domain"]: dict(row) for row in connection.execute(
            select(DomainConfig).where(DomainConfig.run_id == run_id)).mappings()}
        profile = connection.execute(select(EvalRun.hardware_profile).where(
            EvalRun.run_id == run_id)).scalar()
    return sampled, configs, profile


def domain_names(store: Store, run_id: str, status: str | None = None,
                 enabled: bool | None = None) -> list[str]:
    """The run's planned domains, sorted (with that status / enabled, when given)."""
    where = DomainConfig.run_id == run_id
    if status is not None:
        where = where & (DomainConfig.status == status)
    if enabled is not None:
        where = where & DomainConfig.enabled.is_(enabled)
    with store.connect() as connection:
        return sorted(connection.execute(select(DomainConfig.domain).where(where)).scalars())


def has_live_measurement(store: Store, run_id: str) -> bool:
    """Whether the run has any live measurement."""
    with store.connect() as connection:
        return connection.execute(select(LiveMeasurement.id).where(
            LiveMeasurement.run_id == run_id).limit(1)).scalar() is not None


def has_sampling_test(store: Store, run_id: str, domain: str) -> bool:
    """Whether the domain has an own-engine sampling test row in the run."""
    with store.connect() as connection:
        return connection.execute(select(Validation.id).where(
            (Validation.run_id == run_id) & (Validation.domain == domain)
            & (Validation.check_name == "sampling")).limit(1)).scalar() is not None
