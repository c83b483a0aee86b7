"""The engine check's per-domain results as typed records, for the check that builds them
(tasks.steps.checks.engine_check, engine_compare): one domain's row (EngineCheckRow) made of the
parts each kind of row has, so that a row's key set says how far the domain got:
- every row: its status, whether it passed, the reason and the vLLM config it was served with
  (a domain without a vLLM config: these only, status "unsupported");
- a domain an engine was started for: what the engine said of itself (ServedBy: its log, version,
  start, counters, cost profile); where the engine failed as a whole, nothing more;
- a domain the engine served: the comparison with the estimate (Comparison), with each replayed
  request's counts beside the estimate's (ComparedRequest);
- where the plain twins were served: their figures and the measured speedup (PlainFigures);
- a run planned on vLLM's costs: the live check's verdict (live_check).
Their JSON (to_json, from_json) is the rows' shape key for key: what the step returns (XCom),
and, column by column (COLUMNS), what the engine_checks table stores."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

# the engine_checks columns a row fills (the table's others: run_id, domain, engine, created_at)
COLUMNS = ("engine_version", "speculative_config", "status", "passed", "reason", "requests", "k",
           "estimate_e", "estimate_e_lo", "estimate_e_hi", "engine_e", "estimate_rates",
           "engine_rates", "greedy_checked", "greedy_equal", "plain_tokens_per_s",
           "spec_tokens_per_s", "plain_decode_tokens_per_s", "spec_decode_tokens_per_s",
           "measured_speedup", "predicted_speedup", "engine_profile", "start_s", "counters",
           "per_request", "log_path")


def _json(record) -> dict:
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _read(cls, row: dict):
    """The part `cls` of a row, None where the row lacks its first key (it never had the part)."""
    names = [f.name for f in fields(cls)]
    return cls(**{n: row[n] for n in names if n in row}) if names[0] in row else None


@dataclass(frozen=True, kw_only=True)
class ServedBy:
    """The engine a domain's requests were served on, as it said of itself: its log, vLLM's
    version, its start in seconds, vLLM's spec_decode counters and the version's cost profile."""

    log_path: str | None = None
    engine_version: str | None = None
    start_s: float | None = None
    counters: dict | None = None
    engine_profile: str | None = None           # the cost profile's hardware name

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True, kw_only=True)
class ComparedRequest:
    """One replayed request's counts (engine_compare.compare_request): vLLM's output beside the
    logged response (equal, or the first position they differ at), its tokens, wall and
    decode-phase seconds, vLLM's drafted steps and accepted drafts (in all and per position), those
    inside its output where its steps could be placed (None: not placed), and, with the estimate's
    expected rounds on the request, the estimate's steps and accepted drafts and, for a greedy
    request whose output equals the log, whether the counts are equal (the drafts vLLM accepted
    inside the log beside them). Fields in the order of the JSON's keys."""

    request_id: str
    greedy: bool = False
    tokens: int = 0
    seconds: float | None = None
    decode_s: float | None = None
    equal_to_log: bool = False
    first_difference: int | None = None
    engine_steps: int = 0
    engine_accepted: int = 0
    engine_accepted_per_pos: list[int] = field(default_factory=list)
    engine_accepted_in_output: int | None = None
    engine_accepted_per_pos_in_output: list[int] | None = None
    engine_accepted_in_log: int | None = None
    estimate_steps: float | None = None
    estimate_accepted: float | None = None
    estimate_accepted_per_pos: list[float] | None = None
    counts_equal: bool | None = None

    @property
    def engine_accepted_inside(self) -> int:
        """vLLM's accepted drafts inside the output where its steps were placed, else its own count."""
        return self.engine_accepted if self.engine_accepted_in_output is None else self.engine_accepted_in_output

    @property
    def engine_per_pos_inside(self) -> list[int]:
        """Per position, likewise (engine_accepted_inside)."""
        placed = self.engine_accepted_per_pos_in_output
        return self.engine_accepted_per_pos if placed is None else placed

    def to_json(self) -> dict:
        return _json(self)

    @classmethod
    def from_json(cls, row: dict) -> ComparedRequest:
        """The request from its JSON (to_json's shape; a key it lacks keeps its default)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """vLLM's counts on the domain's replayed requests beside the estimate's: E with the
    estimate's 95% interval, rates per position, the greedy requests checked and equal, the
    requests compared (ComparedRequest, engine_compare.compare_request), the config's tokens/s and
    the speedup vLLM's cost profile predicts for the requests."""

    requests: int = 0
    k: int | None = None
    estimate_e: float | None = None
    estimate_e_lo: float | None = None
    estimate_e_hi: float | None = None
    engine_e: float | None = None
    estimate_rates: list | None = None
    engine_rates: list | None = None
    greedy_checked: int = 0
    greedy_equal: int = 0
    per_request: list[ComparedRequest] | None = None
    spec_tokens_per_s: float | None = None
    spec_decode_tokens_per_s: float | None = None
    predicted_speedup: float | None = None

    def to_json(self) -> dict:
        """The part's keys, per_request as each request's to_json."""
        out = _json(self)
        return out if self.per_request is None else {
            **out, "per_request": [request.to_json() for request in self.per_request]}

    @classmethod
    def read(cls, row: dict) -> Comparison | None:
        """The part of a row (_read), per_request read back into ComparedRequests."""
        part = _read(cls, row)
        return part if part is None or part.per_request is None else replace(
            part, per_request=[ComparedRequest.from_json(request) for request in part.per_request])


