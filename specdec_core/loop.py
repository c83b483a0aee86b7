"""The decode loop: prefill, then rounds of draft -> one verify pass -> accept, for every drafter
and both cache kinds. SpecDecoder (decoder.py) checks the inputs and picks the caches; this module
is the whole decode path, top to bottom.

One round for the batch's active rows:
  1. draft budget: row b may draft min(K, tokens still wanted - 1) tokens (a round emits at most
     num_draft + 1 tokens, so nothing is drafted past max_new_tokens); inactive rows draft none;
  2. the drafter proposes; it may propose fewer (prompt lookup), or none;
  3. the target runs once over [pending token, drafts] for every row;
  4. the verify round (verify.verify_round) accepts num_accepted[b] drafts and adds one token
     (the correction or the bonus); the count stops after an EOS;
  5. the emitted tokens are written back, the round is recorded in the history, and the caches
     roll back to the accepted length (rejected positions become holes; nothing is rebuilt);
  6. rows that emitted EOS or reached max_new_tokens stop: a dynamic cache drops them from the
     batch, a static cache keeps them as inactive rows (fixed shapes).
Plain decoding (no drafter) is the same loop with an empty draft: one target step per token.

The host reads the device once per round (the emitted counts, which say how far caches roll back
and which rows finished), and not at all in plain decoding without EOS. It follows each row's
output length itself, so the draft budget's maximum and the verify width are host integers. The
per-row statistics come from the rounds' history, once at the end of the call.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import numpy as np
import torch

from .drafters import Drafter
from .graphs import synchronize
from .head import HiddenTap, final_norm
from .records import DecodeState, GenerateResult, Timings, result_from_history
from .sampling import SamplingParams
from .verify import Verifier, verify_round


def draft_budget(n_out: torch.Tensor, active: torch.Tensor, k: int, max_new_tokens: int) -> torch.Tensor:
    """[B] draft tokens each row may propose: at most K, none past max_new_tokens, none when inactive."""
    return (max_new_tokens - 1 - n_out).clamp(min=0, max=k) * active


def truncate_at_eos(tokens: torch.Tensor, count: torch.Tensor,
                    eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count [B] cut just after each row's first emitted EOS, hit [B]: rows that emitted one)."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    is_eos = (tokens == eos_token_id) & (columns < count[:, None])
    hit = is_eos.any(1)
    return torch.where(hit, is_eos.long().argmax(1) + 1, count), hit


def write_back(out: torch.Tensor, n_out: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
               pad_token_id: int) -> torch.Tensor:
    """Write each row's first count[b] tokens after its output (padding beyond, overwritten by the
    next round); returns the new output lengths."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    out.scatter_(1, n_out[:, None] + columns,
                 torch.where(columns < count[:, None], tokens, pad_token_id))
    return n_out + count


