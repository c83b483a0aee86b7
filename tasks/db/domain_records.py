"""A run's planned domain as a typed record, for the readers of its domain_configs row
(tasks.db.queries_engine_checks: planned_domains, enabled_domains) and those that take what they
read (the engine check and its sampling test on vLLM, `specdec engine validate`, the monitor's
promises): the columns they use, named. Its JSON (to_json) is those columns, key for key, where a
caller hands the row on as JSON."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class PlannedDomain:
    """One domain of a run as its plan left it (its domain_configs row): whether it is on, the
    drafter's label and spec ({kind, params}), the batch-1 K, the predicted speedup, whether it is
    on in the champion config the plan compared against, and the planner's reason."""

    domain: str
    enabled: bool = False
    drafter: str | None = None
    k: int | None = None
    drafter_spec: dict | None = None
    predicted_speedup: float | None = None
    champion_on: bool | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_row(cls, row) -> PlannedDomain:
        """The record of a domain_configs row (a mapping with every column)."""
        return cls(**{f.name: row[f.name] for f in fields(cls)})
