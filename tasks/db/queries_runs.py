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

from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from ..timeutil import utcnow
from .models import EvalRun

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


def record_owner(engine: Engine, run_id: str, owner: dict) -> None:
    """Stamp the run as driven by `owner` (this_process())."""
    with engine.begin() as connection:
        params = connection.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).scalar()
        connection.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
            params={**(params or {}), "owner": owner}))


def mark_interrupted(engine: Engine, run_id: str, how: str) -> bool:
    """Mark the run interrupted (`how`: "SIGTERM", "owner process gone", ...) when it is still in
    progress; True when it was marked."""
    with engine.begin() as connection:
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


def mark_abandoned_runs(engine: Engine) -> list[str]:
    """Mark interrupted every run in progress whose owner process on this host is gone; their ids."""
    host = socket.gethostname()
    with engine.connect() as connection:
        rows = connection.execute(select(EvalRun.run_id, EvalRun.params).where(
            EvalRun.status.in_(RUNNING_STATUSES))).all()
    gone = [run_id for run_id, params in rows
            if isinstance((params or {}).get("owner"), dict) and params["owner"].get("host") == host
            and not _alive(params["owner"])]
    return [run_id for run_id in gone if mark_interrupted(engine, run_id, "owner process gone")]
