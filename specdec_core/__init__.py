"""specdec_core: the speculative decoding engine of specdec-rollout (torch + transformers only)."""

from .decoder import GenerateResult, SpecDecoder
from .drafters import DraftModel, LayerSkip, PromptLookup
from .errors import (EmbeddedModelUnavailable, InvalidDecodeInput, ModelNotFound, SpecDecError,
                     TokenizerMismatch)
from .models import load_model
from .sampling import SamplingParams
from .stats import SpecStats

__all__ = [
    "DraftModel", "EmbeddedModelUnavailable", "GenerateResult", "InvalidDecodeInput", "LayerSkip",
    "ModelNotFound", "PromptLookup", "SamplingParams", "SpecDecError", "SpecDecoder", "SpecStats",
    "TokenizerMismatch", "load_model",
]
