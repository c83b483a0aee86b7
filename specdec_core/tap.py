"""The target's hidden states, tapped: a draft head reads the input of the target's final norm
(the last decoder layer's output) of every pass the target runs; an EAGLE-3 head reads the inputs
of three of its decoder layers (LayerInputsTap)."""

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


class LayerInputsTap:
    """Context manager like HiddenTap over several modules: while open, `value` is their latest
    inputs concatenated on the last axis ([B, T, n x H] for n decoder layers: an EAGLE-3 head's
    auxiliary hidden states). The concatenation runs where `value` is read (inside a captured
    round: a graph tensor, updated by each replay)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.taps = [HiddenTap(module) for module in modules]

    @property
    def value(self) -> torch.Tensor | None:
        values = [tap.value for tap in self.taps]
        return None if any(v is None for v in values) else torch.cat(values, -1)

    def __enter__(self) -> "LayerInputsTap":
        for tap in self.taps:
            tap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for tap in self.taps:
            tap.__exit__(*exc)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (.model.layers), checked as final_norm checks its norm."""
    final_norm(model)
    return model.model.layers
