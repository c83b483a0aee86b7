"""The load check's results as typed records, for the check that measures them
(tasks.steps.checks.load_check) and for those that read them (the run view, the version page, the
plots, `specdec engine`): one concurrency level's figures (LoadLevel, a load_check_levels row) and
one domain's verdict with its levels (DomainLoad, a load_check_domains row). Their JSON (to_json,
from_json) is the rows' shape, key for key: what the tables store, the step returns (XCom) and
`specdec engine show --format json` prints from."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LoadLevel:
    """One domain's requests at one concurrency level, served at K 0 (plain) and at the level's K
    (spec) on its method's server: tokens/s, the measured speedup with its 95% interval, the
    predicted one, TTFT and ITL p50/p95, what vLLM's /metrics counted. Fields in the table's
    column order (the JSON's key order)."""

    run_id: str | None = None
    domain: str | None = None
    concurrency: int
    k: int | None = None                          # the schedule's K at this size
    requests: int = 0
    failed: int = 0                               # both sides' failed requests
    plain_tokens_per_s: float | None = None       # output tokens / the level's wall time
    spec_tokens_per_s: float | None = None
    measured_speedup: float | None = None         # decode phases, the same requests
    measured_speedup_lo: float | None = None
    measured_speedup_hi: float | None = None
    predicted_speedup: float | None = None        # vLLM's cost profile at this batch size
    pays: bool | None = None
    plain_ttft_p50_s: float | None = None
    plain_ttft_p95_s: float | None = None
    spec_ttft_p50_s: float | None = None
    spec_ttft_p95_s: float | None = None
    plain_itl_p50_s: float | None = None
    plain_itl_p95_s: float | None = None
    spec_itl_p50_s: float | None = None
    spec_itl_p95_s: float | None = None
    engine_e: float | None = None                 # from the /metrics deltas
    engine_rates: list | None = None              # per position, from the /metrics deltas
    counters: dict | None = None                  # the level's /metrics deltas
    request_sums: dict | None = None              # the per-request metrics summed
    counters_equal: bool | None = None
    per_request: list | None = None               # None: not read (queries_load.load_checks)
    created_at: Any = None                        # a datetime from the table, text from JSON
    predicted_served_speedup: float | None = None   # the same, along the tokens vLLM served
    verdict: str | None = None                    # level_verdict's word while the run decides; not stored

    def to_json(self) -> dict:
        """The load_check_levels row (per_request only where it was read, no verdict)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "verdict" and not (f.name == "per_request" and self.per_request is None)}

    @classmethod
    def from_json(cls, row: dict) -> LoadLevel:
        """A level from its row (to_json's shape; a key it lacks keeps its default)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


@dataclass(frozen=True, kw_only=True)
class DomainLoad:
    """One domain's load check: its status (ok | cut | off | died | timeout | failed), whether it
    passed, the reason, the speculative config its server ran, the exported schedule before and
    after the cut, the largest level up to which every level pays, the servers' logs, and its
    levels by concurrency. Fields in the table's column order, then the levels."""

    run_id: str | None = None
    domain: str | None = None
    status: str | None = None
    passed: bool | None = None
    reason: str | None = None
    speculative_config: dict | None = None
    schedule_before: list | None = None           # [[first, last, K], ...]
    schedule_after: list | None = None
    max_level_paying: int | None = None
    plain_log: str | None = None
    spec_log: str | None = None
    created_at: Any = None                        # a datetime from the table, text from JSON
    levels: tuple[LoadLevel, ...] = ()

    def to_json(self) -> dict:
        """The load_check_domains row with "levels": each level's to_json."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "levels"}
        return {**out, "levels": [level.to_json() for level in self.levels]}

    @classmethod
    def from_json(cls, row: dict) -> DomainLoad:
        """A domain's load check from its row with "levels" (to_json's shape; a key it lacks keeps
        its default)."""
        values = {f.name: row[f.name] for f in fields(cls) if f.name in row and f.name != "levels"}
        return cls(**values, levels=tuple(LoadLevel.from_json(level) for level in row.get("levels") or ()))
