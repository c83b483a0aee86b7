"""The data-quality step's reads and writes (tasks.steps.traffic.quality): a run's sample and result rows
to check, and its stored outcomes (quality_results, data_docs_pages). Each takes the Unit of the
transaction the step opened (Store.transaction()); writes and replace the run's earlier rows
of the same suites or pages, so a re-run of a run id is idempotent."""

from __future__ import annotations

from sqlalchemy import delete, insert, select, update

from ..timeutil import utcnow
from .models import Base, DataDocsPage, EvalRun, EvalSample, QualityResult, TrafficRequest
from .store import Unit


def sampling_params(tx: Unit, run_id: str):
    """The run's eval_runs row (its `params`), None when the run has no row (was never sampled)."""
    return tx.execute(select(EvalRun.params).where(EvalRun.run_id == run_id)).first()


def sample_rows(tx: Unit, run_id: str) -> list[tuple]:
    """The run's sample in draw order: (id, domain, prompt, response, requested_at, temperature,
    top_k, top_p, prompt_chars, response_chars, prompt_tokens, response_tokens) per request;
    a request no longer stored comes back with null fields."""
    t = TrafficRequest
    query = (select(EvalSample.request_id.label("id"), t.domain, t.prompt, t.response, t.requested_at,
                    t.temperature, t.top_k, t.top_p, t.prompt_chars, t.response_chars,
                    t.prompt_tokens, t.response_tokens)
             .select_from(EvalSample).outerjoin(t, t.id == EvalSample.request_id)
             .where(EvalSample.run_id == run_id).order_by(EvalSample.domain, EvalSample.position))
    return [tuple(row) for row in tx.execute(query).all()]


def result_rows(tx: Unit, table: str, run_id: str) -> tuple[list[dict], list[str]]:
    """(the run's rows of result table `table` as dicts, the table's column names)."""
    model_table = Base.metadata.tables[table]
    rows = tx.execute(select(model_table).where(model_table.c.run_id == run_id)).mappings().all()
    return [dict(row) for row in rows], [c.name for c in model_table.columns]


def replace_quality_results(tx: Unit, run_id: str, suites: tuple[str, ...],
                            rows: list[dict]) -> None:
    """In the caller's transaction: the run's quality_results of `suites` replaced by `rows`
    (each {"suite", "scope", "expectation", "column_name", "success", "status", "observed"})."""
    now = utcnow()
    tx.execute(delete(QualityResult).where((QualityResult.run_id == run_id)
                                                   & QualityResult.suite.in_(suites)))
    if rows:
        tx.execute(insert(QualityResult), [{"run_id": run_id, **row, "created_at": now}
                                                   for row in rows])


def store_data_docs(tx: Unit, run_id: str, pages: dict[str, str]) -> None:
    """Replace the run's Data Docs pages of these names (in the caller's transaction)."""
    if not pages:
        return
    tx.execute(delete(DataDocsPage).where((DataDocsPage.run_id == run_id)
                                                  & DataDocsPage.page.in_(list(pages))))
    now = utcnow()
    tx.execute(insert(DataDocsPage), [{"run_id": run_id, "page": page, "html": html,
                                                "created_at": now} for page, html in pages.items()])


def set_run_checked(tx: Unit, run_id: str, passed: bool) -> None:
    """In the caller's transaction: the run's status "checked" (passed) or "quality_failed"."""
    tx.execute(update(EvalRun).where(EvalRun.run_id == run_id).values(
        status="checked" if passed else "quality_failed", updated_at=utcnow()))
