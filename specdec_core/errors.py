"""Errors a user can cause, one type per kind. Each message names the input and the fix."""


class SpecDecError(Exception):
    """Base class of specdec_core's user-facing errors."""


class TokenizerMismatch(SpecDecError, ValueError):
    """The drafter does not share the target's vocabulary."""


class InvalidDecodeInput(SpecDecError, ValueError):
    """A generate() argument is malformed (empty prompt, bad shapes, K < 1, ...)."""


class ModelNotFound(SpecDecError, FileNotFoundError):
    """A model spec names nothing that can be loaded."""


class EmbeddedModelUnavailable(SpecDecError, RuntimeError):
    """The embedded default model could not be fetched into the model cache."""


class UnsupportedArchitecture(SpecDecError, ValueError):
    """The model's structure does not allow the requested operation (e.g. LayerSkip)."""
