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
  6. rows that emitted EOS or reached max_new_tokens (or `stop_after`, when given) stop: a
     dynamic cache drops them from the batch, a static cache keeps them as inactive rows (fixed
     shapes).
Plain decoding (no drafter) is the same loop with an empty draft: one target step per token.

The phases, as `decode` reads: `Round.plan` (host: budget, the draft source's host part, the round
shape's graph, reservations), `Round.run_draft` and `Round.run_accept` (device work: steps 2-5),
`HostMirror.apply` (the round's one read of the device) and `Round.follow` (the host parts after
it). Where drafts come from is a `DraftSource`: `DeviceSource` (a device-side drafter on static
caches: proposes and commits inside the round), `HostSource` (prompt lookup, suffix: searched on
the host, staged in one copy) or `EagerSource` (anything else: proposes before the round, commits
after the read).

On static caches every buffer a round touches persists across rounds (and across calls, with the
cache), so with cuda_graphs each round shape -- drafted width, verify width, drafter and settings
-- is captured as graphs after one eager run and replayed from then on (graphs.RoundGraphs): a
round is one or two replays and at most one read of the device. That read (the emitted counts,
which rows are still active and the emitted tokens) tells the host how far caches rolled back,
which rows finished, and what a host drafter searches next; plain decoding without EOS needs none.
The per-row statistics come from the rounds' history, once at the end of the call.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from .cache import KVCache
from .drafters import Drafter
from .graphs import RoundGraph, synchronize
from .records import (DecodeState, GenerateResult, HostView, LoopBuffers, Proposal, Timings,
                      result_from_history)
from .sampling import SamplingParams
from .static_cache import device_only, eager_forwards
from .tap import HiddenTap
from .verify import Verifier, verify_round


def draft_budget(n_out, active, k: int, max_new_tokens):
    """[B] draft tokens each row may propose: at most K, none past max_new_tokens, none when
    inactive. The one rule, for the device (tensors) and the host mirror (numpy arrays)."""
    return (max_new_tokens - 1 - n_out).clip(0, k) * active


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


@dataclass
class RoundPlan:
    """A round as the host planned it."""

    source: "DraftSource | None"        # where the drafts come from; None: no drafts this round
    drafted: int = 0                    # draft positions (the proposal's width)
    proposal: Proposal | None = None    # an eager proposal, made before the round
    run_width: int = 1                  # tokens the verify pass runs (1 + drafted, or more: filler)
    graph: RoundGraph | None = None     # the round shape's captured graphs (static caches)

    @property
    def width(self) -> int:
        return 1 + self.drafted


class DraftSource:
    """Where a round's drafts come from, and when the drafter's own steps run: `plan` on the host
    before the round, `reserve` after the target's reservation, `draft` as the round's first
    device work, `proposal` inside the accept body (captured with it), `commit_in_round` inside it
    after the rollback, `after_read` on the host after the round's one read."""

    name: ClassVar[str]

    def __init__(self, round_: "Round"):
        self.round, self.drafter, self.state = round_, round_.drafter, round_.state

    def plan(self, budget: int, mirror: "HostMirror") -> RoundPlan:
        return RoundPlan(self, budget)

    def capturable(self) -> bool:
        return True

    def reserve(self, drafted: int) -> None:
        pass

    def draft(self, plan: RoundPlan) -> Proposal | None:
        return plan.proposal

    def proposal(self, plan: RoundPlan, proposal: Proposal | None) -> Proposal | None:
        return proposal

    def commit_in_round(self, num_accepted: torch.Tensor) -> None:
        pass

    def after_read(self) -> None:
        self.drafter.commit(self.state, self.state.num_accepted)


class DeviceSource(DraftSource):
    """A device-side drafter on static caches: proposes and commits inside the round (captured
    with it); the host reserves its columns before and follows them after the read."""

    name = "device"

    def plan(self, budget: int, mirror: "HostMirror") -> RoundPlan:
        """K drafts every round, also where fewer are wanted (near max_new_tokens): the rows'
        budgets cap what is accepted on the device (num_draft), so every round of a call has one
        shape -- captured once, never a narrower one first met in a later call -- and a round
        costs the same however close to the end it is."""
        return RoundPlan(self, self.round.k)

    def capturable(self) -> bool:
        return self.drafter.capturable()

    def reserve(self, drafted: int) -> None:
        self.drafter.reserve(self.state, drafted)

    def draft(self, plan: RoundPlan) -> Proposal | None:
        if plan.graph is None:
            return self.round.draft(plan.drafted)
        plan.graph.run("draft", functools.partial(draft_parts, self.round, plan.drafted))
        return None             # the accept body reads the draft graph's output

    def proposal(self, plan: RoundPlan, proposal: Proposal | None) -> Proposal:
        return Proposal(*plan.graph.parts["draft"].out) if plan.graph is not None else proposal

    def commit_in_round(self, num_accepted: torch.Tensor) -> None:
        self.drafter.commit(self.state, num_accepted)

    def after_read(self) -> None:
        self.drafter.follow(self.state)


class HostSource(DraftSource):
    """A drafter that searches on the host (prompt lookup, suffix): the host mirror's view of
    prompts and outputs, within each row's budget; the proposal reaches the device in one copy."""

    name = "host"

    def plan(self, budget: int, mirror: "HostMirror") -> RoundPlan:
        host = self.state.host
        host.limits = mirror.limits
        found, counts = self.drafter.propose_host(host, budget)
        drafted = min(budget, int(counts.max(initial=0)))
        if drafted == 0:
            return RoundPlan(None)
        self.round.bufs.stage(found[:, :drafted], counts)
        return RoundPlan(self, drafted)

    def proposal(self, plan: RoundPlan, proposal: Proposal | None) -> Proposal:
        return self.round.bufs.staged_proposal(self.state.out.shape[0], plan.drafted)


class EagerSource(DraftSource):
    """Any other drafter (device-side drafters on dynamic caches): proposes before the round,
    commits after the read. Its proposals are fresh tensors, so its rounds are not captured."""

    name = "eager"

    def plan(self, budget: int, mirror: "HostMirror") -> RoundPlan:
        proposal = self.round.draft(budget)
        drafted = budget if proposal.max_draft is None else min(budget, proposal.max_draft)
        proposal.narrow(drafted)
        return RoundPlan(self, drafted, proposal)

    def capturable(self) -> bool:
        return False


def draft_source(round_: "Round") -> DraftSource | None:
    drafter = round_.drafter
    if drafter is None:
        return None
    if round_.target.fixed_shapes and drafter.device_side:
        return DeviceSource(round_)
    return HostSource(round_) if drafter.reads_host_state else EagerSource(round_)


class HostMirror:
    """What the host knows of the batch between rounds, updated from each round's one read:
    which rows are done, their output lengths, the original index of each row still in the batch
    (a dynamic batch drops finished rows), the rounds so far, and -- for a host drafter -- the
    host's copy of prompts and outputs (state.host, whose output lengths are the mirror's)."""

    def __init__(self, batch: int, max_new_tokens: int, pad_token_id: int, reads: bool,
                 device: torch.device, stop_after: int | None = None):
        self.max_new, self.pad, self.reads = max_new_tokens, pad_token_id, reads
        self.stop_after = max_new_tokens if stop_after is None else min(stop_after, max_new_tokens)
        self.done = np.full(batch, self.stop_after <= 1)
        self._n_out = np.ones(batch, dtype=np.int64)
        self.host: HostView | None = None
        self.rows = torch.arange(batch, device=device)          # original index of each row
        self.tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.num_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.rounds = 0
        self.limits: np.ndarray | None = None    # [B] each row's draft budget this round

    @property
    def n_out(self) -> np.ndarray:
        return self.host.n_out if self.host is not None else self._n_out

    def start(self, state: DecodeState, first: torch.Tensor, eos_token_id: int | None,
              host_view: bool) -> None:
        """After prefill: rows whose first token ended them, and the host view a host drafter reads."""
        if eos_token_id is not None or host_view:
            first_host = first.cpu().numpy()
            if eos_token_id is not None:
                self.done |= first_host == eos_token_id
        state.active.copy_(torch.from_numpy(~self.done))
        if host_view:
            out = np.full(tuple(state.out.shape), self.pad, dtype=np.int64)
            out[:, 0] = first_host
            self.host = state.host = HostView(state.prompt_ids.cpu().numpy(),
                                              state.prompt_len.cpu().numpy(), out, self._n_out)

    def budget(self, k: int) -> int:
        """The round's draft width: the largest budget of an active row (limits: every row's)."""
        self.limits = draft_budget(self.n_out, ~self.done, k, self.max_new)
        return int(self.limits.max(initial=0))

    def next_round(self, state: DecodeState, holders: tuple) -> bool:
        """Whether a round is due; on a dynamic batch finished rows leave it first (their tokens
        are collected, `holders` -- the target's cache, the drafter -- drop them)."""
        if holders[0].fixed_shapes or not self.done.any():
            return not self.done.all()
        self.collect(state)
        if self.done.all():
            return False
        keep = torch.from_numpy(np.flatnonzero(~self.done)).to(self.rows.device)
        state.select_rows(keep)
        for holder in holders:
            if holder is not None:
                holder.select_rows(keep)
        self.rows, self.done = self.rows[keep], self.done[~self.done]
        if self.host is None:
            self._n_out = self._n_out[keep.cpu().numpy()]
        return True

    def apply(self, report: torch.Tensor, state: DecodeState) -> int:
        """The round's one read (emitted counts, still-active rows, emitted tokens); without a
        drafter or EOS the counts are known (one token per active row) and nothing is read.
        Returns the round's largest emitted count (>= 1)."""
        if self.reads:
            report = report.cpu().numpy()
            counts = report[:, 0]
            if self.host is not None:
                self.host.append(report[:, 2:], counts)
            else:
                self._n_out += counts
            self.done = report[:, 1] == 0
        else:
            counts = (~self.done).astype(np.int64)
            self._n_out += counts
            self.done = self._n_out >= self.max_new
        if self.stop_after < self.max_new:
            # rows with stop_after tokens stop early; the device learns it with the next round
            stopped = (self.n_out >= self.stop_after) & ~self.done
            if stopped.any():
                self.done |= stopped
                state.active.copy_(torch.from_numpy(~self.done))
        self.rounds += 1
        kept_max = max(int(counts.max()), 1)
        state.accepted_max = kept_max - 1
        return kept_max

    def collect(self, state: DecodeState) -> None:
        """The rows' tokens and counts, into their original places."""
        self.tokens[self.rows] = state.out[:, :self.max_new]
        self.num_tokens[self.rows] = state.n_out


class Round:
    """One decode call's rounds: the host's plan and follow-up around the device work (`draft`,
    `accept`). The device work touches only tensors that persist across rounds, so on static
    caches it is captured and replayed."""

    def __init__(self, target: KVCache, drafter: Drafter | None, state: DecodeState,
                 bufs: LoopBuffers, k: int, sampling: SamplingParams, eos_token_id: int | None,
                 pad_token_id: int, verify: Callable, verifier: Verifier | None,
                 tap: HiddenTap | None, verify_widths: dict[int, int]):
        self.target, self.drafter, self.state, self.bufs, self.k = target, drafter, state, bufs, k
        self.sampling, self.eos_token_id, self.pad_token_id = sampling, eos_token_id, pad_token_id
        self.verify, self.verifier, self.tap = verify, verifier, tap
        self.verify_widths = verify_widths
        # a static batch keeps its finished rows: they write holes, and the forwards inside a round
        # are device work only (the host reserved them)
        self.fixed = target.fixed_shapes
        self.device_work = device_only if self.fixed else contextlib.nullcontext
        self.graphs_on = self.fixed and target.cuda_graphs

    def prefill(self) -> torch.Tensor:
        """The prompts through the target; the first token of every row [B]."""
        state = self.state
        logits = self.target.forward(state.prompt_ids,
                                     state.prompt_mask.bool() if state.prompt_has_padding else None,
                                     logits_to_keep=1, graphed=False)
        if self.tap is not None:   # identical rows prefill once (cache.py): the tap saw one row
            hidden, batch = self.tap.value, state.prompt_ids.shape[0]
            state.hidden = hidden.expand(batch, -1, -1) if hidden.shape[0] != batch else hidden
        first, _ = self.verify(logits[:, -1:], None, self.sampling, self.bufs.generator, self.verifier)
        state.out[:, 0] = first[:, 0]
        return first[:, 0]

    def plan(self, source: DraftSource | None, budget: int, mirror: HostMirror) -> RoundPlan:
        """The host's part before the round: the drafts' source and width, the verify width, the
        round shape's graph, and the columns the round's forwards write."""
        plan = source.plan(budget, mirror) if source is not None and budget > 0 else RoundPlan(None)
        if plan.width > 1:
            plan.run_width = self.verify_widths.get(plan.width, plan.width)
        plan.graph = self.graph(plan)
        self.target.reserve(plan.run_width)
        if plan.source is not None:
            plan.source.reserve(plan.drafted)
        return plan

    def graph(self, plan: RoundPlan) -> RoundGraph | None:
        if not self.graphs_on or (plan.source is not None and not plan.source.capturable()):
            return None
        settings = (self.eos_token_id, self.pad_token_id, self.sampling, self.verify, self.verifier)
        if plan.source is None:   # a target step alone: one shape whatever the drafter and K
            return self.bufs.graphs.get((None, 0, plan.run_width) + settings, self.state.out.device,
                                        (self.bufs.generator,), (self.verify, self.verifier))
        drafter = self.drafter
        key = (plan.source.name, plan.drafted, plan.run_width, self.k, id(drafter),
               drafter.graph_key()) + settings
        # the drafter's own generators exist once it has started (after this Round was made)
        generators = (self.bufs.generator,) + drafter.generators()
        return self.bufs.graphs.get(key, self.state.out.device, generators,
                                    (drafter, self.verify, self.verifier))

    def run_draft(self, plan: RoundPlan) -> Proposal | None:
        return plan.source.draft(plan) if plan.source is not None else None

    def run_accept(self, plan: RoundPlan, proposal: Proposal | None, rows: torch.Tensor,
                   rounds: int) -> torch.Tensor:
        if plan.graph is None:
            return self.accept(plan, proposal, rows, rounds)
        # the body is bound to this round's values (a stand-in may rerun it later)
        return plan.graph.run("accept", functools.partial(self.accept, plan, None, None, 0))

    def follow(self, plan: RoundPlan, kept_max: int) -> None:
        """The host's part after the round's read."""
        if plan.run_width > 1:   # the newest token is not cached yet
            self.target.follow(self.target.last_start + kept_max)
        if plan.source is not None:
            plan.source.after_read()

    # -- device work ---------------------------------------------------------------------------
    def draft(self, k: int) -> Proposal:
        state, drafter = self.state, self.drafter
        num_draft = draft_budget(state.n_out, state.active, self.k, self.bufs.max_new)
        with self.device_work() if drafter.device_side else contextlib.nullcontext():
            proposal = drafter.propose(state, k, num_draft, self.sampling, self.bufs.generator)
        proposal.num_draft = torch.minimum(proposal.num_draft, num_draft)
        return proposal

    def accept(self, plan: RoundPlan, proposal: Proposal | None, rows: torch.Tensor | None,
               rounds: int) -> torch.Tensor:
        """One target pass over [pending, drafts], then acceptance and bookkeeping. Returns the
        report [B, 2 + width]: emitted count, still active, the emitted tokens."""
        state, width = self.state, plan.width
        if plan.source is not None:
            proposal = plan.source.proposal(plan, proposal)
        with self.device_work():
            start = self.target.mark()
            logits = self._verify_pass(proposal, width, plan.run_width)
            out_tokens, num_accepted = self.verify(logits[:, :width], proposal, self.sampling,
                                                   self.bufs.generator, self.verifier)
            out_tokens = out_tokens[:, :width]
            count, still = self._write(out_tokens, num_accepted)
            drafted = proposal.num_draft if proposal is not None else torch.zeros_like(count)
            self._record(torch.stack([drafted, num_accepted, count]), rows, rounds)
            state.num_accepted = num_accepted
            state.kept_max = count.max().clamp(min=1)
            if plan.run_width > 1:  # the caches roll back to the accepted length
                self.target.rollback(state.prompt_len + state.n_out - 1, start + state.kept_max)
            if plan.source is not None:
                plan.source.commit_in_round(num_accepted)
            report = torch.cat([count[:, None], still[:, None].long(), out_tokens], 1)
            state.active.copy_(still)
        return report

    def _verify_pass(self, proposal: Proposal | None, width: int, run_width: int) -> torch.Tensor:
        """The target's logits over [pending, drafts, filler] (filler after the drafts leaves the
        causal logits before it unchanged); the tap hands the hidden states to a draft head."""
        state = self.state
        pending = state.out.gather(1, state.n_out[:, None] - 1)
        parts = [pending] + ([proposal.tokens] if proposal is not None else [])
        if run_width > width:
            parts.append(pending.expand(-1, run_width - width))
        valid = state.active[:, None].expand(-1, run_width) if self.fixed else None
        # (a hook inside a compiled body would not hand out its tensor: not compiled)
        with eager_forwards() if self.tap is not None else contextlib.nullcontext():
            logits = self.target.forward(torch.cat(parts, 1) if len(parts) > 1 else pending, valid,
                                         graphed=False)
        if self.tap is not None:
            state.hidden = self.tap.value
        return logits

    def _write(self, out_tokens: torch.Tensor, num_accepted: torch.Tensor):
        """Emit each active row's accepted drafts + 1 (cut after an EOS); (count [B], still [B])."""
        state, active = self.state, self.state.active
        count = (num_accepted + 1) * active          # an inactive row emits nothing
        still = state.n_out + count < self.bufs.max_new
        if self.eos_token_id is not None:
            count, hit = truncate_at_eos(out_tokens, count, self.eos_token_id)
            still &= ~hit
        state.n_out.copy_(write_back(state.out, state.n_out, out_tokens, count, self.pad_token_id))
        return count, still & active

    def _record(self, record: torch.Tensor, rows: torch.Tensor | None, rounds: int) -> None:
        """The round's (drafted, accepted, emitted) [3, B] into the history: at the device's round
        counter (static: captured rounds), or at `rounds` under each row's original index."""
        bufs = self.bufs
        if self.fixed:
            bufs.history.index_copy_(0, bufs.round, record[None])
        else:
            bufs.history[rounds].index_copy_(1, rows, record)
        bufs.round.add_(1)


def draft_parts(round_: Round, k: int) -> tuple:
    return round_.draft(k).parts()


def _lap(device: torch.device, t0: float, on: bool = True) -> float:
    """Seconds since t0, after the device's queued work (0 when not timed)."""
    if not on:
        return 0.0
    synchronize(device)
    return time.perf_counter() - t0


def decode(target_model: torch.nn.Module, drafter: Drafter | None, k: int, input_ids: torch.Tensor,
           attention_mask: torch.Tensor, max_new_tokens: int, sampling: SamplingParams, seed: int,
           eos_token_id: int | None, pad_token_id: int, session: Callable,
           verify: Callable = verify_round, verifier: Verifier | None = None,
           verify_widths: dict[int, int] | None = None, phase_timing: bool = True,
           stop_after: int | None = None) -> GenerateResult:
    """Decode checked inputs (on the target's device); see SpecDecoder.generate for the contract.

    session(target_model, batch, needed_len) is a context manager giving (the target's cache, a
    factory of drafter caches): cache.SequenceCache (dynamic) or a StaticCachePool's static caches.
    verify: the verify round (verify_round's signature); verifier: passed on to it.
    verify_widths: {needed width: width to run} -- filler after the drafts (profile.py).
    phase_timing: synchronise around the draft and verify phases for stats.draft_s / verify_s.
    stop_after: a row stops once it holds this many tokens (it may hold more: a round's accepted
    drafts are kept); the draft budget still counts to max_new_tokens, so rounds draft as they
    would in a longer call.
    """
    device, (batch, prompt_width), timings = input_ids.device, input_ids.shape, Timings()
    # a draft head reads the target's hidden states of every pass: its tap (final norm or layers)
    tap = drafter.target_tap(target_model) if drafter is not None and drafter.needs_target_hidden else None
    synchronize(device)
    t_start = time.perf_counter()
    with session(target_model, batch, prompt_width + max_new_tokens + k + 3) as (target, caches), \
            tap if tap is not None else contextlib.nullcontext():
        bufs = LoopBuffers.of(target, batch, max_new_tokens, k, device)
        bufs.reset(attention_mask.sum(1), max_new_tokens, pad_token_id, seed)
        state = DecodeState(
            prompt_ids=input_ids, prompt_mask=attention_mask, prompt_len=bufs.prompt_len,
            out=bufs.out, n_out=bufs.n_out, active=bufs.active,
            prompt_has_padding=not bool(attention_mask.all()), cache_factory=caches, k=k)
        round_ = Round(target, drafter, state, bufs, k, sampling, eos_token_id, pad_token_id,
                       verify, verifier, tap, verify_widths or {})
        # the host reads the device once a round unless it knows the counts (plain, no EOS)
        mirror = HostMirror(batch, max_new_tokens, pad_token_id,
                            reads=drafter is not None or eos_token_id is not None, device=device,
                            stop_after=stop_after)
        mirror.start(state, round_.prefill(), eos_token_id,
                     host_view=drafter is not None and drafter.reads_host_state)
        if drafter is not None:
            drafter.start(state)
        source = draft_source(round_)
        timings.prefill_s = _lap(device, t_start)
        while mirror.next_round(state, (target, drafter)):
            t0 = time.perf_counter()
            plan = round_.plan(source, mirror.budget(k), mirror)
            proposal = round_.run_draft(plan)
            timings.draft_s += _lap(device, t0, phase_timing and plan.source is not None)
            t0 = time.perf_counter()
            report = round_.run_accept(plan, proposal, mirror.rows, mirror.rounds)
            timings.widths.append(plan.run_width)
            timings.rows.append(int(mirror.rows.shape[0]))   # finished rows left (dynamic)
            round_.follow(plan, mirror.apply(report, state))
            timings.verify_s += _lap(device, t0, phase_timing)
        mirror.collect(state)
        history = bufs.history[:mirror.rounds].clone()    # the buffers serve the next call
    timings.total_s = _lap(device, t_start)
    return result_from_history(mirror.tokens, mirror.num_tokens, history, k, timings,
                               attention_mask.sum(1))
