"""The cost profiles' reads and writes (tasks.steps.costs.costs, tasks.steps.costs.engine_costs): a profile's
rows, check and hardware description stored and read, and the stored checks a run may reuse (the
profile a run plans with: queries_runs.run_hardware_profile)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, insert, select

from ..timeutil import utcnow
from .models import CostProfile, CostProfileCheck, HardwareProfile
from .store import Store


def replace_cost_profile(store: Store, run_id: str, hardware: dict, rows: list[dict],
                         check: dict | None, keyed: dict) -> None:
    """One transaction: the run's rows (cost_profiles), check (cost_profile_checks, with the key
    columns `keyed`) and the hardware description (hardware_profiles) of the profile
    hardware["name"] replaced."""
    now = utcnow()
    keyed = dict(keyed)
    if keyed:
        keyed["measured_at"] = keyed.get("measured_at") or now
    where = (lambda model: (model.run_id == run_id) & (model.hardware_profile == hardware["name"]))
    with store.begin() as connection:
        connection.execute(delete(CostProfile).where(where(CostProfile)))
        connection.execute(insert(CostProfile), [
            dict(row, run_id=run_id, hardware_profile=hardware["name"], created_at=now)
            for row in rows])
        connection.execute(delete(CostProfileCheck).where(where(CostProfileCheck)))
        if check is not None:
            connection.execute(insert(CostProfileCheck).values(
                run_id=run_id, hardware_profile=hardware["name"], status=check["status"],
                reasons=check.get("reasons") or [], attempts=int(check.get("attempts") or 1),
                max_spread=check.get("max_spread"), details=check.get("details"),
                created_at=now, **keyed))
        connection.execute(delete(HardwareProfile).where(HardwareProfile.name == hardware["name"]))
        connection.execute(insert(HardwareProfile).values(
            name=hardware["name"], device=hardware["device"], dtype=hardware["dtype"],
            details=hardware.get("details"), updated_at=now))


def hardware_row(store: Store, hardware_profile: str):
    """The stored hardware_profiles row of the profile (a mapping), or None."""
    with store.connect() as connection:
        return connection.execute(select(HardwareProfile).where(
            HardwareProfile.name == hardware_profile)).mappings().first()


def hardware_rows_newest_first(store: Store) -> list:
    """Every stored hardware_profiles row, the newest first."""
    with store.connect() as connection:
        return connection.execute(select(HardwareProfile)
                                  .order_by(HardwareProfile.updated_at.desc())).all()


def cost_profile_rows(store: Store, hardware_profile: str, run_id: str | None):
    """(run_id: the given one, else the newest run that stored the profile (None: none), its
    cost_profiles rows, the names of every stored hardware profile, its check (a mapping or
    None)), read on one connection."""
    with store.connect() as connection:
        if run_id is None:
            run_id = connection.execute(
                select(CostProfile.run_id).where(CostProfile.hardware_profile == hardware_profile)
                .order_by(CostProfile.created_at.desc(), CostProfile.id.desc()).limit(1)).scalar()
        rows = [] if run_id is None else connection.execute(
            select(CostProfile.component, CostProfile.drafter, CostProfile.k, CostProfile.batch_size,
                   CostProfile.seconds, CostProfile.spread)
            .where((CostProfile.hardware_profile == hardware_profile) & (CostProfile.run_id == run_id))
        ).mappings().all()
        known = connection.execute(select(HardwareProfile.name)).scalars().all()
        check = None if run_id is None else connection.execute(
            select(CostProfileCheck.status, CostProfileCheck.reasons, CostProfileCheck.attempts,
                   CostProfileCheck.max_spread, CostProfileCheck.details)
            .where((CostProfileCheck.hardware_profile == hardware_profile)
                   & (CostProfileCheck.run_id == run_id))).mappings().first()
    if check is not None:
        # of the details (the engines' timings and more), only whether its figures are paired
        # ratios with intervals, which the plan's interval then carries (CostTable.paired)
        check = dict(check)
        details = check.pop("details") or {}
        check["details"] = {"paired": bool(details.get("paired"))} if isinstance(details, dict) else {}
    return run_id, rows, known, check


def passed_checks_of_key(store: Store, run_id: str, key: dict, since: datetime) -> list[dict]:
    """The cost_profile_checks rows of other runs than `run_id` that passed (status ok), with the
    key's target fingerprint, engine, engine version, dtype and device, measured after `since`:
    the newest first, as dicts."""
    with store.connect() as connection:
        rows = connection.execute(select(CostProfileCheck).where(
            (CostProfileCheck.status == "ok") & (CostProfileCheck.run_id != run_id)
            & (CostProfileCheck.target_fingerprint == key["target_fingerprint"])
            & (CostProfileCheck.engine == key["engine"])
            & (CostProfileCheck.engine_version == key["engine_version"])
            & (CostProfileCheck.dtype == key["dtype"]) & (CostProfileCheck.device == key["device"])
            & (CostProfileCheck.measured_at > since))
            .order_by(CostProfileCheck.measured_at.desc(), CostProfileCheck.created_at.desc())
        ).mappings().all()
    return [dict(row) for row in rows]
