"""Data-quality gates with Great Expectations (GX Core 1.x), stored per run in quality_results.

Two kinds of suite:
- traffic_sample: a run's sample (eval_samples joined with traffic_requests). Table-level
  expectations (non-null prompt and response, unique ids, domain in the known set, lengths and
  sampling params within bounds, at least one row) stop the run: QualityGateFailed with a readable
  summary. Then one row-count expectation per domain: a domain under min_per_domain is marked
  "insufficient" (returned, stored, not raised) and keeps the champion's setting downstream.
- results:<table>: a run's rows in a result table (acceptance_estimates, live_measurements,
  domain_configs): rates in [0, 1], K in 1..k_max, speedups > 0, at least one row.

Each check runs in a fresh ephemeral GX context (nothing is written to disk by GX); the outcome of
every expectation is stored in quality_results, replacing that run's earlier results of the suite,
and GX's Data Docs page of each validation in data_docs_pages (the registration attaches them to the
run's MLflow page; no worker's disk is involved). Failure details name requests by id, never by
prompt text.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import pandas as pd
from ...db.queries_quality import (replace_quality_results, result_rows, sample_rows, sampling_params,
                                   set_run_checked, store_data_docs)
from ...db.store import Store
from ...errors import QualityGateFailed, SampleError
from ...settings import Settings
from .traffic_sample import SAMPLE_SUITE

log = logging.getLogger(__name__)

DOMAIN_SUITE = "traffic_sample_domain"
SAMPLE_COLUMNS = ("id", "domain", "prompt", "response", "requested_at", "temperature", "top_k",
                  "top_p", "prompt_chars", "response_chars", "prompt_tokens", "response_tokens")
MAX_EXAMPLES = 10


@dataclass(frozen=True)
class Outcome:
    """One expectation's result in plain types."""

    scope: str
    expectation: str
    column: str | None
    success: bool
    observed: dict

    def describe(self) -> str:
        where = f"{self.column}: " if self.column else ""
        seen = self.observed
        if "unexpected_count" in seen:
            examples = seen.get("examples")
            text = (f"{seen['unexpected_count']} of {seen.get('element_count', '?')} rows unexpected"
                    + (f" (e.g. {examples})" if examples else ""))
        else:
            text = f"observed {seen.get('observed_value')!r}"
        return f"{where}{self.expectation} ({_kwargs_text(seen.get('kwargs', {}))}): {text}"


def _kwargs_text(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items() if k not in ("column", "batch_id"))


def _gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    # imported here: Great Expectations costs ~11 s to import: only the quality step pays it
    import great_expectations as gx

    return gx


def _context():
    """A fresh in-memory GX context: no files, no data docs, no progress bars, no analytics."""
    gx = _gx()
    # imported here: Great Expectations costs ~11 s to import: only the quality step pays it
    from great_expectations.data_context.types.base import (DataContextConfig, InMemoryStoreBackendDefaults,
                                                            ProgressBarsConfig)

    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        progress_bars=ProgressBarsConfig(globally=False), analytics_enabled=False)
    return gx.get_context(mode="ephemeral", project_config=config)


def render_data_docs(result, page: str) -> str | None:
    """Great Expectations' own Data Docs page of one validation result, as standalone HTML; None
    when it cannot be rendered (best effort: the failure is logged, the check's outcome stands)."""
    try:
        from great_expectations.render.renderer import ValidationResultsPageRenderer
        from great_expectations.render.view import DefaultJinjaPageView

        return DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result))
    except Exception as exc:
        log.warning("Data Docs page %s not rendered (%s)", page, exc)
        return None


