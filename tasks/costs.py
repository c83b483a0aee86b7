"""Cost profiles: what a target step, a verify(K) pass and a draft step cost on named hardware.

`profile_costs` measures them on this machine at batch sizes 1..B and stores them in cost_profiles
(keyed by run id and hardware profile) with the profile's description in hardware_profiles.
`export_costs` / `import_costs` move a profile through a JSON file, so costs measured on the
serving GPU can plan for it from any machine. Timing work holds an exclusive file lock
($SPECDEC_HOME/locks/timing.lock): two timing steps never share this machine's CPU/GPU, whichever
process (CLI, test, Airflow task) runs them. Across machines, the Airflow pool `specdec_timing`
does that job; the lock is only the per-machine guard.

A hardware description (describe_hardware / describe_device) is a device and dtype: timings are
comparable only within one (same_hardware); confirm refuses the others (HardwareMismatch).
"""

from __future__ import annotations

import fcntl
import json
import logging
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import delete, insert, select

from .db.engine import database_url, ensure_ready
from .db.models import CostProfile, HardwareProfile
from .errors import SpecdecTaskError
from .settings import Settings, load_settings, specdec_home
from .timeutil import utcnow

log = logging.getLogger(__name__)

FILE_FORMAT = "specdec-cost-profile/1"


class CostProfileError(SpecdecTaskError, LookupError):
    """No usable cost profile (unknown name, missing batch sizes or K, unreadable file)."""


@contextmanager
def timing_lock(name: str = "timing"):
    """Exclusive lock across processes for timing work; waits (and says so) while another holds it."""
    path = specdec_home() / "locks" / f"{name}.lock"
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


def describe_device(device, dtype, name: str | None = None) -> dict:
    """{name, device, dtype, details} of a torch device and dtype on this machine (a hardware
    class: two workers with equal device and dtype time alike)."""
    import torch

    device = torch.device(device)
    dtype = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
        details = {"cuda": torch.version.cuda}
    else:
        label = f"cpu {platform.machine()} ({torch.get_num_threads()} threads)"
        details = {"processor": platform.processor() or platform.machine()}
    details["torch"] = torch.__version__
    if name is None:
        name = _slug(f"{label if device.type == 'cuda' else 'cpu-' + str(torch.get_num_threads()) + 't'}-{dtype}")
    return {"name": name, "device": label, "dtype": dtype, "details": details}


class HardwareMismatch(SpecdecTaskError, RuntimeError):
    """Live timings on one hardware class compared with costs measured on another."""


def same_hardware(a: dict, b: dict) -> bool:
    """Whether two hardware descriptions are one class: the same device and dtype."""
    return (a.get("device"), a.get("dtype")) == (b.get("device"), b.get("dtype"))


def hardware_text(hardware: dict) -> str:
    worker = f" on worker {hardware['worker']}" if hardware.get("worker") else ""
    return f"{hardware.get('device')} {hardware.get('dtype')}{worker}"


