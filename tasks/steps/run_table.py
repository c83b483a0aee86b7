"""A run's per-domain table: what `specdec evaluate` prints, the DAG's report task logs and
returns, and the main job shows.

One row a domain: its plan (domain_configs), the live check on our engine, the engine check and
the sampling test on vLLM, and the load check. Reading it touches only the database: no model,
no torch.
"""

from __future__ import annotations

import logging

from ..db.queries_load import load_summaries
from ..db.queries_runs import evaluation_rows
from ..db.store import Store
from ..registry.run_results import engine_sampling_tests
from .spec import RunSpec

log = logging.getLogger(__name__)

ENGINE_COLUMNS = {"engine_status": "status", "engine_e": "engine_e", "engine_estimate_e": "estimate_e",
                  "engine_passed": "passed"}     # the engine check (tasks.steps.checks.engine_check) on vLLM
TABLE_COLUMNS = ("domain", "status", "drafter", "k", "max_batch_size", "mean_accepted_length",
                 "predicted_speedup", "predicted_speedup_lo", "predicted_speedup_hi",
                 "measured_speedup", "gap", "enabled", "validation", "promotable", "reason",
                 "predicted_same_requests", "cost_model_error", "sampling_error", "greedy_checked",
                 "greedy_consistent", "live_check", "measured_speedup_lo", "measured_speedup_hi",
                 *ENGINE_COLUMNS, "engine_sampling", "load_check")
LIVE_COLUMNS = ("gap", "predicted_same_requests", "cost_model_error", "sampling_error",
                "greedy_checked", "greedy_consistent", "measured_speedup_lo", "measured_speedup_hi")


def evaluation_table(run_id: str, store: Store) -> list[dict]:
    """The run's per-domain table (domain_configs joined with its live measurement, its engine
    check and its sampling test on vLLM: "engine_sampling", run_results.engine_sampling_tests'
    dict or None)."""
    configs, live, checked = evaluation_rows(store, run_id, LIVE_COLUMNS, ENGINE_COLUMNS.values())
    on_engine = engine_sampling_tests(run_id, store)
    under_load = load_summaries(store, run_id)

    def value(row, column):
        if column == "engine_sampling":
            return on_engine.get(row["domain"])
        if column == "load_check":
            return under_load.get(row["domain"])
        if column in LIVE_COLUMNS:
            return (live.get(row["domain"]) or {}).get(column)
        if column in ENGINE_COLUMNS:
            return (checked.get(row["domain"]) or {}).get(ENGINE_COLUMNS[column])
        return row[column]
    return [{column: value(row, column) for column in TABLE_COLUMNS} for row in configs]


def report_table(spec) -> list[dict]:
    """The run's per-domain table (evaluation_table); logs one line a domain (the report task's
    log)."""
    spec = RunSpec.of(spec)
    table = evaluation_table(spec.run_id, spec.open_store())
    for row in table:
        measured = row.get("measured_speedup")
        log.info("run %s, domain %s: %s, %s K=%s, max batch %s, E %s, predicted %s, measured %s, "
                 "validation %s", spec.run_id, row["domain"], "on" if row["enabled"] else "off",
                 row["drafter"] or "-", row["k"] or "-", row["max_batch_size"] or "-",
                 "-" if row["mean_accepted_length"] is None else f"{row['mean_accepted_length']:.2f}",
                 "-" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.2f}x",
                 "-" if measured is None else f"{measured:.2f}x",
                 "not run (off)" if row["validation"] == "not_needed" else row["validation"] or "-")
    return table
