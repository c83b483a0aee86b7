"""A stored cost profile, read: what a target step, a verify(K) pass and a draft step cost on
named hardware, by batch size (CostTable), and the readers of the stored profiles.

The planner, the monitor, the engine check and the load check price rounds with it; none of them
measures anything, so this module imports no torch (the measuring is tasks.steps.costs.costs, which
re-exports these names). A hardware description is a device and dtype: timings are comparable
only within one (same_hardware); confirm refuses the others (HardwareMismatch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ...db.queries_costs import cost_profile_rows, hardware_row
from ...db.queries_runs import run_hardware_profile
from ...db.store import Store
from ...errors import SpecdecTaskError


class CostProfileError(SpecdecTaskError, LookupError):
    """No usable cost profile (unknown name, missing batch sizes or K, unreadable file)."""


class HardwareMismatch(SpecdecTaskError, RuntimeError):
    """Live timings on one hardware class compared with costs measured on another."""


def same_hardware(a: dict, b: dict) -> bool:
    """Whether two hardware descriptions are one class: the same device and dtype."""
    return (a.get("device"), a.get("dtype")) == (b.get("device"), b.get("dtype"))


def hardware_text(hardware: dict) -> str:
    worker = f" on worker {hardware['worker']}" if hardware.get("worker") else ""
    return f"{hardware.get('device')} {hardware.get('dtype')}{worker}"


def pays_sampled_steps(temperature: float | None, top_k: int | None = 0,
                       top_p: float | None = 1.0) -> bool:
    """Whether a request costs what a serving engine's profile times as its sampled steps
    (sampled_step, sampled_verify: requests at top-p 0.9): it samples (temperature > 0) with
    top-p below 1. vLLM's top-p sorts the vocabulary at every position a step verifies, K + 1 rows
    in a round, which is most of what a sampled step costs over a greedy one; a request sampling
    at its temperature alone, or with top-k only, costs about what a greedy one does (measured on
    this CPU, the embedded default, benchmarks/results/sampled_costs.md: at K 8 and batch 1 a
    top-p round cost 2.65 greedy steps, a temperature-only one 1.64 and a top-k one 1.88, a greedy
    one 1.46-1.61), so it is priced with the greedy steps."""
    return bool(temperature) and temperature > 0 and top_p is not None and top_p < 1.0


def batch_share(sampled_share: float, batch_size: int) -> float:
    """The share of batches of `batch_size` requests that pay the sampled steps when
    `sampled_share` of the requests sample with top-p: those holding at least one of them,
    1 - (1 - share)^b (one at batch 1; a domain whose requests are a quarter top-p pays them in
    nine batches of ten at batch 8)."""
    share = min(max(float(sampled_share), 0.0), 1.0)
    return 1.0 - (1.0 - share) ** max(int(batch_size), 1)


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
    # the same step and verify passes for sampled requests (temperature > 0), where the engine
    # prices them apart (a serving engine's rejection sampler; {} in our engine's profiles):
    # {batch: s} and {batch: {K: s}}, at the batch sizes and K timed; see for_sampling()
    sampled_step: dict[int, float] = field(default_factory=dict)
    sampled_verify: dict[int, dict[int, float]] = field(default_factory=dict)
    # a host drafter's whole round at K (its search and the verify pass), timed in its own serving
    # engine beside that engine's K 0 step and stored as that ratio x target_step: {drafter:
    # {batch: {K: s}}}; where a drafter has them its rounds are priced with them (round_ratios)
    draft_round: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)
    # interquartile range / median of each figure's repeated timings, keyed as rows() are:
    # (component, drafter, k, batch_size); draft steps and overheads over the target step
    spread: dict[tuple, float] = field(default_factory=dict)
    # the profile's own check (check_costs): {status: ok | noisy, reasons, attempts, max_spread};
    # None for profiles measured or imported without one
    check: dict | None = None
    # the share of requests the table is blended for (for_sampling): how much of a round's
    # half-width is the sampled verify's (cost_halfwidth)
    sampled_share: float = 0.0

    @property
    def noisy(self) -> bool:
        """Whether the profile failed its consistency or spread checks (tasks.steps.plan.plan then turns no
        domain on from it that the champion has off)."""
        return bool(self.check) and self.check.get("status") == "noisy"

    def noise_text(self, limit: int = 3) -> str:
        """The first reasons of a noisy profile, in words."""
        reasons = list((self.check or {}).get("reasons") or [])
        more = f" (+{len(reasons) - limit} more)" if len(reasons) > limit else ""
        return "; ".join(reasons[:limit]) + more

    @property
    def paired(self) -> bool:
        """Whether the profile's figures are paired ratios with intervals (a serving engine's,
        timed K 0 beside each K in one process): each verify figure's spread is then its ratio's
        95% half-width over the ratio, which the plan's interval carries (cost_halfwidth)."""
        return bool(((self.check or {}).get("details") or {}).get("paired"))

    def cost_halfwidth(self, k: int, batch_size: int, drafter: str | None = None) -> float:
        """The relative 95% half-width of a round at K at a batch size in a paired profile: of
        verify(K), or of the drafter's own rounds where it has them (round_ratios), blended with
        the sampled verify(K)'s by the share of requests that pay it (for_sampling's share, 0 in a
        table not blended); at a K between two timed ones, the wider of the two. 0 in any other
        profile."""
        if not self.paired or k <= 0:
            return 0.0
        own = drafter if self.round_ratios(drafter or "", batch_size) else None
        main = self._timed_halfwidth("draft_round" if own else "verify", own, k, batch_size)
        if self.sampled_share <= 0.0:
            return main
        sampled = self._timed_halfwidth("sampled_verify", None, k, batch_size)
        share = batch_share(self.sampled_share, batch_size)
        return (1.0 - share) * main + share * sampled

    def _timed_halfwidth(self, component: str, label: str | None, k: int, batch_size: int) -> float:
        """The wider spread of the two timed K around K (below and above; the nearest where K is
        outside them) of one component at a batch size; 0 where none is timed."""
        timed = sorted(kk for (name, who, kk, b) in self.spread
                       if name == component and who == label and b == batch_size and kk)
        if not timed:
            return 0.0
        below = max((kk for kk in timed if kk <= k), default=timed[0])
        above = min((kk for kk in timed if kk >= k), default=timed[-1])
        return max(self.spread[(component, label, below, batch_size)],
                   self.spread[(component, label, above, batch_size)])

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

    def round_ratios(self, drafter: str, batch_size: int) -> list[float] | None:
        """[r(1), r(2), ...]: the drafter's whole round at K over a K 0 step of its own engine, at
        least 1 (as verify_ratios), where the profile timed its rounds (draft_round); None where
        it did not (the round is then verify(K) plus its draft step)."""
        rounds = self.draft_round.get(drafter, {}).get(batch_size)
        if not rounds:
            return None
        step = self.target_step[batch_size]
        return [max(rounds[k] / step, 1.0) for k in range(1, max(rounds) + 1)]

    def draft_ratio(self, drafter: str, batch_size: int) -> float:
        """t_draft / t_step at this batch size (per token for models, per round for prompt lookup).
        A prompt lookup the profile has no figure for takes the kind's ("prompt_lookup" for
        "prompt_lookup(max_ngram=3)") where the profile prices the kind as a whole: a serving
        engine's profile does, its n-gram search being inside its verify steps."""
        per_drafter = self.draft_step.get(drafter)
        if per_drafter is None and drafter.startswith("prompt_lookup("):
            per_drafter = self.draft_step.get("prompt_lookup")
        per_drafter = per_drafter or {}
        try:
            return per_drafter[batch_size] / self.target_step[batch_size]
        except KeyError:
            raise CostProfileError(
                f"cost profile {self.hardware_profile!r} (run {self.run_id}) has no draft step for "
                f"{drafter} at batch size {batch_size}; run `specdec profile` with that candidate"
            ) from None

    def for_sampling(self, sampled_share: float) -> "CostTable":
        """The table for traffic of which `sampled_share` of the requests pay the sampled steps
        (pays_sampled_steps: they sample with top-p):
        each step and verify pass the blend (1 - s_b) x greedy + s_b x sampled where the profile
        timed sampled requests (linear in K between the K timed), itself where it did not. s_b
        (batch_share) is the share of batches of b requests that hold one that samples with top-p:
        vLLM's sampler then sorts the logits of every row of the batch (its top-p takes the whole
        batch's tensor), so the batch pays the sampled step whatever its other requests ask."""
        clamped = min(max(float(sampled_share), 0.0), 1.0)
        if clamped == 0.0 or not self.sampled_step:
            return self
        steps, verify = dict(self.target_step), {b: dict(v) for b, v in self.verify.items()}
        rounds = {label: {b: dict(v) for b, v in per_batch.items()}
                  for label, per_batch in self.draft_round.items()}
        for b, sampled in self.sampled_step.items():
            if b not in steps:
                continue
            share = batch_share(clamped, b)
            steps[b] = (1 - share) * steps[b] + share * sampled
            timed = self.sampled_verify.get(b) or {}
            known = sorted(timed)
            for k in verify.get(b, {}):
                if known:
                    at_k = float(np.interp(k, known, [timed[x] for x in known]))
                    # a drafter's own round pays the sampled extra the ngram engine's verify did
                    for per_batch in rounds.values():
                        if k in per_batch.get(b, {}):
                            per_batch[b][k] += share * (at_k - verify[b][k])
                    verify[b][k] = (1 - share) * verify[b][k] + share * at_k
        return replace(self, target_step=steps, verify=verify, draft_round=rounds, sampled_share=clamped)

    @property
    def sampled_timed(self) -> bool:
        """Whether the profile prices sampled requests apart (see for_sampling)."""
        return bool(self.sampled_step)

    def overhead_ratios(self, drafter: str, batch_size: int) -> tuple[float, float]:
        """(plain decoding's overhead per step, the drafter's per round) / t_step at this batch
        size; 0 where the profile has none."""
        step = self.target_step[batch_size]
        plain = self.round_overhead.get("plain", {}).get(batch_size, 0.0)
        return plain / step, self.round_overhead.get(drafter, {}).get(batch_size, 0.0) / step

    def rows(self) -> list[dict]:
        out = self._rows()
        for row in out:
            row["spread"] = self.spread.get((row["component"], row["drafter"], row["k"],
                                             row["batch_size"]))
        return out

    def _rows(self) -> list[dict]:
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
        for b, s in self.sampled_step.items():
            out.append({"component": "sampled_step", "drafter": None, "k": None, "batch_size": b,
                        "seconds": s})
        for b, per_k in self.sampled_verify.items():
            for k, s in per_k.items():
                out.append({"component": "sampled_verify", "drafter": None, "k": k, "batch_size": b,
                            "seconds": s})
        for drafter, per_batch in self.draft_round.items():
            for b, per_k in per_batch.items():
                for k, s in per_k.items():
                    out.append({"component": "draft_round", "drafter": drafter, "k": k,
                                "batch_size": b, "seconds": s})
        return out

    @classmethod
    def from_rows(cls, hardware_profile: str, run_id: str, rows) -> "CostTable":
        table = cls(hardware_profile, run_id, {}, {}, {}, {})
        for row in rows:
            row = dict(row)
            b, s = int(row["batch_size"]), float(row["seconds"])
            if row.get("spread") is not None:
                table.spread[(row["component"], row.get("drafter"),
                              None if row.get("k") is None else int(row["k"]), b)] = float(row["spread"])
            if row["component"] == "target_step":
                table.target_step[b] = s
            elif row["component"] == "verify":
                table.verify.setdefault(b, {})[int(row["k"])] = s
            elif row["component"] == "draft_step":
                table.draft_step.setdefault(row["drafter"], {})[b] = s
            elif row["component"] == "round_overhead":
                table.round_overhead.setdefault(row["drafter"], {})[b] = s
            elif row["component"] == "sampled_step":
                table.sampled_step[b] = s
            elif row["component"] == "sampled_verify":
                table.sampled_verify.setdefault(b, {})[int(row["k"])] = s
            elif row["component"] == "draft_round":
                table.draft_round.setdefault(row["drafter"], {}).setdefault(b, {})[int(row["k"])] = s
            else:
                raise CostProfileError(f"cost profile {hardware_profile!r}: unknown component "
                                       f"{row['component']!r}")
        return table


