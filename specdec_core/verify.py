"""Verification of drafted tokens against the target.

Shapes: B rows, K drafted positions, V vocabulary.
  draft_tokens  LongTensor  [B, K]      tokens the drafter proposed (drawn from draft_probs)
  draft_probs   FloatTensor [B, K, V]   the drafter's distribution q at each proposed position
  target_probs  FloatTensor [B, K+1, V] the target's distribution p at each position; the last is
                                        the bonus position after all K drafts
  num_draft     LongTensor  [B] | None  valid draft tokens per row (0..K); None means K for all
Every verifier returns (out_tokens [B, K+1], num_accepted [B]): out_tokens holds the accepted
draft tokens, then one more token, then -1; row b emits num_accepted[b] + 1 tokens.

`rejection_sample` (exact) and `greedy_verify` preserve the target's output distribution.
`relaxed_verify` does NOT: it exists only to compare against, and validation must catch it.

`verify_round` is one round's verification as the decode loop runs it: from the target's logits
and a drafter's Proposal to the accepted counts, greedy or sampled. Anything with its signature can
replace it in SpecDecoder (faults.py does, to show that validation catches broken rounds).
"""

from __future__ import annotations

from typing import Callable

import torch

from .records import Proposal
from .sampling import SamplingParams, logits_to_probs, sample_from

Verifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Below this total mass the residual max(0, p - q) is treated as empty and p is used instead.
_RESIDUAL_EPS = 1e-12


def _num_draft(num_draft: torch.Tensor | None, batch: int, k: int, device) -> torch.Tensor:
    if num_draft is None:
        return torch.full((batch,), k, dtype=torch.long, device=device)
    return num_draft.to(device=device, dtype=torch.long).clamp(0, k)


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, K] bool -> number of leading True per row [B]."""
    return accept.long().cumprod(-1).sum(-1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
              next_token: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: draft_tokens[:, :n], then next_token at n, then -1."""
    batch, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device).expand(batch, k + 1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    n = num_accepted[:, None]
    out = torch.where(pos < n, padded, torch.full_like(padded, -1))
    return torch.where(pos == n, next_token[:, None].expand_as(out), out)


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None,
                     num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023), vectorised over B and K."""
    batch, k = draft_tokens.shape
    device = target_probs.device
    num_draft = _num_draft(num_draft, batch, k, device)
    rows = torch.arange(batch, device=device)

    if k > 0:
        ids = draft_tokens.clamp(min=0)[..., None]  # slots past num_draft may hold -1
        p_x = target_probs[:, :k].gather(-1, ids).squeeze(-1)                        # [B, K]
        q_x = draft_probs.gather(-1, ids).squeeze(-1)                                # [B, K]
        u = torch.rand(p_x.shape, generator=generator, device=device)
        # accept x with probability min(1, p(x) / q(x))  <=>  u * q(x) < p(x), u ~ U[0, 1)
        # (strict: a token with p(x) = 0 is never accepted)
        accept = (u * q_x < p_x) & (torch.arange(k, device=device) < num_draft[:, None])
        num_accepted = _first_rejection(accept)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)

    # the one more token, at position n = num_accepted
    p_n = target_probs[rows, num_accepted]                                        # [B, V]
    rejected = num_accepted < num_draft
    if k > 0:
        q_n = draft_probs[rows, num_accepted.clamp(max=k - 1)]                    # [B, V]
        # after a rejection: norm(max(0, p - q)); p itself if that residual is ~0
        residual = (p_n - q_n).clamp_(min=0.0)
        empty = residual.sum(-1, keepdim=True) <= _RESIDUAL_EPS
        residual = torch.where(empty, p_n, residual)
        # all num_draft tokens accepted (including num_draft = 0): the bonus token from p
        next_dist = torch.where(rejected[:, None], residual, p_n)
    else:
        next_dist = p_n
    next_token = sample_from(next_dist, generator)  # sample_from normalises implicitly
    return _assemble(draft_tokens, num_accepted, next_token), num_accepted


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while the draft token equals the target's argmax.

    target_logits [B, K+1, V]. The token after the accepted ones is the target's argmax there
    (the correction after a mismatch, or the bonus after all drafts matched).
    """
    batch, k = draft_tokens.shape
    argmax = target_logits.argmax(-1)                                             # [B, K+1]
    num_draft = _num_draft(num_draft, batch, k, target_logits.device)
    accept = (draft_tokens == argmax[:, :k]) & (
        torch.arange(k, device=argmax.device) < num_draft[:, None])
    num_accepted = _first_rejection(accept)
    next_token = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return _assemble(draft_tokens, num_accepted, next_token), num_accepted


