"""A paired profile's K ladder at one batch size: the ratios timed at a few K (1, 2, 4, 8; a suffix
engine's 1, 2, 3, 4, 8) priced at every K from 1 to k_max (tasks.steps.costs.engine_costs).

Each timed K's ratio carries its own 95% interval, and the planner picks the smallest K within
`plan_k_tolerance` of the best prediction. Where the prediction is flat over K (a suffix drafter
on code), K follows whichever K's ratio happened to be timed low: on the same traffic code went
K 4, 2, 3, 3 over four runs. On this hardware a verify pass or a host drafter's round costs
about a fixed part plus a part per drafted token, so where one line fits every timed ratio within
its own interval, the line prices every K: its figure at K rests on all the pairs of the ladder,
and its half-width is the line's (weighted least squares, each ratio weighted by its interval).
Where the line misses a ratio's interval (a CPU's kernels change path with the width, repeatably,
at some batch sizes), the timed ratios are used as measured, linear between them.

Before either, `shaped` keeps the shape costs must have: no K priced below a smaller one beyond
`profile_verify_dip` and both intervals.
"""

from __future__ import annotations

import numpy as np

FLOOR = 0.002       # the least relative half-width a timed ratio is taken to have


def ladder(ratios: dict[int, float], halfwidths: dict[int, float], k_max: int) -> tuple[dict[int, float], dict[int, float] | None]:
    """(ratio at each K from 1 to k_max, the timed Ks' relative half-widths on the line or None
    where the timed ratios are kept). ratios: {K: ratio} at the timed Ks; halfwidths: {K: relative
    95% half-width of that ratio}. The line needs three timed Ks or more, finite half-widths, and
    every timed ratio within its own interval of it."""
    known = sorted(ratios)
    ks = range(1, k_max + 1)
    line = fit_line(ratios, halfwidths)
    if line is None:
        return {k: float(np.interp(k, known, [ratios[x] for x in known])) for k in ks}, None
    coefficients, covariance = line
    at = {k: float(coefficients[0] + coefficients[1] * k) for k in ks}
    # the line's absolute 95% half-width at K, over its figure there
    return at, {k: float(np.sqrt([1.0, k] @ covariance @ [1.0, k])) / at[k] for k in known}


def fit_line(ratios: dict[int, float], halfwidths: dict[int, float]) -> tuple[np.ndarray, np.ndarray] | None:
    """(intercept and slope, their covariance in 95% half-width units) of the weighted
    least-squares line through the timed ratios, or None where it does not fit (see ladder)."""
    known = sorted(ratios)
    if len(known) < 3:
        return None
    y = np.array([ratios[k] for k in known], dtype=float)
    # (pairs that all agree give a spread of 0: no timing is closer than FLOOR of its figure)
    half = np.array([max(halfwidths[k], FLOOR) * ratios[k] for k in known], dtype=float)
    if not np.all(np.isfinite(half)) or np.any(y <= 0):
        return None
    x = np.column_stack([np.ones(len(known)), np.array(known, dtype=float)])
    weights = 1.0 / half ** 2
    # each ratio's half-width as its own scale: the line's covariance in half-width units
    covariance = np.linalg.inv(x.T @ (x * weights[:, None]))
    coefficients = covariance @ (x.T @ (weights * y))
    if np.any(np.abs(x @ coefficients - y) > half) or coefficients[0] + coefficients[1] <= 0:
        return None
    return coefficients, covariance


def shaped(ratios: dict[int, float], spread: dict, component: str, b: int, notes: list[str],
            dip: float, drafter: str | None = None) -> dict[int, float]:
    """The ratios with the shape costs must have: a step may be cheaper at a larger K by up to
    `dip` (profile_verify_dip: CPU matrix kernels change path with the width, repeatably) or
    within both intervals. Cheaper beyond that (the probe measured both Ks again until the budget
    ran out) is never used as measured: the larger K is priced at the smaller K's figure (the
    dearer one: a busy machine slows batches, it never speeds one up, so the plan errs towards
    plain decoding), its spread widened to cover the gap, and a note names it."""
    out, peak = {}, (None, 0.0)
    for k in sorted(ratios):
        value = ratios[k]
        if peak[0] is not None and value < peak[1] * (1 - dip):
            key = (component, drafter, k, b)
            low = value * (1 + spread[key])
            if low < peak[1] * (1 - dip) * (1 - spread[(component, drafter, peak[0], b)]):
                notes.append(f"{component}{f' of {drafter}' if drafter else ''} at batch {b}: K={k} ({value:.3f}) cheaper than K={peak[0]} "
                             f"({peak[1]:.3f}) by more than {dip:.0%} beyond both intervals; priced "
                             f"at K={peak[0]}'s")
                spread[key] = min(max(spread[key], (peak[1] - value) / peak[1]), 9.99)
                value = peak[1]
        out[k] = value
        if value >= peak[1]:
            peak = (k, value)
    return out