def run_suite(context, name: str, frame, expectations: list, scope: str = "table",
              id_column: str | None = None, docs: dict | None = None) -> list[Outcome]:
    """Validate `frame` (a pandas DataFrame) against `expectations` as the suite `name`; with
    `docs` (a dict), also render GX's Data Docs page of the result into it ({file name: HTML})."""
    gx = _gx()
    source = context.data_sources.add_pandas(f"{name}-{scope}-source")
    asset = source.add_dataframe_asset(name=f"{name}-{scope}")
    batch = asset.add_batch_definition_whole_dataframe("whole")
    suite = context.suites.add(gx.ExpectationSuite(name=f"{name}-{scope}"))
    for expectation in expectations:
        suite.add_expectation(expectation)
    validation = context.validation_definitions.add(
        gx.ValidationDefinition(name=f"{name}-{scope}-validation", data=batch, suite=suite))
    result = validation.run(batch_parameters={"dataframe": frame},
                            result_format={"result_format": "COMPLETE" if id_column else "SUMMARY",
                                           "unexpected_index_column_names": [id_column] if id_column else []})
    if docs is not None:
        page = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{scope}") + ".html"
        html = render_data_docs(result, page)
        if html is not None:
            docs[page] = html
    outcomes = []
    for item in result.results:
        config = item.expectation_config
        outcomes.append(Outcome(scope=scope, expectation=config.type,
                                column=config.kwargs.get("column"), success=bool(item.success),
                                observed=_observed(item, config, frame, id_column)))
    return outcomes


def _observed(item, config, frame, id_column) -> dict:
    """JSON-able summary of a result; examples are request ids (or values of numeric columns)."""
    raw = item.result or {}
    observed: dict = {"kwargs": {k: _plain(v) for k, v in config.kwargs.items() if k != "batch_id"}}
    if item.exception_info and item.exception_info.get("raised_exception"):
        observed["exception"] = str(item.exception_info.get("exception_message"))[:500]
    if "observed_value" in raw:
        observed["observed_value"] = _plain(raw["observed_value"])
    if "unexpected_count" in raw:
        observed["unexpected_count"] = int(raw["unexpected_count"])
        observed["element_count"] = int(raw.get("element_count", len(frame)))
        column = config.kwargs.get("column")
        index_list = raw.get("unexpected_index_list") or []
        ids = [entry.get(id_column) for entry in index_list if isinstance(entry, dict)]
        if id_column and ids:
            observed["examples"] = [str(i) for i in ids[:MAX_EXAMPLES]]
        elif column and column not in ("prompt", "response"):
            observed["examples"] = [_plain(v) for v in (raw.get("partial_unexpected_list") or [])[:MAX_EXAMPLES]]
    return observed


