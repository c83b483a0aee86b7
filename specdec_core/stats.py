"""Counting what speculative decoding did: SpecStats.

A round is one verify pass of one active row. Per round the row proposes `num_draft` tokens
(0..K), the verifier accepts `num_accepted` of them, and the row emits num_accepted + 1 tokens
(fewer when it stops at EOS). The token sampled from the prefill is not part of any round.

Derived figures:
  acceptance_rate        = accepted / drafted                   (depends on K; it is not alpha)
  mean_accepted_length   = emitted / rounds                     (tokens per round, bonus included)
  conditional_acceptance = accepted_at_position[i] / reached_at_position[i]   (a_1..a_K)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    # [K] rounds in which draft token i (0-based) was proposed with tokens 0..i-1 accepted
    reached_at_position: list[int] = field(default_factory=list)
    # [K] rounds in which draft token i was accepted
    accepted_at_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0  # every generated token, the prefill's first token included

    @classmethod
    def empty(cls, k: int) -> "SpecStats":
        return cls(reached_at_position=[0] * k, accepted_at_position=[0] * k)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at_position,
                                                       self.reached_at_position)]

    @property
    def decode_s(self) -> float:
        """Decode-phase seconds (everything after the prefill)."""
        return max(self.total_s - self.prefill_s, 0.0)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode-phase throughput: tokens emitted by rounds (all but the prefill's) per decode second."""
        return self.emitted / self.decode_s if self.decode_s > 0 else 0.0

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two stats (timings add up too)."""
        width = max(len(self.reached_at_position), len(other.reached_at_position))

        def pad(values: list[int]) -> list[int]:
            return list(values) + [0] * (width - len(values))

        return SpecStats(
            rounds=self.rounds + other.rounds,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            emitted=self.emitted + other.emitted,
            reached_at_position=[a + b for a, b in zip(pad(self.reached_at_position),
                                                       pad(other.reached_at_position))],
            accepted_at_position=[a + b for a, b in zip(pad(self.accepted_at_position),
                                                        pad(other.accepted_at_position))],
            draft_s=self.draft_s + other.draft_s,
            verify_s=self.verify_s + other.verify_s,
            total_s=self.total_s + other.total_s,
            prefill_s=self.prefill_s + other.prefill_s,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            new_tokens=self.new_tokens + other.new_tokens,
        )

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "emitted": self.emitted, "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "reached_at_position": list(self.reached_at_position),
            "accepted_at_position": list(self.accepted_at_position),
            "conditional_acceptance": self.conditional_acceptance,
            "draft_s": self.draft_s, "verify_s": self.verify_s, "total_s": self.total_s,
            "prefill_s": self.prefill_s, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
        }

    def summary(self) -> str:
        """One line for people."""
        return (f"rounds={self.rounds} drafted={self.drafted} accepted={self.accepted} "
                f"acceptance_rate={self.acceptance_rate:.3f} "
                f"mean_accepted_length={self.mean_accepted_length:.2f} "
                f"decode_tok/s={self.decode_tokens_per_s:.1f} total_s={self.total_s:.2f}")
