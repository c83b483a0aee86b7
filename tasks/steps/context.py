"""A run's spec and its context.

RunSpec is what Airflow hands from task to task (XCom, JSON): the run id, the target and the
settings the run was asked for. The sample step freezes the candidate drafters into it
(`freeze_candidates`): the configured candidates and the drafts registered in MLflow at that moment,
each a pinned `models:/NAME/VERSION`. Estimate, confirm and validate therefore see the same
candidates even when a draft is registered while the run is under way. The frozen list is also kept
in the run's eval_runs.params, for steps handed a spec that does not carry it (the CLI's
`specdec engine check RUN_ID`).

RunContext is what one step works with, built once per step call from the spec
(`RunContext.build`): settings, database URL and engine, the target model, its tokenizer and
fingerprint, and the candidate drafters built from the frozen list. Models and drafters are
loaded once per process (every task of `dag.test()` or `specdec evaluate` shares them).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sqlalchemy.engine import Engine

from ..db.queries_runs import run_params
from ..db.store import Store
from ..settings import DEFAULT_MODEL, Settings, load_settings
from .candidates import build_drafters, candidate_label, parse_candidate
from .draft_training import registered_drafts, trained_request_ids
from .offline_estimate import load_sample_requests
from .suffix_index import domain_drafters, indexed_request_ids

log = logging.getLogger(__name__)


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
    k_max: int | None = None            # the setting eval_k_max (largest K planned and profiled)
    min_speedup: float | None = None
    promote: bool = False
    overrides: dict = field(default_factory=dict)     # any other Settings field
    # registered drafts frozen at sample time, by target fingerprint ({} when the run takes none);
    # None: not frozen yet
    drafts: dict[str, list[dict]] | None = None

    def settings(self) -> Settings:
        """The run's settings (read from the environment each call: a step calls it once)."""
        values = dict(self.overrides)
        for name in ("min_per_domain", "max_per_domain", "hardware_profile", "min_speedup"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.candidates:
            values["candidates"] = tuple(self.candidates)
        if self.k_max:
            values["eval_k_max"] = self.k_max
        return load_settings(**values)

    def open_store(self, settings: Settings | None = None) -> Store:
        """The run's database (db_url, else the settings', else the default): what a step entry
        point opens once (tasks.db.store.Store.open)."""
        return Store.open(self.db_url, settings or self.settings())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, value) -> "RunSpec":
        return value if isinstance(value, RunSpec) else cls(**value)


