"""A registered config as TensorRT-LLM's LLM API takes it: per domain, a `speculative_config`.

prompt_lookup -> NGramDecodingConfig, draft_model -> DraftTargetDecodingConfig; K by batch size
goes to `draft_len_schedule` ({largest batch size: K}, batch sizes above the last entry run
without speculation). Other drafters have no TensorRT-LLM equivalent here (suffix decoding and
our draft heads are not among its methods; LayerSkip is not either)."""

from __future__ import annotations

from .config_schema import DomainSetting, DrafterSpec, SpecdecConfig


def draft_len_schedule(setting: DomainSetting) -> dict[int, int] | None:
    """{last batch size of a range: K} for the ranges with K > 0 (None: a schema 1 config)."""
    if not setting.k_schedule:
        return None
    return {end: k for _, end, k in setting.k_schedule if k > 0}


def decoding_config(drafter: DrafterSpec, k: int) -> dict | None:
    if drafter.kind == "prompt_lookup":
        return {"decoding_type": "NGram", "max_draft_len": k,
                "max_matching_ngram_size": int(drafter.params.get("max_ngram", 3))}
    if drafter.kind == "draft_model":
        return {"decoding_type": "Draft_Target", "max_draft_len": k,
                "speculative_model": drafter.model_uri or drafter.params.get("model")}
    return None


def trtllm_export(config: SpecdecConfig) -> dict:
    """Per domain the speculative_config (None: no speculation) and the unsupported domains."""
    domains, unsupported = {}, {}
    for name, setting in sorted(config.domains.items()):
        if not setting.enabled or setting.drafter is None:
            domains[name] = None
            continue
        schedule = draft_len_schedule(setting)
        k = max(schedule.values()) if schedule else setting.k
        spec = decoding_config(setting.drafter, k)
        if spec is None:
            unsupported[name] = (f"{setting.drafter.kind} has no TensorRT-LLM equivalent; serve this "
                                 "domain without speculation or with another drafter")
            domains[name] = None
            continue
        if schedule:
            spec["draft_len_schedule"] = schedule
        elif setting.max_batch_size:
            spec["max_concurrency"] = setting.max_batch_size
        domains[name] = spec
    return {"target": config.target.id, "run_id": config.run_id, "speculative_config": domains,
            "unsupported": unsupported}
