"""Drafters: propose up to K tokens per row for the target to verify.

`Drafter` is the protocol: it declares every member the decode loop (loop.py), the offline
estimate and the cost profiles use, with defaults for a drafter that keeps no cache of its own.
Its flags are class attributes:
  device_side          propose and commit are device work only on static caches (draft models,
                       LayerSkip, draft heads, ControlledAcceptance): the loop captures them with
                       the round; around it the host reserves (before) and follows (after)
  reads_host_state     proposes on the host (prompt lookup, suffix): propose_host reads
                       state.host, which the loop keeps, so the round never reads the device for it
  needs_target_hidden  reads the target's hidden states (state.hidden, through its target_tap) of
                       the prefill and of every verify pass (draft heads, EAGLE-3 heads)
One call:  check_compatible (at construction), cached_models (the cache kind), start(state) once
           the prompts are known, select_rows(rows) when finished rows leave a dynamic batch.
One round: reserve(state, k) -> propose(...) or propose_host(host, k) -> the target verifies ->
           commit(state, num_accepted) -> follow(state) after the round's one read.
`state` is the decoder's DecodeState: prompts, generated tokens so far and counts per row.
What callers ask of a drafter (no probing of its class or attributes):
  kind                 its kind, as configs name it (`name`: prompt_lookup, suffix, draft_model, ...)
  walks_text           its proposal for a row is propose_tokens(sequence, limit), a function of that
                       row's text alone: a logged response can be walked round by round with it
                       (the offline estimate, the engine check)
  takes_index          it searches a suffix index of logged responses: `index` (None until given
                       one) and with_index(index), a copy that searches `index`
  indexed_requests()   ids of the requests whose responses its own index holds (empty: none)
  index_digest()       a short digest of those ids (None without an index)
  identity(label)      the drafter as a run uses it: the label, and the index digest when it has one
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .errors import TokenizerMismatch, UnsupportedArchitecture
from .records import DecodeState, HostView, Proposal
from .sampling import SamplingParams, logits_to_probs, sample_from
from .lookup import lookup_batch, suffix_batch, warm_up, warm_up_suffix
from .suffix import SuffixIndex, propose_path


def output_size(model: torch.nn.Module) -> int:
    """Number of logits the model emits per position."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def draft_chain(logits: torch.Tensor, k: int, sampling: SamplingParams, generator,
                step) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K tokens drafted one after the other: token i from `logits` (argmax, or sampled), then
    logits = step(token [B]) for the next. (tokens [B, K], their distributions [B, K, V] or None
    when greedy)."""
    tokens, probs = [], []
    for i in range(k):
        if sampling.greedy:
            token = logits.argmax(-1)
        else:
            p = logits_to_probs(logits, sampling)
            token = sample_from(p, generator)
            probs.append(p)
        tokens.append(token)
        if i < k - 1:
            logits = step(token)
    return torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None


class Drafter:
    """The drafter protocol (see the module docstring); subclasses override what they need."""

    name = "drafter"
    device_side = False          # propose/commit are capturable device work on static caches
    reads_host_state = False     # proposes on the host (propose_host), from state.host
    needs_target_hidden = False  # reads state.hidden: the target's hidden states (target_tap)
    walks_text = False           # propose_tokens(sequence, limit) is its proposal for one row
    takes_index = False          # searches a suffix index of logged responses (with_index)
    index = None                 # that index (a SuffixIndex), None when it has none

    @property
    def kind(self) -> str:
        """Its kind as configs and specs name it (`{kind, params}` of describe())."""
        return self.name

    def indexed_requests(self) -> frozenset[str]:
        """Ids of the requests whose responses its own index holds (empty without an index):
        an evaluation never scores it on them."""
        return frozenset() if self.index is None else frozenset(self.index.request_ids)

    def index_digest(self) -> str | None:
        """The first 12 hex digits of the SHA-256 of its indexed request ids (sorted, one a line);
        None when it has no index or an empty one."""
        ids = self.indexed_requests()
        if not ids:
            return None
        return hashlib.sha256("\n".join(sorted(map(str, ids))).encode()).hexdigest()[:12]

    def identity(self, label: str) -> str:
        """The drafter as a run uses it: `label`, plus `/index:<digest>` for one with an index (a
        run's per-domain indexes share one label)."""
        digest = self.index_digest()
        return label if digest is None else f"{label}/index:{digest}"

    def with_index(self, index) -> "Drafter":
        """A copy of this drafter that searches `index` (drafters with takes_index)."""
        raise NotImplementedError(f"{type(self).__name__} searches no suffix index")

    def propose_tokens(self, sequence: np.ndarray, limit: int) -> np.ndarray:
        """With walks_text: up to `limit` tokens continuing `sequence` (one row's prompt +
        output), deterministic."""
        raise NotImplementedError(f"{type(self).__name__} does not propose from a row's text alone")

    def target_tap(self, target_model: torch.nn.Module):
        """With needs_target_hidden: the context manager whose `value` the loop hands over as
        state.hidden after each target pass (tap.HiddenTap, tap.LayerInputsTap)."""
        raise NotImplementedError(f"{type(self).__name__} reads no target hidden states")

    def check_compatible(self, target_model: torch.nn.Module, target_tokenizer=None) -> None:
        """Raise TokenizerMismatch when this drafter cannot propose tokens of the target's vocabulary."""

    def start(self, state: DecodeState) -> None:
        """A call begins: the prompts are in state (prefill a draft model's cache here)."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Finished rows left a dynamic batch: keep only `rows` of per-row state."""

    def reserve(self, state: DecodeState, k: int) -> None:
        """Host part before a device-side proposal of k tokens on static caches (columns of the
        drafter's own cache)."""

    def propose(self, state: DecodeState, k: int, num_draft: torch.Tensor,
                sampling: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Up to k draft tokens per row (at most num_draft[b]) on the device."""
        raise NotImplementedError(f"{type(self).__name__} does not implement propose")

    def propose_host(self, host: HostView, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k], counts [B]) searched on the host within host.limits
        (drafters with reads_host_state)."""
        raise NotImplementedError(f"{type(self).__name__} does not propose on the host")

    def commit(self, state: DecodeState, num_accepted: torch.Tensor) -> None:
        """The verifier accepted num_accepted [B] of the proposal (inside the captured round for
        device-side drafters on static caches; after the round's read otherwise)."""

    def follow(self, state: DecodeState) -> None:
        """Host part after a device-side commit on static caches: state.accepted_max is known."""

    def cached_models(self) -> tuple:
        """Models it runs with KV caches of their own (static caches by default need them all to
        allow it)."""
        return ()

    def generators(self) -> tuple:
        """Random generators of its own that propose() draws from (registered with CUDA graphs)."""
        return ()

    def graph_key(self) -> tuple:
        """What a captured round of this drafter depends on besides its own identity."""
        return ()

    def capturable(self) -> bool:
        """Whether this round's proposal may be captured (a device-side drafter's first round
        may read per-call tensors and run eagerly)."""
        return True

    def describe(self) -> dict:
        """JSON-able {kind, params} for configs and reports."""
        return {"kind": self.name, "params": {}}


@dataclass
class _RoundMarks:
    """A draft model's marks of the round in progress, on the device (static caches: one set per
    cache, read and written by captured rounds)."""

    cached_gen: torch.Tensor      # [B] generated tokens already in the draft's cache
    round_start: torch.Tensor     # [B] generated count when the round began
    base: torch.Tensor            # [] the cache's write column when the round's proposal began

    @classmethod
    def like(cls, n_out: torch.Tensor) -> "_RoundMarks":
        return cls(torch.zeros_like(n_out), torch.zeros_like(n_out),
                   torch.zeros((), dtype=torch.long, device=n_out.device))


class DraftModel(Drafter):
    """A small causal LM with the target's vocabulary, run autoregressively with its own KV cache."""

    name = "draft_model"
    device_side = True

    def __init__(self, draft_model: torch.nn.Module, tokenizer=None):
        self.model = draft_model
        self.tokenizer = tokenizer
        self._cache = None                              # SequenceCache or StaticSequenceCache
        self._cached_gen: torch.Tensor | None = None   # [B] generated tokens already in the cache
        self._round_start: torch.Tensor | None = None  # [B] generated count when the round began
        self._round_k = 0
        self._round_base = 0                            # static cache: its write column at propose
        self._base: torch.Tensor | None = None          # static cache: the same on the device
        self._fixed = False                             # the cache is a static one
        self._vocab: int | None = None
        self._marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # cache -> _RoundMarks

    def check_compatible(self, target_model, target_tokenizer=None) -> None:
        target_size = output_size(target_model)
        draft_size = output_size(self.model)
        if self.tokenizer is not None and target_tokenizer is not None:
            draft_vocab, target_vocab = self.tokenizer.get_vocab(), target_tokenizer.get_vocab()
            if draft_vocab != target_vocab:
                raise TokenizerMismatch(
                    f"draft vocab {len(draft_vocab)} != target vocab {len(target_vocab)} (or the same "
                    "size with other token ids); pick a draft trained with the target's tokenizer")
        elif draft_size != target_size:
            raise TokenizerMismatch(
                f"draft vocab {draft_size} != target vocab {target_size} (model output sizes); pick a "
                "draft trained with the target's tokenizer")
        self._vocab = target_size

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits sized to the target's output (padded vocabularies may differ in size)."""
        if self._vocab is None or logits.shape[-1] == self._vocab:
            return logits
        if logits.shape[-1] > self._vocab:
            return logits[..., : self._vocab]
        pad = logits.new_full((*logits.shape[:-1], self._vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def start(self, state) -> None:
        self._cache = state.cache_factory(self.model)
        self._fixed = self._cache.fixed_shapes
        valid = state.prompt_mask.bool() if state.prompt_has_padding else None
        self._cache.forward(state.prompt_ids, valid, logits_to_keep=1, graphed=False)
        if self._fixed:   # marks that captured rounds read and write: one set per static cache
            marks = self._marks.get(self._cache)
            if marks is None:
                marks = self._marks[self._cache] = _RoundMarks.like(state.n_out)
            marks.cached_gen.zero_()
            self._cached_gen, self._round_start, self._base = (
                marks.cached_gen, marks.round_start, marks.base)
        else:
            self._cached_gen = torch.zeros_like(state.n_out)

    def cached_models(self) -> tuple:
        return (self.model,)

    def graph_key(self) -> tuple:
        return (id(self._cache),)

    def reserve(self, state, k) -> None:
        # a static round writes 2 catch-up columns, then the first k - 1 drafts
        self._round_k = k
        self._round_base = self._cache.reserve(k + 1)

    def propose(self, state, k, num_draft, sampling, generator) -> Proposal:
        cache, fixed = self._cache, self._fixed
        # catch up on generated tokens the draft has not seen (1, or 2 after an all-accepted round);
        # a static cache always takes 2 (the first a hole when only 1 is new): no host sync
        behind = state.n_out - self._cached_gen                                  # [B]
        width = 2 if fixed else int(behind.max())
        idx = state.n_out[:, None] - width + torch.arange(width, device=state.n_out.device)
        valid = idx >= self._cached_gen[:, None]
        tokens = state.out.gather(1, idx.clamp(min=0))
        if fixed:   # device work only (reserve() did the host part): in-place buffer updates
            active = state.active[:, None]
            self._base.copy_(cache.write_column)
            logits = self._fit_vocab(cache.forward(tokens, valid & active, logits_to_keep=1)[:, -1])
        else:
            active = None
            logits = self._fit_vocab(cache.forward(tokens, None if bool(valid.all()) else valid)[:, -1])
        draft_tokens, draft_probs = draft_chain(
            logits, k, sampling, generator,
            lambda token: self._fit_vocab(cache.forward(token[:, None], active)[:, -1]))
        if fixed:
            self._round_start.copy_(state.n_out)
            self._cached_gen.copy_(state.n_out + (k - 1))
        else:
            self._round_start = state.n_out.clone()
            self._round_k = k
            self._cached_gen = state.n_out + (k - 1)
        return Proposal(draft_tokens, draft_probs, num_draft)

    def commit(self, state, num_accepted) -> None:
        # the cache holds the round's first k-1 drafts; keep those that were accepted
        kept_gen = self._round_start + num_accepted.clamp(max=self._round_k - 1)
        if self._fixed:
            # written this round: 2 catch-up columns, then k - 1 drafts of which rows keep
            # min(accepted, k - 1): writing resumes after the furthest kept column
            width = self._base + 2 + (state.kept_max - 1).clamp(max=self._round_k - 1)
            self._cache.rollback(state.prompt_len + kept_gen, width)
            self._cached_gen.copy_(kept_gen)
        else:
            self._cache.rollback_to(state.prompt_len + kept_gen)
            self._cached_gen = kept_gen

    def follow(self, state) -> None:
        self._cache.follow(self._round_base + 2 + min(state.accepted_max, self._round_k - 1))

    def select_rows(self, rows) -> None:
        self._cache.select_rows(rows)
        self._cached_gen = self._cached_gen[rows]

    def describe(self) -> dict:
        name = getattr(self.model.config, "_name_or_path", "") or self.model.config.model_type
        return {"kind": self.name, "params": {"model": str(name)}}


def _truncated_layers_view(target_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A causal LM made of the target's first num_layers layers + final norm + LM head.

    Shallow copies of the outer modules only: every parameter is the target's own tensor.
    """
    inner = getattr(target_model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "norm"):
        raise UnsupportedArchitecture(
            f"LayerSkip needs a decoder-only model with .model.layers and .model.norm (Llama, Mistral, "
            f"Qwen2, ...); {type(target_model).__name__} has another structure: use DraftModel instead")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise UnsupportedArchitecture(
            f"LayerSkip num_layers={num_layers}: the target has {total} layers; use 1..{total - 1}")
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    view_inner.config = config
    view = copy.copy(target_model)
    view._modules = dict(target_model._modules)
    view.model = view_inner
    view.config = config
    return view


class LayerSkip(DraftModel):
    """Self-speculation: the target's first num_layers layers, final norm and LM head as the draft.

    Shares the target's weights (no copy); keeps its own KV cache for those layers.
    """

    name = "layer_skip"

    def __init__(self, target_model: torch.nn.Module, num_layers: int = 8):
        super().__init__(_truncated_layers_view(target_model, num_layers))
        self.num_layers = num_layers

    def describe(self) -> dict:
        return {"kind": self.name, "params": {"num_layers": self.num_layers}}


def find_continuation(sequence: np.ndarray, max_ngram: int, k: int, min_ngram: int = 1,
                      occurrence: str = "earliest") -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the sequence's last n tokens: the
    longest n from max_ngram down to min_ngram that occurs, at its earliest occurrence (vLLM's
    `ngram` proposer's rule) or its latest (occurrence="latest"). Empty when nothing matches.
    """
    length = len(sequence)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        suffix = sequence[length - n:]
        # windows starting at 0 .. length-n-1: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(sequence[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0 if occurrence == "earliest" else -1]) + n
            return sequence[start: start + k]
    return sequence[:0]


def host_view(state: DecodeState, num_draft: torch.Tensor | None) -> HostView:
    """state.host with this round's limits; built from the device (reads) when the caller keeps
    no host view (a decode state made by hand, as the cost profiles do)."""
    if state.host is None:
        state.host = HostView(state.prompt_ids.cpu().numpy(), state.prompt_len.cpu().numpy(),
                              state.out.cpu().numpy(), state.n_out.cpu().numpy())
    if num_draft is not None:
        state.host.limits = num_draft.cpu().numpy()
    return state.host


class HostDrafter(Drafter):
    """A drafter that searches on the host, row by row: propose_tokens(sequence, limit) gives up
    to `limit` tokens continuing one row's prompt + output (deterministic: the offline estimate
    walks rounds with the same function). Proposes fewer than K tokens, or none, per row."""

    reads_host_state = True
    walks_text = True

    def propose(self, state, k, num_draft, sampling, generator) -> Proposal:
        """propose_host as a Proposal (host tensors)."""
        tokens, counts = self.propose_host(host_view(state, num_draft), k)
        return Proposal(torch.from_numpy(tokens), None, torch.from_numpy(counts),
                        max_draft=int(counts.max(initial=0)))

    def propose_host(self, host: HostView, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k], counts [B]) searched on the host, row by row, within host.limits (the
        decode loop calls this directly and stages the result for the device in one copy)."""
        tokens = np.zeros((len(host.n_out), k), dtype=np.int64)
        counts = np.zeros(len(host.n_out), dtype=np.int64)
        width = host.prompts.shape[1]
        for row, (generated, limit) in enumerate(zip(host.n_out.tolist(), host.limits.tolist())):
            if limit <= 0:
                continue
            sequence = np.concatenate([host.prompts[row, width - host.prompt_len[row]:],
                                       host.out[row, :generated]])
            found = self.propose_tokens(sequence, min(k, limit))
            tokens[row, : len(found)] = found
            counts[row] = len(found)
        return tokens, counts


class PromptLookup(HostDrafter):
    """Prompt-lookup (n-gram) drafting: copy what followed the current suffix earlier in the text.

    No model. Proposes fewer than K tokens, or none, when nothing (or too little) matches.
    min_ngram defaults to 2: on the embedded default, single-token matches are accepted too rarely
    to pay for the wider verify pass (benchmarks/decode_cpu.py).
    occurrence: which occurrence of the longest matched n-gram is copied from. "earliest" is vLLM's
    `ngram` proposer's rule (the longest n in [min_ngram, max_ngram], its earliest occurrence, up
    to K tokens until the end of the text), so the offline estimate scores what vLLM proposes and
    the config exports as vLLM's `ngram` with these parameters; "latest" copies from the nearest
    occurrence instead (no vLLM equivalent).
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, occurrence: str = "earliest"):
        if not 1 <= min_ngram <= max_ngram or occurrence not in ("earliest", "latest"):
            raise ValueError(f"PromptLookup(max_ngram={max_ngram}, min_ngram={min_ngram}, "
                             f"occurrence={occurrence!r}): need 1 <= min_ngram <= max_ngram and "
                             "occurrence 'earliest' or 'latest'")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.occurrence = occurrence
        warm_up()    # compiled (or loaded from numba's cache) here, never inside a timed decode

    def propose_tokens(self, sequence: np.ndarray, limit: int) -> np.ndarray:
        return find_continuation(sequence, self.max_ngram, limit, self.min_ngram, self.occurrence)

    def propose_host(self, host, k):
        """The whole batch in one compiled call (lookup.lookup_batch; equal to propose_tokens
        row by row)."""
        return lookup_batch(host.prompts, host.prompt_len, host.out, host.n_out, host.limits, k,
                            self.max_ngram, self.min_ngram, earliest=self.occurrence == "earliest")

    def describe(self) -> dict:
        params = {"max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        if self.occurrence != "earliest":
            params["occurrence"] = self.occurrence
        return {"kind": self.name, "params": params}


class SuffixDrafter(HostDrafter):
    """Suffix decoding: continuations of the longest matched suffix of prompt + output, found in
    the request itself and in a suffix index over a domain's logged responses (suffix.py).

    index: a SuffixIndex, a path to a saved one, or None (the request's own text only).
    max_depth: longest suffix matched; min_token_prob: a draft token needs at least this share of
    the matched occurrences; max_spec_factor: at most this many tokens per matched token.
    """

    name = "suffix"
    takes_index = True

    def __init__(self, index=None, max_depth: int = 24, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0):
        if not (isinstance(max_depth, int) and max_depth >= 1 and 0.0 <= min_token_prob <= 1.0
                and max_spec_factor > 0):
            raise ValueError(f"SuffixDrafter(max_depth={max_depth!r}, min_token_prob="
                             f"{min_token_prob!r}, max_spec_factor={max_spec_factor!r}): need an "
                             "integer max_depth >= 1, min_token_prob in [0, 1], max_spec_factor > 0")
        if index is not None and not isinstance(index, SuffixIndex):
            index = SuffixIndex.load(index)
        self.index = index
        self.max_depth = max_depth
        self.min_token_prob = float(min_token_prob)
        self.max_spec_factor = float(max_spec_factor)
        warm_up_suffix(index)   # compiled (or loaded from numba's cache) here, not in a decode

    def with_index(self, index) -> "SuffixDrafter":
        return SuffixDrafter(index, self.max_depth, self.min_token_prob, self.max_spec_factor)

    def check_compatible(self, target_model, target_tokenizer=None) -> None:
        if self.index is None:
            return
        vocab = output_size(target_model)
        built_for = self.index.meta.get("vocab_size")
        if built_for is not None and int(built_for) != vocab:
            raise TokenizerMismatch(
                f"suffix index built for a vocabulary of {built_for} tokens, the target has {vocab}: "
                "build the index from traffic of this target's tokenizer")
        if self.index.text.size and int(self.index.text.max()) >= vocab:
            raise TokenizerMismatch(
                f"suffix index holds token id {int(self.index.text.max())} >= the target's "
                f"vocabulary {vocab}: build the index from traffic of this target's tokenizer")

    def propose_tokens(self, sequence: np.ndarray, limit: int) -> np.ndarray:
        return propose_path(sequence, limit, self.index, self.max_depth, self.min_token_prob,
                            self.max_spec_factor)

    def propose_host(self, host, k):
        """The whole batch in one compiled call (lookup.suffix_batch; equal to propose_tokens
        row by row)."""
        return suffix_batch(host.prompts, host.prompt_len, host.out, host.n_out, host.limits, k,
                            self.index, self.max_depth, self.min_token_prob, self.max_spec_factor)

    def describe(self) -> dict:
        return {"kind": self.name, "params": {"max_depth": self.max_depth,
                                              "min_token_prob": self.min_token_prob,
                                              "max_spec_factor": self.max_spec_factor}}
