"""The README's main job: the embedded default, the shipped traffic, and `specdec_evaluate` run end
to end through Airflow's own `dag.test()` on SQLite (specdec and Airflow metadata) and the local
MLflow store, all under $SPECDEC_HOME; then the per-domain table, the champion config, and how to
open the Airflow and MLflow UIs on them.

    specdec main-job [--no-promote] [--conf '{"max_per_domain": 20}']
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rich.markup import escape

from specdec_core.home import DEFAULT_MODEL

from ..db import upgrade
from ..db.store import Store
from ..errors import InvalidValue, RegistryError
from ..masking import mask_text, mask_url, printable
from ..orchestration.airflow_glue import TIMING_POOL
from ..orchestration.airflow_logs import recording, write_task_logs
from ..registry.config_schema import config_model_name, target_slug
from ..registry.registry import Registry
from ..registry.run_results import profile_check
from ..registry.run_view import build_run_view
from ..settings import DATABASE_URL_ENV, load_settings, specdec_home
from ..steps.costs.reuse import profile_check_text
from ..steps.run_table import evaluation_table
from ..steps.traffic.traffic_import import import_traffic, sample_traffic_path
from .console import make_console
from .evaluation import print_run


def airflow_environment(home: Path, dags_folder: Path) -> dict:
    """Environment of a local Airflow under $SPECDEC_HOME/airflow (SQLite metadata)."""
    airflow_home = home / "airflow"
    return {"AIRFLOW_HOME": str(airflow_home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
            # a demo machine: no schedule fires until asked. Every DAG is created paused; the
            # trigger form's "Unpause on trigger" box (ticked by default) switches one on
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING")}


def default_dags_folder() -> Path:
    return Path(os.environ.get("AIRFLOW__CORE__DAGS_FOLDER")
                or Path(__file__).resolve().parents[2] / "dags")


class _TaskProgress(logging.Handler):
    """Prints one line per task that dag.test() starts (Airflow's own logs are kept at WARNING)."""

    def __init__(self, console):
        super().__init__(logging.INFO)
        self.console = console
        self.started = time.perf_counter()

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"\[DAG TEST\] starting task_id=(\S+) map_index=(-?\d+)", record.getMessage())
        if match:
            task, index = match.groups()
            label = task if index == "-1" else f"{task}[{index}]"
            self.console.print(f"      {time.perf_counter() - self.started:6.0f} s  {label}")


def prepare_airflow(env: dict) -> None:
    """Migrate the metadata database and create the one-slot timing pool (both idempotent); the
    airflow.cfg Airflow generates then gets this environment's settings (no example DAGs, our DAG
    folder and database), so that an Airflow started on this home without them agrees."""
    os.environ.update(env)
    for command in (["db", "migrate"],
                    ["pools", "set", TIMING_POOL, "1", "timing work never overlaps"]):
        done = subprocess.run([sys.executable, "-m", "airflow", *command], capture_output=True,
                              text=True, env=os.environ.copy())
        if done.returncode != 0:
            raise RuntimeError(f"`airflow {' '.join(command)}` failed:\n{done.stderr[-3000:]}")
    write_airflow_cfg(Path(env["AIRFLOW_HOME"]) / "airflow.cfg", env)


