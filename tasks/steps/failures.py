"""A domain's failure recorded: the one helper the database-only steps (tasks.steps.pipeline), the
model steps (tasks.steps.model_steps) and the CLI's run (tasks.steps.evaluate) share, kept apart so
that none of them imports another for it."""

from __future__ import annotations

import logging

from ..db.queries_runs import fail_domain
from ..db.store import Store
from .spec import RunSpec

log = logging.getLogger(__name__)


def record_domain_failure(spec, domain: str, error: str, store: Store | None = None) -> None:
    """A domain whose step failed: off in this run's config (the champion's setting is kept).
    store: the run's database (None: the spec's, opened here: a step entry point)."""
    spec = RunSpec.of(spec)
    store = store or spec.open_store()
    reason = f"failed: {error}"[:2000]
    with store.transaction() as tx:
        fail_domain(tx, spec.run_id, domain, reason)
    log.error("run %s, domain %s %s; the champion's setting is kept", spec.run_id, domain, reason)
