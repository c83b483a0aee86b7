"""
### specdec_evaluate: per-domain speculative decoding settings, proven lossless, promoted by review

Daily, when `specdec_retrain_draft` registers a new draft (asset `specdec://drafts/new`), when
`specdec_monitor` finds production acceptance below the champion's promise (asset
`specdec://alerts/production-drift`), or on demand from the trigger form, for the target model:

1. **sample** logged traffic per domain over the time window (the same requests for the same traffic);
2. **check** it with Great Expectations: table-level failures stop the run; a domain below its
   minimum is *insufficient* and keeps the champion's setting;
3. **profile** target step, verify(K) and draft steps on this worker (pool `specdec_timing`,
   one slot: timing never overlaps other timing), or reuse the newest stored profile of this
   worker's hardware, engine, dtype and target that passed its checks and is younger than
   `profile_max_age_days` (Param `new_profile`: measure anyway), or use a named stored profile;
4. per domain (mapped): **estimate** acceptance offline and **plan** drafter, K, max batch size and
   on/off; **confirm** live (pool `specdec_timing`); **validate** the sampling distribution;
5. **finish**: domains whose steps failed are recorded as failed (the champion's setting is kept),
   greedy exact match and target fingerprint once, result-table checks; **engine_check**: each
   domain the plan turns on is served by vLLM (the serving environment) with its exported config,
   its requests replayed, vLLM's acceptance counters compared with the estimate (a domain that
   falls short, or whose config vLLM refuses, is turned off; no serving environment: the task ends
   skipped with the reason, and the version page and its engine_check gate say "not checked";
   no domain on: skipped, "not run: no domain is on");
6. **register** the config in MLflow (alias `challenger`), **promote** it when asked and the gates
   pass (alias `champion`, compare-and-set), and publish the assets below.

Assets: `specdec://config/champion` (a new champion config), `specdec://alerts/low-acceptance`
(domains whose expected tokens per round fell below the alert threshold), and
`specdec://evaluations` (which triggers `specdec_reports`).

Connections and secrets: the specdec database comes from the Airflow connection `specdec_db`
(or `$SPECDEC_DATABASE_URL`), MLflow from `$MLFLOW_TRACKING_URI`. Retries: a database or
tracking-server outage is retried; bad input and failed gates fail the task at once.

Queues: the tasks that run the model (profile, estimate, confirm, validate, finish, engine_check)
take the queue `queues_gpu` of the settings (default `gpu`), the others `queues_cpu` (default
`default`): with the CeleryExecutor, GPU workers listen on the first. Tasks pass only small JSON
(XCom), the database and the MLflow store between them: no shared disk. The timing pool spans
every worker.

Every step is a function of `tasks.steps.pipeline`; this file only wires them (the glue shared by the
DAGs is `tasks.orchestration.airflow_glue`). The Param `samples_per_domain` was renamed `max_per_domain`; the
old name is still read from the run conf (with a warning in the `sample` task's log).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Asset, Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from airflow.timetables.assets import AssetOrTimeSchedule
from airflow.timetables.trigger import CronTriggerTimetable

from tasks.orchestration.airflow_glue import (CHAMPION_URI, DEFAULT_CANDIDATES, DEFAULT_MODEL, DRIFT_URI,
                                              EVALUATIONS_URI, K_LIMIT, LOW_ACCEPTANCE_URI, MAP_LABEL,
                                              NEW_DRAFT_URI,
                                              TIMING_POOL, domain_step_failed, domains_failed_text,
                                              evaluate_spec, label_mapped, queues, run_spec,
                                              setting_default, task_errors, wire_in_order)

# The steps (tasks.steps.pipeline) are imported inside the tasks: they load the engine, the
# database and the registry client, and a DAG file's parse loads only Airflow and
# tasks.orchestration.airflow_glue (`python -X importtime -c "import dags.specdec_evaluate"`).

CHAMPION_ASSET = Asset(CHAMPION_URI)
LOW_ACCEPTANCE_ASSET = Asset(LOW_ACCEPTANCE_URI)
EVALUATIONS_ASSET = Asset(EVALUATIONS_URI)
NEW_DRAFT_ASSET = Asset(NEW_DRAFT_URI)      # published by specdec_retrain_draft
DRIFT_ASSET = Asset(DRIFT_URI)              # published by specdec_monitor
CPU_QUEUE, GPU_QUEUE = queues()             # database/registry tasks; tasks that run the model

DEFAULT_ARGS = {
    "owner": "specdec",
    "queue": CPU_QUEUE,
    "retries": 2,                        # database / tracking-server hiccups; user errors fail at once
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=10),
}

# defaults that are settings come from Settings (tasks.settings), never copied here. A Param whose
# type allows null is optional in the trigger form (empty: the stated default); the others are
# required and have a default. Ranges are in the description and in airflow_glue.PARAM_RANGES,
# checked by the first task (sample), which fails naming the field: not in the schema, whose
# minimum/maximum the trigger form enforces by changing the number typed (40 became 32). min <= max
# per domain is checked there too.
PARAMS = {
    "target": Param(DEFAULT_MODEL, type="string", title="Target model",
                    description="HF id, local directory, GGUF file, or the embedded default"),
    "domains": Param([], type=["null", "array"], items={"type": "string"}, title="Domains",
                     description="Optional; empty: every domain with traffic in the window"),
    "window_days": Param(setting_default("sample_window_days"), type="number",
                         title="Time window (days)",
                         description="0.01 to 365 days, ending at the newest stored request"),
    "max_per_domain": Param(setting_default("sample_max_per_domain"), type="integer",
                            title="Samples per domain",
                            description="1 to 100000 requests drawn per domain; at least the "
                                        "minimum below (formerly samples_per_domain)"),
    "min_per_domain": Param(setting_default("sample_min_per_domain"), type="integer",
                            title="Minimum samples per domain",
                            description="1 to 100000, at most Samples per domain (checked when the "
                                        "run starts: the sample task fails naming both); fewer: "
                                        "the domain is insufficient and keeps the champion's setting"),
    "candidates": Param(DEFAULT_CANDIDATES, type=["null", "array"],
                        items={"type": "string"}, title="Candidate drafters",
                        description="Optional; KIND[:NAME=VALUE...], e.g. "
                                    "draft_model:model=/models/draft; empty: the settings' candidates. "
                                    "layer_skip has no vLLM equivalent: a run planned on vLLM's "
                                    "costs estimates it but never plans with it (each domain's "
                                    "reason names it); leave it out there"),
    "hardware_profile": Param(setting_default("plan_hardware_profile"), type=["null", "string"],
                              title="Hardware profile",
                              description="Optional; a stored cost profile to plan with; empty: "
                                          "this worker's costs (a stored profile of its hardware "
                                          "reused, or measured: see New cost profile)"),
    "new_profile": Param(False, type="boolean", title="New cost profile",
                         description="On: the profile task measures this worker even where a stored "
                                     "profile of its hardware, engine and target that passed its "
                                     "checks and is younger than profile_max_age_days could be "
                                     "reused; off: reuse such a profile"),
    "k_max": Param(setting_default("plan_k_max"), type="integer",
                   title="Largest K",
                   description=f"1 to {K_LIMIT}: the largest number of draft tokens per round (K) "
                               "that is profiled and planned; the planner picks each domain's K up "
                               "to it (the setting plan_k_max; at most the result tables' limit, "
                               f"the setting quality_k_max). A value outside 1 to {K_LIMIT} is refused "
                               "when the run starts (the sample task fails naming it), never changed"),
    "min_speedup": Param(setting_default("plan_min_speedup"), type="number",
                         title="Minimum speedup",
                         description="0.01 to 10: a domain that is off turns on only when its "
                                     "interval's lower end clears this; one on in the champion "
                                     "stays on while its upper end clears this and its lower end "
                                     "clears 1.0 (hysteresis: configs do not flap at the edge). "
                                     "Below 1.0 only for testing: it turns on predicted slowdowns"),
    "acceptance_alert": Param(setting_default("plan_acceptance_alert"), type="number",
                              title="Low-acceptance alert",
                              description="1 to 33 tokens per round: alert when a domain's expected "
                                          "tokens per round falls below this"),
    "promote": Param(False, type=["null", "boolean"], title="Promote",
                     description="Optional; on: move the champion alias when every gate passes; "
                                 "off or empty: register only (alias challenger)"),
}


@dag(dag_id="specdec_evaluate",
     description="Daily at 00:00 UTC (cron 0 0 * * *), and whenever specdec_retrain_draft registers "
                 "a new draft (asset specdec://drafts/new) or specdec_monitor finds production "
                 "drift (asset specdec://alerts/production-drift), or from the trigger form: "
                 "per-domain speculative decoding settings, proven lossless, registered in MLflow",
     schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 0 * * *", timezone="UTC"),
                                  assets=(NEW_DRAFT_ASSET | DRIFT_ASSET)),
     start_date=datetime(2025, 1, 1), catchup=False,
     max_active_runs=1, default_args=DEFAULT_ARGS, params=PARAMS, doc_md=__doc__,
     tags=["specdec", "cron 0 0 * * *"], render_template_as_native_obj=True)
def specdec_evaluate():
    @task
    def sample() -> dict:
        from tasks.steps.pipeline import step_sample

        context = get_current_context()
        with task_errors():
            spec = evaluate_spec(context["run_id"], context["params"], context["dag_run"].conf)
            sampled = step_sample(spec)
        return sampled["spec"]      # the spec with its candidates frozen: every later task takes it

    @task
    def check() -> dict:
        from tasks.steps.pipeline import step_check

        with task_errors():
            return step_check(run_spec())

    @task(pool=TIMING_POOL, queue=GPU_QUEUE)
    def profile() -> dict:
        """The run's cost profile: reused (a stored one younger than profile_max_age_days) or
        measured here; the Param new_profile forces a measurement."""
        from tasks.steps.pipeline import step_profile

        with task_errors():
            return step_profile(run_spec(), new_profile=bool(get_current_context()["params"].get("new_profile")))

    @task
    def domains_of(checked: dict) -> list[str]:
        return checked["ok"]

    @task(retries=0, map_index_template=MAP_LABEL, queue=GPU_QUEUE)
    def estimate(domain: str, profile_name: dict) -> str:
        from tasks.steps.pipeline import step_estimate

        label_mapped(domain)
        with task_errors():
            step_estimate(run_spec(), domain, profile_name)
        return domain

    # estimate, confirm and validate are each mapped over the domains (one map index, one domain
    # in all three: the graph counts each one's instances, which it cannot do for the tasks of a
    # mapped task group, "estimate [0]"); each waits for the step before it as a whole task
    # (all_done) and checks its own domain's step, so a failure stays in its domain
    @task(pool=TIMING_POOL, retries=0, map_index_template=MAP_LABEL, queue=GPU_QUEUE,
          trigger_rule="all_done")
    def confirm(domain: str) -> str:
        """Measured nothing (a run planned on vLLM's costs; no plan to measure), or this domain's
        estimate did not succeed: ends skipped with the reason."""
        from tasks.steps.pipeline import step_confirm

        label_mapped(domain)
        failed = domain_step_failed(("estimate",))
        if failed:
            raise AirflowSkipException(f"{domain}: confirm not run: {failed} (finish records the "
                                       "domain as failed; the champion's setting is kept)")
        with task_errors():
            row = step_confirm(run_spec(), domain)
        if row.get("skipped"):
            raise AirflowSkipException(f"{domain}: confirm not run: {row['skipped']}")
        return domain

    # a skipped confirm is no reason to skip the sampling test; a failed estimate or confirm is
    @task(retries=0, map_index_template=MAP_LABEL, queue=GPU_QUEUE, trigger_rule="all_done")
    def validate(domain: str) -> str:
        """A domain that is off has no sampling test, nor one whose estimate or confirm failed,
        nor any where the test on vLLM gates (the engine check runs it): ends skipped with the
        reason."""
        from tasks.steps.pipeline import step_validate

        label_mapped(domain)
        failed = domain_step_failed(("estimate", "confirm"))
        if failed:
            raise AirflowSkipException(f"{domain}: sampling test not run: {failed} (finish records "
                                       "the domain as failed; the champion's setting is kept)")
        with task_errors():
            result = step_validate(run_spec(), domain)
        if result.get("skipped"):
            raise AirflowSkipException(f"{domain}: sampling test on our engine not run: {result['skipped']}")
        if result["validation"] == "not_needed":
            raise AirflowSkipException(f"{domain}: sampling test not run: the domain is off (the "
                                       "tests run only for a domain on)")
        return domain

    @task(trigger_rule="all_done", queue=GPU_QUEUE)
    def finish(checked: dict) -> dict:
        """Runs whatever the domains' outcome: failed domains keep the champion's setting."""
        from tasks.steps.pipeline import step_finish

        spec = run_spec()
        if checked is None:     # check failed: the run has nothing to finish
            raise AirflowSkipException("check did not complete")
        with task_errors():
            return step_finish(spec, insufficient=checked["insufficient"])

    @task(retries=0, queue=GPU_QUEUE)
    def engine_check() -> dict:
        """Each domain the plan turns on, served by vLLM with its exported config. No serving
        environment (or the setting engine_check off): the task ends skipped, its reason in the
        log, and register goes on (the page and the engine_check gate say "not checked")."""
        from tasks.steps.pipeline import step_engine_check

        with task_errors():
            result = step_engine_check(run_spec())
        if result["skipped"] and result.get("nothing_on"):     # nothing to check: says so
            raise AirflowSkipException(f"{result['skipped']} (the version page and its gates say so)")
        if result["skipped"]:       # a visible state: the task ends skipped, the page says why
            raise AirflowSkipException(f"{result['skipped']}: the config is NOT checked on the "
                                       "serving engine (the version page and its gates say so)")
        for domain, row in sorted(result["domains"].items()):
            print(f"{domain}: {row['status']}: {row['reason']}")
        return {"skipped": result["skipped"],
                "domains": {d: {"status": r["status"], "passed": r["passed"]}
                            for d, r in result["domains"].items()}}

    @task(trigger_rule="none_failed")      # a skipped engine check is no reason to stop
    def register() -> dict:
        from tasks.steps.pipeline import step_register

        with task_errors():     # the MLflow run spans the evaluation: from the DAG run's start
            return step_register(run_spec(), started_at=get_current_context()["dag_run"].start_date)

    @task(outlets=[CHAMPION_ASSET])
    def promote(registered: dict) -> dict:
        spec = run_spec()
        if not spec["promote"]:
            raise AirflowSkipException("promotion not requested (param promote=false)")
        from tasks.steps.pipeline import step_promote

        with task_errors():
            result = step_promote(spec, registered)
        if not result["promoted"]:
            raise AirflowSkipException(f"not promoted: {result['reason']}")
        get_current_context()["outlet_events"][CHAMPION_ASSET].extra = {
            "name": registered["name"], "version": result["version"], "run_id": spec["run_id"]}
        return result

    @task(outlets=[LOW_ACCEPTANCE_ASSET])
    def acceptance_alert(finished: dict) -> list[dict]:
        from tasks.steps.pipeline import low_acceptance_domains

        context, spec = get_current_context(), run_spec()
        with task_errors():
            low = low_acceptance_domains(spec, context["params"]["acceptance_alert"])
        if not low:
            raise AirflowSkipException("no domain below the acceptance alert")
        context["outlet_events"][LOW_ACCEPTANCE_ASSET].extra = {"run_id": spec["run_id"], "domains": low}
        return low

    @task(outlets=[EVALUATIONS_ASSET], trigger_rule="none_failed_min_one_success")
    def report(finished: dict) -> list[dict]:
        """The run's per-domain table (logged, and the XCom return value)."""
        from tasks.steps.run_table import report_table

        spec = run_spec()
        with task_errors():
            table = report_table(spec)
        get_current_context()["outlet_events"][EVALUATIONS_ASSET].extra = {"run_id": spec["run_id"]}
        return table

    @task(trigger_rule="none_failed")     # past a skipped finish; a failed report still stops it
    def domain_failures(finished: dict) -> None:
        """Last: fails the run (after everything else is stored) when a domain's steps failed, or
        when the run never finished (sample or check did not complete: the tasks after them end
        skipped, and a run of skipped leaves would read success)."""
        if finished is None:
            raise AirflowFailException("the run did not finish: sample or check did not complete "
                                       "(see the first failed task); nothing was evaluated")
        if finished["failed"]:
            raise AirflowFailException(domains_failed_text(finished["failed"]))

    # the run's spec is pulled by each task (run_spec), not passed: no edge from sample to all
    sampled = sample()
    checked = check()
    profile_name = profile()
    domains = domains_of(checked)
    estimated = estimate.partial(profile_name=profile_name).expand(domain=domains)
    confirmed = confirm.expand(domain=domains)
    validated = validate.expand(domain=domains)
    estimated >> confirmed >> validated
    finished = finish(checked)
    engine_checked = engine_check()
    registered = register()
    promoted = promote(registered)
    # the run's order, written once (tasks.steps.run_order.RUN_ORDER; `specdec evaluate` follows it)
    wire_in_order({"sample": sampled, "check": checked, "profile": profile_name,
                   "per_domain": (estimated, validated), "finish": finished,
                   "engine_check": engine_checked, "register": registered, "promote": promoted})
    acceptance_alert(finished)
    reported = report(finished)
    reported << promoted
    reported >> domain_failures(finished)


specdec_evaluate()
