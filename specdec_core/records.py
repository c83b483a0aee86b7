"""The records the decode loop, the drafters and the verifiers pass between each other.

DecodeState  what the loop knows about the batch's rows (drafters read it)
Proposal     what a drafter proposes for one round
GenerateResult, result_from_history   what generate returns, built once at the end of a call
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .stats import SpecStats


@dataclass
class DecodeState:
    """The rows of the batch being decoded. With a dynamic cache finished rows leave the batch
    (select_rows); a static cache keeps its batch and finished rows turn inactive instead."""

    prompt_ids: torch.Tensor     # LongTensor [B, T], left-padded
    prompt_mask: torch.Tensor    # LongTensor [B, T], 1 = real token
    prompt_len: torch.Tensor     # LongTensor [B], real prompt tokens
    out: torch.Tensor            # LongTensor [B, max_new_tokens + K + 1], generated tokens
    n_out: torch.Tensor          # LongTensor [B], generated tokens so far
    prompt_has_padding: bool
    active: torch.Tensor | None = None          # BoolTensor [B]: rows still decoding
    # builds a drafter model's cache of the same kind as the target's
    cache_factory: Callable[[torch.nn.Module], object] | None = None
    accepted_max: int | None = None             # host: the latest round's largest accepted count
    k: int = 0                                  # draft tokens per round at most (the decoder's K)
    # the target's last-layer hidden states [B, T, H] of its latest pass (prefill, then each
    # verify pass), for a drafter with needs_target_hidden (a draft head); else None
    hidden: torch.Tensor | None = None
    # the device's state as the host follows it, for drafters that search on the host
    # (HostDrafter.reads_host_state): no device read in a round. Kept by the decode loop.
    host: "HostView | None" = None
    # device work of one round (the decode loop sets them for a drafter's commit): the round's
    # largest emitted count [] (>= 1), and its accepted counts [B]
    kept_max: torch.Tensor | None = None
    num_accepted: torch.Tensor | None = None

    def select_rows(self, rows: torch.Tensor) -> None:
        for name in ("prompt_ids", "prompt_mask", "prompt_len", "out", "n_out", "active", "hidden"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        if self.host is not None:
            self.host.select_rows(rows.cpu().numpy())


@dataclass
class HostView:
    """Host copies of what a host drafter reads: the prompts (read once per call), the outputs
    (updated from each round's one read), the output lengths and the round's draft limits."""

    prompts: np.ndarray          # [B, T] left-padded prompt ids
    prompt_len: np.ndarray       # [B]
    out: np.ndarray              # [B, N] generated tokens
    n_out: np.ndarray            # [B] generated tokens so far
    limits: np.ndarray | None = None   # [B] draft tokens each row may propose this round

    def append(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Write each row's first counts[b] tokens [B, W] after its output."""
        rows, cols = np.nonzero(np.arange(tokens.shape[1])[None, :] < counts[:, None])
        self.out[rows, self.n_out[rows] + cols] = tokens[rows, cols]
        self.n_out += counts

    def select_rows(self, rows: np.ndarray) -> None:
        for name in ("prompts", "prompt_len", "out", "n_out", "limits"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])


@dataclass
class Proposal:
    tokens: torch.Tensor              # LongTensor [B, k]
    probs: torch.Tensor | None        # FloatTensor [B, k, V]; None: deterministic (one-hot) or greedy
    num_draft: torch.Tensor           # LongTensor [B]: valid tokens per row (0..k)
    max_draft: int | None = None      # host-side max of num_draft when known for free (the loop
                                      # then verifies only max_draft + 1 tokens)

    def parts(self) -> tuple:
        """(tokens, probs, num_draft): what a captured draft returns; Proposal(*parts) again."""
        return self.tokens, self.probs, self.num_draft

    def narrow(self, width: int) -> None:
        """Keep the first `width` draft positions."""
        self.tokens = self.tokens[:, :width]
        if self.probs is not None:
            self.probs = self.probs[:, :width]


@dataclass
class GenerateResult:
    tokens: torch.Tensor                    # LongTensor [B, max_new_tokens], new tokens, padded
    stats: SpecStats                        # summed over rows
    row_stats: list[SpecStats] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # valid new tokens per row (EOS included)
    round_widths: list[int] = field(default_factory=list)  # tokens of each round's verify pass
    round_rows: list[int] = field(default_factory=list)    # rows in each round's verify pass


@dataclass
class Timings:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    widths: list = field(default_factory=list)   # each round's verify width
    rows: list = field(default_factory=list)     # rows each round's verify pass ran over


def result_from_history(tokens: torch.Tensor, num_tokens: torch.Tensor, history: torch.Tensor,
                        k: int, timings: Timings, prompt_len: torch.Tensor) -> GenerateResult:
    """The result of a call from its rounds' history [R, 3, B]: per round and row (drafted,
    accepted, emitted), zero where the row was not decoding. One pass at the end of the call
    instead of a dozen small updates a round."""
    drafted, accepted, emitted = history.sum(0).tolist()
    live = history[:, 2] > 0                                                   # [R, B]
    rounds = live.sum(0).tolist()
    positions = torch.arange(max(k, 1), device=history.device)
    nd, acc = history[:, 0, :, None], history[:, 1, :, None]
    reached_at = ((positions < nd) & (positions <= acc) & live[..., None]).sum(0)[:, :k].tolist()
    accepted_at = ((positions < acc) & live[..., None]).sum(0)[:, :k].tolist()
    lengths = num_tokens.tolist()
    prompts = prompt_len.tolist()
    row_stats = [
        SpecStats(rounds=rounds[row], drafted=drafted[row], accepted=accepted[row],
                  emitted=emitted[row], reached_at_position=reached_at[row],
                  accepted_at_position=accepted_at[row],
                  # timings: every row shared the whole call's wall-clock time
                  draft_s=timings.draft_s, verify_s=timings.verify_s, total_s=timings.total_s,
                  prefill_s=timings.prefill_s, prompt_tokens=prompts[row], new_tokens=lengths[row])
        for row in range(tokens.shape[0])]
    summed = SpecStats.empty(k)
    for row in row_stats:
        summed = summed.merge(row)
    summed.draft_s, summed.verify_s = timings.draft_s, timings.verify_s
    summed.total_s, summed.prefill_s = timings.total_s, timings.prefill_s
    return GenerateResult(tokens=tokens, stats=summed, row_stats=row_stats, num_tokens=lengths,
                          round_widths=list(timings.widths), round_rows=list(timings.rows))
