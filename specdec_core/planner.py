"""Planning K from acceptance and costs.

With conditional acceptance rates a_1..a_K (a_i = P(draft token i accepted | tokens 1..i-1 were)),
one round emits on average
    E(K) = 1 + sum_{i=1..K} prod_{j<=i} a_j            (the 1 is the correction / bonus token)
and with a constant alpha that is (1 - alpha^(K+1)) / (1 - alpha)  (K + 1 at alpha = 1).
A round costs K draft steps and one verify pass of K + 1 tokens, so against plain decoding
    speedup(K) = E(K) * t_step / (K * t_draft + t_verify(K)) = E(K) / (K c + v(K))
with c = t_draft / t_step and v(K) = t_verify(K) / t_step.
E is convex in alpha: average E over requests, never E of an averaged alpha.
"""

from __future__ import annotations

from collections.abc import Sequence


def _rates(accept_rates: float | Sequence[float], k: int) -> list[float]:
    """a_1..a_k, the last given rate repeating (a float: the same rate at every position)."""
    if isinstance(accept_rates, (int, float)):
        rates = [float(accept_rates)]
    else:
        rates = [float(a) for a in accept_rates]
    if any(not 0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"acceptance rates must lie in [0, 1], got {rates}")
    if not rates:
        rates = [0.0]
    return [rates[min(i, len(rates) - 1)] for i in range(k)]


def expected_tokens_per_round(accept_rates: float | Sequence[float], k: int) -> float:
    """E(K) = 1 + sum_{i=1..K} prod_{j<=i} a_j, tokens emitted per verify round (bonus included)."""
    if k < 0:
        raise ValueError(f"k={k}: must be >= 0")
    expected, reach = 1.0, 1.0
    for rate in _rates(accept_rates, k):
        reach *= rate            # P(tokens 1..i all accepted)
        expected += reach
    return expected


def predicted_speedup(accept_rates: float | Sequence[float], k: int, draft_cost_ratio: float,
                      verify_cost_ratio: float = 1.0) -> float:
    """E(K) / (K c + v(K)): decode tokens/s over plain decoding; 1.0 for K = 0 (off)."""
    if k == 0:
        return 1.0
    return expected_tokens_per_round(accept_rates, k) / (k * draft_cost_ratio + verify_cost_ratio)


def optimal_k(accept_rates: float | Sequence[float], draft_cost_ratio: float, k_max: int = 16,
              verify_cost_ratios: Sequence[float] | None = None) -> tuple[int, float]:
    """(K, predicted speedup) for the K in 1..k_max with the highest E(K) / (K c + v(K)).

    v(K) = verify_cost_ratios[K-1] (t_verify(K) / t_step), 1.0 for every K when None; K is limited
    to the measured ratios. (0, 1.0) ("off") when no K beats plain decoding.
    """
    if draft_cost_ratio < 0:
        raise ValueError(f"draft_cost_ratio={draft_cost_ratio}: must be >= 0")
    if verify_cost_ratios is not None:
        k_max = min(k_max, len(verify_cost_ratios))
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        verify = 1.0 if verify_cost_ratios is None else float(verify_cost_ratios[k - 1])
        speedup = predicted_speedup(accept_rates, k, draft_cost_ratio, verify)
        if speedup > best:       # strictly better: ties keep the smaller K
            best_k, best = k, speedup
    return best_k, best
