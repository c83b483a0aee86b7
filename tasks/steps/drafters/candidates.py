"""Candidate drafters: their text form, labels, and construction.

Text form (settings, CLI, Airflow Params): KIND[:PARAM=VALUE[:PARAM=VALUE...]] (`,` works between
parameters too), e.g.
`prompt_lookup`, `prompt_lookup:max_ngram=4:min_ngram=2`, `layer_skip:num_layers=8`,
`draft_model:model=/models/my-draft`, `suffix:max_depth=24,min_token_prob=0.1` (an index per
domain, built for the run) or `suffix:index=models:/specdec-suffix-<target>/3` (a registered one). The config form is docs/design.md's {kind, params}; the label
(`layer_skip(num_layers=8)`) names a candidate in tables and reports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_core.errors import SpecDecError

from ...errors import SpecdecTaskError

if TYPE_CHECKING:
    from ...registry.registry import Registry

KINDS = ("prompt_lookup", "suffix", "layer_skip", "draft_model", "head", "eagle3")   # = specdec_core.factory.DRAFTER_KINDS
# drafters that search on the host once per round (their cost is per round, not per token)
HOST_DRAFTERS = ("prompt_lookup", "suffix")


class CandidateError(SpecdecTaskError, ValueError):
    """A candidate drafter is malformed or cannot be used with this target."""


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_candidate(candidate) -> dict:
    """{kind, params} from the text form or a dict (validated)."""
    if isinstance(candidate, dict):
        kind, params = candidate.get("kind"), dict(candidate.get("params") or {})
    elif isinstance(candidate, str) and candidate.strip():
        kind, _, rest = candidate.strip().partition(":")
        kind = kind.strip()
        # separators are `:` or `,` before the next NAME=, so values may hold them (models:/...)
        pairs = [part.strip() for part in re.split(r"[:,](?=\s*[A-Za-z_]\w*\s*=)", rest)
                 if part.strip()]
        params = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or not name.strip() or not value.strip():
                raise CandidateError(f"candidate {candidate!r}: parameter {pair!r} is not NAME=VALUE "
                                     "(form: KIND[:NAME=VALUE...], e.g. layer_skip:num_layers=8)")
            params[name.strip()] = _value(value.strip())
    else:
        raise CandidateError(f"candidate {candidate!r}: give KIND[:NAME=VALUE...] or {{kind, params}}")
    if kind not in KINDS:
        raise CandidateError(f"candidate {candidate!r}: unknown drafter kind {kind!r}; choose one of "
                             f"{list(KINDS)}")
    if kind == "draft_model" and "model" not in params:
        raise CandidateError(f"candidate {candidate!r}: draft_model needs model=<HF id, path or GGUF>")
    if kind in ("head", "eagle3") and "model" not in params:
        raise CandidateError(f"candidate {candidate!r}: {kind} needs model=<models:/ URI or directory>")
    return {"kind": kind, "params": params}


def candidate_label(spec: dict) -> str:
    """`kind(name=value,...)`, params sorted; the bare kind without params."""
    params = spec.get("params") or {}
    if not params:
        return spec["kind"]
    return spec["kind"] + "(" + ",".join(f"{k}={params[k]}" for k in sorted(params)) + ")"


def checkpoint_kind(path) -> str | None:
    """The drafter kind whose checkpoint a directory holds: "head" (head_config.json), "eagle3"
    (config.json in the speculators EAGLE-3 format) or "draft_model" (another config.json); None
    for anything else (an HF id, a GGUF file, a missing path: the loader says what is wrong)."""
    directory = Path(str(path))
    if (directory / "head_config.json").is_file():
        return "head"
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("speculators_model_type") == "eagle3":
        return "eagle3"
    return "draft_model"


def build_drafters(candidates, target, tokenizer=None,
                   registry: Registry | None = None) -> dict[str, tuple[dict, object]]:
    """{label: (spec, drafter)} for the candidates, each checked against the target's vocabulary.
    A draft_model given as an MLflow `models:/NAME/VERSION` URI is downloaded first, from
    `registry` (tasks.registry.registry.Registry; default Registry.open())."""
    # imported here: torch: the CLI imports this module at start-up
    from specdec_core.factory import make_drafter

    built = {}
    for candidate in candidates:
        spec = parse_candidate(candidate)
        label = candidate_label(spec)
        if label in built:
            continue
        params = dict(spec["params"])
        try:
            if spec["kind"] in ("draft_model", "head", "eagle3") and str(params["model"]).startswith("models:/"):
                from .draft_training import resolve_model_uri

                params["model"] = resolve_model_uri(params["model"], registry)
            if spec["kind"] in ("draft_model", "head", "eagle3"):
                held = checkpoint_kind(params["model"])
                if held is not None and held != spec["kind"]:
                    raise ValueError(f"{spec['params']['model']} holds a {held} checkpoint, not a "
                                     f"{spec['kind']} one: use {held}:model={spec['params']['model']}")
            if spec["kind"] == "suffix" and str(params.get("index", "")).startswith("models:/"):
                from .suffix_index import resolve_index_uri

                params["index"] = resolve_index_uri(params["index"], registry)
            drafter = make_drafter(spec["kind"], params, target, tokenizer)
            drafter.check_compatible(target, tokenizer)
        except (SpecDecError, TypeError, ValueError) as exc:
            raise CandidateError(f"candidate {label}: {exc}") from exc
        built[label] = (spec, drafter)
    return built