def hardware_of(hardware_profile: str, store: Store) -> dict | None:
    """The stored hardware description of a profile: {name, device, dtype, details} (None: none)."""
    row = hardware_row(store, hardware_profile)
    return None if row is None else {"name": row["name"], "device": row["device"],
                                     "dtype": row["dtype"], "details": row["details"] or {}}


def load_costs(hardware_profile: str, store: Store, run_id: str | None = None) -> CostTable:
    """The profile's costs from `run_id`, or from the newest run that measured or imported it."""
    run_id, rows, known, check = cost_profile_rows(store, hardware_profile, run_id)
    if not rows:
        raise CostProfileError(
            f"no cost profile {hardware_profile!r}{'' if run_id is None else f' from run {run_id}'}; "
            f"known profiles: {sorted(known) or 'none'}. Measure one with `specdec profile` or import "
            "one with `specdec profile import FILE`")
    table = CostTable.from_rows(hardware_profile, run_id, rows)
    table.check = None if check is None else dict(check)
    return table


def run_costs(run_id: str, store: Store) -> CostTable | None:
    """The cost profile the run plans with (eval_runs.hardware_profile, its newest run); None
    before the profile step or when that profile is gone."""
    name = run_hardware_profile(store, run_id)
    if not name:
        return None
    try:
        return load_costs(name, store)
    except CostProfileError:
        return None
