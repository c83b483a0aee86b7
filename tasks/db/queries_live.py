"""The confirm step's reads and write (tasks.steps.checks.confirm): the run's cost profile and worker
hardware, and a domain's live measurement stored (its plan: queries_runs.domain_config)."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .models import DomainConfig, EvalRun, HardwareProfile, LiveMeasurement
from .store import Store


def run_hardware(store: Store, run_id: str) -> tuple[dict | None, dict | None]:
    """The run's {hardware_profile, worker_hardware} (None: no such run) and its profile's stored
    {device, dtype} (None: no profile named, or none stored by that name)."""
    with store.connect() as connection:
        run = connection.execute(select(EvalRun.hardware_profile, EvalRun.worker_hardware).where(
            EvalRun.run_id == run_id)).mappings().first()
        profile = None if run is None else run["hardware_profile"]
        stored = None if profile is None else connection.execute(select(
            HardwareProfile.device, HardwareProfile.dtype).where(
            HardwareProfile.name == profile)).mappings().first()
    return run, stored


def store_live_measurement(store: Store, run_id: str, domain: str, row: dict, values: dict) -> None:
    """One transaction: the domain's live measurement replaced by `row`, and `values` set on its
    domain_configs row."""
    now = utcnow()
    with store.begin() as connection:
        connection.execute(delete(LiveMeasurement).where((LiveMeasurement.run_id == run_id)
                                                         & (LiveMeasurement.domain == domain)))
        connection.execute(insert(LiveMeasurement).values(**row, created_at=now))
        connection.execute(update(DomainConfig).where((DomainConfig.run_id == run_id)
                                                      & (DomainConfig.domain == domain))
                           .values(**values))
