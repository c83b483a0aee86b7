"""The promoted config: one pydantic schema (docs/design.md, "Public contracts").

    {schema_version, target: {id, fingerprint}, hardware_profile, run_id, created_at,
     domains: {NAME: {enabled, drafter, k, max_batch_size, k_schedule, conditional_acceptance,
                      mean_accepted_length, predicted_speedup, predicted_speedup_ci95,
                      measured_speedup, samples (requests)}},
     default: {enabled: false}}

Schema version 2 adds `k_schedule`: [[first batch size, last batch size, K], ...], ascending and
contiguous from batch size 1, K = 0 where speculation stops paying (K by batch size, as serving
engines take it); an enabled domain's max_batch_size is then the last batch size with K > 0.
Version 1 configs (no schedule: K up to max_batch_size) still read.

`drafter` is {kind: prompt_lookup | suffix | layer_skip | draft_model, params, model_uri
("models:/...": a registered draft_model, or a suffix drafter's registered index)}. A suffix
drafter without model_uri uses an index built per domain from the traffic. Beside the design's fields a domain carries `validation` (passed | failed |
not_needed) and `source` ("run": measured in this run; "champion": an insufficient domain that
kept the champion's setting; "off": insufficient with no champion to keep).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import SpecdecTaskError

SCHEMA_VERSION = 2


class ConfigError(SpecdecTaskError, ValueError):
    """A config does not satisfy the schema; the message lists every problem with its field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DrafterSpec(_Strict):
    kind: Literal["prompt_lookup", "suffix", "layer_skip", "draft_model", "head", "eagle3"]
    params: dict = Field(default_factory=dict)
    model_uri: str | None = None

    @model_validator(mode="after")
    def _model_uri_only_for_models_and_indexes(self) -> "DrafterSpec":
        if self.model_uri is not None and self.kind not in ("draft_model", "suffix", "head", "eagle3"):
            raise ValueError(f"model_uri is only for draft_model, head, eagle3 and suffix drafters, "
                             f"not {self.kind}")
        if self.model_uri is not None and not self.model_uri.startswith("models:/"):
            raise ValueError(f"model_uri {self.model_uri!r} must be an MLflow models:/ URI")
        return self


Rate = Annotated[float, Field(ge=0.0, le=1.0)]


class DomainSetting(_Strict):
    enabled: bool
    drafter: DrafterSpec | None = None
    k: int = Field(default=0, ge=0)
    max_batch_size: int | None = Field(default=None, ge=1)
    k_schedule: list[tuple[int, int, int]] = Field(default_factory=list)
    conditional_acceptance: list[Rate] = Field(default_factory=list)
    mean_accepted_length: float | None = Field(default=None, ge=1.0)
    predicted_speedup: float | None = Field(default=None, gt=0)
    predicted_speedup_ci95: tuple[float, float] | None = None
    measured_speedup: float | None = Field(default=None, gt=0)
    samples: int = Field(default=0, ge=0)
    validation: Literal["passed", "failed", "not_needed", "incomplete"] | None = None
    source: Literal["run", "champion", "off"] = "run"
    note: str | None = None      # e.g. "kept on: within hysteresis" (the planner's reason)
    reason: str | None = Field(default=None, max_length=600)   # why on or off, in words

    @model_validator(mode="after")
    def _consistent(self) -> "DomainSetting":
        if self.enabled and (self.drafter is None or self.k < 1):
            raise ValueError("an enabled domain needs a drafter and k >= 1")
        if self.predicted_speedup_ci95 is not None:
            low, high = self.predicted_speedup_ci95
            if not 0 < low <= high:
                raise ValueError(f"predicted_speedup_ci95 {list(self.predicted_speedup_ci95)} must be "
                                 "0 < low <= high")
        if self.k_schedule:
            expected = 1
            for start, end, k in self.k_schedule:
                if start != expected or end < start or k < 0:
                    raise ValueError(f"k_schedule {[list(r) for r in self.k_schedule]}: ranges must "
                                     "run contiguously from batch size 1, each [first, last, K >= 0]")
                expected = end + 1
            paying = [end for _, end, k in self.k_schedule if k > 0]
            if self.enabled and self.max_batch_size != (max(paying) if paying else None):
                raise ValueError(f"max_batch_size {self.max_batch_size} != the last batch size with "
                                 f"K > 0 in k_schedule ({max(paying) if paying else None})")
        return self


class TargetRef(_Strict):
    id: str
    fingerprint: str


class DefaultSetting(_Strict):
    enabled: Literal[False] = False


class SpecdecConfig(_Strict):
    schema_version: Literal[1, 2] = SCHEMA_VERSION
    target: TargetRef
    hardware_profile: str
    run_id: str
    created_at: datetime
    domains: dict[str, DomainSetting]
    default: DefaultSetting = Field(default_factory=DefaultSetting)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    @property
    def domains_on(self) -> list[str]:
        return sorted(name for name, setting in self.domains.items() if setting.enabled)


def parse_config(data: dict | str) -> SpecdecConfig:
    """Validate a config (dict or JSON text); ConfigError lists each problem as field: message."""
    try:
        if isinstance(data, str):
            data = json.loads(data)
        return SpecdecConfig.model_validate(data)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config is not JSON: {exc}") from exc
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in error['loc']) or '(config)'}: {error['msg']}"
                             for error in exc.errors())
        raise ConfigError(f"invalid specdec config ({exc.error_count()} problems): {problems}") from exc


def target_slug(target_id: str) -> str:
    """Lowercase, [a-z0-9-] only, '/' becomes '--' (docs/design.md)."""
    slug = target_id.lower().replace("/", "--")
    slug = re.sub(r"[^a-z0-9-]+", "-", slug)
    return slug.strip("-") or "target"


def config_model_name(target_id: str) -> str:
    return f"specdec-config-{target_slug(target_id)}"
