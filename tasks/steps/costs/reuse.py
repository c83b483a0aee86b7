"""Cost profiles kept between runs: `measure_or_reuse` is the evaluation run's profile.

It copies the newest stored profile of the same key (tasks.steps.costs.costs.profile_key) that
passed its checks, covers the run's batch sizes, K and candidates and is younger than
`profile_max_age_days` under the run's own id (reuse_costs: every reader of a run's costs reads
them as if measured), else measures one (tasks.steps.costs.costs.profile_costs). The serving
engine's profiles are reused the same way (tasks.steps.costs.engine_costs).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from specdec_core import SpecDecoder
from specdec_core.validation import fingerprint_id, target_fingerprint

from ...db.queries_costs import passed_checks_of_key
from ...db.store import Store
from ...settings import Settings
from ...timeutil import utcnow
from .cost_table import CostProfileError, CostTable, hardware_of, load_costs
from .costs import (KEY_COLUMNS, _plain_key, describe_hardware, profile_costs, profile_key,
                    profile_provenance, specdec_engine_version, store_costs)

log = logging.getLogger(__name__)


def reusable_profile(run_id: str, key: dict, settings: Settings, store: Store,
                     batch_sizes=None, k_max: int | None = None, drafters=(),
                     now: datetime | None = None) -> dict | None:
    """The newest stored profile run `run_id` may reuse, or None: one stored by another run whose
    check passed (status ok), with the same key (profile_key: every field equal; none missing),
    measured less than settings.profile.max_age_days ago, timed at the same batch sizes, K = 1..
    k_max and context length as this run would time, with a draft step for each of `drafters`
    (labels). Returns the cost_profile_checks row as a dict (its run_id: where to copy from)."""
    if settings.profile.max_age_days <= 0 or any(key.get(name) is None for name in KEY_COLUMNS
                                                 if name != "processor"):
        return None
    now = now or utcnow()
    sizes = sorted(set(batch_sizes or settings.profile.batch_sizes))
    k_max = k_max or settings.plan.k_max
    rows = passed_checks_of_key(store, run_id, key,
                                now - timedelta(days=settings.profile.max_age_days))
    for row in rows:
        if row["processor"] != key.get("processor"):
            continue
        if (row["details"] or {}).get("context_len") != settings.profile.context_len:
            log.info("run %s: stored cost profile of run %s not reused: timed at context length %s, "
                     "this run's is %d", run_id, row["run_id"], (row["details"] or {}).get("context_len"),
                     settings.profile.context_len)
            continue
        try:
            table = load_costs(row["hardware_profile"], store, row["run_id"])
        except CostProfileError:
            continue
        missing = _coverage_gaps(table, sizes, k_max, drafters)
        if missing:
            log.info("run %s: stored cost profile of run %s not reused: %s", run_id, row["run_id"],
                     missing)
            continue
        return row
    return None


def _coverage_gaps(table: CostTable, sizes: list[int], k_max: int, drafters) -> str:
    """What a stored table lacks to plan this run as its own measurement would ("" : nothing)."""
    if table.batch_sizes != sizes:
        return f"batch sizes {table.batch_sizes}, this run's are {sizes}"
    widths = {b: sorted(table.verify.get(b, {})) for b in sizes}
    if any(w != list(range(1, k_max + 1)) for w in widths.values()):
        return f"verify timed at K {widths}, this run plans K = 1..{k_max}"
    # each drafter's own figure (not a kind's, as draft_ratio allows a serving engine's profile)
    lacking = [label for label in drafters
               if any(b not in table.draft_step.get(label, {}) for b in sizes)]
    if lacking:
        return f"no draft step for {lacking}"
    # a serving engine's profile (it prices sampled requests apart) prices a host drafter (suffix)
    # with its own rounds: one measured before they were timed would price it by a difference of
    # two engines
    lacking = [label for label in drafters if table.sampled_timed and label.startswith("suffix")
               and any(table.round_ratios(label, b) is None for b in sizes)]
    return f"no rounds of its own timed for {lacking}" if lacking else ""


def reuse_costs(run_id: str, source: dict, store: Store) -> dict:
    """Copy the stored profile `source` (a reusable_profile row) under `run_id`, in one
    transaction that replaces the run's own rows of that profile (store_costs): cost_profiles,
    its check (status ok, details saying where the costs came from) and the hardware
    description. Every reader of a run's costs (the planner, confirm, the registry, sql/) reads
    them as this run's. The copy keeps the measurement's time and the run that measured it (the
    source's own origin when the source was itself a copy).

    Output: as profile_costs's, with "seconds" the copy's and "profile": {reused: True, run_id,
    measured_at, age_days, text}."""
    start = time.perf_counter()
    name = source["hardware_profile"]
    table = load_costs(name, store, source["run_id"])
    table.run_id = run_id
    provenance = profile_provenance(run_id, source["measured_at"], source["reused_from"] or source["run_id"])
    table.check = {"status": source["status"], "reasons": list(source["reasons"] or []),
                   "attempts": source["attempts"], "max_spread": source["max_spread"],
                   "details": {**(source["details"] or {}),
                               "reused": {"from_run": provenance["run_id"], "copied_from": source["run_id"],
                                          "measured_at": provenance["measured_at"],
                                          "age_days": provenance["age_days"], "text": provenance["text"]}}}
    hardware = source["hardware"] or hardware_of(name, store)
    key = {**{column: source[column] for column in KEY_COLUMNS},
           "measured_at": source["measured_at"], "reused_from": provenance["run_id"]}
    store_costs(store, run_id, hardware, table, key)
    return {"run_id": run_id, "hardware_profile": hardware, "costs": table.rows(),
            "check": {field_: table.check[field_] for field_ in ("status", "reasons", "attempts", "max_spread")},
            "seconds": time.perf_counter() - start, "key": _plain_key(key), "profile": provenance}


def measure_or_reuse(run_id: str, target, drafters: dict, store: Store,
                     settings: Settings | None = None, k_max: int | None = None, tokenizer=None,
                     fingerprint: str | None = None, new_profile: bool = False,
                     progress: bool = True) -> dict:
    """The evaluation run's cost profile: the newest stored one of this hardware, engine, dtype and
    target that it may reuse (reusable_profile), copied under `run_id` (reuse_costs), else one
    measured here (profile_costs). new_profile: measure whatever is stored (`specdec evaluate
    --new-profile`, the DAG Param new_profile). Logs one line saying which it was; the output
    (profile_costs's) says it in "profile" (profile_provenance)."""
    settings = settings or store.settings
    k_max = k_max or settings.plan.k_max
    if fingerprint is None:
        fingerprint = fingerprint_id(target_fingerprint(target))
    hardware = describe_hardware(target)
    key = profile_key(hardware, "specdec", specdec_engine_version(SpecDecoder(target, None).engine()),
                      fingerprint)
    source = None
    if new_profile:
        why = "a new profile was asked for (new_profile)"
    elif settings.profile.max_age_days <= 0:
        why = "reuse is off (profile_max_age_days = 0)"
    else:
        source = reusable_profile(run_id, key, settings, store, settings.profile.batch_sizes, k_max,
                                  list(drafters))
        why = (f"no stored profile of this key passed its checks within the last "
               f"{settings.profile.max_age_days:g} days and covers this run "
               f"({key['device']}, {key['processor'] or '-'}, {key['dtype']}, {key['engine_version']}, "
               f"target {fingerprint})")
    if source is not None:
        result = reuse_costs(run_id, source, store)
        log.info("run %s: cost profile %s %s (not measured again; profile_max_age_days %g, "
                 "--new-profile to measure)", run_id, source["hardware_profile"],
                 result["profile"]["text"], settings.profile.max_age_days)
        return result
    log.info("run %s: measuring a cost profile: %s", run_id, why)
    return profile_costs(run_id, target, drafters, store, settings=settings, k_max=k_max,
                         progress=progress, tokenizer=tokenizer, fingerprint=fingerprint)


def profile_check_text(check: dict | None) -> str:
    """One line on the cost profile's check, for tables and logs."""
    if check is None:
        return "cost profile: no check recorded (measured or imported without one)"
    head = (f"cost profile {check['hardware_profile']} (run {check['profile_run']}): "
            f"{check['status']}, {check['attempts']} check{'s' if check['attempts'] != 1 else ''}, "
            f"largest spread {100 * (check.get('max_spread') or 0):.0f}%")
    if check.get("reused_from"):
        head += (f"; reused from run {check['reused_from']}, measured at "
                 f"{str(check.get('measured_at') or 'an unknown time').replace('T', ' ')}")
    if check["status"] == "noisy":
        head += ("; too noisy to turn a domain on: " + "; ".join(check.get("reasons") or [])
                 + ". Plan with a stored profile: --hardware-profile NAME")
    return head


def measure_or_reuse_in(context, new_profile: bool = False) -> dict:
    """measure_or_reuse with a RunContext (tasks.steps.context): the run's target, candidates
    ({label: drafter}), tokenizer and fingerprint, its store and settings (k_max: the plan's)."""
    return measure_or_reuse(context.run_id, context.model,
                            {label: d for label, (_, d) in context.drafters.items()},
                            context.store, settings=context.settings,
                            k_max=context.settings.plan.k_max, tokenizer=context.tokenizer,
                            fingerprint=context.fingerprint, new_profile=new_profile)
