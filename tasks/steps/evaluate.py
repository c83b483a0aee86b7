"""One evaluation run end to end, without Airflow: the steps of tasks.steps.pipeline in the run's
order (tasks.steps.run_order.RUN_ORDER, which the DAG dags/specdec_evaluate.py follows too), in one
process (the model is loaded once).
A domain whose step fails is recorded as failed (off; the champion's setting is kept) and the
other domains go on, as in the DAG.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager

from ..db.queries_runs import mark_abandoned_runs, mark_interrupted, record_owner, this_process
from ..db.store import Store
from ..errors import SpecdecTaskError
from ..registry.registry import Registry
from ..registry.run_results import profile_check
from ..settings import DEFAULT_MODEL, Settings
from ..timeutil import default_run_id
from .context import RunSpec, preload_model, use_model
from .run_order import PER_DOMAIN, RUN_ORDER
from .failures import record_domain_failure
from .pipeline import (step_check, step_confirm, step_engine_check, step_estimate, step_finish,
                       step_profile, step_promote, step_register, step_sample, step_validate)
from .run_table import evaluation_table, report_table  # noqa: F401 - report_table re-exported

log = logging.getLogger(__name__)

def evaluate(run_id: str | None = None, target: str = DEFAULT_MODEL, *,
             store: Store, settings: Settings | None = None, domains=None, window=None,
             candidates=None, hardware_profile: str | None = None, k_max: int | None = None,
             max_per_domain: int | None = None, min_per_domain: int | None = None,
             device: str | None = None, progress: bool = True, model=None, tokenizer=None,
             register: bool = False, promote: bool = False, registry: Registry | None = None,
             new_profile: bool = False) -> dict:
    """Run every step for one run id; returns {"run_id", "table", "steps": {step: seconds}, ...}.

    hardware_profile: plan with that stored cost profile (measured elsewhere and imported);
    default (settings.plan.hardware_profile None): reuse the newest stored profile of this machine,
    engine, dtype and target younger than settings.profile.max_age_days that passed its checks,
    else measure this machine in this run; new_profile: measure in any case.
    model/tokenizer: an already loaded target (then `target` only names it).
    register: track the run in MLflow and register its config (alias challenger); promote: then
    gate it and move the champion alias (implies register). registry: the MLflow tracking store
    they use (opened by the caller; default: $MLFLOW_TRACKING_URI, else the default under
    $SPECDEC_HOME); each step opens it again from the spec, as it opens the Store.
    """
    settings = settings or store.settings
    spec = RunSpec(run_id=run_id or default_run_id(), target=target, device=device,
                   db_url=store.url, tracking_uri=registry.uri if registry is not None else None,
                   domains=list(domains) if domains else None, window_days=window,
                   min_per_domain=min_per_domain, max_per_domain=max_per_domain,
                   candidates=list(candidates) if candidates else None,
                   hardware_profile=hardware_profile, k_max=k_max, promote=promote,
                   overrides=settings.overrides())
    abandoned = mark_abandoned_runs(store)     # runs of this host whose process was killed
    if abandoned:
        log.warning("marked %d run(s) interrupted: their process is gone (killed?): %s",
                    len(abandoned), ", ".join(abandoned[:10]))
    if register or promote:     # fail in seconds, not after the expensive steps
        (registry if registry is not None else spec.open_registry(store)).check_reachable()
    if model is not None:
        use_model(target, model, tokenizer, device)
    else:       # a --model that is not a model: one line now, not a traceback at the estimate
        preload_model(target, device)
    with interruptible(store, spec.run_id):
        return _run_steps(spec, store, target, new_profile, register, promote)


class RunInterrupted(BaseException):
    """SIGTERM (or SIGINT) reached a running evaluation; a BaseException so that no step's
    per-domain error handling takes it for a domain's failure."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextmanager
def interruptible(store: Store, run_id: str):
    """Run the steps with SIGTERM and SIGINT turned into RunInterrupted; a run left unfinished by
    them (or by any error) is marked interrupted in eval_runs (reports leave it out)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def stop(signum, _frame):
            raise RunInterrupted(signal.Signals(signum).name)
        for number in (signal.SIGTERM, signal.SIGINT):
            previous[number] = signal.signal(number, stop)
    try:
        yield
    except BaseException as exc:
        how = exc.signal_name if isinstance(exc, RunInterrupted) else (
            "SIGINT" if isinstance(exc, KeyboardInterrupt) else f"stopped by {type(exc).__name__}")
        try:        # the error itself is the command's line: these are INFO
            if mark_interrupted(store, run_id, how):
                log.info("run %s: marked interrupted (%s)", run_id, how)
        except Exception as failure:    # e.g. the disk that stopped the run is still full
            log.info("run %s: not marked interrupted (%s)", run_id, failure)
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _run_steps(spec: RunSpec, store: Store, target: str, new_profile: bool, register: bool, promote: bool) -> dict:
    steps: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps[name] = round(now - clock, 2)
        clock = now
        log.info("run %s: %s done in %.1f s", spec.run_id, name, steps[name])

    done: dict = {}
    wanted = {"register": register or promote, "promote": promote}
    for name in RUN_ORDER:          # the run's order, written once (the DAG follows it too)
        if not wanted.get(name, True):
            continue
        spec = _run_step(name, spec, store, done, new_profile)
        lap(name)
    profile, finished = done["profile"], done["finish"]
    return {"run_id": spec.run_id, "target": target, "fingerprint": finished["fingerprint"],
            "registered": done.get("register"), "promoted": done.get("promote"), "failed": finished["failed"],
            "hardware_profile": profile["hardware_profile"], "profile": profile, "sample": done["sample"],
            "excluded": finished["excluded"], "table": evaluation_table(spec.run_id, store), "steps": steps,
            "profile_check": profile_check(spec.run_id, store), "engine_check": done["engine_check"],
            "seconds": round(sum(steps.values()), 1)}


def _run_step(name: str, spec: RunSpec, store: Store, done: dict, new_profile: bool) -> RunSpec:
    """Run one step of RUN_ORDER in this process, keeping its output in `done`; returns the spec
    the later steps take (sample freezes its candidates). A domain whose step fails is recorded
    as failed and left out of its later steps, as in the DAG."""
    if name == "sample":
        sample = step_sample(spec)
        record_owner(store, spec.run_id, this_process())   # marks it if killed
        spec = RunSpec.of(sample.pop("spec"))
        done["sample"] = sample
    elif name == "check":
        done["check"] = step_check(spec)       # raises QualityGateFailed on table-level failures
    elif name == "profile":
        done["profile"] = step_profile(spec, new_profile=new_profile)
    elif name == "per_domain":
        active = list(done["check"]["ok"])
        steps = {"estimate": lambda d: step_estimate(spec, d, done["profile"]),
                 "confirm": lambda d: step_confirm(spec, d), "validate": lambda d: step_validate(spec, d)}
        for step in PER_DOMAIN:
            for domain in list(active):
                try:
                    steps[step](domain)
                except (SpecdecTaskError, ValueError, RuntimeError) as exc:   # this domain only
                    record_domain_failure(spec, domain, f"{step}: {type(exc).__name__}: {exc}")
                    active.remove(domain)
    elif name == "finish":
        done["finish"] = step_finish(spec, insufficient=done["check"]["insufficient"])
    elif name == "engine_check":
        done["engine_check"] = step_engine_check(spec)
    elif name == "register":
        done["register"] = step_register(spec)
    elif name == "promote":
        done["promote"] = step_promote(spec, done["register"])
    return spec
