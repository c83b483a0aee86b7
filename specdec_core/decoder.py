"""SpecDecoder: prefill, then rounds of draft -> one batched verify pass -> accept.

One round for the active rows of a batch:
  1. each row may draft num_draft[b] = min(K, tokens still wanted - 1) tokens (a round emits at
     most num_draft + 1 tokens, so nothing is drafted past max_new_tokens);
  2. the drafter proposes; PromptLookup may propose fewer, or none;
  3. the target runs once over [pending token, d_1 .. d_k] for every row;
  4. the verifier accepts num_accepted[b] drafts and adds one more token (correction or bonus);
  5. target and draft caches are rolled back to the accepted length (no rebuild);
  6. rows that emitted EOS or reached max_new_tokens leave the batch.
generate_plain runs the same loop with no drafter: one target step per token, the baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import fast
from .fast import synchronize as _sync
from .cache import SequenceCache
from .drafters import Drafter, Proposal
from .errors import InvalidDecodeInput
from .sampling import SamplingParams, logits_to_probs
from .stats import SpecStats
from .verify import greedy_verify, rejection_sample, relaxed_verify

Verifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]
VERIFIERS: dict[str, Verifier] = {"exact": rejection_sample, "relaxed": relaxed_verify}


@dataclass
class DecodeState:
    """What the decoder knows about the active rows; drafters read it."""

    prompt_ids: torch.Tensor     # LongTensor [B, T], left-padded
    prompt_mask: torch.Tensor    # LongTensor [B, T], 1 = real token
    prompt_len: torch.Tensor     # LongTensor [B], real prompt tokens
    out: torch.Tensor            # LongTensor [B, max_new_tokens + K + 1], generated tokens
    n_out: torch.Tensor          # LongTensor [B], generated tokens so far
    prompt_has_padding: bool
    # the static fast path (fast.py) keeps its batch: finished rows are marked inactive instead,
    # caches come from its pool, and the host knows the round's largest accepted count
    active: torch.Tensor | None = None                   # BoolTensor [B] or None (all active)
    cache_factory: Callable[[torch.nn.Module], object] = SequenceCache
    accepted_max: int | None = None

    def select_rows(self, rows: torch.Tensor) -> None:
        for name in ("prompt_ids", "prompt_mask", "prompt_len", "out", "n_out"):
            setattr(self, name, getattr(self, name)[rows])


@dataclass
class GenerateResult:
    tokens: torch.Tensor                    # LongTensor [B, max_new_tokens], new tokens, padded
    stats: SpecStats                        # summed over rows
    row_stats: list[SpecStats] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # valid new tokens per row (EOS included)


class SpecDecoder:
    """Speculative decoding of `target_model` with `drafter`, k draft tokens per round.

    verifier: "exact" (rejection sampling; the default), "relaxed" (LOSSY, for comparison) or a
    callable with rejection_sample's signature. Greedy decoding (temperature 0) verifies with
    greedy_verify unless a verifier is given explicitly.
    verify_widths: optional {needed width: width to run}, from profile.calibrate_verify_widths.
    On some hardware a verify pass over more tokens is cheaper than over fewer (CPU matmul kernels
    pick different paths by row count); the extra positions are filler after the drafts, so the
    causal target's logits for the real positions are unchanged, and the cache rollback drops them.
    static_cache: "auto" (the default) runs the fast path of fast.py -- preallocated static KV
    caches, fixed shapes, one host synchronisation per round -- on CUDA when the models allow it,
    and the general dynamic-cache path otherwise; True forces the fast path (also on CPU), False
    the general one. Both give the same tokens for the same seed.
    cuda_graphs: "auto" captures the fast path's draft steps and verify passes as CUDA graphs on
    CUDA; False runs them eagerly; True off CUDA replays them by running them again on the same
    static buffers (a stand-in that tests the graph plumbing on CPU).
    phase_timing: synchronise around the draft and verify phases to fill stats.draft_s/verify_s
    (on by default; benchmarks turn it off on the fast path, where they stay 0).
    """

    def __init__(self, target_model: torch.nn.Module, drafter: Drafter | None, k: int = 4,
                 tokenizer=None, verifier: str | Verifier | None = None,
                 verify_widths: dict[int, int] | None = None, static_cache: bool | str = "auto",
                 cuda_graphs: bool | str = "auto", phase_timing: bool = True):
        if not isinstance(k, int) or k < 1:
            raise InvalidDecodeInput(f"k={k!r}: the number of draft tokens per round must be an "
                                     "integer >= 1 (use generate_plain for no speculation)")
        self.target = target_model
        self.drafter = drafter
        self.k = k
        self.tokenizer = tokenizer
        if isinstance(verifier, str):
            if verifier not in VERIFIERS:
                raise InvalidDecodeInput(f"verifier={verifier!r}: choose one of {sorted(VERIFIERS)}")
            verifier = VERIFIERS[verifier]
        self.verifier = verifier
        self.verify_widths = {int(n): int(w) for n, w in (verify_widths or {}).items() if int(w) >= int(n)}
        if drafter is not None:
            drafter.check_compatible(target_model, tokenizer)
        for name, value in (("static_cache", static_cache), ("cuda_graphs", cuda_graphs)):
            if value not in ("auto", True, False):
                raise InvalidDecodeInput(f"{name}={value!r}: use 'auto', True or False")
        self.static_cache = static_cache
        self.cuda_graphs = cuda_graphs
        self.phase_timing = phase_timing
        self._static_pool = None
        self._static: bool | None = None          # uses_static_cache(), decided on first use

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    def uses_static_cache(self) -> bool:
        """Whether generate runs the static-cache fast path (see static_cache)."""
        if self._static is None:
            if self.static_cache == "auto":
                draft = getattr(self.drafter, "model", None)
                models = [self.target] + ([draft] if isinstance(draft, torch.nn.Module) else [])
                self._static = all(fast.static_by_default(m) for m in models)
            else:
                self._static = bool(self.static_cache)
        return self._static

    @property
    def static_pool(self) -> "fast.StaticCachePool":
        """The fast path's static caches (and CUDA graphs), kept across generate calls and shared
        by every SpecDecoder of this target model (captured once, whatever the drafter or K)."""
        if self._static_pool is None:
            graphs = self.cuda_graphs is True or (self.cuda_graphs == "auto" and self.device.type == "cuda")
            self._static_pool = fast.StaticCachePool.of(self.target, cuda_graphs=graphs)
        return self._static_pool

    def generate(self, input_ids, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                 seed: int = 0, attention_mask=None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None) -> GenerateResult:
        """Speculative decoding; see DESIGN.md (Public contracts) for the arguments and result."""
        if self.drafter is None:
            raise InvalidDecodeInput("this SpecDecoder has no drafter: pass one, or call generate_plain")
        return self._run(self.drafter, self.k, input_ids, max_new_tokens, sampling, seed,
                         attention_mask, eos_token_id, pad_token_id)

    def generate_plain(self, input_ids, max_new_tokens: int = 64,
                       sampling: SamplingParams | None = None, seed: int = 0, attention_mask=None,
                       eos_token_id: int | None = None, pad_token_id: int | None = None) -> GenerateResult:
        """Plain decoding (one target step per token) with the same signature and result type."""
        return self._run(None, 0, input_ids, max_new_tokens, sampling, seed, attention_mask,
                         eos_token_id, pad_token_id)

    # ------------------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, attention_mask, max_new_tokens):
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise InvalidDecodeInput(f"input_ids of shape {tuple(input_ids.shape)}: expected [B, T] "
                                     "with B >= 1 (token ids of left-padded prompts)")
        if input_ids.shape[1] == 0:
            raise InvalidDecodeInput("empty prompt (input_ids has 0 tokens): give at least one token, "
                                     "e.g. the tokenizer's BOS token")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InvalidDecodeInput(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids "
                                     f"shape {tuple(input_ids.shape)}")
        attention_mask = attention_mask.long()
        empty_rows = (attention_mask.sum(1) == 0).nonzero().flatten().tolist()
        if empty_rows:
            raise InvalidDecodeInput(f"empty prompt in rows {empty_rows} (attention_mask all 0): give "
                                     "every row at least one token")
        if bool((attention_mask[:, -1] == 0).any()):
            raise InvalidDecodeInput("prompts must be left-padded (the last column of attention_mask "
                                     "must be 1): use tokenizer.padding_side = 'left'")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidDecodeInput(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
        return input_ids.long(), attention_mask

    @torch.inference_mode()
    def _run(self, drafter: Drafter | None, k: int, input_ids, max_new_tokens, sampling, seed,
             attention_mask, eos_token_id, pad_token_id) -> GenerateResult:
        sampling = sampling or SamplingParams()
        device = self.device
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask, max_new_tokens)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        batch = input_ids.shape[0]
        if pad_token_id is None:
            pad_token_id = eos_token_id if eos_token_id is not None else 0
        if self.uses_static_cache():
            return fast.run_static(self, drafter, k, input_ids, attention_mask, max_new_tokens,
                                   sampling, seed, eos_token_id, pad_token_id)
        generator = torch.Generator(device=device).manual_seed(seed)
        verifier = self.verifier
        use_greedy_verify = sampling.greedy and verifier is None
        verifier = verifier or rejection_sample

        # per original row, on the device: counts for SpecStats
        rounds = torch.zeros(batch, dtype=torch.long, device=device)
        drafted, accepted, emitted = rounds.clone(), rounds.clone(), rounds.clone()
        reached_at = torch.zeros(batch, max(k, 1), dtype=torch.long, device=device)
        accepted_at = reached_at.clone()
        result = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        num_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        draft_s = verify_s = 0.0

        _sync(device)
        t_start = time.perf_counter()
        state = DecodeState(
            prompt_ids=input_ids, prompt_mask=attention_mask, prompt_len=attention_mask.sum(1),
            out=torch.full((batch, max_new_tokens + k + 1), pad_token_id, dtype=torch.long,
                           device=device),
            n_out=torch.ones(batch, dtype=torch.long, device=device),
            prompt_has_padding=not bool(attention_mask.all()))
        target = SequenceCache(self.target)
        logits = target.forward(input_ids, attention_mask.bool() if state.prompt_has_padding else None)
        first, _ = self._verify_step(None, logits[:, -1:], sampling, generator, verifier,
                                     use_greedy_verify, None)
        state.out[:, 0] = first[:, 0]
        if drafter is not None:
            drafter.start(state)
        _sync(device)
        prefill_s = time.perf_counter() - t_start

        rows = torch.arange(batch, device=device)             # original index of each active row
        finished = state.n_out >= max_new_tokens
        if eos_token_id is not None:
            finished |= first[:, 0] == eos_token_id
        positions = torch.arange(k + 1, device=device)
        while True:
            if bool(finished.any()):
                done = finished.nonzero().flatten()
                result[rows[done]] = state.out[done, :max_new_tokens]
                num_tokens[rows[done]] = state.n_out[done]
                keep = (~finished).nonzero().flatten()
                if keep.numel() == 0:
                    break
                rows = rows[keep]
                state.select_rows(keep)
                target.select_rows(keep)
                if drafter is not None:
                    drafter.select_rows(keep)
            # 1-2. draft
            num_draft = (max_new_tokens - state.n_out - 1).clamp(min=0, max=k)
            proposal = None
            proposed = drafter is not None and bool((num_draft > 0).any())
            if proposed:
                t0 = time.perf_counter()
                proposal = drafter.propose(state, int(num_draft.max()), num_draft, sampling, generator)
                proposal.num_draft = torch.minimum(proposal.num_draft, num_draft)
                round_k = int(proposal.num_draft.max())
                proposal.tokens = proposal.tokens[:, :round_k]
                if proposal.probs is not None:
                    proposal.probs = proposal.probs[:, :round_k]
                _sync(device)
                draft_s += time.perf_counter() - t0
                if round_k == 0:
                    proposal = None
            # 3. one target pass over [pending, drafts]
            t0 = time.perf_counter()
            pending = state.out.gather(1, state.n_out[:, None] - 1)
            verify_input = pending if proposal is None else torch.cat([pending, proposal.tokens], 1)
            width = verify_input.shape[1]
            run_width = self.verify_widths.get(width, width) if width > 1 else 1
            if run_width > width:  # filler after the drafts: the causal logits before it are unchanged
                verify_input = torch.cat([verify_input, pending.expand(-1, run_width - width)], 1)
            logits = target.forward(verify_input)[:, :width]
            # 4. accept
            out_tokens, num_accepted = self._verify_step(
                proposal, logits, sampling, generator, verifier, use_greedy_verify, device)
            _sync(device)
            verify_s += time.perf_counter() - t0
            round_k = out_tokens.shape[1] - 1
            count = num_accepted + 1
            if eos_token_id is not None:
                is_eos = (out_tokens == eos_token_id) & (positions[: round_k + 1] < count[:, None])
                hit = is_eos.any(1)
                count = torch.where(hit, is_eos.long().argmax(1) + 1, count)
                finished = hit
            else:
                finished = torch.zeros_like(count, dtype=torch.bool)
            # write the emitted tokens (beyond `count`: pad, overwritten by the next round)
            cols = state.n_out[:, None] + positions[: round_k + 1]
            written = torch.where(positions[: round_k + 1] < count[:, None], out_tokens,
                                  torch.full_like(out_tokens, pad_token_id))
            state.out.scatter_(1, cols, written)
            state.n_out = state.n_out + count
            finished |= state.n_out >= max_new_tokens
            # stats for this round
            nd = proposal.num_draft if proposal is not None else torch.zeros_like(count)
            rounds[rows] += 1
            drafted[rows] += nd
            accepted[rows] += num_accepted
            emitted[rows] += count
            if round_k > 0:
                pos = positions[:round_k]
                reached_at[rows, :round_k] += ((pos < nd[:, None]) & (pos <= num_accepted[:, None])).long()
                accepted_at[rows, :round_k] += (pos < num_accepted[:, None]).long()
            # 5. roll back caches to the accepted length (the newest token is not cached yet)
            target.rollback_to(state.prompt_len + state.n_out - 1)
            if proposed:
                drafter.commit(state, num_accepted)
        _sync(device)
        total_s = time.perf_counter() - t_start
        return self._result(result, num_tokens, rounds, drafted, accepted, emitted, reached_at,
                            accepted_at, k, draft_s, verify_s, total_s, prefill_s,
                            attention_mask.sum(1))

    def _verify_step(self, proposal: Proposal | None, logits: torch.Tensor, sampling: SamplingParams,
                     generator, verifier, use_greedy_verify: bool, device):
        """(out_tokens [B, k+1], num_accepted [B]) from target logits [B, k+1, V]."""
        if proposal is None:
            draft_tokens = logits.new_zeros((logits.shape[0], 0), dtype=torch.long)
            num_draft = None
        else:
            draft_tokens, num_draft = proposal.tokens, proposal.num_draft
        if use_greedy_verify:
            return greedy_verify(draft_tokens, logits, num_draft)
        target_probs = self._target_probs(logits, sampling)
        k = draft_tokens.shape[1]
        if proposal is not None and proposal.probs is not None:
            draft_probs = proposal.probs
        else:  # a deterministic proposal (prompt lookup, or greedy drafting): q is one-hot
            draft_probs = torch.zeros(logits.shape[0], k, logits.shape[-1], device=logits.device)
            draft_probs.scatter_(-1, draft_tokens[..., None], 1.0)
        return verifier(draft_tokens, draft_probs, target_probs, generator=generator,
                        num_draft=num_draft)

    def _target_probs(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """The target's distributions the verifier compares against (the drafter's transform)."""
        return logits_to_probs(logits, sampling)

    @staticmethod
    def _result(tokens, num_tokens, rounds, drafted, accepted, emitted, reached_at, accepted_at,
                k, draft_s, verify_s, total_s, prefill_s, prompt_len) -> GenerateResult:
        row_stats = []
        for row in range(tokens.shape[0]):
            row_stats.append(SpecStats(
                rounds=int(rounds[row]), drafted=int(drafted[row]), accepted=int(accepted[row]),
                emitted=int(emitted[row]),
                reached_at_position=reached_at[row, :k].tolist(),
                accepted_at_position=accepted_at[row, :k].tolist(),
                # timings: every row shared the whole call's wall-clock time
                draft_s=draft_s, verify_s=verify_s, total_s=total_s, prefill_s=prefill_s,
                prompt_tokens=int(prompt_len[row]), new_tokens=int(num_tokens[row])))
        summed = SpecStats.empty(k)
        for row in row_stats:
            summed = summed.merge(row)
        summed.draft_s, summed.verify_s, summed.total_s, summed.prefill_s = (
            draft_s, verify_s, total_s, prefill_s)
        return GenerateResult(tokens=tokens, stats=summed, row_stats=row_stats,
                              num_tokens=num_tokens.tolist())