def relaxed_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, generator: torch.Generator | None = None,
                   num_draft: torch.Tensor | None = None, top_k: int = 10,
                   log_gap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """LOSSY "relaxed" verification, for comparison only: it changes the output distribution.

    A draft token is accepted when it is among the target's top_k tokens and its log-probability is
    within log_gap of the target's most likely token; at the first failure the next token is drawn
    from p. Same signature and result as :func:`rejection_sample`, so it can be swapped in to show
    what the validation checks catch.
    """
    del draft_probs  # the relaxed rule ignores the drafter's distribution
    batch, k = draft_tokens.shape
    device = target_probs.device
    num_draft = _num_draft(num_draft, batch, k, device)
    rows = torch.arange(batch, device=device)
    if k > 0:
        logp = target_probs[:, :k].clamp_min(1e-30).log()                          # [B, K, V]
        logp_x = logp.gather(-1, draft_tokens.clamp(min=0)[..., None]).squeeze(-1)
        kth = logp.topk(min(top_k, logp.shape[-1]), dim=-1).values[..., -1]
        ok = (logp_x >= kth) & (logp_x >= logp.max(-1).values - log_gap)
        accept = ok & (torch.arange(k, device=device) < num_draft[:, None])
        num_accepted = _first_rejection(accept)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = sample_from(target_probs[rows, num_accepted], generator)
    return _assemble(draft_tokens, num_accepted, next_token), num_accepted


def verify_round(logits: torch.Tensor, proposal: Proposal | None, sampling: SamplingParams,
                 generator: torch.Generator | None = None,
                 verifier: Verifier | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's verification: (tokens [B, w+1], num_accepted [B]) from the target's logits
    [B, w+1, V] over [pending token, w drafts] (proposal None: w = 0, a plain decoding step).

    Row b emits tokens[b, :num_accepted[b] + 1]; later positions are unspecified (the loop masks
    them). Greedy sampling without an explicit verifier accepts while the draft equals the
    target's argmax -- then the emitted tokens are the argmax itself, read without assembly.
    Otherwise `verifier` (default rejection_sample) compares the target's distributions with the
    drafter's; a proposal without probabilities (prompt lookup, greedy drafts) is one-hot.
    """
    if proposal is None:
        draft_tokens = logits.new_zeros((logits.shape[0], 0), dtype=torch.long)
        num_draft = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    else:
        draft_tokens, num_draft = proposal.tokens, proposal.num_draft
    width = draft_tokens.shape[1]
    if sampling.greedy and verifier is None:
        argmax = logits.argmax(-1)
        match = (draft_tokens == argmax[:, :width]) & (
            torch.arange(width, device=logits.device) < num_draft[:, None])
        return argmax, _first_rejection(match)
    target_probs = logits_to_probs(logits, sampling)
    if proposal is not None and proposal.probs is not None:
        draft_probs = proposal.probs
    else:
        draft_probs = torch.zeros(logits.shape[0], width, logits.shape[-1], device=logits.device)
        draft_probs.scatter_(-1, draft_tokens[..., None], 1.0)
    return (verifier or rejection_sample)(draft_tokens, draft_probs, target_probs,
                                          generator=generator, num_draft=num_draft)
