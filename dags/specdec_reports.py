"""
### specdec_reports: materialise the ops SQL reports after each evaluation

Triggered by the `specdec://evaluations` asset that `specdec_evaluate` publishes. Runs every
report in `sql/` (portable SQL: SQLite and PostgreSQL) against the specdec database and writes
each as CSV under `$SPECDEC_HOME/reports/` (one file per report, replaced each time), so ops teams
read them from a file share or open them in a notebook. With several workers (CeleryExecutor), the
files land on the worker that ran the task (queue `queues_cpu`): mount `$SPECDEC_HOME/reports` from
a shared volume there, or run the same reports from any machine with `specdec report`. Every step is
a function of `tasks.steps.traffic.reports` (the glue shared by the DAGs is
`tasks.orchestration.airflow_glue`).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Asset, dag, task

from tasks.orchestration.airflow_glue import (EVALUATIONS_URI, MAP_LABEL, connection_store,
                                              label_mapped, queues, task_errors)

# The steps (tasks.steps.traffic.reports) are imported inside the tasks: they load the engine, the
# database and the registry client, and a DAG file's parse loads only Airflow and
# tasks.orchestration.airflow_glue (`python -X importtime -c "import dags.specdec_reports"`).

EVALUATIONS_ASSET = Asset(EVALUATIONS_URI)
CPU_QUEUE, _ = queues()


@dag(dag_id="specdec_reports", schedule=[EVALUATIONS_ASSET],
     description="After each specdec_evaluate run (asset specdec://evaluations), or from the "
                 "trigger form: writes the ops SQL reports as CSV under $SPECDEC_HOME/reports", start_date=datetime(2025, 1, 1),
     catchup=False, doc_md=__doc__, tags=["specdec"],
     default_args={"owner": "specdec", "queue": CPU_QUEUE, "retries": 2,
                   "retry_exponential_backoff": True})
def specdec_reports():
    @task
    def report_names() -> list[str]:
        from tasks.steps.traffic.reports import list_reports

        return sorted(list_reports())

    @task(map_index_template=MAP_LABEL)
    def materialise(name: str) -> dict:
        from tasks.steps.traffic.reports import materialise_report

        label_mapped(name)
        with task_errors():
            return materialise_report(name, connection_store())

    materialise.expand(name=report_names())


specdec_reports()