# airflow.cfg keys (section, key) set from the environment variables of airflow_environment
CFG_KEYS = {"AIRFLOW__CORE__LOAD_EXAMPLES": ("core", "load_examples"),
            "AIRFLOW__CORE__DAGS_FOLDER": ("core", "dags_folder"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": ("database", "sql_alchemy_conn"),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": ("core", "dags_are_paused_at_creation")}


def write_airflow_cfg(path: Path, env: dict) -> None:
    """Set the CFG_KEYS of `env` in the generated airflow.cfg (Airflow writes its defaults there,
    `load_examples = True` among them, whatever the environment said)."""
    if not path.exists():
        return
    section, lines = None, path.read_text().splitlines()
    wanted = {keys: env[name] for name, keys in CFG_KEYS.items() if name in env}
    for n, line in enumerate(lines):
        header = re.fullmatch(r"\[(\w+)\]\s*", line)
        if header:
            section = header.group(1)
            continue
        key = re.match(r"(\w+)\s*=", line)
        if key and (section, key.group(1)) in wanted:
            lines[n] = f"{key.group(1)} = {wanted[(section, key.group(1))]}"
    path.write_text("\n".join(lines) + "\n")


def airflow_command(env: dict, port: int = 8080) -> str:
    """The shell line that opens the Airflow UI on the main job's home: every component of
    `airflow standalone` is started as `airflow` from PATH, so PATH names this environment's bin
    directory; the environment of airflow_environment and the api-server's port are spelled out."""
    bin_dir = Path(sys.executable).parent
    names = ["AIRFLOW_HOME", "AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__CORE__LOAD_EXAMPLES",
             "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"]
    # SPECDEC_HOME first (the Airflow home is under it, airflow_environment): a run triggered from
    # that UI, started from any directory, finds the main job's stores, not ./.specdec of wherever
    home = Path(env["AIRFLOW_HOME"]).resolve().parent
    assignments = f"SPECDEC_HOME={shlex.quote(str(home))} " + " ".join(
        f"{name}={shlex.quote(str(env[name]))}" for name in names)
    # the stores the tasks use, where this shell named them: as they are, or by reference where
    # they carry a password (never printed)
    for name in (DATABASE_URL_ENV, "MLFLOW_TRACKING_URI"):
        value = os.environ.get(name)
        if value:
            assignments += (f" {name}={shlex.quote(value)}" if mask_url(value) == value
                            else f' {name}="${name}"')
    return (f"PATH={shlex.quote(str(bin_dir))}:\"$PATH\" {assignments} AIRFLOW__API__HOST=127.0.0.1 "
            f"AIRFLOW__API__PORT={port} "
            f"{shlex.quote(str(bin_dir / 'airflow'))} standalone")


def mlflow_command(tracking: str, port: int = 5000) -> str:
    """The shell line that opens the MLflow UI on the main job's tracking store."""
    mlflow = Path(sys.executable).parent / "mlflow"
    return (f"{shlex.quote(str(mlflow))} ui --backend-store-uri {shlex.quote(mask_url(tracking))} "
            f"--host 127.0.0.1 --port {port}")


def mlflow_urls(base: str, experiment_id: str | None, model: str | None, version: str | None,
                run_id: str | None = None) -> dict:
    """Direct links: the experiment's runs table, the evaluation's run and a config version's page."""
    urls = {}
    # workflowType: MLflow 3 opens its GenAI view without it, where runs and models are hidden
    if experiment_id is not None:
        urls["runs"] = f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        if run_id is not None:
            urls["run"] = (f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
                           "?workflowType=machine_learning")
    if model and version:
        urls["version"] = f"{base}/#/models/{model}/versions/{version}?workflowType=machine_learning"
    return urls


SCHEDULES_TEXT = (
    "schedules wait until you ask: every DAG is created paused, so opening the UI starts no run "
    "(specdec_evaluate: daily at 00:00 UTC, on each new draft and on production drift; "
    "specdec_reports: after each evaluation; specdec_retrain_draft: Sundays 03:00 UTC and on the "
    "low-acceptance alert; specdec_monitor: every 5 minutes). Triggering a DAG from its page "
    "unpauses it (the form's \"Unpause on trigger\" box, ticked by default), as do its toggle and "
    "`airflow dags unpause DAG_ID` (the environment above); catchup is off: an unpaused DAG runs "
    "at its next scheduled time, never the times it missed")


def ui_text(env: dict, tracking: str, experiment_id: str | None, model: str | None,
            version: str | None, run_id: str | None = None) -> str:
    """What the main job prints last: commands to paste as they are, then where to go (run_id:
    the evaluation's MLflow run, opened in the model-training view, not the GenAI one)."""
    urls = mlflow_urls("http://127.0.0.1:5000", experiment_id, model, version, run_id)
    lines = ["Open the UIs on these stores (paste each command as it is, in any shell):",
             f"  Airflow: {airflow_command(env)}",
             "           then http://127.0.0.1:8080 (user admin; its password is printed at start "
             f"and kept in {env['AIRFLOW_HOME']}/simple_auth_manager_passwords.json.generated)",
             f"  MLflow:  {mlflow_command(tracking)}"]
    lines.append(f"           {SCHEDULES_TEXT}")
    if "runs" in urls:
        lines.append(f"           runs: {urls['runs']}")
    if "run" in urls:
        lines.append(f"           this evaluation's run: {urls['run']}")
    if "version" in urls:
        lines.append(f"           config {model} version {version}: {urls['version']}")
    return "\n".join(lines)


JSON_TYPES = {"string": "a string", "integer": "a whole number", "number": "a number",
              "boolean": "true or false", "array": "a list", "null": "null", "object": "an object"}


def check_conf(dag, conf: dict) -> None:
    """InvalidValue naming the key, the value and the type its Param takes, for a --conf value
    the DAG's Params refuse (before any work: Airflow would refuse it with a traceback when the
    run is made). Keys that are not Params pass, as Airflow lets them."""
    from airflow.sdk.definitions.param import ParamValidationError

    for key, value in conf.items():
        if key not in dag.params:
            continue
        param = dag.params.get_param(key)
        try:
            param.resolve(value)
        except ParamValidationError:
            kinds = param.schema.get("type")
            kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
            takes = " or ".join(JSON_TYPES.get(kind, kind) for kind in kinds) or "another value"
            extra = {k: param.schema[k] for k in ("enum", "minimum", "maximum") if k in param.schema}
            raise InvalidValue(
                f"--conf: {key!r} is {json.dumps(value)[:60]}, but the run's Param {key!r} "
                f"({param.schema.get('title', key)}) takes {takes}"
                + (f" {json.dumps(extra)}" if extra else "")
                + f"; e.g. --conf '{{\"{key}\": {json.dumps(param.value)}}}', or leave it out "
                  "for its default") from None


def failed_tasks(dag_run, recorder) -> list[dict]:
    """The run's failed task instances, in order: {task, error}, error being the last ERROR line
    the task logged (its exception), or None."""
    failed = []
    for ti in sorted(dag_run.get_task_instances(), key=lambda ti: (ti.start_date is None, ti.start_date
                                                                      or 0, ti.task_id)):
        if str(ti.state) != "failed":
            continue
        error = None
        for line in recorder.records.get((ti.task_id, ti.map_index), []):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and str(record.get("level", "")).lower() in ("error", "critical"):
                event = [text for text in str(record.get("event") or "").splitlines() if text.strip()]
                if event:       # an exception's traceback: its last line says what it was
                    error = event[-1] if "Traceback (most recent call last)" in record["event"] else event[0]
        label = ti.task_id if ti.map_index == -1 else f"{ti.task_id}[{ti.map_index}]"
        failed.append({"task": label, "error": error})
    return failed


def failure_text(run_id: str, failed: list[dict], logs: list[Path]) -> str:
    """What the main job says when its run failed: which task, its error, where its log is, and
    how to run it again (a new run; what was stored is kept)."""
    first = failed[0]
    error = " ".join((first["error"] or "").split())
    log = next((str(path) for path in logs if f"task_id={first['task'].split('[')[0]}" in str(path)), None)
    lines = [f"error: run {run_id} failed at task {first['task']}"
             + (f": {printable(mask_text(error))[:500]}" if error else "")]
    if log:
        lines.append(f"  its log: {log}")
    if len(failed) > 1:
        lines.append("  also failed: " + ", ".join(f["task"] for f in failed[1:]))
    lines.append("  the tasks after it did not run, so there is no result table and nothing was "
                 "registered. Fix the cause above, then run `specdec main-job` again: a new run "
                 "(the imported traffic is kept)")
    return "\n".join(lines)


def _dag_bag(env: dict):
    """The DAG folder of `env` parsed (Airflow's DagBag); call it once `env` is in os.environ."""
    # imported here: Airflow reads its configuration when imported, once the caller has set `env`
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=env["AIRFLOW__CORE__DAGS_FOLDER"])


