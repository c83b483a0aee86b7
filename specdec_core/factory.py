"""Drafters from their config form {kind, params} (docs/design.md, "Public contracts"): the one
place that knows every kind, above drafters.py and head.py, which it builds from."""

from __future__ import annotations

import torch

from .drafters import DraftModel, Drafter, LayerSkip, PromptLookup, SuffixDrafter
from .eagle3 import Eagle3Head
from .head import DraftHead, HeadDrafter
from .models import load_model

DRAFTER_KINDS = ("prompt_lookup", "suffix", "layer_skip", "draft_model", "head", "eagle3")


def make_drafter(kind: str, params: dict | None, target_model: torch.nn.Module,
                 target_tokenizer=None) -> Drafter:
    """A drafter from its config form {kind, params} (see docs/design.md, "Public contracts").

    draft_model takes params {"model": spec} (anything load_model accepts); it is loaded on the
    target's device and dtype. suffix takes its parameters and optionally {"index": path}. head
    takes {"model": directory of a saved DraftHead} (head.py), attached to the target; eagle3
    {"model": directory of an EAGLE-3 checkpoint in the speculators format} (eagle3.py).
    """
    params = dict(params or {})
    if kind == "prompt_lookup":
        return PromptLookup(**params)
    if kind == "suffix":
        return SuffixDrafter(**params)
    if kind == "layer_skip":
        return LayerSkip(target_model, **params)
    if kind == "draft_model":
        if "model" not in params:
            raise ValueError("draft_model needs params {'model': <HF id, path or GGUF file>}")
        weight = next(target_model.parameters())
        model, tokenizer = load_model(params["model"], device=weight.device, dtype=weight.dtype)
        return DraftModel(model, tokenizer)
    if kind == "head":
        if "model" not in params:
            raise ValueError("head needs params {'model': <directory of a saved draft head>}")
        return HeadDrafter(DraftHead.load(params["model"], target_model))
    if kind == "eagle3":
        if "model" not in params:
            raise ValueError("eagle3 needs params {'model': <directory of an EAGLE-3 checkpoint>}")
        return HeadDrafter(Eagle3Head.load(params["model"], target_model))
    raise ValueError(f"unknown drafter kind {kind!r}: choose one of {list(DRAFTER_KINDS)}")
