"""The sample-traffic script's request builder and its resume bookkeeping (no model needed)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from .helpers.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("scripts/make_sample_traffic.py", "make_sample_traffic")


def test_requests_are_deterministic_varied_and_cover_six_domains(script):
    # same seed, same requests; 110 per domain, unique ids and prompts, a mix of sampling settings
    first, again = script.build_requests(110), script.build_requests(110)
    assert first == again
    assert Counter(r["domain"] for r in first) == {d: 110 for d in
                                                   ("json", "code", "summarize", "qa", "chat", "creative")}
    assert len({r["id"] for r in first}) == len(first)
    assert len({json.dumps(r["messages"]) for r in first}) == len(first)
    assert {r["sampling_name"] for r in first} == {name for name, *_ in script.SAMPLING_MIX}
    code = [r["messages"][-1]["content"] for r in first if r["domain"] == "code"]
    assert all("```python\n" in text for text in code)
    assert len({text.split("```python\n")[1] for text in code}) > 90      # distinct stdlib functions


def test_vary_gives_more_distinct_prompts_than_a_pool_holds(script):
    # qa's pools hold under 200 distinct prompts; reworded, a domain gives 400 distinct ones
    many = script.build_requests(400, seed=7, vary=True)
    qa = [json.dumps(r["messages"]) for r in many if r["domain"] == "qa"]
    assert len(qa) == 400 and len(set(qa)) == 400
    texts = [r["messages"][-1]["content"] for r in many if r["domain"] == "qa"]
    reworded = [t for t in texts if any(p and t.startswith(p) for p in script.VARY_PREFIXES)
                or any(x and t.endswith(x) for x in script.VARY_SUFFIXES)]
    assert len(reworded) >= 400 - 200          # the pool gives the rest at most
    with pytest.raises(ValueError, match="'qa' gave only"):
        script.build_requests(400, seed=7)


def test_torn_last_line_of_the_progress_file_is_dropped(script, tmp_path):
    # a run killed while writing leaves half a line: resume keeps the whole lines only
    partial = tmp_path / "p.jsonl"
    partial.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "resp')
    script._truncate_torn_tail(partial)
    assert partial.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_finish_refuses_an_incomplete_run(script, tmp_path):
    # the compressed file is written only when every request has its response
    requests = [{"id": "x"}, {"id": "y"}]
    partial = tmp_path / "p.jsonl"
    partial.write_text(json.dumps({"id": "x", "timestamp": "2025-11-01T00:00:00Z"}) + "\n")
    with pytest.raises(SystemExit, match="1 requests have no response"):
        script.finish(requests, partial, tmp_path / "out.jsonl.gz")
    assert not (tmp_path / "out.jsonl.gz").exists()
