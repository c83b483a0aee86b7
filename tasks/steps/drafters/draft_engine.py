"""The engine's side of the draft recipes (tasks.steps.drafters.draft_recipes): the draft each kind
builds on the loaded target and its training, with specdec_core's training code. It loads torch:
draft_recipes, whose defaults a DAG file's parse reads, imports it when a recipe trains or checks
its target."""

from __future__ import annotations

from dataclasses import replace

import torch

from specdec_core.drafters import output_size
from specdec_core.eagle3 import Eagle3Head, default_layer_ids
from specdec_core.head import DraftHead
from specdec_core.tap import decoder_layers
from specdec_core.train import head_vocabulary, init_draft_from_target, train_draft, train_head

from .draft_recipes import DraftTrainingError


def train_draft_model(recipe, run):
    """DraftModelRecipe.train: a small causal LM of the target's first layers, trained."""
    draft = init_draft_from_target(run.model, num_layers=recipe.num_layers,
                                   hidden_size=recipe.hidden_size)
    return train_draft(draft, run.model, run.train, run.evaluation, recipe.config, run.directory,
                       progress=run.progress, report=run.report)


def train_draft_head(recipe, run):
    """HeadRecipe.train: a draft head on the target's hidden states, trained."""
    ids = (None if recipe.vocab_size is None
           else head_vocabulary(run.train, recipe.vocab_size, output_size(run.model)))
    head = DraftHead(run.model, vocab_ids=ids)
    return train_head(head, run.model, run.train, run.evaluation, recipe.config, run.directory,
                      progress=run.progress, unroll=recipe.unroll, report=run.report)


def eagle3_head(model, train: list, vocab_size: int | None, layer_ids: list[int] | None = None):
    """An untrained EAGLE-3 head for `model` whose draft vocabulary is the `vocab_size` most
    frequent tokens of the training rows' responses (all of the target's ids when None)."""
    full = output_size(model)
    if vocab_size is not None and vocab_size < 1:
        raise DraftTrainingError(f"vocab_size {vocab_size}: give at least 1 token (or none: the "
                                 "full vocabulary)")
    ids = (torch.arange(full) if vocab_size is None
           else head_vocabulary(train, vocab_size, full, responses_only=True))
    try:
        return Eagle3Head(model, vocab_ids=ids, layer_ids=layer_ids)
    except ValueError as exc:          # layer ids outside the target
        raise DraftTrainingError(f"eagle3: {exc}") from exc


def prepare_eagle3(recipe, model, target: str):
    """Eagle3Recipe.prepare: layer_ids resolved (recorded as used, not as "default") and checked
    against the target."""
    depth = len(decoder_layers(model))
    layer_ids = list(recipe.layer_ids) if recipe.layer_ids is not None else default_layer_ids(depth)
    if (not layer_ids or any(not 0 <= i <= depth for i in layer_ids)
            or layer_ids != sorted(set(layer_ids))):
        raise DraftTrainingError(f"layer_ids {layer_ids}: distinct, ascending, each in 0..{depth} "
                                 f"(id i: the input of layer i; {depth}: the last layer's "
                                 f"output) for target {target}")
    return replace(recipe, layer_ids=tuple(layer_ids))


def train_eagle3(recipe, run):
    """Eagle3Recipe.train: an EAGLE-3 head trained; its kept checkpoint rewritten with what serving
    reads."""
    layer_ids = None if recipe.layer_ids is None else list(recipe.layer_ids)
    head = eagle3_head(run.model, run.train, recipe.vocab_size, layer_ids)
    result = train_head(head, run.model, run.train, run.evaluation, recipe.config, run.directory,
                        progress=run.progress, unroll=recipe.unroll, report=run.report)
    if result.best_dir is not None:
        # the kept checkpoint, rewritten with what serving reads: the planned K (k_max where
        # nothing paid) and the target as the verifier, plus its lineage
        best = type(head).load(result.best_dir, run.model)
        best.save(result.best_dir, k=result.best["k"] or recipe.config.k_max, verifier=run.target,
                  meta={"train_id": run.train_id, "target_fingerprint": run.fingerprint,
                        "best_step": result.best_step, "unroll": recipe.unroll,
                        "vocab_from": "responses", "train_requests": len(run.train)})
    return result