def freeze_candidates(spec: RunSpec, settings: Settings | None = None) -> RunSpec:
    """The spec with its candidates frozen: the configured ones, and the drafts registered for the
    target now (by fingerprint, each a pinned version). A frozen spec is returned as it is."""
    if spec.drafts is not None:
        return spec
    settings = settings or spec.settings()
    drafts = (registered_drafts(spec.target, spec.tracking_uri)
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


# ------------------------------------------------------------------------------------------------
# models: loaded once per process, keyed by (target, device)
_MODELS: dict[tuple[str, str | None], dict] = {}


def use_model(target: str, model, tokenizer=None, device: str | None = None) -> None:
    """Make an already loaded model the one steps use for `target` (tests, notebooks)."""
    _MODELS[(target, device)] = {"model": model, "tokenizer": tokenizer}


def loaded_model(target: str, device: str | None = None):
    """The model this process already loaded for (target, device); None (none is loaded)."""
    entry = _MODELS.get((target, device))
    return None if entry is None else entry["model"]


def _model_entry(target: str, device: str | None) -> dict:
    entry = _MODELS.get((target, device))
    if entry is None:
        from specdec_core import load_model  # torch and transformers: only the steps that run the model

        model, tokenizer = load_model(target, device=device)
        entry = _MODELS[(target, device)] = {"model": model, "tokenizer": tokenizer}
    if "fingerprint" not in entry:    # a digest of every weight: computed once per process
        from specdec_core.validation import fingerprint_id, target_fingerprint

        entry["target_fingerprint"] = target_fingerprint(entry["model"])
        entry["fingerprint"] = fingerprint_id(entry["target_fingerprint"])
    return entry


def preload_model(target: str, device: str | None = None) -> None:
    """Load the target now (once per process): a target that is not a model fails here, in one
    line, before a run's first step."""
    _model_entry(target, device)


def context_tokens(model) -> int | None:
    """The target's context in tokens (its config's max_position_embeddings); None: not stated."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


@dataclass
class RunContext:
    """What a step of one run works with; built once per step call (`RunContext.build`)."""

    spec: RunSpec
    settings: Settings
    store: Store                      # the run's database, opened once by build
    model: Any
    tokenizer: Any
    fingerprint: str                  # fingerprint id of the target
    target_fingerprint: dict          # the full fingerprint (digest and canary log-probabilities)
    candidates: tuple                 # the frozen candidates: configured ones, then registered drafts
    drafters: dict[str, tuple[dict, Any]]   # {label: (spec, drafter)}
    _by_domain: dict = field(default_factory=dict, repr=False)
    _trained_on: set[str] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, spec) -> "RunContext":
        spec = RunSpec.of(spec)
        settings = spec.settings()
        store = spec.open_store(settings)
        if spec.candidates is None:
            # a spec made after the fact (the CLI's engine check): the run's own candidates, which
            # its plan names, not the settings' of today
            stored = stored_candidates(store, spec.run_id)
            if stored:
                spec = replace(spec, candidates=list(stored))
                settings = spec.settings()
                store = replace(store, settings=settings)     # the Store carries the run's settings
        entry = _model_entry(spec.target, spec.device)
        drafts = spec.drafts
        if drafts is None:
            drafts = stored_drafts(store, spec.run_id)
        if drafts is None:      # a run sampled before candidates were frozen: listed now
            log.warning("run %s: no frozen candidate list (sample the run again to freeze one); "
                        "listing registered drafts now", spec.run_id)
            drafts = (registered_drafts(spec.target, spec.tracking_uri)
                      if settings.plan.auto_draft_candidates else {})
        candidates = tuple(settings.plan.candidates) + tuple(drafts.get(entry["fingerprint"], []))
        key = tuple(candidate_label(parse_candidate(c)) for c in candidates)
        built = entry.setdefault("drafters", {})
        if key not in built:
            built[key] = build_drafters(candidates, entry["model"], entry["tokenizer"], spec.tracking_uri)
        return cls(spec=spec, settings=settings, store=store, model=entry["model"],
                   tokenizer=entry["tokenizer"], fingerprint=entry["fingerprint"],
                   target_fingerprint=entry["target_fingerprint"], candidates=candidates,
                   drafters=built[key])

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def url(self) -> str:
        """The run's database URL (for the steps that still take one)."""
        return self.store.url

    @property
    def engine(self) -> Engine:
        """The run's database engine (for the queries that still take one)."""
        return self.store.engine

    @property
    def trained_on(self) -> set[str]:
        """Request ids that a candidate draft was trained on: never scored in this run."""
        if self._trained_on is None:
            uris = [s["params"]["model"] for s, _ in self.drafters.values()
                    if s["kind"] in ("draft_model", "head", "eagle3")
                    and str(s["params"].get("model", "")).startswith("models:/")]
            self._trained_on = trained_request_ids(self.store, uris)
        return self._trained_on

    def sample_requests(self, domains: list[str]):
        """(requests by domain, excluded) of the run's sample in these domains, scored by this
        target: other fingerprints, training rows of a candidate draft and rows inside a
        candidate's registered suffix index left out."""
        return load_sample_requests(self.run_id, self.store, domains=domains, tokenizer=self.tokenizer,
                                    fingerprint=self.fingerprint, exclude_ids=self.trained_on,
                                    indexed_ids=indexed_request_ids(self.drafters),
                                    max_tokens=context_tokens(self.model),
                                    max_prompt_tokens=self.settings.quality.max_prompt_tokens)

    def domain_requests(self, domain: str):
        """(requests, excluded) of one domain; read once per context."""
        if domain not in self._by_domain:
            requests, excluded = self.sample_requests([domain])
            self._by_domain[domain] = (requests.get(domain, []), excluded)
        return self._by_domain[domain]

    def domain_drafters(self, domain: str) -> dict:
        """The run's candidates for one domain: a suffix candidate without an index of its own
        gets the run's index of this domain (tasks.steps.suffix_index)."""
        return domain_drafters(self.drafters, self.run_id, domain, self.store, self.fingerprint,
                               self.tokenizer, self.model)
