"""tasks.registry.live_check.LiveVerdict: the live check's one vocabulary, judged and decided."""

import json

from tasks.registry.live_check import LiveVerdict, judge_live


def test_a_verdict_is_its_stored_word():
    # the DB, XCom and the pages keep the plain words: a member equals, prints and dumps as its word
    assert LiveVerdict.VETO == "veto" and f"{LiveVerdict.FLAG}" == "flag"
    assert json.dumps({"verdict": LiveVerdict.UNSURE}) == '{"verdict": "unsure"}'


def test_reading_a_stored_word():
    # a stored word reads back as its member; a missing or unknown one as NONE
    assert LiveVerdict.read("veto") is LiveVerdict.VETO
    assert LiveVerdict.read(None) is LiveVerdict.NONE and LiveVerdict.read("maybe") is LiveVerdict.NONE


def test_a_problem_is_a_fail_judgement_or_a_flag_or_veto_decision():
    assert {v for v in LiveVerdict if v.found_problem} == {LiveVerdict.FAIL, LiveVerdict.FLAG,
                                                          LiveVerdict.VETO}


def test_confirms_decision_on_each_judgement():
    # a failure vetoes a domain turning on and flags one that is not; unsure is no problem shown
    assert LiveVerdict.FAIL.decision(turning_on=True) is LiveVerdict.VETO
    assert LiveVerdict.FAIL.decision(turning_on=False) is LiveVerdict.FLAG
    assert LiveVerdict.UNSURE.decision(turning_on=True) is LiveVerdict.PASS
    assert LiveVerdict.PASS.decision(turning_on=True) is LiveVerdict.PASS
    assert LiveVerdict.NONE.decision(turning_on=True) is LiveVerdict.NONE


def test_judge_live_returns_the_type():
    # 0.9x measured: slower than plain decoding, a failure; 1.5x [1.3, 1.7] against 1.1x passes;
    # 1.2x [1.0, 1.4] reaches below 1.1x: unsure; nothing measured: none
    assert judge_live({"measured": 0.9}, 1.1, 0.25).verdict is LiveVerdict.FAIL
    assert judge_live({"measured": 1.5, "lo": 1.3, "hi": 1.7}, 1.1, 0.25).verdict is LiveVerdict.PASS
    assert judge_live({"measured": 1.2, "lo": 1.0, "hi": 1.4}, 1.1, 0.25).verdict is LiveVerdict.UNSURE
    assert judge_live(None, 1.1, 0.25).verdict is LiveVerdict.NONE


def test_a_point_below_plain_vetoes_only_where_its_interval_lies_below_plain():
    # a busy machine's pairs: one slowed twin pulls the point under 1 while the interval reaches
    # well past it (busy 2's code, 0.81x [0.50, 1.31]): unsure, said, no veto
    busy = judge_live({"measured": 0.81, "lo": 0.50, "hi": 1.31}, 1.1, 0.25)
    assert busy.verdict is LiveVerdict.UNSURE and not busy.problems
    assert busy.doubts[0] == "measured slower than plain decoding, within its interval [0.50, 1.31]"
    assert busy.verdict.decision(turning_on=True) is LiveVerdict.PASS
    # the whole interval under 1: slower than plain decoding, a failure that vetoes
    slow = judge_live({"measured": 0.81, "lo": 0.70, "hi": 0.95}, 1.1, 0.25)
    assert slow.verdict is LiveVerdict.FAIL and slow.problems[0] == "slower than plain decoding"
    assert slow.verdict.decision(turning_on=True) is LiveVerdict.VETO
