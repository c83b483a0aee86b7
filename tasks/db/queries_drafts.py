"""Draft training's reads and writes (tasks.steps.drafters.draft_training): the stored traffic a draft
trains on, its draft_models record and training split, and the requests drafts were trained on."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .models import DraftModelRecord, DraftTrainingRequest, TrafficRequest, production_traffic
from .store import Store, Unit


def target_traffic_rows(store: Store, fingerprint: str, domains, start: datetime,
                        generated: bool, end: datetime | None = None) -> list:
    """The traffic_requests rows of this target since `start` (up to `end` inclusive when given;
    in `domains` when given), by id: production traffic, or (generated) the rows the target
    generated."""
    kept = TrafficRequest.generated_by.is_not(None) if generated else production_traffic()
    query = (select(TrafficRequest).where(kept & (TrafficRequest.requested_at >= start)
                                          & (TrafficRequest.target_fingerprint == fingerprint))
             .order_by(TrafficRequest.id))
    if domains:
        query = query.where(TrafficRequest.domain.in_(list(domains)))
    if end is not None:
        query = query.where(TrafficRequest.requested_at <= end)
    with store.connect() as connection:
        return connection.execute(query).all()


def record_draft(tx: Unit, train_id: str, values: dict,
                 splits: dict[str, str] | None = None) -> None:
    """In the caller's transaction: the training's draft_models record made or updated with
    `values`; with splits ({request id: split}), its draft_training_requests replaced."""
    exists = tx.execute(select(DraftModelRecord.id).where(
        DraftModelRecord.name == train_id)).scalar()
    if exists is None:
        tx.execute(insert(DraftModelRecord).values(name=train_id, run_id=train_id,
                                                           created_at=utcnow(), **values))
    else:
        tx.execute(update(DraftModelRecord).where(DraftModelRecord.name == train_id)
                           .values(**values))
    if splits is not None:
        tx.execute(delete(DraftTrainingRequest).where(
            DraftTrainingRequest.draft_name == train_id))
        tx.execute(insert(DraftTrainingRequest), [
            {"draft_name": train_id, "request_id": rid, "split": split} for rid, split in splits.items()])


def draft_record(store: Store, train_id: str):
    """The training's draft_models row (a mapping); NoResultFound when there is none."""
    with store.connect() as connection:
        return connection.execute(select(DraftModelRecord).where(
            DraftModelRecord.name == train_id)).mappings().one()


def trained_request_ids(store: Store, model_uris: list[str]) -> set[str]:
    """Request ids the drafts behind these model URIs were trained on, and the logged requests
    whose prompts the generated rows among them answered."""
    with store.connect() as connection:
        names = connection.execute(select(DraftModelRecord.name).where(
            DraftModelRecord.model_uri.in_(model_uris))).scalars().all()
        if not names:
            return set()
        trained = DraftTrainingRequest.draft_name.in_(names) & (DraftTrainingRequest.split == "train")
        ids = set(connection.execute(select(DraftTrainingRequest.request_id).where(trained)).scalars())
        ids |= set(connection.execute(
            select(TrafficRequest.generated_from)
            .join(DraftTrainingRequest, DraftTrainingRequest.request_id == TrafficRequest.id)
            .where(trained & TrafficRequest.generated_from.is_not(None))).scalars())
        return ids