def decode(target_model: torch.nn.Module, drafter: Drafter | None, k: int, input_ids: torch.Tensor,
           attention_mask: torch.Tensor, max_new_tokens: int, sampling: SamplingParams, seed: int,
           eos_token_id: int | None, pad_token_id: int, session: Callable,
           verify: Callable = verify_round, verifier: Verifier | None = None,
           verify_widths: dict[int, int] | None = None, phase_timing: bool = True) -> GenerateResult:
    """Decode checked inputs (on the target's device); see SpecDecoder.generate for the contract.

    session(target_model, batch, needed_len) is a context manager giving (the target's cache, a
    factory of drafter caches): cache.SequenceCache (dynamic) or a StaticCachePool's static caches.
    verify: the verify round (verify_round's signature); verifier: passed on to it.
    verify_widths: {needed width: width to run} -- filler after the drafts (profile.py).
    phase_timing: synchronise around the draft and verify phases for stats.draft_s / verify_s.
    """
    device = input_ids.device
    batch, prompt_width = input_ids.shape
    generator = torch.Generator(device=device).manual_seed(seed)
    timings = Timings()
    verify_widths = verify_widths or {}
    # a draft head reads the target's last-layer hidden states of every pass (eager passes: a
    # replayed graph would not run the tap)
    wants_hidden = drafter is not None and getattr(drafter, "needs_target_hidden", False)
    tap = HiddenTap(final_norm(target_model)) if wants_hidden else contextlib.nullcontext()
    synchronize(device)
    t_start = time.perf_counter()
    with session(target_model, batch, prompt_width + max_new_tokens + k + 3) as (target, caches), tap:
        state = DecodeState(
            prompt_ids=input_ids, prompt_mask=attention_mask, prompt_len=attention_mask.sum(1),
            out=torch.full((batch, max_new_tokens + k + 1), pad_token_id, dtype=torch.long,
                           device=device),
            n_out=torch.ones(batch, dtype=torch.long, device=device),
            prompt_has_padding=not bool(attention_mask.all()), cache_factory=caches)
        # prefill: the prompt's last logits give the first token
        logits = target.forward(input_ids, attention_mask.bool() if state.prompt_has_padding else None,
                                logits_to_keep=1, graphed=False)
        if wants_hidden:   # identical rows prefill once (cache.py): the tap saw one row
            state.hidden = tap.value.expand(batch, -1, -1) if tap.value.shape[0] != batch else tap.value
        first, _ = verify(logits[:, -1:], None, sampling, generator, verifier)
        state.out[:, 0] = first[:, 0]
        done = np.full(batch, max_new_tokens <= 1)              # host: rows that stopped
        if eos_token_id is not None:
            done |= first[:, 0].cpu().numpy() == eos_token_id
        state.active = torch.from_numpy(~done).to(device)
        if drafter is not None:
            drafter.start(state)
        n_out = np.ones(batch, dtype=np.int64)                  # host: the rows' output lengths
        rows = torch.arange(batch, device=device)              # original index of each row
        history = torch.zeros(max_new_tokens, 3, batch, dtype=torch.long, device=device)
        tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        num_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        synchronize(device)
        timings.prefill_s = time.perf_counter() - t_start
        rounds = 0
        while True:
            if not target.fixed_shapes and done.any():   # finished rows leave the batch
                tokens[rows] = state.out[:, :max_new_tokens]
                num_tokens[rows] = state.n_out
                if done.all():
                    break
                keep = torch.from_numpy(np.flatnonzero(~done)).to(device)
                for holder in (state, target, drafter):
                    if holder is not None:
                        holder.select_rows(keep)
                rows, done, n_out = rows[keep], done[~done], n_out[~done]
            if done.all():
                break
            active = state.active
            # 1-2. draft
            t0 = time.perf_counter()
            num_draft = draft_budget(state.n_out, active, k, max_new_tokens)
            budget = min(k, max_new_tokens - 1 - int(n_out[~done].min()))
            proposal = None
            if drafter is not None and budget > 0:
                proposal = drafter.propose(state, budget, num_draft, sampling, generator)
                proposal.num_draft = torch.minimum(proposal.num_draft, num_draft)
                proposal.narrow(budget if proposal.max_draft is None
                                else min(budget, proposal.max_draft))
                if phase_timing:
                    synchronize(device)
                    timings.draft_s += time.perf_counter() - t0
            # 3. one target pass over [pending, drafts]
            t0 = time.perf_counter()
            pending = state.out.gather(1, state.n_out[:, None] - 1)
            width = 1 + (proposal.tokens.shape[1] if proposal is not None else 0)
            run_width = verify_widths.get(width, width) if width > 1 else 1
            parts = [pending] + ([proposal.tokens] if proposal is not None else [])
            if run_width > width:  # filler after the drafts: causal logits before it are unchanged
                parts.append(pending.expand(-1, run_width - width))
            valid = active[:, None].expand(-1, run_width) if target.fixed_shapes else None
            logits = target.forward(torch.cat(parts, 1) if len(parts) > 1 else pending, valid,
                                    graphed=not wants_hidden)
            if wants_hidden:
                state.hidden = tap.value
            # 4. accept; an inactive row drafted nothing and emits nothing
            out_tokens, num_accepted = verify(
                logits[:, :width], proposal if width > 1 else None, sampling, generator, verifier)
            count = (num_accepted + 1) * active
            still = state.n_out + count < max_new_tokens
            if eos_token_id is not None:
                count, hit = truncate_at_eos(out_tokens[:, :width], count, eos_token_id)
                still &= ~hit
            # 5. write back, record, roll back
            state.n_out = write_back(state.out, state.n_out, out_tokens[:, :width], count, pad_token_id)
            state.active = active & still
            drafted = proposal.num_draft if proposal is not None else torch.zeros_like(count)
            history[rounds].index_copy_(1, rows, torch.stack([drafted, num_accepted, count]))
            rounds += 1
            if drafter is None and eos_token_id is None:   # one token per active row: known
                counts = (~done).astype(np.int64)
                n_out += counts
                done = n_out >= max_new_tokens
            else:   # the round's one read of the device
                counts, still_active = torch.stack([count, state.active.long()]).cpu().numpy()
                n_out += counts
                done = ~still_active.astype(bool)
            kept_max = max(int(counts.max()), 1)
            state.accepted_max = kept_max - 1
            if run_width > 1:  # the newest token is not cached yet
                target.rollback_to(state.prompt_len + state.n_out - 1,
                                   width=target.last_start + kept_max)
            if proposal is not None:
                drafter.commit(state, num_accepted)
            if phase_timing:
                synchronize(device)
                timings.verify_s += time.perf_counter() - t0
        tokens[rows] = state.out[:, :max_new_tokens]
        num_tokens[rows] = state.n_out
    synchronize(device)
    timings.total_s = time.perf_counter() - t_start
    return result_from_history(tokens, num_tokens, history[:rounds], k, timings,
                               attention_mask.sum(1))