def run(conf: dict | None = None, promote: bool = True, dags_folder: Path | None = None) -> dict:
    console = make_console()
    home = specdec_home().resolve()
    env = airflow_environment(home, dags_folder or default_dags_folder())
    if conf:        # a value of the wrong type: one line before any work
        os.environ.update(env)
        check_conf(_dag_bag(env).dags["specdec_evaluate"], conf)
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    started = time.perf_counter()
    console.print(f"[bold]1/4[/bold] Airflow metadata database and pool under {env['AIRFLOW_HOME']}")
    prepare_airflow(env)
    console.print("[bold]2/4[/bold] specdec database and the shipped traffic")
    upgrade()
    report = import_traffic(sample_traffic_path(), Store.open(), progress=False)
    console.print(f"      {report['inserted']} new requests ({report['rows_read']} read, {report['skipped_existing']} already stored)")
    dag_run, recorder, states, logs = _run_dag(console, env, conf, promote)
    failed = failed_tasks(dag_run, recorder)
    if str(dag_run.state) != "success" and failed:
        # no table, champion or links: the run did not reach them (its rows, if any, are partial)
        make_console(stderr=True).print(escape(failure_text(dag_run.run_id, failed, logs)), soft_wrap=True,
                                        highlight=False)
        return {"run_id": dag_run.run_id, "state": str(dag_run.state), "table": None,
                "champion": None, "task_states": states, "profile_check": None, "failed": failed}
    return _results(console, env, dag_run, states, started)


