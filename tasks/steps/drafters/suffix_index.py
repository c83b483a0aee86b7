"""Suffix indexes over a domain's logged responses: built for an evaluation, or built and
registered in MLflow (`specdec-suffix-<target>`) for reuse, with their lineage.

An index used to score a request never contains that request:
- for an evaluation, a `suffix` candidate without an index gets, per domain, an index over the
  domain's stored responses of this target up to the end of the run's window, minus every request
  of the run's sample (the requests it scores); its request ids are recorded in
  draft_training_requests (draft `suffix-index:<run id>:<domain>`, split "index");
- a registered index carries its request ids in the file: an evaluation that uses it excludes
  them from scoring, as it does a draft's training rows.
"""

from __future__ import annotations

import logging
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from mlflow.exceptions import MlflowException

from specdec_core import load_model
from specdec_core.drafters import output_size
from specdec_core.suffix import SuffixIndex
from specdec_core.validation import fingerprint_id, target_fingerprint

from ...db.queries_suffix import (domain_traffic, newest_in_domain, production_domains,
                                  replace_index_requests, run_window_and_sample)
from ...db.store import Store
from ...errors import SpecdecTaskError
from ...registry.config_schema import target_slug
from ...registry.tracking import experiment_for_target
from ...registry.registry import Registry
from ...paths import home_path
from ...timeutil import utcnow
from ..estimate.offline_estimate import request_token_ids

log = logging.getLogger(__name__)

INDEX_ARTIFACT = "index"
INDEX_FILE = "suffix_index.npz"
# built per (database, run, domain, fingerprint) once per process: estimate, confirm and validate
# of one domain use the same index
_RUN_INDEXES: dict[tuple, object] = {}


class SuffixIndexError(SpecdecTaskError, ValueError):
    """A suffix index cannot be built or found (no traffic, bad URI)."""


def suffix_model_name(target: str) -> str:
    return f"specdec-suffix-{target_slug(target)}"


def index_sequences(store: Store, domain: str, fingerprint: str | None, tokenizer=None,
                    until: datetime | None = None, since: datetime | None = None,
                    exclude: set[str] | None = None) -> tuple[list[str], list[list[int]]]:
    """(request ids, response token ids) of a domain's stored requests answered by this target
    (rows of another fingerprint are left out), in [since, until], minus `exclude`; oldest first."""
    rows = _indexable(store, domain, fingerprint, tokenizer, until, since, exclude)
    return [row.id for row, _, _ in rows], [response for _, _, response in rows]


def _indexable(store: Store, domain: str, fingerprint: str | None, tokenizer, until: datetime | None,
               since: datetime | None, exclude: set[str] | None) -> list[tuple]:
    """[(row, prompt ids, response ids)] of index_sequences' requests, oldest first."""
    out = []
    for row in domain_traffic(store, domain, until=until, since=since):
        if exclude and row.id in exclude:
            continue
        if fingerprint is not None and row.target_fingerprint not in (None, fingerprint):
            continue
        prompt, response = request_token_ids(row, tokenizer)
        if len(response) >= 2:
            out.append((row, list(prompt), list(response)))
    return out


def run_history(run_id: str, domain: str, store: Store, fingerprint: str | None, tokenizer,
                count: int) -> list[tuple]:
    """The newest `count` of the requests the run's index of this domain holds (run_index: the
    domain's stored responses of this target up to the run's window end, less the run's sample),
    newest first, as [(row, prompt ids, response ids)]: the history a serving suffix tree holds."""
    if count <= 0:
        return []
    until, sampled = run_window_and_sample(store, run_id)
    rows = _indexable(store, domain, fingerprint, tokenizer, until, None, sampled)
    return rows[::-1][:count]


def build_index(request_ids: list[str], sequences: list[list[int]], meta: dict):
    return SuffixIndex.build(sequences, request_ids=request_ids, depth=32, meta=meta)


def run_index(run_id: str, domain: str, store: Store, fingerprint: str | None, tokenizer,
              vocab_size: int):
    """The index a `suffix` candidate without its own index uses in this run for this domain
    (see the module docstring); its request ids are recorded."""
    key = (store.url, run_id, domain, fingerprint)
    if key in _RUN_INDEXES:
        return _RUN_INDEXES[key]
    until, sampled = run_window_and_sample(store, run_id)
    ids, sequences = index_sequences(store, domain, fingerprint, tokenizer, until=until,
                                     exclude=sampled)
    index = build_index(ids, sequences, {"domain": domain, "run_id": run_id,
                                         "vocab_size": vocab_size, "target_fingerprint": fingerprint,
                                         "until": until.isoformat() if until else None})
    name = f"suffix-index:{run_id}:{domain}"
    with store.transaction() as tx:
        replace_index_requests(tx, name, ids)
    log.info("run %s, domain %s: suffix index over %d responses (%d tokens), the run's %d sampled "
             "requests left out", run_id, domain, len(ids), index.tokens, len(sampled))
    _RUN_INDEXES[key] = index
    return index


def domain_drafters(drafters: dict, run_id: str, domain: str, store: Store,
                    fingerprint: str | None, tokenizer, target) -> dict:
    """The run's candidates {label: (spec, drafter)} for one domain: a `suffix` candidate without
    an index of its own gets the run's index of this domain."""
    out = {}
    for label, (spec, drafter) in drafters.items():
        if drafter.takes_index and drafter.index is None:
            drafter = drafter.with_index(
                run_index(run_id, domain, store, fingerprint, tokenizer, output_size(target)))
        out[label] = (spec, drafter)
    return out


