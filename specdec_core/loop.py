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

Steps 1-5 are device work (`Round.draft` and `Round.accept`); the host does only its own
bookkeeping around them. On static caches every buffer a round touches persists across rounds
(and across calls, with the cache), so with cuda_graphs each round shape -- drafted width, verify
width, drafter and settings -- is captured as graphs after one eager run and replayed from then on:
a round is one or two replays and at most one read of the device. That read (the emitted counts,
which rows are still active and the emitted tokens) tells the host how far caches rolled back,
which rows finished, and what a host drafter searches next; plain decoding without EOS needs none.
The per-row statistics come from the rounds' history, once at the end of the call.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from .drafters import Drafter
from .graphs import CapturedGraph, RecordedGraph, synchronize
from .head import HiddenTap, final_norm
from .records import DecodeState, GenerateResult, HostView, Proposal, Timings, result_from_history
from .sampling import SamplingParams
from .static_cache import device_only, eager_forwards
from .verify import Verifier, verify_round


def draft_budget(n_out: torch.Tensor, active: torch.Tensor, k: int,
                 max_new_tokens: int | torch.Tensor) -> torch.Tensor:
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


# Eager runs of a round shape before it is captured: real work, which also warms up everything
# the capture needs (kernels chosen, workspaces allocated)
WARMUP_ROUNDS = 1
# Captured round shapes kept per static cache (the least recently used go first)
MAX_ROUND_GRAPHS = 64


