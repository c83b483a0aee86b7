"""Offline acceptance: what a drafter would achieve on logged traffic, without running decoding.

Logged traffic holds the target's own responses. One batched target pass and one drafter pass over
prompt + response give, at every response position t with logged token x_t, the probability
beta_t that a draft at t is accepted, given that the emitted token is x_t:
  sampling:            beta_t = min(1, q_t(x_t) / p_t(x_t)), p and q under the row's own params.
                       (In speculative sampling the emitted y follows p and
                       P(draft accepted | y) = min(p(y), q(y)) / p(y), so along a logged path
                       acceptances are independent Bernoulli(beta_t).)
  greedy:              beta_t = 1 when the drafter's argmax equals x_t, else 0.
  host drafters:       prompt lookup and suffix decoding propose deterministically: beta = 1 when
                       the proposal d = x_t, else 0; the proposal depends on where a round starts,
                       so rounds are walked directly (walk_rounds).
Rounds of K are then simulated along each response in exact expectation (dynamic programming over
the beta_t), mirroring SpecDecoder: the first response token comes from the prefill, a round at
position t drafts min(K, L - 1 - t) tokens. Per domain, E(K) = total tokens / total expected
rounds, with bootstrap 95% intervals over requests.
Precondition: the responses were produced by this target with the logged sampling params.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from .drafters import DraftModel, Drafter, HostDrafter
from .sampling import SamplingParams, logits_to_probs

log = logging.getLogger(__name__)


@dataclass
class LoggedRequest:
    request_id: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    domain: str = "general"


def split_hash(split_key: str, request_id: str) -> float:
    """A number in [0, 1) fixed by (split key, request id): where a request falls in a split."""
    digest = hashlib.sha256(f"{split_key}\x00{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def in_heldout(split_key: str, request_id: str, fraction: float) -> bool:
    """Whether request `request_id` is held out (never trained on) under split `split_key`: a hash
    of (split key, request id) below `fraction`. Training (tasks.steps.drafters.draft_training) and the
    benchmarks split by this one rule."""
    return split_hash(split_key, request_id) < fraction


def validation_key(split_key: str) -> str:
    """The hash key of split `split_key`'s validation rows (salted apart from its held-out hash)."""
    return f"{split_key}/validation"


def in_validation(split_key: str, request_id: str, fraction: float) -> bool:
    """Whether a request that split `split_key` does not hold out is kept for validation (not
    trained on; it chooses the checkpoint): its validation hash below `fraction`. Training
    (tasks.steps.drafters.draft_training, which also keeps the lowest one where none falls below) and
    generation for a training (which skips those prompts) use this rule."""
    return split_hash(validation_key(split_key), request_id) < fraction


def round_robin(requests: Sequence[LoggedRequest], limit: int | None) -> list[LoggedRequest]:
    """Up to `limit` of the requests (all when None) taken in turn from each domain (domains in
    name order, each domain's requests in their order): a sample that keeps every domain."""
    if limit is None or len(requests) <= limit:
        return list(requests)
    by_domain: dict[str, list] = {}
    for request in requests:
        by_domain.setdefault(request.domain, []).append(request)
    turns = itertools.chain.from_iterable(itertools.zip_longest(*(by_domain[d] for d in sorted(by_domain))))
    return [r for r in turns if r is not None][:max(limit, 0)]


def split_off(requests: Sequence[LoggedRequest], limit: int) -> tuple[list[LoggedRequest], list[LoggedRequest]]:
    """(the other requests, round_robin(requests, limit)): e.g. validation rows taken out of a
    training set, to choose a checkpoint on rows that neither trained it nor report it."""
    taken = round_robin(requests, limit)
    chosen = {id(r) for r in taken}
    return [r for r in requests if id(r) not in chosen], taken


