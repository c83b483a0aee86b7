"""Reads and writes of the `promotions` table (the audit rows of registration, promotion, refusal,
rollback) and the lock that serialises a registered model's alias moves (tasks.registry.promotion).

The alias-lock path is transactional: alias_lock yields the Unit of its transaction (PostgreSQL:
an advisory lock; SQLite: BEGIN IMMEDIATE); the reads and writes made under it take that Unit, so
they commit or roll back with the alias move. Outside the lock an audit row is written in a
transaction of its own: `with store.transaction() as tx: record_promotion(tx, ...)`.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

from sqlalchemy import insert, select, text

from ..timeutil import utcnow
from .models import Promotion
from .store import Store, Unit


def record_promotion(tx: Unit, **values) -> None:
    """One audit row in `promotions` (register, promote, reject, rollback), stamped now, in the
    unit's transaction (alias_lock's, or one of Store.transaction())."""
    tx.execute(insert(Promotion).values(created_at=utcnow(), **values))


def _lock_key(name: str) -> int:
    digest = hashlib.sha256(f"specdec-alias:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextmanager
def alias_lock(store: Store, name: str):
    """Serialise the alias moves of one registered model across processes and hosts, through
    specdec's own database: a transaction-scoped advisory lock on PostgreSQL, a write transaction
    (BEGIN IMMEDIATE) on SQLite. MLflow has no compare-and-set for aliases; every specdec move
    reads the alias, checks it, sets it and writes its audit row inside this lock, so the row says
    what was really replaced. Yields the Unit to read and write the audit row with; it commits
    on success and rolls back on error."""
    with store.connect() as connection:
        if store.engine.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_key(name)})
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")   # waits on the busy timeout (30 s)
        try:
            yield Unit(store, connection)
        except BaseException:
            connection.rollback()
            raise
        connection.commit()


def promotion_of(tx: Unit, name: str, alias: str, version: str):
    """The newest promote row that made `version` the `alias` of `name` (a mapping; None when
    there is none). Inside alias_lock: `tx` is the lock's Unit."""
    return tx.execute(
        select(Promotion).where((Promotion.config_name == name) & (Promotion.alias == alias)
                                & (Promotion.action == "promote")
                                & (Promotion.config_version == version))
        .order_by(Promotion.id.desc()).limit(1)).mappings().first()


def registered_run(tx: Unit, name: str, version: str):
    """(run_id, target_id) of a version, from its newest audit row; None when it has none. Inside
    alias_lock: `tx` is the lock's Unit."""
    return tx.execute(
        select(Promotion.run_id, Promotion.target_id)
        .where((Promotion.config_name == name) & (Promotion.config_version == version))
        .order_by(Promotion.id.desc()).limit(1)).first()


def last_champion_move(store: Store, name: str, alias: str = "champion"):
    """The newest promote or rollback row that moved `name`'s `alias` (config_version, action,
    forced, created_at); None when specdec never moved it."""
    with store.connect() as connection:
        return connection.execute(
            select(Promotion.config_version, Promotion.action, Promotion.forced, Promotion.created_at)
            .where((Promotion.config_name == name) & (Promotion.alias == alias)
                   & Promotion.action.in_(("promote", "rollback")))
            .order_by(Promotion.id.desc()).limit(1)).first()

