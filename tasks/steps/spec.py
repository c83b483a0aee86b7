"""A run's spec: what Airflow hands from task to task (XCom, JSON).

RunSpec holds the run id, the target and the settings the run was asked for. The sample step
freezes the candidate drafters into it (`freeze_candidates`): the configured candidates and the
drafts registered in MLflow at that moment, each a pinned `models:/NAME/VERSION`. Estimate,
confirm and validate therefore see the same candidates even when a draft is registered while the
run is under way. The frozen list is also kept in the run's eval_runs.params, for steps handed a
spec that does not carry it (the CLI's `specdec engine check RUN_ID`).

This module loads no model and imports neither torch nor transformers: the database and registry
steps (sample, check, register, promote, report) start with it alone. What the steps that run the
model work with is tasks.steps.context.RunContext.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..db.queries_runs import run_params
from ..db.store import Store
from ..registry.registry import Registry
from ..settings import DEFAULT_MODEL, Settings, load_settings


@dataclass
class RunSpec:
    """Everything a step needs besides the database contents (Airflow passes it through XCom)."""

    run_id: str
    target: str = DEFAULT_MODEL
    device: str | None = None
    db_url: str | None = None
    tracking_uri: str | None = None
    domains: list[str] | None = None
    window_days: float | None = None
    min_per_domain: int | None = None
    max_per_domain: int | None = None
    candidates: list[str] | None = None
    hardware_profile: str | None = None
    k_max: int | None = None            # the setting plan_k_max (largest K planned and profiled)
    min_speedup: float | None = None
    promote: bool = False
    overrides: dict = field(default_factory=dict)     # any other setting, by name
    # registered drafts frozen at sample time, by target fingerprint ({} when the run takes none);
    # None: not frozen yet
    drafts: dict[str, list[dict]] | None = None

    def settings(self) -> Settings:
        """The run's settings (read from the environment each call: a step calls it once)."""
        values = dict(self.overrides)
        for name, setting in (("min_per_domain", "sample_min_per_domain"),
                              ("max_per_domain", "sample_max_per_domain"),
                              ("hardware_profile", "plan_hardware_profile"),
                              ("min_speedup", "plan_min_speedup")):
            if getattr(self, name) is not None:
                values[setting] = getattr(self, name)
        if self.candidates:
            values["plan_candidates"] = tuple(self.candidates)
        if self.k_max:
            values["plan_k_max"] = self.k_max
        return load_settings(**values)

    def open_store(self, settings: Settings | None = None) -> Store:
        """The run's database (db_url, else the settings', else the default): what a step entry
        point opens once (tasks.db.store.Store.open)."""
        return Store.open(self.db_url, settings or self.settings())

    def open_registry(self, store: Store | None = None) -> Registry:
        """The run's MLflow tracking store (tracking_uri, else $MLFLOW_TRACKING_URI, else the
        default; never `store`'s database): what a step entry point opens once
        (tasks.registry.registry.Registry.open; nothing is contacted until it is used)."""
        return Registry.open(self.tracking_uri, store if store is not None else self.db_url)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, value) -> "RunSpec":
        return value if isinstance(value, RunSpec) else cls(**value)


def freeze_candidates(spec: RunSpec, settings: Settings | None = None,
                      registry: Registry | None = None) -> RunSpec:
    """The spec with its candidates frozen: the configured ones, and the drafts registered for the
    target now (by fingerprint, each a pinned version). A frozen spec is returned as it is.
    registry: the tracking store (default: the spec's, spec.open_registry())."""
    if spec.drafts is not None:
        return spec
    from ..registry.drafts import registered_drafts     # the tracking client: only the sample step

    settings = settings or spec.settings()
    drafts = (registered_drafts(spec.target, registry or spec.open_registry())
              if settings.plan.auto_draft_candidates else {})
    return replace(spec, candidates=list(settings.plan.candidates), drafts=drafts)


def stored_drafts(store: Store, run_id: str) -> dict[str, list[dict]] | None:
    """The drafts the sample step froze into the run's eval_runs.params; None when it did not."""
    drafts = run_params(store, run_id).get("drafts")
    return None if drafts is None else dict(drafts)


def stored_candidates(store: Store, run_id: str) -> list[str] | None:
    """The configured candidates the run was sampled with (eval_runs.params); None when it kept
    none (the settings' then apply)."""
    return run_params(store, run_id).get("candidates") or None