@dataclass
class RoundTotals:
    """Expected round counts for one request (or summed over requests) at one K."""

    tokens: float = 0.0           # tokens emitted by rounds (the response minus its first token)
    rounds: float = 0.0           # expected rounds
    reached: np.ndarray = None    # [K] expected rounds in which draft i was proposed with 0..i-1 accepted
    accepted: np.ndarray = None   # [K] expected rounds in which draft i was accepted
    widths: np.ndarray = None     # [K+1] expected rounds that drafted w tokens (verify width w + 1)

    def __add__(self, other: "RoundTotals") -> "RoundTotals":
        return RoundTotals(self.tokens + other.tokens, self.rounds + other.rounds,
                           self.reached + other.reached, self.accepted + other.accepted,
                           self.widths + other.widths)

    @property
    def width_share(self) -> list[float]:
        """Share of rounds by number of tokens drafted, 0..K."""
        return [float(w / self.rounds) if self.rounds else 0.0 for w in self.widths]

    @property
    def expected_tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        return [float(a / r) if r > 0 else 0.0 for a, r in zip(self.accepted, self.reached)]


def simulate_rounds(beta: np.ndarray, k: int) -> RoundTotals:
    """Exact expectation of rounds of K along one response with per-position acceptance beta [L].

    beta[t] is the acceptance probability of a draft for response token t (beta[0] is unused: token
    0 comes from the prefill). A draft model's acceptance depends only on the token it drafts.
    """
    length = len(beta)
    padded = np.concatenate([np.asarray(beta, dtype=float), np.zeros(k)])
    rates = np.stack([padded[i: i + length] for i in range(k)], 1) if k else np.zeros((length, 0))
    return simulate_rounds_by_start(rates, k)


def simulate_rounds_by_start(rates: np.ndarray, k: int) -> RoundTotals:
    """Exact expectation of rounds of K along one response of L tokens, where the acceptance of a
    round's draft i depends on where the round started: rates[t, i] [L, >= K] is the acceptance
    probability of draft i in a round starting at response position t (it drafts token t + i).
    A draft head's drafts after the first feed on its own features, so its rates do. Forward DP
    over the position at which a round starts; 0/1 rates (greedy) give the exact walk.
    """
    length = len(rates)
    start = np.zeros(length + k + 1)          # P(a round starts at position t)
    if length > 1:
        start[1] = 1.0
    reached = np.zeros(k)
    accepted = np.zeros(k)
    widths = np.zeros(k + 1)
    rounds = 0.0
    for t in range(1, length):
        weight = start[t]
        if weight == 0.0:
            continue
        rounds += weight
        drafts = min(k, length - 1 - t)
        widths[drafts] += weight
        survive = 1.0                          # P(drafts 0..i-1 accepted)
        for i in range(drafts):
            reached[i] += weight * survive
            p_next = survive * rates[t, i]
            accepted[i] += weight * p_next
            # exactly i accepted: the round emits i + 1 tokens
            start[t + i + 1] += weight * (survive - p_next)
            survive = p_next
        start[t + drafts + 1] += weight * survive
    return RoundTotals(tokens=float(max(length - 1, 0)), rounds=rounds, reached=reached,
                       accepted=accepted, widths=widths)


def walk_rounds(prompt_ids: Sequence[int], response_ids: Sequence[int], k: int,
                drafter: HostDrafter) -> RoundTotals:
    """Rounds of K for a deterministic host drafter (prompt lookup, suffix) along a logged
    response: each round proposes from the text so far, exactly as decoding would."""
    sequence = np.asarray(list(prompt_ids) + list(response_ids), dtype=np.int64)
    prompt_len, length = len(prompt_ids), len(response_ids)
    reached, accepted, widths = np.zeros(k), np.zeros(k), np.zeros(k + 1)
    rounds, t = 0, 1
    while t < length:
        drafts = min(k, length - 1 - t)
        proposal = drafter.propose_tokens(sequence[: prompt_len + t], drafts)
        truth = sequence[prompt_len + t: prompt_len + t + len(proposal)]
        n = int(np.argmin(proposal == truth)) if not (proposal == truth).all() else len(proposal)
        reached[: min(n + 1, len(proposal))] += 1
        accepted[:n] += 1
        widths[len(proposal)] += 1
        rounds += 1
        t += n + 1
    return RoundTotals(tokens=float(max(length - 1, 0)), rounds=float(rounds), reached=reached,
                       accepted=accepted, widths=widths)


