"""The drafts registered in MLflow for a target, as an evaluation's candidates.

A draft trained on the traffic (tasks.steps.drafters.draft_training) is a version of the registered model
`specdec-draft-<target-slug>`, tagged with the target fingerprint it was trained against and its
kind. An evaluation offers, per fingerprint and kind, the version with alias `candidate`, else
the newest one. Listing them needs the tracking client only (no model, no torch): the sample
step freezes them into the run's spec.
"""

from __future__ import annotations

import logging

from mlflow.exceptions import MlflowException

from ..errors import RegistryError
from ..masking import mask_text
from .config_schema import target_slug
from .registry import Registry

log = logging.getLogger(__name__)

CANDIDATE_ALIAS = "candidate"


def draft_model_name(target_id: str) -> str:
    return f"specdec-draft-{target_slug(target_id)}"


def registered_drafts(target: str, registry: Registry) -> dict[str, list[dict]]:
    """The drafts registered for this target now, as candidate specs by target fingerprint
    ({fingerprint: [{kind, params: {model: models:/NAME/VERSION}}]}): per kind, the version with
    alias `candidate`, else the newest of that kind. A version without a fingerprint is never
    offered. {} when there is no tracking store or it cannot be reached."""
    if registry.local_store_missing():
        return {}          # no local tracking store yet: nothing registered (and none created)
    try:
        versions = registry.client.search_model_versions(f"name='{draft_model_name(target)}'")
    except (MlflowException, RegistryError) as exc:    # unreachable: evaluate without them
        log.warning("no registered drafts listed (%s)", mask_text(str(exc)))
        return {}
    by_fingerprint: dict[str, list] = {}
    for version in versions:
        fingerprint = (version.tags or {}).get("target_fingerprint")
        if fingerprint:
            by_fingerprint.setdefault(fingerprint, []).append(version)
    offered: dict[str, list[dict]] = {}
    for fingerprint, of_target in sorted(by_fingerprint.items()):
        offered[fingerprint] = []
        for kind in sorted({(v.tags or {}).get("kind", "draft_model") for v in of_target}):
            of_kind = [v for v in of_target if (v.tags or {}).get("kind", "draft_model") == kind]
            chosen = [v for v in of_kind if CANDIDATE_ALIAS in (v.aliases or [])] or \
                [max(of_kind, key=lambda v: int(v.version))]
            offered[fingerprint] += [{"kind": kind, "params": {"model": f"models:/{v.name}/{v.version}"}}
                                     for v in chosen]
    return offered


def draft_candidates(target: str, fingerprint: str, registry: Registry | None = None) -> list[dict]:
    """Registered drafts for this target fingerprint, as candidate specs, per kind (draft_model,
    head): the version with alias `candidate`, else the newest of that kind. Drafts of another
    fingerprint are never offered. registry: default Registry.open()."""
    return registered_drafts(target, registry or Registry.open()).get(fingerprint, [])