def indexed_request_ids(drafters: dict) -> set[str]:
    """Requests inside the candidates' own (registered) indexes: never scored with them."""
    ids: set[str] = set()
    for _, drafter in drafters.values():
        ids.update(drafter.indexed_requests())
    return ids


def timing_index(store: Store, fingerprint: str | None, tokenizer, vocab_size: int):
    """An index over every stored response of this target (all domains), for timing a suffix
    drafter at the size it will have: its lookups cost more with more indexed tokens."""
    ids, sequences = [], []
    for domain in production_domains(store):
        more_ids, more = index_sequences(store, domain, fingerprint, tokenizer)
        ids += more_ids
        sequences += more
    return build_index(ids, sequences, {"domain": "*", "vocab_size": vocab_size,
                                        "target_fingerprint": fingerprint})


def build_and_register(target: str, domain: str, store: Store,
                       registry: Registry | None = None, window_days: float | None = None,
                       model=None, tokenizer=None) -> dict:
    """Build a domain's index from its stored responses of this target (the last window_days
    days up to the newest request, or all) and register it as a version of
    specdec-suffix-<target> with its lineage. Output: {model_uri, version, requests, tokens}."""
    if model is None:
        model, tokenizer = load_model(target, device="cpu")

    fingerprint = fingerprint_id(target_fingerprint(model))
    newest = newest_in_domain(store, domain)
    if newest is None:
        raise SuffixIndexError(f"domain {domain!r} has no stored traffic: import traffic first "
                               "(specdec traffic import) or pick another domain")
    since = newest - timedelta(days=window_days) if window_days else None
    ids, sequences = index_sequences(store, domain, fingerprint, tokenizer, since=since)
    if not ids:
        raise SuffixIndexError(f"domain {domain!r}: no stored responses of this target "
                               f"(fingerprint {fingerprint}) to index")
    window = f"{since.isoformat() if since else 'start'}..{newest.isoformat()}"
    index = build_index(ids, sequences, {"domain": domain, "vocab_size": output_size(model),
                                         "target_fingerprint": fingerprint, "window": window})
    mlflow_client = (registry if registry is not None else Registry.open(store=store)).client
    experiment_id = experiment_for_target(mlflow_client, target)
    run = mlflow_client.create_run(experiment_id, run_name=f"suffix index {domain}",
                                   tags={"specdec.suffix_index": domain})
    lineage = {"domain": domain, "window": window, "requests": len(ids), "tokens": index.tokens,
               "target": target, "target_fingerprint": fingerprint}
    for key, value in lineage.items():
        mlflow_client.log_param(run.info.run_id, key, str(value))
    with tempfile.TemporaryDirectory() as tmp:
        index.save(Path(tmp) / INDEX_FILE)
        mlflow_client.log_artifacts(run.info.run_id, tmp, artifact_path=INDEX_ARTIFACT)
    mlflow_client.set_terminated(run.info.run_id)
    name = suffix_model_name(target)
    try:
        mlflow_client.get_registered_model(name)
    except MlflowException:
        mlflow_client.create_registered_model(
            name, description=f"specdec suffix indexes over {target}'s logged responses")
    version = str(mlflow_client.create_model_version(
        name, source=f"runs:/{run.info.run_id}/{INDEX_ARTIFACT}", run_id=run.info.run_id,
        tags={key: str(value) for key, value in lineage.items()},
        description=(f"Suffix index of domain {domain}: {len(ids)} responses, {index.tokens} tokens, "
                     f"window {window}, target fingerprint {fingerprint}.")).version)
    mlflow_client.set_registered_model_alias(name, domain.replace("_", "-") if domain else "latest",
                                             version)
    log.info("registered suffix index %s version %s (%d requests)", name, version, len(ids))
    return {"model_uri": f"models:/{name}/{version}", "version": version, "requests": len(ids),
            "tokens": index.tokens, "window": window, "created_at": utcnow().isoformat()}


def refresh_indexes(target: str, domains=None, store: Store | None = None,
                    registry: Registry | None = None, window_days: float | None = None) -> dict:
    """Build and register the index of every domain (default: each stored one); {domain: result}.
    The target is loaded once. `store` is required (a keyword default only because `domains`
    before it has one)."""
    if store is None:
        raise TypeError("refresh_indexes: pass the Store (tasks.db.store.Store.open) the indexes "
                        "are built from")
    stored = production_domains(store)
    model, tokenizer = load_model(target, device="cpu")
    registry = registry if registry is not None else Registry.open(store=store)
    return {domain: build_and_register(target, domain, store, registry, window_days, model,
                                       tokenizer)
            for domain in (domains or stored) if domain in stored}


def resolve_index_uri(uri: str, registry: Registry | None = None) -> str:
    """A local path of a registered index (`models:/NAME/VERSION`), downloaded once under
    $SPECDEC_HOME/models/suffix. registry: where it is registered (default Registry.open();
    used only to download)."""
    name, _, version = uri[len("models:/"):].partition("/")
    if not uri.startswith("models:/") or not name or not version:
        raise SuffixIndexError(f"index URI {uri!r}: expected models:/NAME/VERSION")
    local = home_path("models", "suffix", name, version, INDEX_FILE)
    if local.exists():
        return str(local)
    mlflow_client = (registry or Registry.open()).client
    detail = mlflow_client.get_model_version(name, version)
    local.parent.mkdir(parents=True, exist_ok=True)
    path = Path(mlflow_client.download_artifacts(detail.run_id, INDEX_ARTIFACT, str(local.parent)))
    found = path / INDEX_FILE if path.is_dir() else path
    if found != local:
        found.replace(local)
    return str(local)
