"""Figures beside a bar: a bound near a bar shows the digits that decide it.

"[1.10, 1.20], whose lower end does not clear the minimum 1.10x" read as a contradiction when the
stored lower end was 1.0976: at_bar writes it 1.098, with as many digits as it takes (up to 6)
for the figure and each bar to read apart.
"""

from __future__ import annotations

MAX_DIGITS = 6


def at_bar(value: float | None, bars: tuple[float, ...] = (), digits: int = 2) -> str:
    """`value` with `digits` decimals, more where it would read equal to a bar it is not equal to
    ("-" for None)."""
    if value is None:
        return "-"
    shown = digits
    while shown < MAX_DIGITS and any(value != bar and f"{value:.{shown}f}" == f"{bar:.{shown}f}"
                                     for bar in bars):
        shown += 1
    return f"{value:.{shown}f}"


def interval_at_bar(lo: float, hi: float, bars: tuple[float, ...] = (), digits: int = 2) -> str:
    """"[LO, HI]", each end at_bar."""
    return f"[{at_bar(lo, bars, digits)}, {at_bar(hi, bars, digits)}]"