def _plain(value):
    """Numbers, strings, None, lists and dicts of them (NaN becomes None)."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "item"):      # numpy scalars
        return _plain(value.item())
    return str(value)


def sample_expectations(settings: Settings) -> list:
    """The table-level expectations of a traffic sample."""
    gx = _gx()
    e = gx.expectations
    return [
        e.ExpectTableRowCountToBeBetween(min_value=1),
        *[e.ExpectColumnValuesToNotBeNull(column=column)
          for column in ("id", "domain", "prompt", "response", "requested_at", "temperature")],
        e.ExpectColumnValuesToBeUnique(column="id"),
        e.ExpectColumnValuesToBeInSet(column="domain", value_set=list(settings.known_domains)),
        e.ExpectColumnValuesToBeBetween(column="prompt_chars", min_value=settings.quality.min_prompt_chars,
                                        max_value=settings.quality.max_prompt_chars),
        e.ExpectColumnValuesToBeBetween(column="response_chars", min_value=0,
                                        max_value=settings.quality.max_response_chars),
        e.ExpectColumnValuesToBeBetween(column="prompt_tokens", min_value=1,
                                        max_value=settings.quality.max_prompt_tokens),
        e.ExpectColumnValuesToBeBetween(column="response_tokens", min_value=settings.quality.min_response_tokens,
                                        max_value=settings.quality.max_response_tokens),
        e.ExpectColumnValuesToBeBetween(column="temperature", min_value=0, max_value=100),
        e.ExpectColumnValuesToBeBetween(column="top_p", min_value=0, max_value=1, strict_min=True),
        e.ExpectColumnValuesToBeBetween(column="top_k", min_value=0),
    ]


def load_sample_frame(tx, run_id: str):
    """The run's sample as a DataFrame; requests no longer stored come back with null fields."""
    frame = pd.DataFrame(sample_rows(tx, run_id), columns=list(SAMPLE_COLUMNS))
    for column in ("temperature", "top_p", "prompt_chars", "response_chars", "prompt_tokens",
                   "response_tokens", "top_k"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    for column in ("id", "domain", "prompt", "response"):
        frame[column] = frame[column].astype("object")
    return frame


def _store(tx, run_id: str, suites: tuple[str, ...], outcomes: list[tuple[str, Outcome, str]]) -> None:
    replace_quality_results(tx, run_id, suites, [
        {"suite": suite, "scope": outcome.scope, "expectation": outcome.expectation,
         "column_name": outcome.column, "success": outcome.success, "status": status,
         "observed": outcome.observed}
        for suite, outcome, status in outcomes])


def _failure_summary(what: str, failures: list[Outcome], fix: str) -> str:
    lines = [f"{what} failed {len(failures)} table-level expectation(s):"]
    lines += [f"  - {outcome.describe()}" for outcome in failures]
    lines.append(fix)
    return "\n".join(lines)


def check_traffic_sample(run_id: str, store: Store,
                         settings: Settings | None = None) -> dict:
    """Run the traffic-sample suite on the run's sample and store the results.

    Inputs: run id (sampled before with sample_traffic), the Store, settings (bounds, known set;
    min_per_domain comes from the run's own sampling params). Output: {"run_id", "rows",
    "expectations", "domains": {name: {"rows", "status"}}, "insufficient": [...]}.
    Raises QualityGateFailed (after storing the results) when a table-level expectation fails.
    """
    settings = settings or store.settings
    with store.transaction() as tx:
        run = sampling_params(tx, run_id)
        if run is None:
            raise SampleError(f"run {run_id!r} has no sample; draw one first (sample_traffic / "
                              f"`specdec traffic sample {run_id}`)")
        params = run.params or {}
        frame = load_sample_frame(tx, run_id)
    min_rows = int(params.get("min_per_domain", settings.sample.min_per_domain))
    domains = list(params.get("domains") or sorted(frame["domain"].dropna().unique()))

    context = _context()
    pages: dict[str, str] = {}
    table = run_suite(context, SAMPLE_SUITE, frame, sample_expectations(settings), id_column="id",
                      docs=pages)
    per_domain = {}
    domain_outcomes = []
    gx = _gx()
    for domain in domains:
        rows = frame[frame["domain"] == domain].reset_index(drop=True)
        outcome = run_suite(context, DOMAIN_SUITE, rows,
                            [gx.expectations.ExpectTableRowCountToBeBetween(min_value=min_rows)],
                            scope=domain)[0]
        status = "ok" if outcome.success else "insufficient"
        per_domain[domain] = {"rows": int(len(rows)), "status": status, "min_rows": min_rows}
        domain_outcomes.append((DOMAIN_SUITE, outcome, status))
    failures = [outcome for outcome in table if not outcome.success]
    stored = [(SAMPLE_SUITE, outcome, "pass" if outcome.success else "fail") for outcome in table]
    with store.transaction() as tx:
        _store(tx, run_id, (SAMPLE_SUITE, DOMAIN_SUITE), stored + domain_outcomes)
        store_data_docs(tx, run_id, pages)
        set_run_checked(tx, run_id, passed=not failures)
    insufficient = sorted(d for d, info in per_domain.items() if info["status"] == "insufficient")
    if failures:
        summary = _failure_summary(
            f"traffic sample of run {run_id!r} ({len(frame)} rows)", failures,
            "Fix or purge the offending traffic rows (ids above: `specdec traffic purge --id ID`), "
            "or widen the bounds in the settings, then sample and check the run again.")
        log.error("%s", summary)
        raise QualityGateFailed(summary, [dict(o.observed, expectation=o.expectation, column=o.column)
                                          for o in failures])
    log.info("run %s: traffic sample passed %d expectations; insufficient domains: %s", run_id,
             len(table), insufficient or "none")
    return {"run_id": run_id, "rows": int(len(frame)), "expectations": len(table),
            "domains": per_domain, "insufficient": insufficient}


# ------------------------------------------------------------------------------------------------
# result tables
def result_expectations(table: str, settings: Settings, columns) -> list:
    """Expectations for a result table's rows of one run (only on the columns it has)."""
    e = _gx().expectations
    k_max = settings.quality.k_max
    rate = lambda column: e.ExpectColumnValuesToBeBetween(column=column, min_value=0, max_value=1)  # noqa: E731
    positive = lambda column: e.ExpectColumnValuesToBeBetween(column=column, min_value=0,  # noqa: E731
                                                              strict_min=True)
    candidates = [
        e.ExpectTableRowCountToBeBetween(min_value=1),
        e.ExpectColumnValuesToNotBeNull(column="domain"),
        rate("acceptance_rate"), rate("conditional_acceptance_min"), rate("conditional_acceptance_max"),
        e.ExpectColumnValuesToBeBetween(column="k", min_value=1, max_value=k_max),
        e.ExpectColumnValuesToBeBetween(column="mean_accepted_length", min_value=1, max_value=k_max + 1),
        positive("predicted_speedup"), positive("predicted_speedup_lo"),
        positive("predicted_speedup_hi"), positive("measured_speedup"),
        e.ExpectColumnValuesToBeBetween(column="batch_size", min_value=1),
        e.ExpectColumnValuesToBeBetween(column="max_batch_size", min_value=1),
        e.ExpectColumnValuesToBeBetween(column="requests", min_value=1),
    ]
    return [x for x in candidates if getattr(x, "column", None) in (None, *columns)]


RESULT_TABLES = ("acceptance_estimates", "live_measurements", "domain_configs")


def load_result_frame(tx, table: str, run_id: str):
    rows, columns = result_rows(tx, table, run_id)
    return pd.DataFrame(rows, columns=columns)


def check_result_table(run_id: str, table: str, store: Store,
                       settings: Settings | None = None, frame=None) -> dict:
    """Run the result-table suite on the run's rows of `table` (or on `frame`, before writing it).

    Output: {"run_id", "table", "rows", "expectations"}. Raises QualityGateFailed (after storing
    the results) when an expectation fails.
    """
    if table not in RESULT_TABLES:
        raise SampleError(f"result table {table!r}: choose one of {list(RESULT_TABLES)}")
    settings = settings or store.settings
    if frame is None:
        with store.transaction() as tx:
            frame = load_result_frame(tx, table, run_id)
    frame = frame.copy()
    if "conditional_acceptance" in frame.columns:
        rates = frame["conditional_acceptance"].apply(lambda v: list(v) if isinstance(v, (list, tuple)) else [])
        frame["conditional_acceptance_min"] = rates.apply(lambda v: min(v) if v else None)
        frame["conditional_acceptance_max"] = rates.apply(lambda v: max(v) if v else None)
        frame = frame.drop(columns=["conditional_acceptance"])
    for column in frame.columns:
        if column not in ("run_id", "domain", "drafter", "status", "created_at", "enabled"):
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    suite = f"results:{table}"
    pages: dict[str, str] = {}
    outcomes = run_suite(_context(), suite, frame, result_expectations(table, settings, frame.columns),
                         docs=pages)
    failures = [o for o in outcomes if not o.success]
    with store.transaction() as tx:
        _store(tx, run_id, (suite,),
               [(suite, o, "pass" if o.success else "fail") for o in outcomes])
        store_data_docs(tx, run_id, pages)
    if failures:
        summary = _failure_summary(f"{table} of run {run_id!r} ({len(frame)} rows)", failures,
                                   f"The step that wrote {table} produced impossible values; fix it "
                                   "and re-run that step for this run.")
        log.error("%s", summary)
        raise QualityGateFailed(summary, [dict(o.observed, expectation=o.expectation, column=o.column)
                                          for o in failures])
    return {"run_id": run_id, "table": table, "rows": int(len(frame)), "expectations": len(outcomes)}
