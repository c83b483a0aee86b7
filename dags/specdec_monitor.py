"""
### specdec_monitor: production acceptance from the serving engines, beside the champion's promise

Every 5 minutes, or on demand from the trigger form:

1. **targets**: the champion's vLLM deployments (`specdec config export --format compose` names
   them) and the URL of each: the Airflow Variable `specdec_monitor_targets`
   (`{"vllm-json-qa": "http://host:8000", ...}`; only the deployments it names are scraped), else a
   connection `specdec_vllm_<deployment>` (dashes as underscores: its host, port and schema), else
   `http://<deployment>:8000`, the Compose service of the `serving` profile;
2. **scrape** (mapped, one per deployment): the server's `/metrics` spec-decode counters and their
   deltas since the last scrape (a restart starts a new series); a server that does not answer
   fails its own task with one line and stores nothing;
3. **check**: over the sustained window (setting `monitor_window_s`, at least `monitor_min_drafts`
   drafts), production E below the promise's interval raises a drift alert, and below the
   break-even of the deployed K rolls the champion back (compare-and-set, audit row with the
   evidence; setting `monitor_auto_rollback`);
4. **drift_alert**: when the check raised an alert or a rollback, publishes the asset
   `specdec://alerts/production-drift`, which triggers `specdec_evaluate` (skipped otherwise).

The specdec database is the Airflow connection `specdec_db` (or `$SPECDEC_DATABASE_URL`), MLflow
`$MLFLOW_TRACKING_URI`. Every step is a function of `tasks.steps.monitor` (docs/monitoring.md).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Asset, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowSkipException
from airflow.timetables.trigger import CronTriggerTimetable

from tasks.orchestration.airflow_glue import (DRIFT_URI, MAP_LABEL, connection_store,
                                              label_mapped, monitor_targets, queues, task_errors)

# The steps (tasks.steps.monitor) are imported inside the tasks: they load the database and the
# registry client, and a DAG file's parse loads only Airflow and tasks.orchestration.airflow_glue.

DRIFT_ASSET = Asset(DRIFT_URI)
CPU_QUEUE, _ = queues()


@dag(dag_id="specdec_monitor",
     description="Every 5 minutes (cron */5 * * * *), or from the trigger form: scrapes the "
                 "champion's vLLM deployments, compares production E with the promise, rolls back "
                 "below break-even and publishes drift on the asset specdec://alerts/production-drift",
     schedule=CronTriggerTimetable("*/5 * * * *", timezone="UTC"), start_date=datetime(2025, 1, 1),
     catchup=False, max_active_runs=1, doc_md=__doc__, tags=["specdec"],
     default_args={"owner": "specdec", "queue": CPU_QUEUE, "retries": 1,
                   "retry_delay": timedelta(seconds=30)})
def specdec_monitor():
    @task
    def targets() -> list[dict]:
        from tasks.steps.monitor.drift import champion_deployment_names
        from tasks.steps.monitor.monitor import MonitorContext

        with task_errors():
            names = champion_deployment_names(MonitorContext.open(connection_store()))
            return [{"deployment": name, "url": url}
                    for name, url in sorted(monitor_targets(names).items())]

    @task(map_index_template=MAP_LABEL, retries=0)
    def scrape(target: dict) -> dict:
        from tasks.steps.monitor.monitor import MonitorContext
        from tasks.steps.monitor.scrape import scrape as scrape_one

        label_mapped(target["deployment"])
        with task_errors():
            row = scrape_one(MonitorContext.open(connection_store()), target["url"],
                             target["deployment"])
        return {k: row[k] for k in ("deployment", "series", "start", "config_version",
                                    "delta_drafts", "delta_draft_tokens", "delta_accepted")}

    @task(trigger_rule="all_done")
    def check() -> list[dict]:
        from tasks.steps.monitor.monitor import MonitorContext
        from tasks.steps.monitor.drift import check as check_window

        with task_errors():
            result = check_window(MonitorContext.open(connection_store()))
        if not result["deployments"]:       # nothing watched: never "within the promise"
            raise AirflowSkipException(
                "nothing to watch: " + ("no champion" if result["champion"] is None else
                                        f"champion version {result['champion']} has no speculative "
                                        "deployment (no domain on)"))
        return [{k: str(e[k]) if k.startswith("window") else e[k]
                 for k in ("kind", "deployment", "config_version", "production_e", "reason",
                           "window_start", "window_end")} for e in result["events"]]

    @task(outlets=[DRIFT_ASSET])
    def drift_alert(events: list[dict]) -> list[dict]:
        if not events:
            raise AirflowSkipException("production E within the promise on every watched "
                                       "deployment (or too few drafts)")
        get_current_context()["outlet_events"][DRIFT_ASSET].extra = {"events": events}
        return events

    scraped = scrape.expand(target=targets())
    found = check()
    scraped >> found
    drift_alert(found)


specdec_monitor()
