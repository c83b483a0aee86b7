"""Draft heads on the target's own hidden states (after EAGLE, Li et al. 2024), with an optional
vocabulary cut to the traffic's frequent tokens (after FR-Spec, Zhao et al. 2025).

DraftHead: at sequence position j its input is the target's last-layer hidden state f_j (the
input of the target's final norm) and the embedding of token x_{j+1} (the target's embedding,
shared and frozen), fused by a linear layer [f_j ; e(x_{j+1})] -> H. One decoder layer of the
target's architecture and width follows, then the target's final norm (shared, frozen) and an
output head: the target's LM head (shared, frozen) or a reduced head over `vocab_ids` (its rows
initialised from the target's, then trained). The layer's output g_j stands in for f_{j+1}: it
predicts token x_{j+2}, and a draft's step i > 1 feeds g forward in place of the target's f.

HeadDrafter drives a DraftHead in the decode loop. Each round's verify pass gives the target's
hidden states of the pending token and the drafts (the loop taps them: HiddenTap); after the
verifier accepted a drafts, the head catches up on (f, next token) of those a + 1 positions --
replacing whatever it had drafted from its own features -- and drafts the next round from there.
A reduced head's q is zero outside its vocabulary, which rejection sampling handles as it is.

Saved as a directory: head.safetensors (the head's own weights: fuse, layer, reduced head and
vocab ids -- never the target's shared parts) and head_config.json ({"format", "version", the
layer's config, vocab size, the target it was built for}).
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .cache import SequenceCache
from .drafters import Drafter, draft_chain, output_size
from .errors import SpecDecError, TokenizerMismatch
from .records import Proposal
from .sampling import logits_to_probs
from .tap import HiddenTap, final_norm

FORMAT = "specdec-draft-head"
VERSION = 1


class HeadFileError(SpecDecError, ValueError):
    """A saved draft head that cannot be read (missing, corrupted, another format or target)."""


class DraftHead(torch.nn.Module):
    """See the module docstring. target: the model the head drafts for (its embedding, final norm
    and -- without vocab_ids -- LM head are shared, not copied); vocab_ids: token ids of a reduced
    output head, or None for the target's full head."""

    kind = "head"                # its drafter kind in configs (factory.DRAFTER_KINDS)
    feature_regression = True    # trained to reproduce the target's next feature (EAGLE-1/2)

    def __init__(self, target: torch.nn.Module, vocab_ids: torch.Tensor | None = None,
                 init_layer: int | None = -1, seed: int = 0):
        super().__init__()
        norm = final_norm(target)
        layers = target.model.layers
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types)[-1:]
        config.tie_word_embeddings = False
        full_vocab = output_size(target)
        self.reduced = vocab_ids is not None
        config.vocab_size = int(len(vocab_ids)) if self.reduced else 1
        config.pad_token_id = None       # the body's own embedding is never used (inputs_embeds)
        weight = next(target.parameters())
        torch.manual_seed(seed)
        body = type(target)(config).to(device=weight.device, dtype=weight.dtype)
        hidden = config.hidden_size
        self.fuse = torch.nn.Linear(2 * hidden, hidden, bias=False, device=weight.device,
                                    dtype=weight.dtype)
        with torch.no_grad():
            if init_layer is not None:   # start from a target layer's weights (its scale and form)
                body.model.layers[0].load_state_dict(layers[init_layer].state_dict())
            if self.reduced:
                ids = torch.as_tensor(vocab_ids, dtype=torch.long, device=weight.device)
                body.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
        # the target's final norm, copied (its own module: a hook on the target's norm does not
        # see the head's passes) and frozen; the embedding and a full head are shared
        body.model.norm = copy.deepcopy(norm).requires_grad_(False)
        self._shared = {"embed": target.get_input_embeddings()}
        if not self.reduced:
            body.lm_head = target.get_output_embeddings()
        self.body = body
        self.register_buffer("vocab_ids", torch.as_tensor(
            vocab_ids if self.reduced else [], dtype=torch.long).to(weight.device))
        self.full_vocab = full_vocab
        self.config = config
        self.target_ref = getattr(target.config, "_name_or_path", "") or target.config.model_type

    # -- the parts that are this head's own ---------------------------------------------------
    def own_named_parameters(self):
        """(name, parameter) of the trainable weights: fuse, the layer, a reduced head."""
        for name, param in self.named_parameters():
            if name.startswith("body.model.layers.") or name.startswith("fuse.") or (
                    self.reduced and name.startswith("body.lm_head.")):
                yield name, param

    def own_state(self) -> dict[str, torch.Tensor]:
        state = {name: param.detach() for name, param in self.own_named_parameters()}
        state["vocab_ids"] = self.vocab_ids
        return state

    @property
    def vocab_size(self) -> int:
        return int(self.vocab_ids.numel()) if self.reduced else self.full_vocab

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads (its tap's value)."""
        return self.config.hidden_size

    def tap(self, target: torch.nn.Module):
        """The tap on `target` whose value is this head's features of a pass: the last layer's
        hidden states (the input of the final norm)."""
        return HiddenTap(final_norm(target))

    def embed(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of the next tokens [B, T, H]: the target's own weights, shared
        and frozen (no gradient is taken for them in training)."""
        with torch.no_grad():
            return self._shared["embed"](next_tokens)

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Fused input vectors [B, T, H] from features f [B, T, H] and the next tokens [B, T]."""
        return self.fuse(torch.cat([features, self.embed(next_tokens).to(features.dtype)], -1))

    def chained(self, outputs: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Input vectors of a chain step from the head's own outputs g [B, T, H] (they stand in
        for the target's features here)."""
        return self.inputs(outputs, next_tokens)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: a reduced head's are -inf outside its ids."""
        if not self.reduced:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.full_vocab), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass (training, estimates): (head logits [B, T, N], outputs g [B, T, H])."""
        with HiddenTap(self.body.model.norm) as tap:
            out = self.body(inputs_embeds=self.inputs(features, next_tokens),
                            attention_mask=attention_mask, use_cache=False)
            return out.logits, tap.value

    # -- files ---------------------------------------------------------------------------------
    def save(self, directory: str | Path, meta: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in self.own_state().items()},
                  str(directory / "head.safetensors"))
        (directory / "head_config.json").write_text(json.dumps({
            "format": FORMAT, "version": VERSION, "reduced": self.reduced,
            "vocab_size": self.vocab_size, "full_vocab": self.full_vocab,
            "hidden_size": self.config.hidden_size, "target": self.target_ref,
            "meta": meta or {}}, indent=1))
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: torch.nn.Module) -> "DraftHead":
        """A saved head attached to `target` (which must have the width and vocabulary it was
        trained for)."""
        directory = Path(directory)
        config_path, weights = directory / "head_config.json", directory / "head.safetensors"
        try:
            config = json.loads(config_path.read_text())
            state = load_file(str(weights))
        except (OSError, ValueError, SafetensorError) as exc:
            raise HeadFileError(f"draft head {directory}: cannot read {config_path.name} / "
                                f"{weights.name} ({exc}); train or download it again") from exc
        if config.get("format") != FORMAT or config.get("version") != VERSION:
            raise HeadFileError(f"draft head {directory}: format {config.get('format')!r} version "
                                f"{config.get('version')!r}, expected {FORMAT!r} {VERSION}")
        if (config["full_vocab"] != output_size(target)
                or config["hidden_size"] != target.config.hidden_size):
            raise TokenizerMismatch(
                f"draft head {directory} was trained for a vocabulary of {config['full_vocab']} and "
                f"width {config['hidden_size']}; the target has {output_size(target)} and "
                f"{target.config.hidden_size}: train a head for this target")
        vocab_ids = state.pop("vocab_ids") if config["reduced"] else None
        state.pop("vocab_ids", None)
        head = cls(target, vocab_ids=vocab_ids, init_layer=None)
        weight = next(target.parameters())
        own = dict(head.own_named_parameters())
        if set(own) != set(state):
            raise HeadFileError(f"draft head {directory}: weights {sorted(set(state) ^ set(own))[:4]} "
                                "do not match the head's layout; train it again")
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor.to(device=weight.device, dtype=weight.dtype))
        return head.eval()


@dataclass
class _HeadBuffers:
    """A head drafter's round state on a static cache, at fixed width W = K + 1 (captured rounds
    read and write it): the positions to catch up on and the marks of the round's drafts."""

    features: torch.Tensor        # [B, W, H] the target's features of the pending positions
    nxt: torch.Tensor             # [B, W] the token that followed each
    valid: torch.Tensor           # [B, W] False: a hole (not accepted)
    draft_base: torch.Tensor      # [B] the head cache's valid count before the round's drafts
    round_w: torch.Tensor         # [] its write column before the round's drafts

    @classmethod
    def like(cls, features: torch.Tensor, width: int) -> "_HeadBuffers":
        batch, device = features.shape[0], features.device
        return cls(features.new_zeros(batch, width, features.shape[-1]),
                   torch.zeros(batch, width, dtype=torch.long, device=device),
                   torch.zeros(batch, width, dtype=torch.bool, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device),
                   torch.zeros((), dtype=torch.long, device=device))


class HeadDrafter(Drafter):
    """Drafts with a DraftHead from the target's hidden states (see the module docstring).

    The decode loop sees `needs_target_hidden` and hands the target's last-layer hidden states of
    the prefill and of each verify pass over in state.hidden. On static caches it proposes and
    commits as device work on buffers of fixed width (K + 1 positions a round, the unaccepted ones
    holes), so rounds after the first are captured; the first round takes the prompt's positions
    and runs eagerly.
    """

    name = "head"
    needs_target_hidden = True
    device_side = True

    def __init__(self, head: DraftHead):
        self.head = head
        self.name = head.kind
        self._cache = None
        self._fixed = False
        # (features [B, W, H], next tokens [B, W], valid [B, W]) to catch up on: the prompt's
        # (eager) or, on a dynamic cache, each round's accepted positions; None: the buffers
        self._pending = None
        self._bufs: _HeadBuffers | None = None   # static cache: pending positions and round marks
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {W: _HeadBuffers}
        self._draft_base = None     # head cache's valid count per row before this round's drafts
        self._round_w = 0           # write column before this round's drafts (host)
        self._round_k = 0

    def target_tap(self, target_model):
        return self.head.tap(target_model)

    def check_compatible(self, target_model, target_tokenizer=None) -> None:
        if (output_size(target_model) != self.head.full_vocab
                or target_model.config.hidden_size != self.head.config.hidden_size):
            raise TokenizerMismatch(
                f"draft head for a vocabulary of {self.head.full_vocab} and width "
                f"{self.head.config.hidden_size}; the target has {output_size(target_model)} and "
                f"{target_model.config.hidden_size}: train a head for this target")

    def start(self, state) -> None:
        self._cache = state.cache_factory(self.head.body)
        self._fixed = self._cache.fixed_shapes
        # prefill: (f_j, x_{j+1}) for the prompt's positions; the last takes the first output token
        features = state.hidden
        nxt = torch.cat([state.prompt_ids[:, 1:], state.out[:, :1]], 1)
        valid = state.prompt_mask.bool()
        self._pending = (features, nxt, valid)
        if self._fixed:      # one set per static cache and width (captured rounds read them)
            by_width = self._buffers.setdefault(self._cache, {})
            width = state.k + 1
            if width not in by_width:
                by_width[width] = _HeadBuffers.like(features, width)
            self._bufs = by_width[width]

    def capturable(self) -> bool:
        return self._pending is None

    def graph_key(self) -> tuple:
        return (id(self._cache),)

    def _inputs(self):
        if self._pending is not None:
            return self._pending
        return self._bufs.features, self._bufs.nxt, self._bufs.valid

    def reserve(self, state, k) -> None:
        # the pending positions, then the first k - 1 drafts
        width = self._inputs()[0].shape[1]
        self._round_k = k
        self._round_w = self._cache.reserve(width + k - 1) + width

    def _step(self, embeds, tokens, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Append positions (their input vectors) to the head's cache; (full-vocabulary logits, g)
        of the last column."""
        with HiddenTap(self.head.body.model.norm) as tap:
            logits = self._cache.forward(tokens, valid, logits_to_keep=1, graphed=False,
                                         inputs_embeds=embeds)
            g = tap.value[:, -1:]
        return self.head.full_logits(logits[:, -1]), g

    def propose(self, state, k, num_draft, sampling, generator) -> Proposal:
        features, nxt, valid = self._inputs()
        if self._fixed:
            valid = valid & state.active[:, None]
        elif bool(valid.all()):
            valid = None
        logits, g = self._step(self.head.inputs(features, nxt), nxt, valid)
        if self._fixed:      # device work only (reserve() did the host part)
            self._bufs.draft_base.copy_(self._cache.count)   # valid positions before the drafts
            self._bufs.round_w.copy_(self._cache.write_column)
        else:
            self._draft_base = self._cache.count.clone()
            self._round_w = self._cache.width
        active = state.active[:, None] if self._fixed else None
        chained = {"g": g}

        def step(token):   # the head feeds on its own output g
            logits, chained["g"] = self._step(self.head.chained(chained["g"], token[:, None]),
                                              token[:, None], active)
            return logits
        tokens, probs = draft_chain(logits, k, sampling, generator, step)
        return Proposal(tokens, probs, num_draft)

    def commit(self, state, num_accepted) -> None:
        # drop the round's own-feature positions, then queue the target's features of the pending
        # token and the accepted drafts, each with the token that followed it (right-aligned)
        hidden = state.hidden                                       # [B, W, H] of the verify pass
        if self._fixed:      # device work: fixed width, the positions not accepted are holes
            self._cache.rollback(self._bufs.draft_base, self._bufs.round_w)
            width = self._bufs.valid.shape[1]
        else:
            self._cache.rollback_to(self._draft_base, width=self._round_w)
            width = int(state.accepted_max) + 1 if state.accepted_max is not None else hidden.shape[1]
            width = max(1, min(width, hidden.shape[1]))
        a = num_accepted.clamp(max=width - 1)
        idx = torch.arange(width, device=a.device)[None] + a[:, None] - (width - 1)
        valid = idx >= 0
        idx = idx.clamp(min=0)
        features = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        start = state.n_out - (a + 1)                               # first token emitted this round
        nxt = state.out.gather(1, (start[:, None] + idx).clamp(min=0))
        if self._fixed:
            self._bufs.features.copy_(features)
            self._bufs.nxt.copy_(nxt)
            self._bufs.valid.copy_(valid)
        else:
            self._pending = (features, nxt, valid)

    def follow(self, state) -> None:
        self._cache.follow(self._round_w)
        self._pending = None      # from now on the buffers hold what to catch up on

    def select_rows(self, rows) -> None:
        self._cache.select_rows(rows)
        features, nxt, valid = self._pending
        self._pending = (features[rows], nxt[rows], valid[rows])

    def describe(self) -> dict:
        return {"kind": self.head.kind, "params": {"vocab_size": self.head.vocab_size}}


@torch.inference_mode()
def target_features(target: torch.nn.Module, ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None,
                    head: "DraftHead | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, T, F], logits [B, T, V]) of a teacher-forced target pass: what `head` reads
    (its tap), by default the last layer's hidden states."""
    with (head.tap(target) if head is not None else HiddenTap(final_norm(target))) as tap:
        logits = target(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
        return tap.value, logits


@torch.inference_mode()
def head_round_rates(target: torch.nn.Module, head: DraftHead, prompt_ids, response_ids, k: int,
                     sampling=None) -> np.ndarray:
    """Acceptance rates [L, K] of a head's drafts by round start, along one logged response.

    rates[t, i]: draft i of a round that starts with t response tokens emitted (it drafts response
    token t + i). Draft 0 comes from the head's teacher-forced output before the pending token;
    draft i > 0 feeds on the head's own output of draft i - 1 and the logged token there (a
    later draft only counts when the earlier ones were accepted, i.e. equal the logged tokens).
    All round starts of the response run as one batch: each row attends to the teacher-forced
    positions before its start, then to its own chain. Greedy: argmax == logged token (0/1);
    sampling: min(1, q(x) / p(x)) at the logged token x, as token_acceptance scores draft models.
    """
    device = next(target.parameters()).device
    prompt, response = list(prompt_ids), list(response_ids)
    seq = torch.tensor(prompt + response, dtype=torch.long, device=device)
    p_len, length, total = len(prompt), len(response), len(prompt) + len(response)
    rates = np.zeros((length, k))
    if length < 2 or k < 1:
        return rates
    features, target_logits = target_features(target, seq[None], head=head)
    cache = SequenceCache(head.body)
    with HiddenTap(head.body.model.norm) as tap:
        logits = cache.forward(seq[None, 1:], inputs_embeds=head.inputs(features[:, :-1], seq[None, 1:]))
        g_tf = tap.value[0]                                          # [T-1, H]
    starts = torch.arange(1, length, device=device)                  # response tokens emitted
    j0 = p_len + starts - 2                                          # head position before pending
    greedy = sampling is None or sampling.greedy
    step_logits = head.full_logits(logits[0, j0])                    # [S, V]: draft 0
    g = g_tf[j0][:, None]
    cache.expand_prefixes(j0 + 1)
    for i in range(k):
        pos = (p_len + starts + i).clamp(max=total - 1)              # abs position drafted
        x = seq[pos]
        if greedy:
            rate = (step_logits.argmax(-1) == x).double()
        else:
            q = logits_to_probs(step_logits, sampling).gather(-1, x[:, None])[:, 0].double()
            p = logits_to_probs(target_logits[0, pos - 1], sampling).gather(-1, x[:, None])[:, 0].double()
            rate = torch.where(p > 0, (q / p.clamp(min=1e-300)).clamp(max=1.0), torch.ones_like(p))
        inside = (starts + i) < length
        rates[starts.cpu().numpy(), i] = torch.where(inside, rate, torch.zeros_like(rate)).cpu().numpy()
        if i < k - 1:
            with HiddenTap(head.body.model.norm) as tap:
                step = cache.forward(x[:, None], inputs_embeds=head.chained(g, x[:, None]))
                g = tap.value[:, -1:]
            step_logits = head.full_logits(step[:, -1])
    return rates
