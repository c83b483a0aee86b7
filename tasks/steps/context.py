"""A run's context: what the steps that run the model work with.

RunSpec (tasks.steps.spec, re-exported here) is what Airflow hands from task to task.
RunContext is what one step works with, built once per step call from the spec
(`RunContext.build`): settings, the Store, the Registry, the target model, its tokenizer and
fingerprint, and the candidate drafters built from the frozen list. Models and drafters are
loaded once per process (every task of `dag.test()` or `specdec evaluate` shares them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from specdec_core import load_model
from specdec_core.validation import fingerprint_id, target_fingerprint

from ..db.store import Store
from ..registry.drafts import registered_drafts
from ..registry.registry import Registry
from ..settings import Settings
from .drafters.candidates import build_drafters, candidate_label, parse_candidate
from .drafters.draft_training import trained_request_ids
from .estimate.offline_estimate import load_sample_requests
from .spec import RunSpec, freeze_candidates, stored_candidates, stored_drafts  # noqa: F401 - re-exported
from .drafters.suffix_index import domain_drafters, indexed_request_ids

log = logging.getLogger(__name__)


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
        model, tokenizer = load_model(target, device=device)
        entry = _MODELS[(target, device)] = {"model": model, "tokenizer": tokenizer}
    if "fingerprint" not in entry:    # a digest of every weight: computed once per process
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
    registry: Registry                # the run's MLflow tracking store, opened once by build
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
        registry = spec.open_registry(store)
        entry = _model_entry(spec.target, spec.device)
        drafts = spec.drafts
        if drafts is None:
            drafts = stored_drafts(store, spec.run_id)
        if drafts is None:      # a run sampled before candidates were frozen: listed now
            log.warning("run %s: no frozen candidate list (sample the run again to freeze one); "
                        "listing registered drafts now", spec.run_id)
            drafts = (registered_drafts(spec.target, registry)
                      if settings.plan.auto_draft_candidates else {})
        candidates = tuple(settings.plan.candidates) + tuple(drafts.get(entry["fingerprint"], []))
        key = tuple(candidate_label(parse_candidate(c)) for c in candidates)
        built = entry.setdefault("drafters", {})
        if key not in built:
            built[key] = build_drafters(candidates, entry["model"], entry["tokenizer"], registry)
        return cls(spec=spec, settings=settings, store=store, registry=registry, model=entry["model"],
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
        gets the run's index of this domain (tasks.steps.drafters.suffix_index)."""
        return domain_drafters(self.drafters, self.run_id, domain, self.store, self.fingerprint,
                               self.tokenizer, self.model)