def _run_dag(console, env: dict, conf: dict | None, promote: bool):
    """specdec_evaluate through dag.test(), its tasks' progress printed: (dag_run, the log
    recorder, task states by task id, the task log files written for the UI)."""
    console.print("[bold]3/4[/bold] specdec_evaluate through dag.test() (about 12 minutes on 2 CPU cores)")
    dag = _dag_bag(env).get_dag("specdec_evaluate")
    progress_logger = logging.getLogger("airflow.sdk.definitions.dag")
    progress = _TaskProgress(console)
    progress_logger.addHandler(progress)
    progress_logger.setLevel(logging.INFO)
    try:
        with recording() as recorder:
            dag_run = dag.test(run_conf={"promote": promote, **(conf or {})})
    finally:
        progress_logger.removeHandler(progress)
    logs = write_task_logs(dag_run, recorder, Path(env["AIRFLOW_HOME"]) / "logs")
    states = {}
    for ti in dag_run.get_task_instances():
        states.setdefault(ti.task_id, []).append(str(ti.state))
    console.print(f"      run {dag_run.run_id}: {dag_run.state}; tasks: "
                  + ", ".join(f"{task} {'/'.join(sorted(set(s)))}" for task, s in sorted(states.items())))
    console.print(f"      task logs for the UI: {len(logs)} files under {env['AIRFLOW_HOME']}/logs")
    return dag_run, recorder, states, logs


def _results(console, env: dict, dag_run, states: dict, started: float) -> dict:
    """Step 4/4 of a run that succeeded: its table, the profile's check, the champion and the
    UI links."""
    console.print("[bold]4/4[/bold] results")

    settings = load_settings()
    store = Store.open(settings=settings)
    table = evaluation_table(dag_run.run_id, store)
    check = profile_check(dag_run.run_id, store)
    print_run(build_run_view(dag_run.run_id, store, settings),
              time.perf_counter() - started)
    console.print(escape(profile_check_text(check)))
    try:
        champion = Registry.open().show_version(config_model_name(dag_run.conf.get("target") or DEFAULT_MODEL))
        console.print(f"champion: {champion['name']} version {champion['version']} (run "
                      f"{champion['config']['run_id']})")
        console.print_json(json.dumps(champion["config"]))
    except RegistryError as exc:
        champion = None
        console.print(f"no champion: {exc}")
    tracking = os.environ["MLFLOW_TRACKING_URI"]
    target = dag_run.conf.get("target") or DEFAULT_MODEL
    mlflow_client, name = Registry.open(tracking).client, config_model_name(target)
    experiment = mlflow_client.get_experiment_by_name(f"specdec/{target_slug(target)}")
    versions = mlflow_client.search_model_versions(f"name='{name}' and tag.run_id='{dag_run.run_id}'")
    # soft_wrap: a command wrapped at the terminal's width would not paste
    console.print("\n" + escape(ui_text(env, tracking, experiment.experiment_id if experiment else None,
                                         name, str(versions[0].version) if versions else None,
                                         versions[0].run_id if versions else None)),
                  soft_wrap=True, highlight=False)
    console.print(f"  total {time.perf_counter() - started:.0f} s")
    return {"run_id": dag_run.run_id, "state": str(dag_run.state), "table": table,
            "champion": champion, "task_states": states, "profile_check": check}


def cmd_main_job(args) -> int:
    """`specdec main-job`: 0 when the run succeeded, else 1."""
    return 0 if run(args.conf, promote=not args.no_promote)["state"] == "success" else 1
