"""
### specdec_retrain_draft: distil a draft from the target's own logged responses

Weekly, and whenever `specdec_evaluate` reports domains whose acceptance fell below its alert
threshold (asset `specdec://alerts/low-acceptance`):

0. **generate** (Param `generate_count` > 0; queue `queues_gpu`, the timing pool): more training
   data from the target itself -- for up to that many logged prompts per domain it answers again
   under each row's logged sampling parameters, stored as traffic rows marked as generated (never
   sampled, indexed or reported as production traffic). A retried task resumes: the run id names
   the generation, and the prompts it already answered are skipped; so are the prompts this
   run's training holds out (`tasks.steps.traffic.traffic_generate`).
1. **train**: stored requests answered by this target (same fingerprint) in the window, split
   train / held-out by request id (recorded: evaluations never score a draft's training rows);
   a draft is trained -- Param `kind`: a small draft initialised from the target (KL from the
   target's top-k, or cross-entropy on the logged tokens), a draft head, or an EAGLE-3 head
   (vocabulary: the training responses' most frequent tokens; training-time test over `unroll`
   steps, default 3; saved in the speculators format vLLM serves) -- and the checkpoint with the
   best *held-out predicted speedup* is kept. Generated rows join the training split when Param
   `include_generated` is on (empty: when this run generates some), none from a held-out prompt.
   Runs in the `specdec_timing` pool (it would distort timing work). A retried task resumes from
   its last checkpoint.
   The kept checkpoint is uploaded to the training's MLflow run from the training worker (queue
   `queues_gpu` of the settings, default `gpu`).
2. **register** (queue `queues_cpu`, default `default`): the uploaded draft goes to the MLflow registry as a
   version of `specdec-draft-<target>`
   with alias `candidate` and its lineage (window, domains, training parameters, fingerprint,
   held-out acceptance per domain); the asset `specdec://drafts/new` then triggers a fresh
   `specdec_evaluate`, whose candidates include the new draft.
3. **refresh_suffix_indexes** (beside the training): each domain's suffix index over its logged
   responses in the window is rebuilt and registered as a version of `specdec-suffix-<target>`
   with its lineage (window, requests, tokens, fingerprint); evaluations can use one as the
   candidate `suffix:index=models:/...`.

Every step is a function of `tasks.steps` (draft_training, traffic_generate, suffix_index); this file only wires them (the glue shared by
the DAGs is `tasks.orchestration.airflow_glue`: a database or tracking-server outage is retried, bad input fails
the task at once).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Asset, Param, dag, get_current_context, task
from airflow.timetables.assets import AssetOrTimeSchedule
from airflow.timetables.trigger import CronTriggerTimetable

from tasks.orchestration.airflow_glue import (DEFAULT_MODEL, LOW_ACCEPTANCE_URI, NEW_DRAFT_URI, TIMING_POOL,
                                              connection_registry, connection_store, queues, task_errors)
from tasks.steps.drafters.draft_recipes import KINDS, SCHEDULED_RETRAINING

# The steps (tasks.steps.drafters.draft_training) are imported inside the tasks: they load the engine, the
# database and the registry client, and a DAG file's parse loads only Airflow,
# tasks.orchestration.airflow_glue and the training defaults (tasks.steps.drafters.draft_recipes: no engine)
# (`python -X importtime -c "import dags.specdec_retrain_draft"`).
# The Params' defaults are SCHEDULED_RETRAINING: the library's and the CLI's training defaults,
# with this schedule's deliberate choice of longer training on a bounded window.
DEFAULTS = SCHEDULED_RETRAINING

LOW_ACCEPTANCE_ASSET = Asset(LOW_ACCEPTANCE_URI)
NEW_DRAFT_ASSET = Asset(NEW_DRAFT_URI)
CPU_QUEUE, GPU_QUEUE = queues()

PARAMS = {
    "target": Param(DEFAULT_MODEL, type="string", title="Target model",
                    description="HF id, local directory, GGUF file, or the embedded default"),
    "domains": Param([], type=["null", "array"], items={"type": "string"}, title="Domains",
                     description="Optional; empty: pooled over every domain"),
    "window_days": Param(DEFAULTS["window_days"], type="number", minimum=1, maximum=365, title="Time window (days)",
                         description="1 to 365 days, ending at the newest stored request"),
    "max_requests": Param(DEFAULTS["max_requests"], type="integer", minimum=10, maximum=10_000_000,
                          title="Most requests used",
                          description="10 to 10000000 stored requests (train and held-out)"),
    "kind": Param("draft_model", type="string", enum=list(KINDS),
                  title="Draft kind",
                  description="draft_model: a small LM of the target's first layers; head: a draft "
                              "head on the target's hidden states (EAGLE-style); eagle3: an EAGLE-3 "
                              "head on three target layers, saved in the speculators format vLLM "
                              "serves"),
    "vocab_size": Param(None, type=["null", "integer"], minimum=64, title="Head vocabulary",
                        description="Optional, at least 64; head: the N most frequent tokens of the training traffic; "
                                    "eagle3: of the training responses; empty: the target's full "
                                    "vocabulary"),
    "unroll": Param(None, type=["null", "integer"], minimum=1, maximum=8,
                    title="Head chain steps trained (training-time test)",
                    description="Optional, 1 to 8; head, eagle3: draft steps trained on the head's own features; "
                                "empty: 1 for head, 3 for eagle3"),
    "layer_ids": Param(None, type=["null", "array"], items={"type": "integer", "minimum": 0},
                       title="EAGLE-3 target layers",
                       description="Optional; eagle3: the target layers whose inputs it reads; empty: "
                                   "vLLM's default (the inputs of layers 2, N/2 and N-3)"),
    "num_layers": Param(DEFAULTS["num_layers"], type="integer", minimum=1, maximum=32, title="Draft layers",
                        description="1 to 32: draft_model: the target's first layers it starts from"),
    "steps": Param(DEFAULTS["steps"], type="integer", minimum=1, maximum=1_000_000, title="Training steps",
                   description="1 to 1000000 optimiser steps"),
    "batch_size": Param(DEFAULTS["batch_size"], type="integer", minimum=1, maximum=1024, title="Batch size",
                        description="1 to 1024 requests per step"),
    "lr": Param(DEFAULTS["lr"], type="number", exclusiveMinimum=0, maximum=1, title="Peak learning rate",
                description="above 0, at most 1"),
    "eval_every": Param(DEFAULTS["eval_every"], type="integer", minimum=1, title="Validation evaluation every N steps",
                        description="at least 1; the kept checkpoint is the best of these evaluations "
                                    "on the validation rows, and the held-out rows score it once"),
    "teacher_topk": Param(DEFAULTS["teacher_topk"], type="integer", minimum=0, maximum=1024, title="Teacher top-k",
                          description="0 to 1024; 0: cross-entropy on the logged tokens; k > 0: KL from the "
                                      "target's top-k probabilities (one extra target pass)"),
    "heldout_fraction": Param(DEFAULTS["heldout_fraction"], type="number", minimum=0.01, maximum=0.9, title="Held-out share",
                              description="0.01 to 0.9 of the requests, held out by request id"),
    "generate_count": Param(0, type="integer", minimum=0, maximum=1_000_000,
                            title="Rows generated per domain",
                            description="0 to 1000000; before training, the target answers this many logged "
                                        "prompts per domain again (their logged sampling params); "
                                        "0: none"),
    "include_generated": Param(None, type=["null", "boolean"], title="Train on generated rows",
                               description="Optional; train on the rows the target generated too (this "
                                           "run's and earlier ones); empty: when this run "
                                           "generates some"),
}


@dag(dag_id="specdec_retrain_draft",
     description="Weekly on Sunday at 03:00 UTC (cron 0 3 * * 0), and whenever specdec_evaluate "
                 "reports low acceptance (asset specdec://alerts/low-acceptance), or from the "
                 "trigger form: trains a draft on the logged traffic and refreshes suffix indexes",
     start_date=datetime(2025, 1, 1), catchup=False, max_active_runs=1,
     schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 3 * * 0", timezone="UTC"),
                                  assets=[LOW_ACCEPTANCE_ASSET]),
     params=PARAMS, doc_md=__doc__, tags=["specdec", "cron 0 3 * * 0"],
     default_args={"owner": "specdec", "queue": CPU_QUEUE, "retries": 2, "retry_delay": timedelta(minutes=1),
                   "retry_exponential_backoff": True})
def specdec_retrain_draft():
    @task(pool=TIMING_POOL, queue=GPU_QUEUE)
    def generate() -> dict:
        """Generated training rows (Param generate_count per domain; nothing when 0)."""
        from tasks.steps.drafters.draft_training import train_id_of_run
        from tasks.steps.traffic.traffic_generate import generate_traffic

        context = get_current_context()
        p = context["params"]
        if not p["generate_count"]:
            return {"generated": 0, "domains": {}}
        with task_errors():
            train_id = train_id_of_run(context["run_id"])
            # the prompts this run's training holds out or validates on are skipped: it would
            # leave their rows out
            return generate_traffic(train_id, p["domains"] or None, p["generate_count"],
                                    target=p["target"], store=connection_store(),
                                    window_days=p["window_days"], progress=False,
                                    heldout=(train_id, p["heldout_fraction"],
                                             DEFAULTS["validation_fraction"]))

    @task(pool=TIMING_POOL, queue=GPU_QUEUE)
    def train() -> dict:
        """Train, then upload the kept checkpoint to MLflow from this worker: the registration
        (another task, maybe on another machine) reads no local file."""
        from tasks.steps.drafters.draft_recipes import recipe_and_data
        from tasks.steps.drafters.draft_training import log_draft, train_draft_from_traffic, train_id_of_run

        context = get_current_context()
        p = context["params"]
        with task_errors():
            recipe, data = recipe_and_data(
                p["kind"], steps=p["steps"], batch_size=p["batch_size"], lr=p["lr"],
                eval_every=p["eval_every"], teacher_topk=p["teacher_topk"],
                num_layers=p["num_layers"], vocab_size=p["vocab_size"], unroll=p["unroll"],
                layer_ids=p["layer_ids"] or None, domains=p["domains"] or None,
                window_days=p["window_days"], max_requests=p["max_requests"],
                heldout_fraction=p["heldout_fraction"],
                include_generated=(p["include_generated"] if p["include_generated"] is not None
                                   else p["generate_count"] > 0))
            store = connection_store()
            trained = train_draft_from_traffic(
                train_id_of_run(context["run_id"]), recipe, data, target=p["target"],
                store=store, register=False, progress=False)
            trained["tracking_run_id"] = log_draft(trained["train_id"], p["target"], trained["fingerprint"],
                                                   trained["best_dir"], trained["result"], store=store,
                                                   registry=connection_registry(store))
        return trained

    @task(outlets=[NEW_DRAFT_ASSET])
    def register(trained: dict) -> dict:
        from tasks.steps.drafters.draft_training import register_logged_draft

        with task_errors():
            store = connection_store()
            registered = register_logged_draft(
                trained["train_id"], get_current_context()["params"]["target"], trained["fingerprint"],
                trained["tracking_run_id"], trained["result"], store=store,
                registry=connection_registry(store))
        get_current_context()["outlet_events"][NEW_DRAFT_ASSET].extra = {
            "model_uri": registered["model_uri"], "train_id": trained["train_id"]}
        return registered

    @task
    def refresh_suffix_indexes() -> dict:
        from tasks.steps.drafters.suffix_index import refresh_indexes

        p = get_current_context()["params"]
        with task_errors():
            store = connection_store()
            return refresh_indexes(p["target"], p["domains"] or None, store=store,
                                   registry=connection_registry(store), window_days=p["window_days"])

    trained = train()
    generate() >> trained
    register(trained)
    refresh_suffix_indexes()


specdec_retrain_draft()
