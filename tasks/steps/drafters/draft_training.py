"""Drafts trained on the traffic they serve: data, training, registration, selection.

- Data: stored requests answered by this target (same fingerprint) in a time window, per domain
  or pooled; split train / validation / held-out by hashes of (training id, request id). The
  split is recorded in draft_training_requests, and an evaluation never scores the training rows
  of a draft it evaluates (tasks.steps.pipeline excludes them).
- Kinds: one typed recipe each (tasks.steps.drafters.draft_recipes): `draft_model` (a small causal LM),
  `head` (a draft head on the target's hidden states) or `eagle3` (an EAGLE-3 head saved in the
  speculators format vLLM and SGLang load); each recipe trains itself (its train()). All share
  the data (TrainingData), split, optimiser loop, checkpoints and registration below; a version's
  tag `kind` says which.
- Training: specdec_core.train (checkpoints under $SPECDEC_HOME/drafts/<train id>/: re-running
  the same training id resumes); the best checkpoint by predicted speedup on the validation rows
  is kept, and the held-out rows score it once: what the record and the registry report.
- Registration: an MLflow run in experiment `specdec/<target-slug>` (tag specdec.draft_train_id)
  whose `draft/` artifact (weights, config, the target's tokenizer) is registered as a version of
  `specdec-draft-<target-slug>` with alias `candidate` and its lineage as tags.
- Selection: draft_candidates() (tasks.registry.drafts, re-exported here) lists the registered
  drafts of this target's fingerprint (alias `candidate`, else the newest version); evaluations
  add them to their candidates, and
  resolve_model_uri() downloads a version to $SPECDEC_HOME/models/drafts/ before specdec_core
  loads it.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from mlflow.exceptions import MlflowException

from specdec_core import SamplingParams, load_model
from specdec_core.estimate import (LoggedRequest, in_heldout, in_validation,  # noqa: F401 - in_heldout re-exported
                                   round_robin, split_hash, validation_key)
from specdec_core.validation import fingerprint_id, target_fingerprint

from ...db import queries_drafts as q
from ...db.queries_window import newest_request_at
from ...db.store import Store
from ...errors import SampleError
from ...registry.drafts import (CANDIDATE_ALIAS, draft_candidates,  # noqa: F401 - re-exported
                                draft_model_name, registered_drafts)
from ...registry.tracking import experiment_for_target
from ...registry.registry import Registry
from ...paths import check_identifier, home_path
from ...settings import DEFAULT_MODEL
from ...timeutil import utcnow
from .draft_recipes import DraftModelRecipe, DraftRecipe, DraftTrainingError, TrainingData, TrainingRun
from ..estimate.offline_estimate import request_token_ids

log = logging.getLogger(__name__)

TRAIN_TAG = "specdec.draft_train_id"


def _stored_requests(store: Store, fingerprint: str, tokenizer, domains, start, generated: bool,
                     end=None):
    """[(LoggedRequest, the logged request it was generated from or None)] of this target's
    stored rows since `start`: production traffic, or (generated) the rows the target generated
    (tasks.steps.traffic.traffic_generate)."""
    requests = []
    for row in q.target_traffic_rows(store, fingerprint, domains, start, generated, end):
        prompt, response = request_token_ids(row, tokenizer)
        if len(response) >= 2:
            requests.append((LoggedRequest(row.id, prompt, response, SamplingParams(
                temperature=row.temperature, top_k=row.top_k or 0,
                top_p=row.top_p if row.top_p is not None else 1.0), row.domain), row.generated_from))
    return requests


def training_requests(store: Store, fingerprint: str, tokenizer=None, domains=None,
                      window_days: float | None = None, max_requests: int | None = None):
    """(requests [LoggedRequest], (window start, end)) of this target's stored production traffic
    (rows the target generated are never among them: generated_requests). The window ends at the
    newest request stamped at most future_tolerance_hours after now, as an evaluation's does
    (tasks.steps.traffic.traffic_sample.resolve_window): rows stamped later (a skewed clock) are left out."""
    tolerance = store.settings.sample.future_tolerance_hours
    newest, future = newest_request_at(store, utcnow() + timedelta(hours=tolerance))
    if future:
        log.warning("%d stored request(s) are stamped more than %g h in the future (setting "
                    "future_tolerance_hours): the training window ignores them", future, tolerance)
    if newest is None:
        raise SampleError("traffic_requests is empty: import traffic first (`specdec traffic import`)"
                          if not future else f"every stored request ({future}) is stamped in the "
                          "future: fix the clock that stamped them, or raise future_tolerance_hours")
    start = newest - timedelta(days=window_days) if window_days else datetime(1970, 1, 1)
    requests = [r for r, _ in _stored_requests(store, fingerprint, tokenizer, domains, start, False,
                                               newest)]
    if max_requests:
        requests = requests[:max_requests]
    if len(requests) < 10:
        raise DraftTrainingError(
            f"only {len(requests)} stored requests answered by this target (fingerprint {fingerprint})"
            f"{' in ' + str(list(domains)) if domains else ''}: a draft needs at least 10; import more "
            "traffic or widen the window")
    return requests, (start, newest)


def generated_requests(store: Store, fingerprint: str, tokenizer=None, domains=None,
                       start=None) -> list[tuple[LoggedRequest, str]]:
    """[(request, the logged request it was generated from)] of the rows this target generated
    for training (tasks.steps.traffic.traffic_generate) since `start`."""
    return _stored_requests(store, fingerprint, tokenizer, domains, start or datetime(1970, 1, 1),
                            True)


def _record(store: Store, train_id: str, values: dict, splits: dict[str, str] | None = None) -> None:
    with store.transaction() as tx:
        q.record_draft(tx, train_id, values, splits)


def _require(store: Store | None, what: str) -> None:
    if store is None:
        raise TypeError(f"{what}: pass the Store (tasks.db.store.Store.open) holding the stored "
                        "traffic and the drafts' records")


def train_id_of_run(run_id: str) -> str:
    """The training id of an Airflow run: its run id with `:` and `+` made file-name safe (the
    checkpoints live under $SPECDEC_HOME/drafts/<training id>/)."""
    return run_id.replace(":", "-").replace("+", "-")


@dataclass
class TrainingSplit:
    """The rows of one training: every stored request used, split train / validation /
    held-out, and the generated rows that joined the training split."""

    requests: list                    # [LoggedRequest] of production traffic, every split
    train: list                       # [LoggedRequest] trained on (generated ones among them)
    heldout: list                     # [LoggedRequest] never trained on, score the checkpoint kept
    splits: dict                      # request id -> "train" | "validation" | "heldout"
    window: tuple                     # (start, end) of the stored traffic used
    split_key: str                    # the training id whose hash split the rows
    generated: int = 0                # generated rows trained on
    generated_left_out: int = 0       # generated from a held-out or validation request: left out
    validation: list = field(default_factory=list)   # never trained on, choose the checkpoint


def validation_ids(split_key: str, candidates: list[str], fraction: float) -> set[str]:
    """The ids of `candidates` (the rows not held out) kept for validation: in_validation's, or
    the one with the lowest validation hash where none is (a curve needs a row). Fixed by the
    split key and the rows, so a re-run resumes on the same split."""
    chosen = {i for i in candidates if in_validation(split_key, i, fraction)}
    if not chosen and len(candidates) > 1:
        chosen = {min(candidates, key=lambda i: split_hash(validation_key(split_key), i))}
    return chosen


def split_training_rows(train_id: str, data: TrainingData, store: Store, fingerprint: str,
                        tokenizer) -> TrainingSplit:
    """This target's stored rows for `data`, split train / held-out by request id (by
    data.split_from's id when given); the generated rows join the training split when asked."""
    requests, (start, end) = training_requests(store, fingerprint, tokenizer, data.domains,
                                               data.window_days, data.max_requests)
    split_key = data.split_from or train_id
    splits = {r.request_id: ("heldout" if in_heldout(split_key, r.request_id, data.heldout_fraction)
                             else "train") for r in requests}
    kept = validation_ids(split_key, [i for i, s in splits.items() if s == "train"],
                          data.validation_fraction)
    splits.update(dict.fromkeys(kept, "validation"))
    train = [r for r in requests if splits[r.request_id] == "train"]
    validation = [r for r in requests if splits[r.request_id] == "validation"]
    heldout = [r for r in requests if splits[r.request_id] == "heldout"]
    generated, left_out = [], 0
    if data.include_generated:
        for request, source in generated_requests(store, fingerprint, tokenizer, data.domains, start):
            # a held-out or validation prompt answered again would be trained on
            if in_heldout(split_key, source, data.heldout_fraction) or source in kept:
                left_out += 1
            else:
                generated.append(request)
                splits[request.request_id] = "train"
        train += generated
    if not heldout or not train or not validation:
        raise DraftTrainingError(f"{len(requests)} requests split into {len(train)} train / "
                                 f"{len(validation)} validation / {len(heldout)} held-out: change "
                                 f"heldout_fraction ({data.heldout_fraction}) or validation_fraction "
                                 f"({data.validation_fraction}), or add traffic")
    return TrainingSplit(requests, train, heldout, splits, (start, end), split_key, len(generated),
                         left_out, validation)


