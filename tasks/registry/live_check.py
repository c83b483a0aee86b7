"""The live check's one rule: what a domain's live measurement says against the policy minimum and
the prediction for the same requests, judged on intervals, and its words.

confirm's veto (tasks.steps.checks.confirm.live_verdict), the version page, `domains.md`, the live_check
gate and the terminal tables all judge a measurement with `judge_live`, so they cannot disagree:

- FAIL (a problem of the domain): slower than plain decoding (the speedup's 95% interval lies
  below 1); the interval lies below min_speedup (its upper end is below it); the cost-model error's interval lies below
  -tolerance (slower than predicted, confidently).
- UNSURE (no problem shown, none ruled out): the interval reaches below min_speedup, or the error's
  interval reaches below -tolerance, without lying there; a point figure below 1 whose interval
  reaches past 1 (a busy machine's pairs: one slowed twin moves the point, not the verdict).
- PASS otherwise. Faster than predicted beyond the tolerance is a note about the cost model, never a
  problem of the domain, and is worded by its direction.

A measurement without intervals (older rows) is judged on its point values as degenerate intervals.

Its words are one type, LiveVerdict: the judgement above (none, pass, unsure, fail) and what
confirm decided from it and stored with the measurement (none, pass, flag, veto). It lives here,
with the rule, because the registry's live_check gate reads it and the registry does not import
steps; steps (confirm, the engine check) import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class LiveVerdict(StrEnum):
    """A live check's verdict; its value is the word stored (domain_configs.live_check, the live
    measurement) and shown, so a member equals its word ("veto" == LiveVerdict.VETO).

    As a judgement of a measurement (judge_live): NONE (not measured), PASS, UNSURE (no problem
    shown, none ruled out), FAIL (a problem of the domain). As confirm's decision (decision()):
    NONE, PASS (no problem shown), VETO (a problem, in a domain turning on: it stays off), FLAG (a
    problem, in a domain that is not turning on: said, not acted on)."""

    NONE = "none"
    PASS = "pass"
    UNSURE = "unsure"
    FAIL = "fail"
    FLAG = "flag"
    VETO = "veto"

    @classmethod
    def read(cls, word: str | None) -> LiveVerdict:
        """A stored verdict's word as the type; NONE for a missing or unknown word."""
        try:
            return cls(word)
        except ValueError:
            return cls.NONE

    @property
    def found_problem(self) -> bool:
        """Whether the live check found a problem: a FAIL judgement, or a FLAG or VETO decision."""
        return self in (LiveVerdict.FAIL, LiveVerdict.FLAG, LiveVerdict.VETO)

    def decision(self, turning_on: bool) -> LiveVerdict:
        """confirm's decision on this judgement: FAIL vetoes a domain turning on and flags any
        other; UNSURE passes (only a problem shown vetoes); NONE and PASS stay as they are."""
        if self is LiveVerdict.FAIL:
            return LiveVerdict.VETO if turning_on else LiveVerdict.FLAG
        return LiveVerdict.PASS if self is LiveVerdict.UNSURE else self


@dataclass(frozen=True)
class LiveJudgement:
    """verdict: LiveVerdict NONE (not measured) | PASS | UNSURE | FAIL; problems: why it fails,
    doubts: why it is unsure, notes: what is worth saying that is neither (faster than predicted).
    Words only."""

    verdict: LiveVerdict
    problems: list[str] = field(default_factory=list)
    doubts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _interval(live: dict, point: str, lo: str, hi: str) -> tuple:
    value = live.get(point)
    low = live.get(lo)
    high = live.get(hi)
    return value, value if low is None else low, value if high is None else high


def judge_live(live: dict | None, min_speedup: float, tolerance: float) -> LiveJudgement:
    """The judgement of one live measurement: {measured, lo, hi, cost_model_error, error_lo,
    error_hi, min_speedup?, tolerance?} (the stored verdict's min_speedup and tolerance win over
    the arguments: a run is judged by the settings it ran with)."""
    if not live or live.get("measured") is None:
        return LiveJudgement(LiveVerdict.NONE)
    minimum = live.get("min_speedup") or min_speedup
    limit = live.get("tolerance") or tolerance
    measured, lo, hi = _interval(live, "measured", "lo", "hi")
    error, error_lo, error_hi = _interval(live, "cost_model_error", "error_lo", "error_hi")
    problems, doubts, notes = [], [], []
    if hi < 1.0:
        problems.append("slower than plain decoding")
    elif measured < 1.0:
        doubts.append(f"measured slower than plain decoding, within its interval [{lo:.2f}, {hi:.2f}]")
    if hi < minimum:
        problems.append(f"the interval's upper end {hi:.2f}x is below min_speedup {minimum:.2f}x")
    elif lo < minimum and measured >= 1.0:
        doubts.append(f"its interval [{lo:.2f}, {hi:.2f}] reaches below min_speedup {minimum:.2f}x")
    if error is not None:
        spread = "" if error_lo == error_hi else f" (cost-model error {100 * error_lo:+.0f}% to {100 * error_hi:+.0f}%)"
        if error_hi < -limit:
            problems.append(f"{100 * abs(error):.0f}% slower than predicted for the same requests, "
                            f"beyond the {100 * limit:.0f}% tolerance{spread}")
        elif error_lo < -limit:
            doubts.append(f"possibly slower than predicted by more than the {100 * limit:.0f}% "
                          f"tolerance{spread}")
        if error > limit:
            notes.append(f"{100 * error:.0f}% faster than predicted for the same requests "
                         f"(tolerance {100 * limit:.0f}%)")
    verdict = LiveVerdict.FAIL if problems else (LiveVerdict.UNSURE if doubts else LiveVerdict.PASS)
    return LiveJudgement(verdict, problems, doubts, notes)


def live_text(live: dict | None) -> str:
    """A live check in words: measured [interval] vs predicted on the same N requests."""
    if not live or live.get("measured") is None:
        return "not measured live"
    interval = "" if live.get("lo") is None else f" [{live['lo']:.2f}, {live['hi']:.2f}]"
    predicted = live.get("predicted_same") or live.get("predicted")
    requests = live.get("requests") or 0
    return (f"{live['measured']:.2f}x measured{interval}"
            + ("" if predicted is None else f" vs {predicted:.2f}x predicted")
            + f" on the same {requests} request{'s' if requests != 1 else ''}")


def judgement_words(judgement: LiveJudgement) -> str:
    """The judgement in one clause for a table cell or a reason: "WARNING: ...", "unsure: ...",
    the notes; "" when there is nothing to say."""
    parts = []
    if judgement.problems:
        parts.append("WARNING: " + "; ".join(judgement.problems))
    if judgement.doubts:
        parts.append("unsure: " + "; ".join(judgement.doubts))
    parts += judgement.notes
    return "; ".join(parts)
