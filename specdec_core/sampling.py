"""Sampling parameters and the one logits -> probabilities transform.

Target and drafter go through :func:`logits_to_probs` with the same :class:`SamplingParams`, so the
verifier compares the distributions that would actually be sampled from (temperature, then top-k,
then top-p), exactly as speculative sampling requires.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


from .errors import SpecDecError


class InvalidSamplingParams(SpecDecError, ValueError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits.

    temperature: 0 means greedy (argmax); > 0 divides the logits before the softmax.
    top_k:       keep the k most likely tokens (0: keep all).
    top_p:       keep the smallest set of most likely tokens whose mass reaches top_p (1.0: keep all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf") or 0.0 < self.temperature < 1e-4:
            raise InvalidSamplingParams(
                f"temperature={self.temperature!r}: must be 0 (greedy) or in [1e-4, inf)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidSamplingParams(f"top_k={self.top_k!r}: must be an integer")
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k={self.top_k!r}: must be >= 0 (0 disables top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p={self.top_p!r}: must be in (0, 1] (1.0 disables top-p)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] (float32) that `params` samples from, given logits [..., V].

    Greedy gives a one-hot distribution on the argmax, so exact verification of greedy drafts
    degenerates to "accept while equal to the argmax".
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        # keep logits >= the k-th largest (ties at the threshold are kept)
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        if logits.device.type == "cpu":
            drop = _top_p_drop_from_head(logits, params.top_p)
        else:
            drop = _top_p_drop(logits, params.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def _top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p drops [..., V] (bool): in descending order, a token is dropped when the
    mass strictly before it already reaches top_p (the first one always stays)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return torch.zeros_like(mass_before, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)


TOP_P_HEAD = 256


def _top_p_drop_from_head(logits: torch.Tensor, top_p: float, head: int = TOP_P_HEAD) -> torch.Tensor:
    """_top_p_drop's result without sorting the whole vocabulary (on a CPU a sort of a verify
    pass's [rows, K + 1, V] logits costs seconds): where the `head` most likely tokens hold top_p,
    every later token has that much mass before it and is dropped, so only the head is ranked;
    the other rows (a flat distribution) take the full sort. Reads the result on the host, so
    it is for the CPU (a captured CUDA round cannot branch on it)."""
    vocab = logits.shape[-1]
    if vocab <= head:
        return _top_p_drop(logits, top_p)
    flat = logits.reshape(-1, vocab)
    probs = flat.softmax(-1)
    top, order = probs.topk(head, dim=-1)
    held = top.cumsum(-1)
    drop = torch.ones_like(flat, dtype=torch.bool).scatter_(-1, order, held - top >= top_p)
    short = (held[:, -1] < top_p).nonzero().flatten()
    if short.numel():
        drop[short] = _top_p_drop(flat[short], top_p)
    return drop.view(logits.shape)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token index per row of probs [..., V] -> LongTensor [...].

    Unnormalised weights are fine and zero weights are never picked; neither way synchronises
    host and device.
    - CUDA: the exponential race, argmax(p / E) with E ~ Exp(1), which picks index i with
      probability p_i / sum(p).
    - CPU: the inverse of the cumulative weights, summed in float64: the first index whose
      cumulative weight exceeds u * total, u ~ U[0, 1) (a zero weight adds no width to step
      into). Drawing a [V] exponential per row is the CPU's slow part: for [300, 49152] (a
      sampling test's residuals) 340 ms against 71 ms on the 2-core machine.
    """
    if probs.device.type != "cpu":
        race = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_(min=1e-30)
        return (probs / race).argmax(-1)
    cumulative = probs.cumsum(-1, dtype=torch.float64)
    total = cumulative[..., -1:]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64)
    # u * total may round up to total itself: keep the point strictly below it, inside the last
    # non-zero weight's interval
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, point, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
