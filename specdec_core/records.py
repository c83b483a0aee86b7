"""The records the decode loop, the drafters and the verifiers pass between each other.

DecodeState  what the loop knows about the batch's rows (drafters read it)
HostView     the host's copy of prompts and outputs, for drafters that search on the host
Proposal     what a drafter proposes for one round
LoopBuffers  what rounds read and write besides the caches (kept with a static cache)
GenerateResult, result_from_history   what generate returns, built once at the end of a call
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .graphs import RoundGraphs
from .stats import SpecStats

# Eager runs of a round shape before it is captured: real work, which also warms up everything
# the capture needs (kernels chosen, workspaces allocated)
WARMUP_ROUNDS = 1
# Captured round shapes kept per static cache (the least recently used go first)
MAX_ROUND_GRAPHS = 64


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


class LoopBuffers:
    """What rounds read and write besides the caches. On a static cache they are allocated once
    and kept with it (cache.loop), so rounds captured in one call replay in the next; on a
    dynamic cache they are made per call."""

    def __init__(self, batch: int, out_width: int, max_rounds: int, device: torch.device):
        as_long = {"dtype": torch.long, "device": device}
        self.out = torch.zeros(batch, out_width, **as_long)          # generated tokens
        self.n_out = torch.ones(batch, **as_long)                    # their counts
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        self.prompt_len = torch.zeros(batch, **as_long)
        self.history = torch.zeros(max_rounds, 3, batch, **as_long)  # (drafted, accepted, emitted)
        self.round = torch.zeros(1, **as_long)                       # next row of the history
        self.max_new = torch.zeros((), **as_long)
        self.generator = torch.Generator(device=device)
        self.staged: dict[tuple, torch.Tensor] = {}  # host proposals of w drafts: [B, w + 1]
        self.graphs = RoundGraphs(WARMUP_ROUNDS, MAX_ROUND_GRAPHS)

    @classmethod
    def of(cls, target, batch: int, max_new_tokens: int, k: int, device: torch.device) -> "LoopBuffers":
        """The buffers of a call on `target` (a KVCache): a static cache's own, else new ones."""
        if not target.fixed_shapes:
            return cls(batch, max_new_tokens + k + 1, max_new_tokens, device)
        # a static cache holds prompt + max_new_tokens + K + 1 columns at least: as many suffice
        if target.loop is None:
            target.loop = cls(batch, target.max_len, target.max_len, device)
        return target.loop

    def reset(self, prompt_len: torch.Tensor, max_new_tokens: int, pad_token_id: int, seed: int) -> None:
        self.out.fill_(pad_token_id)
        self.n_out.fill_(1)
        self.active.fill_(True)
        self.prompt_len.copy_(prompt_len)
        self.round.zero_()      # every row of the history a call reads, its rounds write whole
        self.max_new.fill_(max_new_tokens)
        self.generator.manual_seed(seed)

    def stage(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        """A host proposal (tokens [B, w], counts [B]) on the device, in one copy."""
        staged = self.staged.get(tokens.shape)   # (rows: a dynamic batch shrinks, width)
        if staged is None:
            staged = self.staged[tokens.shape] = torch.zeros(
                len(counts), tokens.shape[1] + 1, dtype=torch.long, device=self.out.device)
        staged.copy_(torch.from_numpy(np.concatenate([tokens, counts[:, None]], 1)))

    def staged_proposal(self, rows: int, width: int) -> "Proposal":
        """The staged host proposal of `width` drafts as a Proposal (views of the staged buffer:
        what a captured round reads)."""
        staged = self.staged[(rows, width)]
        return Proposal(staged[:, :-1], None, staged[:, -1])


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