@dataclass
class CostTable:
    """Seconds per component of one hardware profile, by batch size."""

    hardware_profile: str
    run_id: str
    target_step: dict[int, float]                          # {batch: s}
    verify: dict[int, dict[int, float]]                    # {batch: {K: s}}
    draft_step: dict[str, dict[int, float]] = field(default_factory=dict)  # {drafter: {batch: s}}
    # per round outside the forward passes and proposals ({drafter or "plain": {batch: s}});
    # empty in profiles measured before it was (they plan without it)
    round_overhead: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.target_step)

    def k_max(self, batch_size: int) -> int:
        return max(self.verify.get(batch_size, {0: 0}))

    def verify_ratios(self, batch_size: int) -> list[float]:
        """[v(1), v(2), ...] = t_verify(K) / t_step at this batch size, at least 1: a verify pass
        does at least a step's work, and a lower ratio is measurement noise (a step timed while the
        machine was busier) that would promise a speedup no acceptance rate can deliver."""
        step = self.target_step[batch_size]
        verify = self.verify[batch_size]
        return [max(verify[k] / step, 1.0) for k in range(1, max(verify) + 1)]

    def draft_ratio(self, drafter: str, batch_size: int) -> float:
        """t_draft / t_step at this batch size (per token for models, per round for prompt lookup)."""
        try:
            return self.draft_step[drafter][batch_size] / self.target_step[batch_size]
        except KeyError:
            raise CostProfileError(
                f"cost profile {self.hardware_profile!r} (run {self.run_id}) has no draft step for "
                f"{drafter} at batch size {batch_size}; run `specdec profile` with that candidate"
            ) from None

    def overhead_ratios(self, drafter: str, batch_size: int) -> tuple[float, float]:
        """(plain decoding's overhead per step, the drafter's per round) / t_step at this batch
        size; 0 where the profile has none."""
        step = self.target_step[batch_size]
        plain = self.round_overhead.get("plain", {}).get(batch_size, 0.0)
        return plain / step, self.round_overhead.get(drafter, {}).get(batch_size, 0.0) / step

    def rows(self) -> list[dict]:
        out = []
        for b, seconds in self.target_step.items():
            out.append({"component": "target_step", "drafter": None, "k": None, "batch_size": b,
                        "seconds": seconds})
            for k, s in self.verify.get(b, {}).items():
                out.append({"component": "verify", "drafter": None, "k": k, "batch_size": b,
                            "seconds": s})
        for drafter, per_batch in self.draft_step.items():
            for b, s in per_batch.items():
                out.append({"component": "draft_step", "drafter": drafter, "k": None,
                            "batch_size": b, "seconds": s})
        for drafter, per_batch in self.round_overhead.items():
            for b, s in per_batch.items():
                out.append({"component": "round_overhead", "drafter": drafter, "k": None,
                            "batch_size": b, "seconds": s})
        return out

    @classmethod
    def from_rows(cls, hardware_profile: str, run_id: str, rows) -> "CostTable":
        table = cls(hardware_profile, run_id, {}, {}, {}, {})
        for row in rows:
            row = dict(row)
            b, s = int(row["batch_size"]), float(row["seconds"])
            if row["component"] == "target_step":
                table.target_step[b] = s
            elif row["component"] == "verify":
                table.verify.setdefault(b, {})[int(row["k"])] = s
            elif row["component"] == "draft_step":
                table.draft_step.setdefault(row["drafter"], {})[b] = s
            elif row["component"] == "round_overhead":
                table.round_overhead.setdefault(row["drafter"], {})[b] = s
            else:
                raise CostProfileError(f"cost profile {hardware_profile!r}: unknown component "
                                       f"{row['component']!r}")
        return table


def _store(engine, run_id: str, hardware: dict, table: CostTable) -> None:
    now = utcnow()
    with engine.begin() as connection:
        connection.execute(delete(CostProfile).where(
            (CostProfile.run_id == run_id) & (CostProfile.hardware_profile == hardware["name"])))
        connection.execute(insert(CostProfile), [
            dict(row, run_id=run_id, hardware_profile=hardware["name"], created_at=now)
            for row in table.rows()])
        connection.execute(delete(HardwareProfile).where(HardwareProfile.name == hardware["name"]))
        connection.execute(insert(HardwareProfile).values(
            name=hardware["name"], device=hardware["device"], dtype=hardware["dtype"],
            details=hardware.get("details"), updated_at=now))


def profile_costs(run_id: str, target, drafters: dict, db_url: str | None = None,
                  hardware_profile: str | None = None, settings: Settings | None = None,
                  k_max: int | None = None, batch_sizes=None, progress: bool = True,
                  tokenizer=None) -> dict:
    """Measure and store the costs of `target` and the drafters ({label: Drafter}) on this machine.

    A suffix drafter without an index of its own is timed with an index over every stored
    response (its lookups cost more with more indexed tokens); tokenizer: for stored requests
    without token ids.

    Output: {"run_id", "hardware_profile": {name, device, dtype, details}, "costs": CostTable rows,
             "seconds"}. Re-running a run id replaces its rows for that profile.
    """
    from tqdm.auto import tqdm

    from specdec_core import SpecDecoder
    from specdec_core.profile import measure_step_costs

    settings = settings or load_settings()
    k_max = k_max or settings.eval_k_max
    batch_sizes = sorted(set(batch_sizes or settings.profile_batch_sizes))
    engine = ensure_ready(database_url(db_url or settings.database_url))
    hardware = describe_hardware(target, hardware_profile)
    # which engine the costs describe: static caches, CUDA graphs, compiled forwards
    hardware["details"]["engine"] = SpecDecoder(target, None).engine()
    drafters = _with_timing_indexes(drafters, db_url or settings.database_url, target, tokenizer)
    table = CostTable(hardware["name"], run_id, {}, {}, {}, {})
    start = time.perf_counter()
    with timing_lock():
        for b in tqdm(batch_sizes, desc=f"profile {hardware['name']}", disable=not progress):
            costs = measure_step_costs(target, drafters, k_max, batch_size=b,
                                       context_len=settings.profile_context_len,
                                       repeats=settings.profile_repeats)
            table.target_step[b] = costs["target_step"]
            table.verify[b] = costs["verify"]
            for label, seconds in costs["draft_step"].items():
                table.draft_step.setdefault(label, {})[b] = seconds
            for label, seconds in costs.get("round_overhead", {}).items():
                table.round_overhead.setdefault(label, {})[b] = seconds
    _store(engine, run_id, hardware, table)
    elapsed = time.perf_counter() - start
    log.info("run %s: profiled %s at batch sizes %s in %.1f s", run_id, hardware["name"],
             batch_sizes, elapsed)
    return {"run_id": run_id, "hardware_profile": hardware, "costs": table.rows(), "seconds": elapsed}


