"""The target's hidden states, tapped: a draft head reads the input of the target's final norm
(the last decoder layer's output) of every pass the target runs."""

from __future__ import annotations

import torch

from .errors import UnsupportedArchitecture


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The model's final norm (its input is the last layer's hidden state)."""
    decoder = getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if norm is None or not hasattr(decoder, "layers"):
        raise UnsupportedArchitecture(
            f"a draft head needs a decoder-only model with .model.layers and .model.norm (Llama, "
            f"Mistral, Qwen2, ...); {type(model).__name__} has another structure")
    return norm


class HiddenTap:
    """Context manager: while open, `value` is the input of `module` in its latest forward (for a
    model's final norm: the last layer's hidden states [B, T, H]). Inside a captured round the
    value is the graph's own tensor, updated in place by each replay."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.value, self._handle = module, None, None

    def _hook(self, module, args):
        self.value = args[0]

    def __enter__(self) -> "HiddenTap":
        self._handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self.value = None