def _pad_left(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


@torch.inference_mode()
def _response_logits(model: torch.nn.Module, batch: list[LoggedRequest]) -> torch.Tensor:
    """Logits [B, L_max, V] predicting each response token (row b: its last L_b entries)."""
    device = next(model.parameters()).device
    longest = max(len(r.response_ids) for r in batch)
    ids, mask = _pad_left([list(r.prompt_ids) + list(r.response_ids) for r in batch], 0)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                position_ids=position_ids.to(device), logits_to_keep=longest + 1, use_cache=False)
    return out.logits[:, :-1]   # column c predicts token at kept column c + 1


def token_acceptance(target: torch.nn.Module, drafter: DraftModel, requests: list[LoggedRequest],
                     batch_size: int = 4, progress: bool = True) -> list[np.ndarray]:
    """beta_t per request for a model drafter (DraftModel, LayerSkip): arrays [L_b], in the
    requests' order.

    Requests are batched sampled first, then greedy, each by length: a batch of greedy requests
    needs no target forward (the draft's argmax is compared with the logged token), and requests
    of like length pad little. On the main job's sample (180 requests, a third greedy, batches of
    4) that took the target's forwards from 33,450 padded tokens to 19,040 and the drafter's from
    33,730 to 28,972."""
    betas: list[np.ndarray | None] = [None] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: (
        requests[i].sampling.greedy, len(requests[i].prompt_ids) + len(requests[i].response_ids)))
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for indexes in tqdm(batches, desc=f"acceptance {drafter.name}", disable=not progress):
        batch = [requests[i] for i in indexes]
        need_target = any(not r.sampling.greedy for r in batch)
        draft_logits = drafter._fit_vocab(_response_logits(drafter.model, batch))
        target_logits = _response_logits(target, batch) if need_target else None
        longest = draft_logits.shape[1]
        for b, request in enumerate(batch):
            length = len(request.response_ids)
            cols = slice(longest - length, longest)
            x = torch.tensor(request.response_ids, dtype=torch.long, device=draft_logits.device)
            if request.sampling.greedy:
                beta = (draft_logits[b, cols].argmax(-1) == x).double()
            else:
                q = logits_to_probs(draft_logits[b, cols], request.sampling)
                p = logits_to_probs(target_logits[b, cols], request.sampling)
                q_x = q.gather(-1, x[:, None]).squeeze(-1).double()
                p_x = p.gather(-1, x[:, None]).squeeze(-1).double()
                if bool((p_x <= 0).any()):
                    log.warning("request %s: a logged token has probability 0 under the target with "
                                "its logged sampling params; was it produced by this target?",
                                request.request_id)
                beta = torch.where(p_x > 0, (q_x / p_x.clamp(min=1e-300)).clamp(max=1.0),
                                   torch.ones_like(p_x))
            betas[indexes[b]] = beta.cpu().numpy()
    return betas


