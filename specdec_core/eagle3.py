"""EAGLE-3 draft heads (Li et al. 2025) in the layout vLLM and SGLang serve, as the speculators
library writes it.

Eagle3Head reads three of the target's hidden states -- by default the inputs of decoder layers
2, N/2 and N-3 (vLLM's default ids: id i is the input of layer i, id N the last layer's output) --
concatenated [B, T, 3H] and fused by `fc` (3H -> H, no bias). Its one decoder layer takes
[input_layernorm(embedding of the next token) ; hidden_norm(fused)] (2H wide) into attention;
the residual is hidden_norm(fused) when `norm_before_residual`, else the fused vector. Then the
head's own final norm and an LM head over a reduced draft vocabulary; draft index d stands for
target id d + d2t[d], and t2d marks the target ids that have one. The embedding is the target's
(shared, never saved). A chain step after the first feeds on the layer's output g (before the
final norm) in place of the fused features, without fc.

It is a DraftHead (head.py) with other inputs and files: HeadDrafter drives it in the decode
loop, head_round_rates scores it offline, train.train_head trains it (unrolled on its own
outputs: "training-time test").

Files (the speculators format): config.json ({"speculators_model_type": "eagle3",
"speculators_config", "transformer_layer_config", "draft_vocab_size", "norm_before_residual",
"target_hidden_size", "eagle_aux_hidden_state_layer_ids", ...}) and model.safetensors (fc,
layers.0.*, norm, lm_head, d2t, t2d).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .drafters import output_size
from .errors import TokenizerMismatch
from .head import DraftHead, HeadFileError
from .tap import LayerInputsTap, decoder_layers, final_norm

MODEL_TYPE = "eagle3"
WEIGHTS, CONFIG = "model.safetensors", "config.json"
_PREFIXES = (("body.model.layers.0.", "layers.0."), ("body.model.norm.", "norm."),
             ("body.lm_head.", "lm_head."), ("fc.", "fc."))


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default auxiliary layers of an N-layer target: the inputs of layers 2, N/2, N-3;
    for shallow targets clamped into 0..N-1, distinct and ascending (vLLM collects them as a
    sorted set, speculators refuses repeats), so fewer than three."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def is_eagle3_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a checkpoint in the speculators EAGLE-3 format."""
    path = Path(directory) / CONFIG
    try:
        return json.loads(path.read_text()).get("speculators_model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


class Eagle3Layer(torch.nn.Module):
    """The head's decoder layer: one of the target's layer class, its q/k/v projections 2H wide
    over [input_layernorm(embedding) ; hidden_norm(fused)]. Called as the target's layers are."""

    def __init__(self, layer: torch.nn.Module, hidden: int, norm_before_residual: bool):
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.hidden_norm = copy.deepcopy(layer.input_layernorm)
        if hasattr(layer, "attention_type"):        # Qwen-style models pick their mask by it
            self.attention_type = layer.attention_type
        self.norm_before_residual = norm_before_residual
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, torch.nn.Linear(
                2 * hidden, old.out_features, bias=old.bias is not None,
                device=old.weight.device, dtype=old.weight.dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        embeds, fused = hidden_states.chunk(2, -1)
        normed = self.hidden_norm(fused)
        residual = normed if self.norm_before_residual else fused
        attended, _ = self.self_attn(
            hidden_states=torch.cat([self.input_layernorm(embeds), normed], -1),
            attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(DraftHead):
    """See the module docstring. target: the model it drafts for; vocab_ids: the draft vocabulary
    (target ids, ascending); layer_ids: the auxiliary layers (default_layer_ids); init_layer: the
    target layer whose weights start the head's layer (its hidden half of q/k/v), None: random."""

    kind = "eagle3"
    feature_regression = False   # EAGLE-3 trains on tokens only

    def __init__(self, target: torch.nn.Module, vocab_ids: torch.Tensor,
                 layer_ids: list[int] | None = None, norm_before_residual: bool = True,
                 init_layer: int | None = -1, seed: int = 0):
        super().__init__(target, vocab_ids=vocab_ids, init_layer=None, seed=seed)
        layers, weight = decoder_layers(target), next(target.parameters())
        n_layers, hidden = len(layers), self.config.hidden_size
        self.layer_ids = [int(i) for i in (layer_ids if layer_ids is not None
                                          else default_layer_ids(n_layers))]
        if (not self.layer_ids or any(not 0 <= i <= n_layers for i in self.layer_ids)
                or self.layer_ids != sorted(set(self.layer_ids))):
            raise ValueError(f"EAGLE-3 layer ids {self.layer_ids}: distinct, ascending, each in "
                             f"0..{n_layers} (the target has {n_layers} layers; engines collect "
                             "them as a sorted set)")
        self.norm_before_residual = bool(norm_before_residual)
        self.target_num_layers = n_layers
        self.target_config = copy.deepcopy(target.config)
        self.target_class = type(target).__name__
        del self.fuse
        torch.manual_seed(seed + 1)
        self.fc = torch.nn.Linear(len(self.layer_ids) * hidden, hidden, bias=False,
                                  device=weight.device, dtype=weight.dtype)
        layer = Eagle3Layer(self.body.model.layers[0], hidden, self.norm_before_residual)
        with torch.no_grad():
            if init_layer is not None:
                # start from a target layer: the hidden half of q/k/v and the rest of its
                # weights, the embedding half at zero, fc passing the last auxiliary state on
                source = layers[init_layer]
                for name, param in source.state_dict().items():
                    mine = layer.state_dict()[name]
                    if mine.shape == param.shape:
                        mine.copy_(param)
                    else:                                  # q/k/v: [out, 2H] from [out, H]
                        mine.zero_()[:, hidden:].copy_(param)
                layer.hidden_norm.load_state_dict(source.input_layernorm.state_dict())
                self.fc.weight.zero_()[:, -hidden:].copy_(torch.eye(hidden))
        self.body.model.layers[0] = layer
        # its own final norm, trainable, from the target's
        self.body.model.norm = copy.deepcopy(final_norm(target)).requires_grad_(True)

    # -- what differs from DraftHead ------------------------------------------------------------
    def own_named_parameters(self):
        for name, param in self.named_parameters():
            if name.startswith(("body.model.layers.", "body.model.norm.", "body.lm_head.", "fc.")):
                yield name, param

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.config.hidden_size

    def tap(self, target: torch.nn.Module) -> LayerInputsTap:
        layers = decoder_layers(target)
        return LayerInputsTap([layers[i] if i < len(layers) else final_norm(target)
                               for i in self.layer_ids])

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """[embedding ; fc(features)] [B, T, 2H] from the target's auxiliary states [B, T, 3H]."""
        fused = self.fc(features.to(self.fc.weight.dtype))
        return torch.cat([self.embed(next_tokens).to(fused.dtype), fused], -1)

    def chained(self, outputs: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.embed(next_tokens).to(outputs.dtype), outputs], -1)

    # -- the speculators format -------------------------------------------------------------------
    def d2t(self) -> torch.Tensor:
        """int64 offsets: target id = draft index + d2t[draft index]."""
        ids = self.vocab_ids.cpu()
        return ids - torch.arange(len(ids))

    def t2d(self) -> torch.Tensor:
        """bool mask over the target vocabulary: the ids the draft vocabulary has."""
        mask = torch.zeros(self.full_vocab, dtype=torch.bool)
        mask[self.vocab_ids.cpu()] = True
        return mask

    def export_state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under the speculators names; d2t and t2d only for a reduced
        vocabulary (vLLM refuses them when the draft vocabulary is the target's)."""
        state = {}
        for name, param in self.own_named_parameters():
            for ours, theirs in _PREFIXES:
                if name.startswith(ours):
                    state[theirs + name[len(ours):]] = param.detach().contiguous().cpu()
        if self.vocab_size != self.full_vocab:
            state["d2t"], state["t2d"] = self.d2t(), self.t2d()
        return state

    def speculators_config(self, k: int = 3, verifier: str | None = None) -> dict:
        """config.json: the speculators EAGLE-3 config (`k`: the proposal's speculative tokens)."""
        layer_config = self.target_config.to_dict()
        layer_config.update(num_hidden_layers=1, tie_word_embeddings=False)
        layer_config.pop("layer_types", None)
        for key in ("_name_or_path", "architectures", "transformers_version", "quantization_config"):
            layer_config.pop(key, None)
        verifier = verifier or self.target_ref
        dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": MODEL_TYPE,
            "speculators_config": {
                "algorithm": MODEL_TYPE,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": list(self.target_config.architectures
                                                   or [self.target_class])},
            },
            "transformer_layer_config": layer_config,
            "draft_vocab_size": self.vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "embed_requires_grad": False,
            "target_hidden_size": self.config.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
            "dtype": dtype,
        }

    def save(self, directory: str | Path, meta: dict | None = None, k: int = 3,
             verifier: str | None = None) -> Path:
        """Write config.json + model.safetensors (meta: kept under "specdec" in config.json)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.export_state(), str(directory / WEIGHTS))
        config = self.speculators_config(k=k, verifier=verifier)
        config["specdec"] = meta or {}
        (directory / CONFIG).write_text(json.dumps(config, indent=1))
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: torch.nn.Module) -> "Eagle3Head":
        """An EAGLE-3 checkpoint (speculators format) attached to `target`, which must have the
        width, vocabulary and depth it was trained for."""
        directory = Path(directory)
        try:
            config = json.loads((directory / CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise HeadFileError(f"EAGLE-3 head {directory}: cannot read {CONFIG} ({exc}); train or "
                                "download it again") from exc
        kind = config.get("speculators_model_type") if isinstance(config, dict) else None
        if kind != MODEL_TYPE:
            raise HeadFileError(f"EAGLE-3 head {directory / CONFIG}: speculators_model_type "
                                f"{kind!r}, expected {MODEL_TYPE!r}")
        try:
            state = load_file(str(directory / WEIGHTS))
        except (OSError, ValueError, SafetensorError) as exc:
            raise HeadFileError(f"EAGLE-3 head {directory}: cannot read {WEIGHTS} ({exc}); train "
                                "or download it again") from exc
        hidden = config.get("target_hidden_size")
        # the target vocabulary it was built for: t2d's length, or (full vocabulary, no t2d) the
        # layer config's
        t2d, d2t = state.pop("t2d", None), state.pop("d2t", None)
        vocab = len(t2d) if t2d is not None else (config.get("transformer_layer_config") or {}).get("vocab_size")
        if hidden != target.config.hidden_size or vocab != output_size(target):
            raise TokenizerMismatch(
                f"EAGLE-3 head {directory / WEIGHTS} was built for width {hidden} and a vocabulary "
                f"of {vocab}; the target has {target.config.hidden_size} and "
                f"{output_size(target)}: train a head for this target")
        if (t2d is None) != (d2t is None):
            raise HeadFileError(f"EAGLE-3 head {directory / WEIGHTS}: has one of d2t and t2d")
        vocab_ids = torch.arange(vocab) if d2t is None else torch.arange(len(d2t)) + d2t
        if t2d is not None and not torch.equal(t2d.nonzero()[:, 0], vocab_ids):
            raise HeadFileError(f"EAGLE-3 head {directory / WEIGHTS}: d2t and t2d disagree")
        try:
            head = cls(target, vocab_ids=vocab_ids,
                       layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
                       norm_before_residual=config.get("norm_before_residual", True), init_layer=None)
        except ValueError as exc:
            raise HeadFileError(f"EAGLE-3 head {directory / CONFIG}: {exc}") from exc
        expected = head.export_state()
        if set(expected) - {"d2t", "t2d"} != set(state) or any(
                expected[name].shape != tensor.shape for name, tensor in state.items()):
            wrong = sorted(n for n in set(state) | set(expected) - {"d2t", "t2d"}
                           if n not in state or n not in expected or expected[n].shape != state[n].shape)
            raise HeadFileError(f"EAGLE-3 head {directory / WEIGHTS}: tensors {wrong[:4]} do not match "
                                "an EAGLE-3 head for this target; train it again")
        own, weight = dict(head.own_named_parameters()), next(target.parameters())
        with torch.no_grad():
            for name, param in own.items():
                for ours, theirs in _PREFIXES:
                    if name.startswith(ours):
                        param.copy_(state[theirs + name[len(ours):]].to(weight.device, weight.dtype))
        head.meta = config.get("specdec", {})
        return head.eval()