@dataclass(frozen=True, kw_only=True)
class PlainFigures:
    """The K 0 twins' tokens/s on the domain's replayed requests, and the decode-phase speedup
    of the config over them (the live check's judged figure where it ran)."""

    plain_tokens_per_s: float | None = None
    plain_decode_tokens_per_s: float | None = None
    measured_speedup: float | None = None

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True, kw_only=True)
class EngineCheckRow:
    """One domain's engine check (see the module): status (ok | below | unsupported | refused |
    unresolved | died | timeout | contended | lossy), passed (None: reported, not gated), the
    reason, the config, and the parts the domain reached."""

    status: str
    passed: bool | None
    reason: str
    speculative_config: dict | None = None
    served: ServedBy | None = None
    comparison: Comparison | None = None
    plain: PlainFigures | None = None
    live_check: dict | None = None              # confirm.live_verdict's verdict, on vLLM

    @property
    def predicted_speedup(self) -> float | None:
        return None if self.comparison is None else self.comparison.predicted_speedup

    @property
    def measured_speedup(self) -> float | None:
        return None if self.plain is None else self.plain.measured_speedup

    def to_json(self) -> dict:
        """The row as the step returns it: the parts it has, flat (no key of a part it lacks)."""
        out = {"speculative_config": self.speculative_config}
        for part in (self.served, self.comparison, self.plain):
            out.update(part.to_json() if part is not None else {})
        out.update(status=self.status, passed=self.passed, reason=self.reason)
        return out if self.live_check is None else {**out, "live_check": self.live_check}

    def columns(self) -> dict:
        """The engine_checks columns of the row (None for a part it lacks)."""
        row = self.to_json()
        return {column: row.get(column) for column in COLUMNS}

    @classmethod
    def from_json(cls, row: dict) -> EngineCheckRow:
        """A row from to_json's shape, or a stored engine_checks row (every part present)."""
        return cls(status=row["status"], passed=row["passed"], reason=row["reason"],
                   speculative_config=row.get("speculative_config"), served=_read(ServedBy, row),
                   comparison=Comparison.read(row), plain=_read(PlainFigures, row),
                   live_check=row.get("live_check"))


@dataclass(frozen=True, kw_only=True)
class EngineRecord:
    """One engine of the check as the step reports it ("engines"): its name, the domains it
    replayed, the config it started with, its log, vLLM's start seconds, how it went (ok,
    refused, unresolved, timeout, died, or died on N requests and started again), its seconds,
    the engines started, the mends of vLLM's CPU build, and how many pairs the replay's budget
    left out (None: none)."""

    engine: str
    domains: list[str]
    speculative_config: dict | None
    log: str
    start_s: float | None = None
    status: str = "ok"
    seconds: float | None = None
    starts: int | None = None
    mends: list[str] = field(default_factory=list)
    left_out: int | None = None

    def to_json(self) -> dict:
        """The record as the step returns it (left_out only where pairs were left out)."""
        out = _json(self)
        return out if self.left_out else {k: v for k, v in out.items() if k != "left_out"}

    @classmethod
    def from_json(cls, row: dict) -> EngineRecord:
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


def rows_json(rows: dict[str, EngineCheckRow]) -> dict[str, dict[str, Any]]:
    """{domain: row.to_json()}: the step's "domains"."""
    return {domain: row.to_json() for domain, row in rows.items()}
