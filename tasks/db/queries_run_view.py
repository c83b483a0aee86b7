"""Reads and writes of a run's view (tasks.registry.run_view): whether its engine check ran or
was skipped, and why. The skip is kept in the run's eval_runs.params under ENGINE_CHECK_SKIPPED
(no column of its own): the reason in words, or absent once the check ran.
"""

from __future__ import annotations

from sqlalchemy import select, update

from .models import EvalRun
from .store import Store, Unit

ENGINE_CHECK_SKIPPED = "engine_check_skipped"


def record_engine_check_skip(store: Store, run_id: str, reason: str | None) -> None:
    """Keep why the run's engine check was skipped (None: it ran; an earlier skip is cleared).
    One transaction; a run id with no eval_runs row changes nothing."""
    with store.begin() as connection:
        params = connection.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).scalar()
        if params is None and reason is None:
            return
        params = dict(params or {})
        if reason is None:
            params.pop(ENGINE_CHECK_SKIPPED, None)
        else:
            params[ENGINE_CHECK_SKIPPED] = reason[:600]
        connection.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(params=params))


def engine_check_skip(store: Store, run_id: str) -> str | None:
    """Why the run's engine check was skipped; None when it ran or nothing was recorded."""
    with store.connect() as connection:
        return engine_check_skip_in(Unit(store, connection), run_id)


def engine_check_skip_in(tx: Unit, run_id: str) -> str | None:
    """engine_check_skip read inside the caller's unit of work (a registration's reads)."""
    params = tx.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).scalar()
    return (params or {}).get(ENGINE_CHECK_SKIPPED)
