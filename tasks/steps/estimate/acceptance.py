"""Acceptance, written once: the mean accepted length, the per-position rates and E's interval.

The figures every check compares (the estimate's expected rounds in the engine check, vLLM's
per-request metrics and /metrics counters in the engine and load checks, production scrapes in
the monitor) are derived here and nowhere else:

- mean accepted length E = 1 + accepted / drafts, where drafts counts the verify steps that had
  drafts (vLLM's definition: a step in which the drafter proposed nothing is not a draft);
  None without drafts.
- the acceptance rate = accepted / draft tokens: the share of drafted tokens the target accepted
  (vLLM's num_accepted_tokens / num_draft_tokens); None without draft tokens.
- the rate at draft position i = accepted at i / drafts: the share of drafted steps whose draft i
  was accepted (vLLM's num_accepted_tokens_per_pos / num_drafts).
- accepted per position from an acceptance histogram (histogram[j]: steps that accepted exactly j
  drafts): a step that accepted j drafts accepted positions 0..j-1.
- E's 95% interval by bootstrap over requests (each request's accepted and drafts resampled as a
  pair).

Inputs are plain counts (ints or floats, or arrays of them); outputs are floats or lists of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mean_accepted_length(accepted: float, drafts: float) -> float | None:
    """E = 1 + accepted / drafts; None without drafts (drafts <= 0)."""
    accepted, drafts = float(accepted), float(drafts)
    return 1.0 + accepted / drafts if drafts > 0 else None


def acceptance_rate(accepted: float, draft_tokens: float) -> float | None:
    """accepted / draft_tokens: the share of drafted tokens accepted; None without draft tokens
    (draft_tokens 0 or None)."""
    return accepted / draft_tokens if draft_tokens else None


def position_rates(accepted_per_pos: Sequence[float], drafts: float, width: int | None = None,
                   digits: int | None = None) -> list[float] | None:
    """Per position i, accepted_per_pos[i] / drafts; None without drafts (drafts <= 0).
    width: cut or pad (with zero counts) to this many positions; digits: round each rate."""
    if not drafts or drafts <= 0:
        return None
    counts = list(accepted_per_pos)
    if width is not None:
        counts = (counts + [0] * width)[:width]
    rates = [float(a / drafts) for a in counts]
    return rates if digits is None else [round(r, digits) for r in rates]


def accepted_per_position(histogram: Sequence[int]) -> list[int]:
    """Accepted drafts per position from an acceptance histogram (histogram[j]: steps that accepted
    exactly j drafts): position i was accepted in every step that accepted more than i drafts."""
    return [sum(histogram[i + 1:]) for i in range(max(len(histogram) - 1, 0))]


def mean_length_interval(accepted: Sequence[float], drafts: Sequence[float], samples: int = 2000,
                         seed: int = 0) -> tuple[float | None, float | None, float | None]:
    """E over requests (accepted[r], drafts[r] per request, summed) and its 95% interval by
    bootstrap over the requests: (E, lo, hi); (None, None, None) without requests, (E, None, None)
    when no resample has drafts."""
    accepted, drafts = np.asarray(accepted, dtype=float), np.asarray(drafts, dtype=float)
    if not len(accepted):
        return None, None, None
    draws = np.random.default_rng(seed).integers(0, len(accepted), size=(samples, len(accepted)))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = 1.0 + accepted[draws].sum(-1) / drafts[draws].sum(-1)
    boot = boot[np.isfinite(boot)]
    point = mean_accepted_length(accepted.sum(), drafts.sum())
    if point is None or not len(boot):
        return point, None, None
    return point, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))