def _with_timing_indexes(drafters: dict, db_url: str | None, target, tokenizer) -> dict:
    from specdec_core.drafters import SuffixDrafter, output_size

    from .suffix_index import timing_index

    index = None
    out = {}
    for label, drafter in drafters.items():
        if isinstance(drafter, SuffixDrafter) and drafter.index is None:
            if index is None:
                index = timing_index(db_url, None, tokenizer, output_size(target))
            drafter = SuffixDrafter(index, drafter.max_depth, drafter.min_token_prob,
                                    drafter.max_spec_factor)
        out[label] = drafter
    return out


def load_costs(hardware_profile: str, db_url: str | None = None, run_id: str | None = None) -> CostTable:
    """The profile's costs from `run_id`, or from the newest run that measured or imported it."""
    engine = ensure_ready(database_url(db_url))
    with engine.connect() as connection:
        if run_id is None:
            run_id = connection.execute(
                select(CostProfile.run_id).where(CostProfile.hardware_profile == hardware_profile)
                .order_by(CostProfile.created_at.desc(), CostProfile.id.desc()).limit(1)).scalar()
        rows = [] if run_id is None else connection.execute(
            select(CostProfile.component, CostProfile.drafter, CostProfile.k, CostProfile.batch_size,
                   CostProfile.seconds)
            .where((CostProfile.hardware_profile == hardware_profile) & (CostProfile.run_id == run_id))
        ).mappings().all()
        known = connection.execute(select(HardwareProfile.name)).scalars().all()
    if not rows:
        raise CostProfileError(
            f"no cost profile {hardware_profile!r}{'' if run_id is None else f' from run {run_id}'}; "
            f"known profiles: {sorted(known) or 'none'}. Measure one with `specdec profile` or import "
            "one with `specdec profile import FILE`")
    return CostTable.from_rows(hardware_profile, run_id, rows)


def export_costs(hardware_profile: str, path: str | Path, db_url: str | None = None,
                 run_id: str | None = None) -> dict:
    """Write the profile (newest run unless run_id) to a JSON file; returns what was written."""
    table = load_costs(hardware_profile, db_url, run_id)
    engine = ensure_ready(database_url(db_url))
    with engine.connect() as connection:
        hardware = connection.execute(select(HardwareProfile).where(
            HardwareProfile.name == hardware_profile)).mappings().first()
    document = {"format": FILE_FORMAT, "run_id": table.run_id,
                "hardware_profile": {"name": hardware_profile,
                                     "device": hardware["device"] if hardware else "unknown",
                                     "dtype": hardware["dtype"] if hardware else "unknown",
                                     "details": hardware["details"] if hardware else None},
                "exported_at": utcnow().isoformat(), "costs": table.rows()}
    Path(path).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return document


def import_costs(path: str | Path, db_url: str | None = None, name: str | None = None) -> dict:
    """Store a profile exported by export_costs (optionally under another name); idempotent."""
    try:
        document = json.loads(Path(path).read_text("utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CostProfileError(f"cost profile file {path}: cannot read JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        raise CostProfileError(f"cost profile file {path}: not a {FILE_FORMAT} document (make it with "
                               "`specdec profile export`)")
    try:
        hardware = dict(document["hardware_profile"])
        if name:
            hardware["name"] = name
        table = CostTable.from_rows(hardware["name"], document["run_id"], document["costs"])
    except (CostProfileError, KeyError, TypeError, ValueError) as exc:
        raise CostProfileError(f"cost profile file {path}: malformed ({type(exc).__name__}: {exc}); "
                               "make it with `specdec profile export`") from exc
    if not table.target_step or any(b not in table.verify for b in table.target_step):
        raise CostProfileError(f"cost profile file {path}: every batch size needs a target step and "
                               "verify costs")
    gaps = {b: sorted(v) for b, v in table.verify.items() if sorted(v) != list(range(1, max(v) + 1))}
    if gaps:
        raise CostProfileError(f"cost profile file {path}: verify costs must cover K = 1..k_max at "
                               f"every batch size; got {gaps}")
    _store(ensure_ready(database_url(db_url)), table.run_id, hardware, table)
    return {"hardware_profile": hardware, "run_id": table.run_id, "rows": len(table.rows())}
