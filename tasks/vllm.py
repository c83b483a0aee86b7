"""A registered config as vLLM takes it: per domain, a `speculative_config` (or none)."""

from __future__ import annotations

from .config_schema import DrafterSpec, SpecdecConfig


BEYOND = 1 << 20     # the end of the last range: speculation off above the profiled batch sizes


def speculative_config(drafter: DrafterSpec, k: int) -> dict | None:
    """The vLLM `speculative_config` of one drafter at K tokens per round; None: no equivalent.

    suffix: vLLM's suffix decoding builds its own tree from the requests it serves, so the export
    carries our tuned parameters, not our index (max_cached_requests is left to vLLM's default).
    head: vLLM's `eagle` method loads EAGLE checkpoints in their own layout (a fuse layer and
    decoder layer with the target's LM head, no final norm of their own, full vocabulary); our
    head adds the target's final norm and may cut the vocabulary, so it has no equivalent."""
    if drafter.kind == "prompt_lookup":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": int(drafter.params.get("max_ngram", 3)),
                "prompt_lookup_min": int(drafter.params.get("min_ngram", 2))}
    if drafter.kind == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k,
                "suffix_decoding_max_tree_depth": int(drafter.params.get("max_depth", 24)),
                "suffix_decoding_min_token_prob": float(drafter.params.get("min_token_prob", 0.1)),
                "suffix_decoding_max_spec_factor": float(drafter.params.get("max_spec_factor", 1.0))}
    if drafter.kind == "draft_model":
        return {"method": "draft_model", "model": drafter.model_uri or drafter.params.get("model"),
                "num_speculative_tokens": k}
    return None


def vllm_export(config: SpecdecConfig) -> dict:
    """Per domain, the `speculative_config` a vLLM server takes (None: no speculation), the
    domains whose drafter has no vLLM equivalent, and notes on what the mapping leaves out."""
    domains, unsupported, notes = {}, {}, {}
    for name, setting in sorted(config.domains.items()):
        if not setting.enabled or setting.drafter is None:
            domains[name] = None
            continue
        drafter = setting.drafter
        spec = speculative_config(drafter, setting.k)
        if spec is None:
            unsupported[name] = (f"{drafter.kind} has no vLLM equivalent; serve this domain without "
                                 "speculation or with another drafter")
            domains[name] = None
            continue
        if drafter.kind == "suffix":
            notes[name] = ("vLLM builds its suffix tree from the requests it serves: these are the "
                           "parameters tuned here, not the index the evaluation measured with")
        if setting.k_schedule:   # K by batch size; inclusive ranges, 0 = off (gaps inherit in vLLM)
            last = setting.k_schedule[-1][1]
            spec["num_speculative_tokens"] = max(k for _, _, k in setting.k_schedule)
            spec["num_speculative_tokens_per_batch_size"] = {
                **{f"{first}-{end}": k for first, end, k in setting.k_schedule},
                f"{last + 1}-{BEYOND}": 0}
        elif setting.max_batch_size:   # a schema 1 config: one K up to a cut-off
            spec["disable_by_batch_size"] = setting.max_batch_size
        domains[name] = spec
    return {"target": config.target.id, "run_id": config.run_id, "speculative_config": domains,
            "unsupported": unsupported, "notes": notes, "default": None}