def _record_start(store: Store, train_id: str, target: str, fingerprint: str, recipe: DraftRecipe,
                  data: TrainingData, split: TrainingSplit) -> None:
    """The training's record (status `training`, lineage, parameters) and its split."""
    params = {"kind": recipe.kind, "heldout_fraction": data.heldout_fraction,
              "validation_fraction": data.validation_fraction,
              "validation_requests": len(split.validation),
              "split_from": split.split_key, "train": asdict(recipe.config),
              "include_generated": bool(data.include_generated),
              "generated_requests": split.generated, "generated_left_out": split.generated_left_out,
              **recipe.params()}
    start, end = split.window
    _record(store, train_id, {"status": "training", "target_id": target, "target_fingerprint": fingerprint,
                               "domains": sorted({r.domain for r in split.requests}),
                               "window_start": start, "window_end": end,
                               "train_requests": len(split.train),
                               "heldout_requests": len(split.heldout), "params": params,
                               "base_model": recipe.base_model(target)}, split.splits)


def train_draft_from_traffic(train_id: str, recipe: DraftRecipe | None = None,
                             data: TrainingData | None = None, target: str = DEFAULT_MODEL,
                             store: Store | None = None, registry: Registry | None = None,
                             device: str | None = None, model=None, tokenizer=None,
                             register: bool = True, progress: bool = True) -> dict:
    """Build the data, train the recipe (resuming a previous attempt of the same id), register.
    recipe: what to train (tasks.steps.drafters.draft_recipes; default DraftModelRecipe()); data: which
    rows (default TrainingData()). Output: {"train_id", "train_requests", "heldout_requests",
    "best", "steps", "best_dir", "model_uri", "version", "fingerprint", "kind",
    "generated_requests", "result"}."""
    check_identifier(train_id, "draft id")     # it names $SPECDEC_HOME/drafts/<train_id>
    recipe, data = recipe or DraftModelRecipe(), data or TrainingData()
    if model is None:
        model, tokenizer = load_model(target, device=device)
    fingerprint = fingerprint_id(target_fingerprint(model))
    recipe = recipe.prepare(model, target)
    _require(store, "train_draft_from_traffic")
    split = split_training_rows(train_id, data, store, fingerprint, tokenizer)
    _record_start(store, train_id, target, fingerprint, recipe, data, split)
    result = recipe.train(TrainingRun(train_id, target, fingerprint, model, split.train,
                                      round_robin(split.validation, data.max_eval_requests),
                                      home_path("drafts", train_id), progress,
                                      report=round_robin(split.heldout, data.max_eval_requests)))
    best_dir = Path(result.best_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(best_dir)
    out = {"train_id": train_id, "train_requests": len(split.train),
           "validation_requests": len(split.validation),
           "heldout_requests": len(split.heldout), "best": result.best, "heldout": result.report,
           "steps": result.step, "best_dir": str(best_dir), "model_uri": None, "version": None,
           "fingerprint": fingerprint, "kind": recipe.kind, "generated_requests": split.generated,
           "result": json.loads(json.dumps(result.to_dict(), default=float))}
    # trained: the checkpoint is kept (register_draft moves it on to "registered")
    _record(store, train_id, {"heldout": out["result"]["report"], "status": "trained"})
    if register:
        out.update(register_draft(train_id, target, fingerprint, best_dir, out["result"], store,
                                  registry))
    return out


def register_draft(train_id: str, target: str, fingerprint: str, best_dir, result: dict,
                   store: Store | None = None, registry: Registry | None = None) -> dict:
    """Log the draft and its lineage to MLflow and register it (alias `candidate`); idempotent.
    result: TrainResult.to_dict() of the training."""
    registry = _registry(registry, store)
    mlflow_run_id = log_draft(train_id, target, fingerprint, best_dir, result, store, registry)
    return register_logged_draft(train_id, target, fingerprint, mlflow_run_id, result, store,
                                 registry)


def _lineage(store: Store, train_id: str, target: str, fingerprint: str) -> tuple[dict, dict]:
    """(the training's record, its lineage as MLflow params)."""
    record = q.draft_record(store, train_id)
    return record, {"target": target, "target_fingerprint": fingerprint,
                    "window_start": record["window_start"].isoformat(),
                    "window_end": record["window_end"].isoformat(),
                    "domains": ",".join(record["domains"] or []), "train_requests": record["train_requests"],
                    "heldout_requests": record["heldout_requests"],
                    "train_params": json.dumps(record["params"], sort_keys=True)[:6000]}


def log_draft(train_id: str, target: str, fingerprint: str, best_dir, result: dict,
              store: Store | None = None, registry: Registry | None = None) -> str:
    """Upload the draft (the files in best_dir), its lineage and held-out curve to the MLflow run
    tagged with the training id (created once; idempotent); the MLflow run id. Runs where the
    draft was trained: the registration (register_logged_draft) then needs no local file, so it
    may run on another machine."""
    _require(store, "log_draft")
    mlflow_client = _registry(registry, store).client
    _, lineage = _lineage(store, train_id, target, fingerprint)
    experiment_id = experiment_for_target(mlflow_client, target)
    runs = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{TRAIN_TAG}` = '{train_id}'",
                                     max_results=1)
    run_id = runs[0].info.run_id if runs else mlflow_client.create_run(
        experiment_id, run_name=f"draft {train_id}", tags={TRAIN_TAG: train_id}).info.run_id
    logged = mlflow_client.get_run(run_id).data.params
    for key, value in lineage.items():
        if key not in logged:
            mlflow_client.log_param(run_id, key, str(value))
    # the curve on the validation rows (which chose the checkpoint), the kept checkpoint's
    # held-out scores once, at its step
    scored = [("validation", entry) for entry in result["history"]]
    if result.get("report"):
        scored.append(("heldout", result["report"]))
    for split, entry in scored:
        mlflow_client.log_metric(run_id, f"{split}_kl", entry["heldout_kl"], step=entry["step"])
        mlflow_client.log_metric(run_id, f"{split}_predicted_speedup", entry["predicted_speedup"],
                                 step=entry["step"])
        for domain, scores in entry["domains"].items():
            mlflow_client.log_metric(run_id, f"{domain}.{split}_expected_tokens_per_round",
                                     scores["expected_tokens_per_round"], step=entry["step"])
    mlflow_client.log_artifacts(run_id, str(best_dir), artifact_path="draft")
    mlflow_client.set_tag(run_id, "specdec.heldout", json.dumps(reported(result)["domains"], default=float)[:4900])
    return run_id


def reported(result: dict) -> dict:
    """The scores a training reports (TrainResult.to_dict()'s): the kept checkpoint on the held-out
    rows, scored once; a result without them (trained before the validation split), its best."""
    return result.get("report") or result["best"]


def register_logged_draft(train_id: str, target: str, fingerprint: str, mlflow_run_id: str,
                          result: dict, store: Store | None = None,
                          registry: Registry | None = None) -> dict:
    """Register the draft that log_draft uploaded to MLflow run `mlflow_run_id` as a version of
    `specdec-draft-<target>` (alias `candidate`; reused on retry). Reads no local file."""
    _require(store, "register_logged_draft")
    mlflow_client = _registry(registry, store).client
    record, lineage = _lineage(store, train_id, target, fingerprint)
    run_id = mlflow_run_id
    name = draft_model_name(target)
    try:
        mlflow_client.get_registered_model(name)
    except MlflowException:
        mlflow_client.create_registered_model(name, description=f"specdec drafts trained for {target}")
    existing = mlflow_client.search_model_versions(f"name='{name}' and tag.train_id='{train_id}'")
    kind = (record["params"] or {}).get("kind", "draft_model")
    heldout = reported(result)
    tags = {"train_id": train_id, "kind": kind, "target_fingerprint": fingerprint, "domains": lineage["domains"],
            "window": f"{lineage['window_start']}..{lineage['window_end']}",
            "heldout_predicted_speedup": f"{heldout['predicted_speedup']:.3f}",
            "heldout_k": str(heldout["k"]),
            "validation_predicted_speedup": f"{result['best']['predicted_speedup']:.3f}",
            # the data rows: logged requests trained on (generated ones among them) and held out
            "train_requests": str(record["train_requests"]),
            "heldout_requests": str(record["heldout_requests"]),
            "validation_requests": str((record["params"] or {}).get("validation_requests", 0)),
            "generated_requests": str((record["params"] or {}).get("generated_requests", 0))}
    if kind in ("head", "eagle3"):
        tags["vocab_size"] = str((record["params"] or {}).get("vocab_size") or "full")
        tags["unroll"] = str((record["params"] or {}).get("unroll") or 1)
    if kind == "eagle3":
        layer_ids = (record["params"] or {}).get("layer_ids")
        tags["layer_ids"] = ",".join(map(str, layer_ids or []))
        tags["format"] = "speculators"
    description = ("Draft trained on logged traffic. Held-out (offline estimate of the kept checkpoint, "
                   "on requests neither trained on nor used to choose it):\n\n"
                   "| domain | E[tokens/round] | K | predicted speedup |\n|---|---|---|---|\n"
                   + "\n".join(f"| {d} | {s['expected_tokens_per_round']:.3f} | {s['k']} | "
                               f"{s['predicted_speedup']:.2f}x |" for d, s in heldout["domains"].items()))
    if existing:
        version = str(existing[0].version)
    else:
        version = str(mlflow_client.create_model_version(
            name, source=f"runs:/{run_id}/draft", run_id=run_id, tags=tags, description=description).version)
    mlflow_client.set_registered_model_alias(name, CANDIDATE_ALIAS, version)
    uri = f"models:/{name}/{version}"
    _record(store, train_id, {"status": "registered", "version": version, "model_uri": uri})
    return {"model_uri": uri, "version": version, "mlflow_run_id": run_id}


def _registry(registry: Registry | None, store: Store) -> Registry:
    """The caller's Registry, else the default one (never `store`'s database)."""
    return registry if registry is not None else Registry.open(store=store)


def resolve_model_uri(uri: str, registry: Registry | None = None) -> str:
    """A local directory holding the registered version (downloaded once under $SPECDEC_HOME).
    registry: where it is registered (default Registry.open(); used only to download)."""
    name, _, version = uri[len("models:/"):].partition("/")
    if not name or not version:
        raise DraftTrainingError(f"model URI {uri!r}: expected models:/NAME/VERSION")
    local = home_path("models", "drafts", name, version)
    if (local / "config.json").exists() or (local / "head_config.json").exists():
        return str(local)
    mlflow_client = (registry or Registry.open()).client
    detail = mlflow_client.get_model_version(name, version)
    tmp = local.with_name(version + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    path = Path(mlflow_client.download_artifacts(detail.run_id, "draft", str(tmp)))
    shutil.rmtree(local, ignore_errors=True)
    path.rename(local)
    shutil.rmtree(tmp, ignore_errors=True)
    return str(local)


def trained_request_ids(store: Store, model_uris: list[str]) -> set[str]:
    """Request ids the drafts behind these model URIs were trained on, and the logged requests
    whose prompts the generated rows among them answered (the draft has seen those prompts)."""
    if not model_uris:
        return set()
    return q.trained_request_ids(store, model_uris)