@dataclass
class DomainEstimate:
    """Offline estimate for one domain, drafter and K."""

    domain: str
    k: int
    requests: int
    tokens: float
    rounds: float
    expected_tokens_per_round: float
    ci95: tuple[float, float]                  # bootstrap over requests
    conditional_acceptance: list[float]
    width_share: list[float] = field(default_factory=list)   # share of rounds drafting 0..K tokens
    # per draft position, the 95% interval of a_i (bootstrap over requests, as ci95 is for E)
    conditional_acceptance_ci: list[list[float]] = field(default_factory=list)
    per_request: list[RoundTotals] = field(repr=False, default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted over the expected rounds (depends on K; not alpha)."""
        drafted = sum(w * share for w, share in enumerate(self.width_share)) * self.rounds
        return float((self.tokens - self.rounds) / drafted) if drafted > 0 else 0.0

    def to_dict(self) -> dict:
        return {"domain": self.domain, "k": self.k, "requests": self.requests,
                "tokens": self.tokens, "rounds": self.rounds,
                "expected_tokens_per_round": self.expected_tokens_per_round,
                "ci95": list(self.ci95), "conditional_acceptance": self.conditional_acceptance,
                "conditional_acceptance_ci": self.conditional_acceptance_ci,
                "width_share": self.width_share, "acceptance_rate": self.acceptance_rate}


def bootstrap_ratio(numerators: np.ndarray, denominators: np.ndarray, n_boot: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of sum(num) / sum(den) over requests resampled with replacement.

    A function of the requests, not of their order: the pairs are put in a canonical order before
    resampling, so two runs that drew the same requests in another order (their samples are seeded
    by the run id) get the same interval."""
    count = len(numerators)
    if count == 0:
        return (0.0, 0.0)
    numerators, denominators = np.asarray(numerators), np.asarray(denominators)
    order = np.lexsort((denominators, numerators))
    numerators, denominators = numerators[order], denominators[order]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, count, size=(n_boot, count))
    ratios = numerators[picks].sum(1) / np.maximum(denominators[picks].sum(1), 1e-12)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def position_intervals(totals: list[RoundTotals], k: int, n_boot: int = 1000,
                       seed: int = 0) -> list[list[float]]:
    """[[lo, hi]] per draft position 1..K: the 95% interval of the conditional acceptance a_i =
    accepted_i / reached_i, resampling requests (the rounds of one request are not independent, so
    the request is the unit, as for E's interval). A position no request reached reads [0, 0]."""
    out = []
    for i in range(k):
        accepted = np.array([float(t.accepted[i]) for t in totals])
        reached = np.array([float(t.reached[i]) for t in totals])
        out.append(list(bootstrap_ratio(accepted, reached, n_boot=n_boot, seed=seed))
                   if reached.sum() > 0 else [0.0, 0.0])
    return out


def estimate_acceptance(target: torch.nn.Module, drafter: Drafter, requests: list[LoggedRequest],
                        ks: Sequence[int], batch_size: int = 4, n_boot: int = 1000, seed: int = 0,
                        progress: bool = True) -> dict[str, dict[int, DomainEstimate]]:
    """{domain: {K: DomainEstimate}} for one drafter over logged requests.

    Requests with fewer than 2 response tokens carry no rounds and are skipped.
    """
    usable = [r for r in requests if len(r.response_ids) >= 2]
    if isinstance(drafter, HostDrafter):
        per_k = {k: [walk_rounds(r.prompt_ids, r.response_ids, k, drafter) for r in usable]
                 for k in ks}
    elif drafter.needs_target_hidden:   # a draft head: rates by round start
        from .head import head_round_rates

        iterator = tqdm(usable, desc=f"acceptance {drafter.name}", disable=not progress)
        rates = [head_round_rates(target, drafter.head, r.prompt_ids, r.response_ids, max(ks),
                                  r.sampling) for r in iterator]
        per_k = {k: [simulate_rounds_by_start(rate, k) for rate in rates] for k in ks}
    elif isinstance(drafter, DraftModel):
        betas = token_acceptance(target, drafter, usable, batch_size=batch_size, progress=progress)
        per_k = {k: [simulate_rounds(beta, k) for beta in betas] for k in ks}
    else:
        raise TypeError(f"no offline estimate for drafter {type(drafter).__name__}")
    result: dict[str, dict[int, DomainEstimate]] = {}
    domains = sorted({r.domain for r in usable})
    for domain in domains:
        index = [i for i, r in enumerate(usable) if r.domain == domain]
        result[domain] = {}
        for k in ks:
            totals = [per_k[k][i] for i in index]
            summed = totals[0]
            for item in totals[1:]:
                summed = summed + item
            tokens = np.array([t.tokens for t in totals])
            rounds = np.array([t.rounds for t in totals])
            result[domain][k] = DomainEstimate(
                domain=domain, k=k, requests=len(totals), tokens=summed.tokens, rounds=summed.rounds,
                expected_tokens_per_round=summed.expected_tokens_per_round,
                ci95=bootstrap_ratio(tokens, rounds, n_boot=n_boot, seed=seed),
                conditional_acceptance=summed.conditional_acceptance,
                conditional_acceptance_ci=position_intervals(totals, k, n_boot=n_boot, seed=seed),
                width_share=summed.width_share, per_request=totals)
    return result
