"""Cost profiles measured: what a target step, a verify(K) pass and a draft step cost on named hardware.

`profile_costs` measures them on this machine at batch sizes 1..B and stores them in cost_profiles
(keyed by run id and hardware profile) with the profile's description in hardware_profiles. Timing
work holds an exclusive file lock ($SPECDEC_HOME/locks/timing.lock): two timing steps never share
this machine's CPU/GPU, whichever process (CLI, test, Airflow task) runs them. Across machines, the
Airflow pool `specdec_timing` does that job; the lock is only the per-machine guard.

A hardware description (describe_hardware / describe_device) is a device and dtype: timings are
comparable only within one (same_hardware); confirm refuses the others (HardwareMismatch). The
table read back (CostTable, load_costs) is tasks.steps.costs.cost_table, re-exported here: what only
reads profiles (the planner, the monitor) imports it without torch.

Every stored profile carries its key (profile_key: the hardware as hardware_profiles describes it,
with the CPU model and a CPU's thread count; the engine and its version; the dtype; the target's
fingerprint) and when it was measured (cost_profile_checks), by which a later run reuses it
(tasks.steps.costs.reuse); a profile moves between machines as a JSON file
(tasks.steps.costs.transfer). `profile_costs` always measures.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version as package_version
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec_core import SpecDecoder
from specdec_core.drafters import output_size
from specdec_core.profile import CostSampler
from specdec_core.validation import fingerprint_id, target_fingerprint

from ...db.queries_costs import replace_cost_profile
from ...db.store import Store
from ...paths import home_path
from ...settings import Settings
from ...timeutil import utcnow
from .cost_table import (CostProfileError, CostTable, HardwareMismatch, hardware_of,  # noqa: F401 - re-exported
                         hardware_text, load_costs, run_costs, same_hardware)

log = logging.getLogger(__name__)


@contextmanager
def timing_lock(name: str = "timing"):
    """Exclusive lock across processes for timing work; waits (and says so) while another holds it."""
    path = home_path("locks", f"{name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for other timing work to finish (lock %s)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def describe_hardware(model, name: str | None = None) -> dict:
    """{name, device, dtype, details} of the device and dtype `model` runs on."""
    weight = next(model.parameters())
    return describe_device(weight.device, weight.dtype, name)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; elsewhere platform's), e.g. "AMD EPYC": the
    same torch build takes different kernel paths on different CPUs (MKL's small-row matmuls)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_device(device, dtype, name: str | None = None) -> dict:
    """{name, device, dtype, details} of a torch device and dtype on this machine (a hardware
    class: two workers with equal device and dtype time alike)."""
    device = torch.device(device)
    dtype = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
        details = {"cuda": torch.version.cuda}
    else:
        label = f"cpu {platform.machine()} ({torch.get_num_threads()} threads)"
        details = {"processor": cpu_model()}
    details["torch"] = torch.__version__
    if name is None:
        name = _slug(f"{label if device.type == 'cuda' else 'cpu-' + str(torch.get_num_threads()) + 't'}-{dtype}")
    return {"name": name, "device": label, "dtype": dtype, "details": details}


def specdec_engine_version(options: dict) -> str:
    """Our engine's version as a profile's key names it: the package's and torch's versions and a
    digest of the engine options resolved for the target (SpecDecoder.engine(): static caches,
    CUDA graphs, compiled forwards, CPU kernels), each of which changes what a step costs."""
    try:
        ours = package_version("specdec-rollout")
    except PackageNotFoundError:        # run from a source tree that was never installed
        ours = "source"
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"specdec {ours}, torch {torch.__version__}, options {digest}"


def profile_key(hardware: dict, engine: str, engine_version: str, fingerprint: str | None) -> dict:
    """The key a stored profile is reused by: {device, processor, engine, engine_version, dtype,
    target_fingerprint}. device and dtype are hardware_profiles' (a CPU's device names its thread
    count), processor the CPU model (describe_device's details; None where not described)."""
    return {"device": hardware["device"], "processor": (hardware.get("details") or {}).get("processor"),
            "engine": engine, "engine_version": engine_version, "dtype": hardware["dtype"],
            "target_fingerprint": fingerprint}


KEY_COLUMNS = ("device", "processor", "engine", "engine_version", "dtype", "target_fingerprint")


def store_costs(store: Store, run_id: str, hardware: dict, table: CostTable, key: dict | None = None) -> None:
    """One transaction: the profile's rows, check and hardware description of this run replaced.
    key (profile_key, with `measured_at` and `reused_from` where the costs were measured before,
    by another run): stored with the check, so a later run can reuse the profile."""
    keyed = {} if key is None else {
        **{column: key.get(column) for column in KEY_COLUMNS}, "hardware": hardware,
        "measured_at": key.get("measured_at"), "reused_from": key.get("reused_from")}
    replace_cost_profile(store, run_id, hardware, table.rows(), table.check, keyed)


def check_costs(table: CostTable, raw_overhead: dict[int, dict[str, float]] | None = None,
                max_spread: float = 0.25, noise_floor: float = 0.05,
                verify_dip: float = 0.25, overhead_floor: float = 0.2,
                step_dip: float = 0.1) -> list[str]:
    """What makes a profile untrustworthy, in words (empty: consistent and quiet enough).

    A fall counts only beyond noise: by more than max(noise_floor, the two figures' spreads).
    - the target step must not fall as the batch grows;
    - verify(K) must cost at least one step less max(step_dip, the spreads): on a CPU one token
      takes the packed kernels' 4-row path plus the padding, so a verify pass of a few tokens can
      cost a little less (the 2-core AMD EPYC: a step 38.3 ms and v(4) 37.0 ms in the main job;
      v(4) = 0.91-0.98 of a step in repeated timings), where a busy machine gave v(1) = 0.80;
    - verify(K) must not fall as K grows by more than max(verify_dip, the spreads): a CPU's
      matrix kernels change path with the width, and a quiet 2-core machine measured v(6) =
      2.33-2.43 but v(7) = 2.05 at batch 2 in every measurement (spreads 2-3%), where a busy one
      gave v(2) = 1.80 but v(3) = 1.40;
    - a round's overhead must not be negative beyond max(overhead_floor, its spread) of a step
      (raw_overhead: the medians before clipping at 0). An overhead is the small difference of a
      short decode's time and its forwards priced at the profile's medians: on the quiet 2-core
      machine it came out as low as -0.12 of a step for host drafters at batch 1;
    - no figure's spread (interquartile range / median; draft steps and overheads over the
      target step) may exceed max_spread.
    """
    reasons = []
    spread = lambda component, drafter, k, b: table.spread.get((component, drafter, k, b), 0.0)  # noqa: E731
    tolerance = lambda *spreads: max(noise_floor, *spreads)  # noqa: E731
    sizes = table.batch_sizes
    for small, large in zip(sizes, sizes[1:]):
        a, b = table.target_step[small], table.target_step[large]
        if b < a * (1 - tolerance(spread("target_step", None, None, small),
                                  spread("target_step", None, None, large))):
            reasons.append(f"target step falls as the batch grows: {1000 * a:.1f} ms at batch {small}, "
                           f"{1000 * b:.1f} ms at batch {large}")
    for size in sizes:
        step = table.target_step[size]
        step_spread = spread("target_step", None, None, size)
        verify = table.verify.get(size, {})
        below = [k for k, seconds in sorted(verify.items())
                 if seconds < step * (1 - tolerance(step_dip, step_spread, spread("verify", None, k, size)))]
        if below:
            reasons.append(f"verify cheaper than one step at batch {size}: v({below[0]}) = "
                           f"{verify[below[0]] / step:.2f}" + (f" (and {len(below) - 1} more K)"
                                                               if len(below) > 1 else ""))
        peak = None
        for k, seconds in sorted(verify.items()):
            if peak is not None and seconds < verify[peak] * (1 - max(
                    verify_dip, spread("verify", None, peak, size), spread("verify", None, k, size))):
                reasons.append(f"verify falls as K grows at batch {size}: v({peak}) = "
                               f"{verify[peak] / step:.2f} but v({k}) = {seconds / step:.2f}")
                break
            if peak is None or seconds > verify[peak]:
                peak = k
        for label, seconds in sorted((raw_overhead or {}).get(size, {}).items()):
            if seconds < -step * max(overhead_floor, spread("round_overhead", label, None, size)):
                reasons.append(f"negative overhead at batch {size}: {label} {seconds / step:+.2f} of a "
                               "step (its decode took less than its own forwards)")
    widest = max(table.spread.items(), key=lambda item: item[1], default=None)
    if widest is not None and widest[1] > max_spread:
        (component, drafter, k, size), value = widest
        name = component if drafter is None and k is None else (
            f"v({k})" if k is not None else f"{component} {drafter}")
        over = sum(1 for v in table.spread.values() if v > max_spread)
        # as many decimals as it takes for the two figures to differ ("25.3% > 25%", not "25% > 25%")
        digits = next((d for d in range(4) if round(100 * value, d) > round(100 * max_spread, d)), 4)
        reasons.append(f"spread {100 * value:.{digits}f}% > {100 * max_spread:.0f}% ({name} at batch {size}"
                       + (f"; {over} figures in all" if over > 1 else "") + ")")
    return reasons


def _table_of(sampler, hardware_profile: str, run_id: str) -> CostTable:
    table = CostTable(hardware_profile, run_id, {}, {}, {}, {})
    spreads = sampler.spreads()
    for b, costs in sampler.costs().items():
        table.target_step[b] = costs["target_step"]
        table.verify[b] = costs["verify"]
        table.spread[("target_step", None, None, b)] = spreads[b]["target_step"]
        for k, value in spreads[b]["verify"].items():
            table.spread[("verify", None, k, b)] = value
        for component in ("draft_step", "round_overhead"):
            for label, seconds in costs[component].items():
                getattr(table, component).setdefault(label, {})[b] = seconds
                table.spread[(component, label, None, b)] = spreads[b][component][label]
    return table


def profile_costs(run_id: str, target, drafters: dict, store: Store,
                  hardware_profile: str | None = None, settings: Settings | None = None,
                  k_max: int | None = None, batch_sizes=None, progress: bool = True,
                  tokenizer=None, fingerprint: str | None = None) -> dict:
    """Measure and store the costs of `target` and the drafters ({label: Drafter}) on this machine.

    Every figure is timed settings.profile.repeats times, interleaved over batch sizes, widths and
    drafters (specdec_core.profile.CostSampler), and stored as its median with its spread. The
    profile is then checked (check_costs); one that fails gets one more pass at a time and is
    checked again after each (measure_until_consistent), over its last 2 x profile_repeats passes
    (one hiccup among three timings is outvoted by the fourth; a slow phase that spoiled the
    first passes ages out of the window), up to profile_repeats x profile_attempts passes in
    all. If it still fails it is stored marked `noisy` with the reasons (the planner turns nothing
    on from it that the champion has off).

    A suffix drafter without an index of its own is timed with an index over every stored
    response (its lookups cost more with more indexed tokens); tokenizer: for stored requests
    without token ids.

    The profile is stored with its key (profile_key; fingerprint: the target's fingerprint id,
    computed here when not given), so that later runs can reuse it (measure_or_reuse); this
    function always measures.

    Output: {"run_id", "hardware_profile": {name, device, dtype, details}, "costs": CostTable rows,
             "check": {status, reasons, attempts, max_spread}, "seconds", "key",
             "profile": {reused: False, ...} (profile_provenance)}. Re-running a run id replaces
    its rows for that profile.
    """
    settings = settings or store.settings
    k_max = k_max or settings.plan.k_max
    batch_sizes = sorted(set(batch_sizes or settings.profile.batch_sizes))
    hardware = describe_hardware(target, hardware_profile)
    # which engine the costs describe: static caches, CUDA graphs, compiled forwards
    hardware["details"]["engine"] = SpecDecoder(target, None).engine()
    if fingerprint is None:
        fingerprint = fingerprint_id(target_fingerprint(target))
    key = profile_key(hardware, "specdec", specdec_engine_version(hardware["details"]["engine"]),
                      fingerprint)
    drafters = _with_timing_indexes(drafters, store, target, tokenizer)
    start = time.perf_counter()
    with timing_lock():
        sampler = CostSampler(target, drafters, k_max, batch_sizes, settings.profile.context_len)
        measured = ProfileMeasurement(*measure_until_consistent(
            sampler, lambda: checked_table(sampler, settings, hardware["name"], run_id),
            settings.profile.repeats,
            most=settings.profile.repeats * (settings.profile.attempts if settings.profile.checks else 1),
            progress=progress, label=f"profile {hardware['name']}", run_id=run_id))
    table, passes, attempt = measured.table, measured.passes, measured.attempt
    _mark_checked(measured, settings, run_id, hardware["name"])
    key["measured_at"] = utcnow()
    store_costs(store, run_id, hardware, table, key)
    elapsed = time.perf_counter() - start
    log.info("run %s: profiled %s at batch sizes %s in %.1f s (%d passes, %d check%s, %s)", run_id,
             hardware["name"], batch_sizes, elapsed, passes, attempt, "s" if attempt > 1 else "",
             table.check["status"])
    return {"run_id": run_id, "hardware_profile": hardware, "costs": table.rows(),
            "check": {name: table.check[name] for name in ("status", "reasons", "attempts", "max_spread")},
            "seconds": elapsed, "key": _plain_key(key),
            "profile": profile_provenance(run_id, key["measured_at"], None)}


@dataclass
class ProfileMeasurement:
    """What measure_until_consistent returns: the last table, what its check found wrong, the
    earlier checks' findings and the passes timed in all."""
    table: CostTable
    reasons: list[str]
    earlier: list
    passes: int

    @property
    def attempt(self) -> int:
        """Checks made: the earlier ones and the last."""
        return len(self.earlier) + 1


def _mark_checked(measured: ProfileMeasurement, settings: Settings, run_id: str,
                  hardware_name: str) -> None:
    """The measured table's check: "unchecked" with what a check would have flagged where
    profile_checks is off (measured once, trusted as it is), else "noisy" with the reasons (and a
    warning saying what to do) or "ok"."""
    table, reasons, attempt = measured.table, measured.reasons, measured.attempt
    passes, earlier = measured.passes, measured.earlier
    if not settings.profile.checks:     # measured once, trusted as it is: say what a check saw
        table.check = {"status": "unchecked", "reasons": [], "attempts": attempt,
                       "max_spread": max(table.spread.values(), default=0.0),
                       "details": {"would_flag": reasons, "context_len": settings.profile.context_len}}
        reasons = []
    else:
        table.check = {"status": "noisy" if reasons else "ok", "reasons": reasons, "attempts": attempt,
                       "max_spread": max(table.spread.values(), default=0.0),
                       "details": {"max_spread_allowed": settings.profile.max_spread,
                                   "noise_floor": settings.profile.noise_floor,
                                   "verify_dip": settings.profile.verify_dip,
                                   "step_dip": settings.profile.step_dip,
                                   "overhead_floor": settings.profile.overhead_floor,
                                   "repeats": settings.profile.repeats, "passes": passes,
                                   "earlier_attempts": earlier,
                                   "context_len": settings.profile.context_len}}
    if reasons:
        log.warning("run %s: cost profile %s marked noisy after %d checks: %s. No domain turns "
                    "on from it that the champion has off; measure on a quiet machine or plan with a "
                    "stored profile (`--hardware-profile NAME`)", run_id, hardware_name, attempt,
                    "; ".join(reasons))


def checked_table(sampler, settings: Settings, hardware_profile: str = "",
                  run_id: str = "") -> tuple[CostTable, list[str]]:
    """The cost table of the timings a CostSampler holds, and what check_costs finds wrong with it
    under the settings' bounds (empty: trustworthy)."""
    table = _table_of(sampler, hardware_profile, run_id)
    return table, check_costs(table, sampler.raw_overheads(), settings.profile.max_spread,
                              settings.profile.noise_floor, settings.profile.verify_dip,
                              settings.profile.overhead_floor, settings.profile.step_dip)


def measure_until_consistent(sampler, check, repeats: int, most: int, progress: bool = True,
                             label: str = "profile", run_id: str = "") -> tuple:
    """Time `repeats` passes of every figure, then check; while the check fails and fewer than
    `most` passes ran, time one more pass, keep the last 2 x `repeats` of them and check again.

    One more pass is usually what a profile spoiled by a single slow timing needs (four timings
    outvote one), at a third of the cost of measuring all `repeats` again; a machine that stays
    busy fails every check and costs what a fresh measurement each time would. check() gives
    (table, reasons) for the timings the sampler holds.
    Returns (table, reasons of the last check, reasons of each earlier failed check, passes).
    """
    earlier: list[list[str]] = []
    with tqdm(total=max(most, repeats), disable=not progress, desc=label) as bar:
        sampler.sample(repeats, progress=bar.update)
        passes = repeats
        table, reasons = check()
        while reasons and passes < most:
            if not earlier:
                log.warning("run %s: %s is not trustworthy (%s); timing one pass more at a time and "
                            "checking the last %d passes after each (at most %d passes)", run_id,
                            label, "; ".join(reasons), 2 * repeats, most)
            else:
                log.info("run %s: %s still fails after %d passes: %s", run_id, label, passes,
                         "; ".join(reasons))
            earlier.append(reasons)
            bar.set_postfix_str(f"check {len(earlier) + 1}")
            sampler.sample(1, progress=bar.update)
            sampler.keep_last(2 * repeats)
            passes += 1
            table, reasons = check()
        bar.total = passes      # a profile that passed early shows as complete
        bar.refresh()
    return table, reasons, earlier, passes


def _with_timing_indexes(drafters: dict, store: Store, target, tokenizer) -> dict:
    index = None
    out = {}
    for label, drafter in drafters.items():
        if drafter.takes_index and drafter.index is None:
            if index is None:
                # imported here: suffix_index reaches MLflow, which a GPU machine's
                # `profile measure` (no MLflow installed there) never needs
                from ..drafters.suffix_index import timing_index

                index = timing_index(store, None, tokenizer, output_size(target))
            drafter = drafter.with_index(index)
        out[label] = drafter
    return out


def _plain_key(key: dict) -> dict:
    return {name: (value.isoformat() if isinstance(value, datetime) else value)
            for name, value in key.items()}


def profile_provenance(run_id: str, measured_at: datetime | None, reused_from: str | None,
                       now: datetime | None = None) -> dict:
    """Which costs a run plans with, in words and figures: {reused, run_id (the run whose costs
    they are), measured_at (ISO, UTC), age_days, text}, e.g. "reused from run X, measured at
    2026-11-20 08:00:00 UTC, 2.3 days old"."""
    now = now or utcnow()
    origin = reused_from or run_id
    age = None if measured_at is None else max((now - measured_at).total_seconds(), 0.0) / 86400
    when = "at an unknown time" if measured_at is None else f"at {measured_at:%Y-%m-%d %H:%M:%S} UTC"
    text = (f"reused from run {origin}, measured {when}, {age:.1f} days old" if reused_from
            else f"measured by this run {when}")
    return {"reused": reused_from is not None, "run_id": origin,
            "measured_at": None if measured_at is None else measured_at.isoformat(),
            "age_days": None if age is None else round(age, 3), "text": text}
