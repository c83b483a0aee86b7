"""A drafter with a chosen acceptance rate, for benchmarks and tests of the decoding engine.

`ControlledAcceptance(reference, alpha)` knows the target's greedy continuation of each prompt
(`reference`, e.g. the tokens of a plain greedy run) and, at every draft position, proposes the
target's own next token with probability alpha, else a token that is certainly different. Under
greedy verification a draft token is then accepted with probability alpha given that the ones before
it were, so one round emits E(K) = (1 - alpha^(K+1)) / (1 - alpha) tokens on average (see
planner.py) -- the same acceptance at every position, whatever the model's weights. It costs a few
small tensor operations per round and never leaves the device (no host synchronisation).

It is meaningful for greedy decoding only: with sampling the target's next token is random, and the
reference is one draw of it.
"""

from __future__ import annotations

import torch

from .drafters import Drafter, output_size
from .errors import InvalidDecodeInput
from .records import Proposal


class ControlledAcceptance(Drafter):
    """Proposes reference[b, n + i] with probability alpha, else a different token (greedy only).

    reference: LongTensor [B, N] -- the target's greedy new tokens for the batch's prompts, N at
    least the max_new_tokens of the run. seed: its own random stream (not the decoder's), so the
    same seed gives the same accept / reject pattern on any decoding path.
    """

    name = "controlled_acceptance"
    device_side = True     # device work only: captured inside the round on static caches

    def __init__(self, reference: torch.Tensor, alpha: float, seed: int = 0):
        if not 0.0 <= float(alpha) <= 1.0:
            raise InvalidDecodeInput(f"alpha={alpha!r}: the acceptance rate must lie in [0, 1]")
        if reference.dim() != 2 or reference.shape[1] == 0:
            raise InvalidDecodeInput(f"reference of shape {tuple(reference.shape)}: expected [B, N] "
                                     "with N >= 1 (the target's greedy new tokens per prompt)")
        self.reference = reference.long()
        self.alpha = float(alpha)
        self.seed = seed
        self._vocab: int | None = None
        self._rows: torch.Tensor | None = None      # original row of each active row (None: all)
        self._generator: torch.Generator | None = None

    def check_compatible(self, target_model, target_tokenizer=None) -> None:
        self._vocab = output_size(target_model)

    def start(self, state) -> None:
        device = state.out.device
        if state.out.shape[0] != self.reference.shape[0]:
            raise InvalidDecodeInput(f"reference has {self.reference.shape[0]} rows, the batch has "
                                     f"{state.out.shape[0]}: give one reference row per prompt")
        self.reference = self.reference.to(device)
        self._rows = None                      # all rows (a static cache never drops any)
        # one generator for the drafter's life, re-seeded per call (captured rounds draw from it)
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(self.seed)

    def generators(self) -> tuple:
        return (self._generator,) if self._generator is not None else ()

    def propose(self, state, k, num_draft, sampling, generator) -> Proposal:
        if not sampling.greedy:
            raise InvalidDecodeInput("ControlledAcceptance is defined for greedy decoding only "
                                     "(temperature 0): with sampling the target's next token is random")
        if self._vocab is None:
            raise InvalidDecodeInput("ControlledAcceptance needs the target's vocabulary size: pass it "
                                     "to SpecDecoder, which calls check_compatible")
        last = self.reference.shape[1] - 1
        # state.n_out tokens are out, so the next one is reference[n_out]; positions n_out .. + k - 1
        idx = (state.n_out[:, None] + torch.arange(k, device=state.n_out.device)).clamp(max=last)
        reference = self.reference if self._rows is None else self.reference[self._rows]
        own = reference.gather(1, idx)
        shape = own.shape
        hit = torch.rand(shape, generator=self._generator, device=own.device) < self.alpha
        shift = torch.randint(1, self._vocab, shape, generator=self._generator, device=own.device)
        tokens = torch.where(hit, own, (own + shift) % self._vocab)
        return Proposal(tokens, None, num_draft)

    def select_rows(self, rows) -> None:
        self._rows = rows if self._rows is None else self._rows[rows]

    def describe(self) -> dict:
        return {"kind": self.name, "params": {"alpha": self.alpha, "seed": self.seed}}
