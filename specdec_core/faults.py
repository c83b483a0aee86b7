"""Deliberately BROKEN verifiers, for measuring the power of the losslessness checks.

Never use these to decode. Each has a mistake that real implementations have made; the sampling
check (validation.sampling_check) must catch every one of them.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams, sample_from
from .verify import _assemble, _num_draft, rejection_sample, relaxed_verify, verify_round


def swapped_verifier(draft_tokens, draft_probs, target_probs, generator=None, num_draft=None):
    """BROKEN: p and q swapped at the draft positions."""
    k = draft_tokens.shape[1]
    swapped_target = torch.cat([draft_probs, target_probs[:, k:]], 1)
    return rejection_sample(draft_tokens, target_probs[:, :k], swapped_target, generator, num_draft)


def off_by_one_bonus(draft_tokens, draft_probs, target_probs, generator=None, num_draft=None):
    """BROKEN: after all drafts are accepted, the bonus is drawn from p one position too early."""
    out, num_accepted = rejection_sample(draft_tokens, draft_probs, target_probs, generator, num_draft)
    batch, k = draft_tokens.shape
    drafted = _num_draft(num_draft, batch, k, target_probs.device)
    all_accepted = (num_accepted == drafted) & (drafted > 0)
    rows = torch.arange(batch, device=target_probs.device)
    early = sample_from(target_probs[rows, (num_accepted - 1).clamp(min=0)], generator)
    fixed = torch.where(all_accepted, early, out.gather(1, num_accepted[:, None]).squeeze(1))
    return _assemble(draft_tokens, num_accepted, fixed), num_accepted


def ignores_temperature(logits, proposal, sampling, generator=None, verifier=None):
    """BROKEN verify round: compares the drafts with the target at temperature 1, whatever the
    request's temperature (the drafter still samples at the request's)."""
    if not sampling.greedy:
        sampling = SamplingParams(temperature=1.0, top_k=sampling.top_k, top_p=sampling.top_p)
    return verify_round(logits, proposal, sampling, generator, verifier)


# name -> keyword arguments for validation.sampling_check
BROKEN_VARIANTS = {
    "relaxed": {"verifier": relaxed_verify},
    "swapped_p_q": {"verifier": swapped_verifier},
    "ignores_temperature": {"verify_round": ignores_temperature},
    "off_by_one_bonus": {"verifier": off_by_one_bonus},
}
