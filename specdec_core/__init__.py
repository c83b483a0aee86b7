"""specdec_core: the speculative decoding engine of specdec-rollout (torch + transformers only).

Layers, from the top; each module imports only from its own layer and those below it
(pyproject.toml's "specdec_core layers" contract; docs/design.md has the same table):
  around it     profile, estimate, planner, validation, train, models, faults, factory
  decoding      loop, decoder
  drafters      suffix, lookup, drafters, synthetic, head, eagle3
  caches        cache, static_cache
  verification  verify
  records       records
  device        graphs, tap, cpu_kernels, layer_compile, fused_projections
  values        errors, home, stats, sampling, train_config

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
