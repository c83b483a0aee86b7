"""specdec_core: the speculative decoding engine of specdec-rollout (torch + transformers only).

Layers, each importing only the ones above it:
  errors, home, stats, sampling, records   plain values: errors, paths, counts, params, records
  verify                                  exact verification and the verify round
  graphs, cache, static_cache             KV caches (dynamic; static with CUDA graphs)
  suffix, drafters, synthetic             what proposes draft tokens
  loop, decoder                           the one decode loop and SpecDecoder around it
  profile, estimate, planner, validation, train, models, faults   measuring, planning, proving

The package's names are imported on first use, so a torch-free module (home, errors) can be
imported without loading torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SpecDecoder": "decoder", "DraftModel": "drafters", "LayerSkip": "drafters",
    "PromptLookup": "drafters", "SuffixDrafter": "drafters", "EmbeddedModelUnavailable": "errors",
    "InvalidDecodeInput": "errors", "ModelNotFound": "errors", "SpecDecError": "errors",
    "TokenizerMismatch": "errors", "load_model": "models", "GenerateResult": "records",
    "SamplingParams": "sampling", "SpecStats": "stats",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