class LoopBuffers:
    """What rounds read and write besides the caches. On a static cache they are allocated once
    and kept with it (extras["loop"]), so rounds captured in one call replay in the next; on a
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
        self.graphs: OrderedDict = OrderedDict()     # round shape -> RoundGraph
        self.seen: dict = {}                         # round shape -> eager runs so far

    @classmethod
    def of(cls, target, batch: int, max_new_tokens: int, k: int, device: torch.device) -> "LoopBuffers":
        if not target.fixed_shapes:
            return cls(batch, max_new_tokens + k + 1, max_new_tokens, device)
        # a static cache holds prompt + max_new_tokens + K + 1 columns at least: as many suffice
        bufs = target.extras.get("loop")
        if bufs is None:
            bufs = target.extras["loop"] = cls(batch, target.max_len, target.max_len, device)
        return bufs

    def reset(self, prompt_len: torch.Tensor, max_new_tokens: int, pad_token_id: int, seed: int) -> None:
        self.out.fill_(pad_token_id)
        self.n_out.fill_(1)
        self.active.fill_(True)
        self.prompt_len.copy_(prompt_len)
        self.round.zero_()      # every row of the history a call reads, its rounds write whole
        self.max_new.fill_(max_new_tokens)
        self.generator.manual_seed(seed)

    def stage(self, tokens: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        """A host proposal (tokens [B, w], counts [B]) on the device, in one copy."""
        staged = self.staged.get(tokens.shape)   # (rows: a dynamic batch shrinks, width)
        if staged is None:
            staged = self.staged[tokens.shape] = torch.zeros(
                len(counts), tokens.shape[1] + 1, dtype=torch.long, device=self.out.device)
        staged.copy_(torch.from_numpy(np.concatenate([tokens, counts[:, None]], 1)))
        return staged


class RoundGraph:
    """One round shape captured: its parts (draft, accept), each recorded on its first run."""

    def __init__(self, device: torch.device, generators: tuple, holds: tuple):
        self.device, self.generators = device, generators
        self.holds = holds              # what the key names by id: kept alive with the graphs
        self.parts: dict[str, CapturedGraph] = {}

    def run(self, part: str, body: Callable):
        graph = self.parts.get(part)
        if graph is None:
            graph = self.parts[part] = (CapturedGraph if self.device.type == "cuda" else RecordedGraph)()
            graph.record(body, self.device, self.generators)
        graph.replay()
        return graph.out


class Round:
    """The device work of one round, for one decode call: `draft` (a device-side proposal) and
    `accept` (verify pass, acceptance, write-back, history, rollbacks). Both touch only tensors
    that persist across rounds, so on static caches they can be captured and replayed."""

    def __init__(self, target, drafter: Drafter | None, state: DecodeState, bufs: LoopBuffers,
                 k: int, sampling: SamplingParams, eos_token_id: int | None, pad_token_id: int,
                 verify: Callable, verifier: Verifier | None, tap):
        self.target, self.drafter, self.state, self.bufs, self.k = target, drafter, state, bufs, k
        self.sampling, self.eos_token_id, self.pad_token_id = sampling, eos_token_id, pad_token_id
        self.verify, self.verifier, self.tap = verify, verifier, tap
        self.fixed = target.fixed_shapes

    def device_work(self):
        """Forwards on static caches inside it are device work only (the host reserved them)."""
        return device_only() if self.fixed else contextlib.nullcontext()

    def draft(self, k: int) -> Proposal:
        state, drafter = self.state, self.drafter
        num_draft = draft_budget(state.n_out, state.active, self.k, self.bufs.max_new)
        with self.device_work() if drafter.device_side else contextlib.nullcontext():
            proposal = drafter.propose(state, k, num_draft, self.sampling, self.bufs.generator)
        proposal.num_draft = torch.minimum(proposal.num_draft, num_draft)
        return proposal

    def accept(self, source: str | None, width: int, run_width: int, proposal: Proposal | None,
               rows: torch.Tensor, rounds: int) -> torch.Tensor:
        """One target pass over [pending, drafts], then acceptance and bookkeeping. Returns the
        report [B, 2 + width]: emitted count, still active, the emitted tokens."""
        state, bufs, target = self.state, self.bufs, self.target
        if source == "host":
            staged = bufs.staged[(state.out.shape[0], width - 1)]
            proposal = Proposal(staged[:, :-1], None, staged[:, -1])
        active = state.active
        with self.device_work():
            start = target.write_column.clone() if self.fixed else None
            pending = state.out.gather(1, state.n_out[:, None] - 1)
            parts = [pending] + ([proposal.tokens] if proposal is not None else [])
            if run_width > width:  # filler after the drafts: causal logits before it are unchanged
                parts.append(pending.expand(-1, run_width - width))
            valid = active[:, None].expand(-1, run_width) if self.fixed else None
            with eager_forwards() if self.tap is not None else contextlib.nullcontext():
                # (a hook inside a compiled body would not hand out its tensor: not compiled)
                logits = target.forward(torch.cat(parts, 1) if len(parts) > 1 else pending, valid,
                                        graphed=False)
            if self.tap is not None:
                state.hidden = self.tap.value
            # an inactive row drafted nothing and emits nothing
            out_tokens, num_accepted = self.verify(logits[:, :width], proposal, self.sampling,
                                                   bufs.generator, self.verifier)
            out_tokens = out_tokens[:, :width]
            count = (num_accepted + 1) * active
            still = state.n_out + count < bufs.max_new
            if self.eos_token_id is not None:
                count, hit = truncate_at_eos(out_tokens, count, self.eos_token_id)
                still &= ~hit
            state.n_out.copy_(write_back(state.out, state.n_out, out_tokens, count, self.pad_token_id))
            still &= active
            drafted = proposal.num_draft if proposal is not None else torch.zeros_like(count)
            record = torch.stack([drafted, num_accepted, count])
            if self.fixed:
                bufs.history.index_copy_(0, bufs.round, record[None])
            else:
                bufs.history[rounds].index_copy_(1, rows, record)
            bufs.round.add_(1)
            state.num_accepted = num_accepted
            if self.fixed:   # roll back on the device; the host follows after its read
                state.kept_max = count.max().clamp(min=1)
                if run_width > 1:  # the newest token is not cached yet
                    target.rollback_device(state.prompt_len + state.n_out - 1, start + state.kept_max)
                if source == "device":
                    self.drafter.commit(state, num_accepted)
            report = torch.cat([count[:, None], still[:, None].long(), out_tokens], 1)
            state.active.copy_(still)
        return report


def draft_parts(round_: Round, k: int) -> tuple:
    return round_.draft(k).parts()


def accept_captured(round_: Round, drafts: CapturedGraph | None, source: str | None, width: int,
                    run_width: int) -> torch.Tensor:
    """Round.accept of a captured round: the proposal is the captured draft's output."""
    proposal = Proposal(*drafts.out) if drafts is not None else None
    return round_.accept(source, width, run_width, proposal, None, 0)


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
    timings = Timings()
    verify_widths = verify_widths or {}
    # a draft head reads the target's last-layer hidden states of every pass: a tap on the final
    # norm (inside a captured round it hands out the graph's own tensor, updated by each replay)
    wants_hidden = drafter is not None and getattr(drafter, "needs_target_hidden", False)
    tap = HiddenTap(final_norm(target_model)) if wants_hidden else contextlib.nullcontext()
    host_drafter = drafter is not None and drafter.reads_host_state
    # the host reads the device once a round unless it knows the counts (plain, no EOS)
    reads = drafter is not None or eos_token_id is not None
    synchronize(device)
    t_start = time.perf_counter()
    with session(target_model, batch, prompt_width + max_new_tokens + k + 3) as (target, caches), tap:
        fixed = target.fixed_shapes
        bufs = LoopBuffers.of(target, batch, max_new_tokens, k, device)
        prompt_len = attention_mask.sum(1)
        bufs.reset(prompt_len, max_new_tokens, pad_token_id, seed)
        state = DecodeState(
            prompt_ids=input_ids, prompt_mask=attention_mask, prompt_len=bufs.prompt_len,
            out=bufs.out, n_out=bufs.n_out, active=bufs.active,
            prompt_has_padding=not bool(attention_mask.all()), cache_factory=caches, k=k)
        # prefill: the prompt's last logits give the first token
        logits = target.forward(input_ids, attention_mask.bool() if state.prompt_has_padding else None,
                                logits_to_keep=1, graphed=False)
        if wants_hidden:   # identical rows prefill once (cache.py): the tap saw one row
            state.hidden = tap.value.expand(batch, -1, -1) if tap.value.shape[0] != batch else tap.value
        first, _ = verify(logits[:, -1:], None, sampling, bufs.generator, verifier)
        state.out[:, 0] = first[:, 0]
        done = np.full(batch, max_new_tokens <= 1)              # host: rows that stopped
        if eos_token_id is not None or host_drafter:
            first_host = first[:, 0].cpu().numpy()
            if eos_token_id is not None:
                done |= first_host == eos_token_id
        state.active.copy_(torch.from_numpy(~done))
        if host_drafter:   # the host's own copy of what the drafter searches
            out_host = np.full(tuple(state.out.shape), pad_token_id, dtype=np.int64)
            out_host[:, 0] = first_host
            state.host = HostView(input_ids.cpu().numpy(), prompt_len.cpu().numpy(), out_host,
                                  np.ones(batch, dtype=np.int64))
        if drafter is not None:
            drafter.start(state)
        n_out = np.ones(batch, dtype=np.int64)                  # host: the rows' output lengths
        rows = torch.arange(batch, device=device)              # original index of each row
        tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        num_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        round_ = Round(target, drafter, state, bufs, k, sampling, eos_token_id, pad_token_id, verify,
                       verifier, tap if wants_hidden else None)
        graphs_on = fixed and target.cuda_graphs
        generators = (bufs.generator,) + (drafter.generators() if drafter is not None else ())
        custom_commit = drafter is not None and type(drafter).commit is not Drafter.commit
        synchronize(device)
        timings.prefill_s = time.perf_counter() - t_start
        rounds = 0
        while True:
            if not fixed and done.any():   # finished rows leave the batch
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
            # 1-2. draft: on the device (captured with the round), on the host, or eagerly
            t0 = time.perf_counter()
            budget = min(k, max_new_tokens - 1 - int(n_out[~done].min()))
            source, drafted, proposal = None, 0, None
            if drafter is not None and budget > 0:
                if fixed and drafter.device_side:
                    source, drafted = "device", budget
                elif host_drafter:
                    state.host.limits = np.clip(max_new_tokens - 1 - n_out, 0, budget) * ~done
                    found, counts = drafter.propose_host(state.host, budget)
                    drafted = min(budget, int(counts.max(initial=0)))
                    if drafted > 0:
                        source = "host"
                        bufs.stage(found[:, :drafted], counts)
                else:
                    proposal = round_.draft(budget)
                    drafted = budget if proposal.max_draft is None else min(budget, proposal.max_draft)
                    proposal.narrow(drafted)
                    source = "eager"
            width = 1 + drafted
            run_width = verify_widths.get(width, width) if width > 1 else 1
            graph = None
            if graphs_on and (source != "device" or drafter.capturable()):
                key = (source, drafted, run_width, k, id(drafter),
                       drafter.graph_key() if drafter is not None else (), eos_token_id,
                       pad_token_id, sampling, verify, verifier)
                graph = bufs.graphs.get(key)
                if graph is None:
                    bufs.seen[key] = bufs.seen.get(key, 0) + 1
                    if bufs.seen[key] > WARMUP_ROUNDS:
                        graph = bufs.graphs[key] = RoundGraph(device, generators, (drafter, verify, verifier))
                        while len(bufs.graphs) > MAX_ROUND_GRAPHS:
                            bufs.graphs.popitem(last=False)
                else:
                    bufs.graphs.move_to_end(key)
            if fixed:      # the host's part of the round's forwards
                target.reserve(run_width)
                if source == "device":
                    drafter.reserve(state, drafted)
            if source == "device":
                if graph is not None:
                    graph.run("draft", functools.partial(draft_parts, round_, drafted))
                else:
                    proposal = round_.draft(drafted)
            if phase_timing and source is not None:
                synchronize(device)
                timings.draft_s += time.perf_counter() - t0
            # 3-5. one target pass over [pending, drafts], accept, write back, record, roll back
            t0 = time.perf_counter()
            if graph is not None:
                # the body is bound to this round's values (a stand-in may rerun it later)
                report = graph.run("accept", functools.partial(
                    accept_captured, round_, graph.parts.get("draft"), source, width, run_width))
            else:
                report = round_.accept(source, width, run_width, proposal if source else None,
                                       rows, rounds)
            rounds += 1
            timings.widths.append(run_width)
            timings.rows.append(int(rows.shape[0]))     # finished rows left the batch (dynamic)
            if reads:   # the round's one read of the device
                report = report.cpu().numpy()
                counts = report[:, 0]
                n_out += counts
                done = report[:, 1] == 0
                if host_drafter:
                    state.host.append(report[:, 2:], counts)
            else:       # one token per active row: known
                counts = (~done).astype(np.int64)
                n_out += counts
                done = n_out >= max_new_tokens
            kept_max = max(int(counts.max()), 1)
            state.accepted_max = kept_max - 1
            if fixed:
                if run_width > 1:
                    target.follow(target.last_start + kept_max)
                if source == "device":
                    drafter.follow(state)
            elif run_width > 1:
                target.rollback_to(state.prompt_len + state.n_out - 1, width=target.last_start + kept_max)
            if source in ("host", "eager") and custom_commit:   # device-side drafters commit
                drafter.commit(state, state.num_accepted)           # inside the round
            if phase_timing:
                synchronize(device)
                timings.verify_s += time.perf_counter() - t0
        tokens[rows] = state.out[:, :max_new_tokens]
        num_tokens[rows] = state.n_out
        history = bufs.history[:rounds].clone()    # the buffers serve the next call
    synchronize(device)
    timings.total_s = time.perf_counter() - t_start
    return result_from_history(tokens, num_tokens, history, k, timings, attention_mask.sum(1))
