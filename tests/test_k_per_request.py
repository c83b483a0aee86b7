"""K per request on vLLM through the project's plugin (tasks/serving/vllm_plugin): the plan file,
the K each request gets, the cut of a step's drafts, and the refusal where vLLM's scheduler is
not the code the cut expects. Pure functions and small stand-ins for the scheduler's objects; the
real server serving a mixed batch is in tests/test_vllm_server.py."""

from __future__ import annotations

import importlib.util
import os
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from .helpers import REPO

SPEC = importlib.util.spec_from_file_location(
    "specdec_vllm_mends", REPO / "tasks" / "serving" / "vllm_plugin" / "specdec_vllm_mends.py")
plugin = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(plugin)


@dataclass
class DraftTokenIds:             # vLLM's own shape: the request ids and each one's drafts
    req_ids: list
    draft_token_ids: list


class Scheduler:                 # the two intakes as vLLM 0.32 writes them (the parts read)
    def __init__(self, requests, running):
        self.requests, self.running, self.taken = requests, running, {}

    def update_draft_token_ids(self, draft_token_ids):
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            self.taken[req_id] = list(spec_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output):
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            scheduler_output[req_id] = list(spec_token_ids)


def request(**extra_args):
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra_args or None))


def test_a_plan_file_gives_each_domain_its_k_by_batch_size(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"method": "ngram", "domains": {"json": [[1, 4, 8], [5, 8, 3]], "chat": 0},
                                "default": 2}))
    plan = plugin.read_plan(str(path))
    assert plan["method"] == "ngram"
    assert [plugin.request_k({"specdec_domain": "json"}, plan, b) for b in (1, 4, 5, 8, 9)] == [8, 8, 3, 3, 0]
    assert plugin.request_k({"specdec_domain": "chat"}, plan, 1) == 0
    # a domain the plan does not name, and a request naming none: the plan's default
    assert plugin.request_k({"specdec_domain": "poetry"}, plan, 1) == 2
    assert plugin.request_k(None, plan, 1) == 2
    # a request's own K wins over its domain's; a K that is not a whole number >= 0: no drafts
    assert plugin.request_k({"specdec_k": 5, "specdec_domain": "chat"}, plan, 1) == 5
    assert plugin.request_k({"specdec_k": "8"}, plan, 1) == 0
    assert plugin.request_k({"specdec_k": -1}, None, 1) == 0
    # no plan and nothing asked: vLLM's own schedule (no cut)
    assert plugin.request_k(None, None, 1) is None


@pytest.mark.parametrize("text, named", [
    ("{not json", "cannot be read"),
    (json.dumps({"domains": {"json": [[4, 1, 8]]}}), "domain 'json'"),
    (json.dumps({"domains": {"json": [[1, 4, -1]]}}), "domain 'json'"),
    (json.dumps({"domains": {"json": "eight"}}), "domain 'json'"),
    (json.dumps({"domains": {}, "default": [1, 2]}), "default"),
    (json.dumps([1, 2]), "not a plan"),
])
def test_a_plan_file_that_is_not_one_is_refused_naming_the_file_and_the_entry(tmp_path, text, named):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(plugin.PlanError) as refused:
        plugin.read_plan(str(path))
    assert str(path) in str(refused.value) and named in str(refused.value)
    assert "\n" not in str(refused.value)


def test_each_request_keeps_at_most_its_k_of_the_drafts_vllm_proposed():
    class Mine(Scheduler):
        pass

    plan = {"method": "ngram", "domains": {"json": [(1, 8, 8)], "chat": [(1, 8, 0)]}, "default": [(1, 8, 1)]}
    lines = plugin.enable_k_per_request(Mine, DraftTokenIds, plan)
    assert lines and "K per request on" in lines[0]
    requests = {"a": request(specdec_domain="json"), "b": request(specdec_domain="chat"),
                "c": request(specdec_k=2), "d": request(), "e": request(specdec_k=9)}
    scheduler = Mine(requests, running=list(requests))
    drafts = [list(range(8))] * 5
    scheduler.update_draft_token_ids(DraftTokenIds(list(requests), drafts))
    assert scheduler.taken == {"a": list(range(8)), "b": [], "c": [0, 1], "d": [0],
                               "e": list(range(8))}      # never more than vLLM proposed
    output = {}
    scheduler.update_draft_token_ids_in_output(DraftTokenIds(["b", "c"], [[5, 6], [7, 8, 9]]), output)
    assert output == {"b": [], "c": [7, 8]}
    # enabled once: a second call changes nothing
    assert plugin.enable_k_per_request(Mine, DraftTokenIds, plan) == []


def test_a_scheduler_that_is_not_the_code_the_cut_expects_is_refused():
    class Other(Scheduler):
        def update_draft_token_ids(self, draft_token_ids):      # reads drafts another way
            self.taken = dict(enumerate(draft_token_ids.draft_token_ids))

    with pytest.raises(plugin.PlanError, match="update_draft_token_ids does not read drafts by request id"):
        plugin.enable_k_per_request(Other, DraftTokenIds, None)

    @dataclass
    class Drafts:
        ids: list

    with pytest.raises(plugin.PlanError, match="DraftTokenIds has fields"):
        plugin.enable_k_per_request(Scheduler, Drafts, None)


def test_an_engine_runs_its_threads_on_the_cpus_other_processes_leave_free():
    from tasks.serving.environment import choose_cpus, free_cpus

    # quiet: every CPU, vLLM's own binding
    assert choose_cpus({0: 0.02, 1: 0.05}) == {"cpus": [0, 1], "others": 0.07, "spare": 0, "bind": None}
    # a neighbour spinning on CPU 1: the engine keeps off it
    assert choose_cpus({0: 0.03, 1: 0.97})["bind"] == "0"
    # a bursty one, half a core somewhere: one CPU left to it, the least busy one used
    assert choose_cpus({0: 0.30, 1: 0.20, 2: 0.0, 3: 0.05}) == {
        "cpus": [1, 2, 3], "others": 0.55, "spare": 1, "bind": "1,2,3"}
    # busier than the machine: still one CPU
    assert choose_cpus({0: 1.0, 1: 1.0})["cpus"] == [0] and choose_cpus({0: 1.0, 1: 1.0})["spare"] == 1
    # read from /proc on this machine: a choice among the CPUs this process may use
    seen = free_cpus(sample_s=0.2)
    assert seen["cpus"] and set(seen["cpus"]) <= set(os.sched_getaffinity(0))


def test_a_neighbour_working_in_bursts_is_counted_whatever_phase_the_sampling_catches():
    import subprocess
    import sys

    from tasks.serving.environment import choose_cpus, free_cpus

    # a quarter of a core on average, a whole one while it works: the burst decides
    assert choose_cpus({0: 0.05, 1: 0.20})["spare"] == 0
    assert choose_cpus({0: 0.05, 1: 0.20}, others=0.95) == {"cpus": [0], "others": 0.95, "spare": 1, "bind": "0"}
    # on this machine: a process spinning 1 s in every 4 (busy_neighbour.py's pattern, shorter);
    # sampled over one period, its burst is seen and one CPU is left to it
    burst = ("import time\nwhile True:\n    end = time.time() + 1\n    while time.time() < end:\n"
             "        pass\n    time.sleep(3)\n")
    neighbour = subprocess.Popen([sys.executable, "-c", burst])
    try:
        seen = free_cpus(sample_s=4.0, slices=8)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert seen["others"] >= 0.5 and seen["spare"] >= 1 and len(seen["cpus"]) == len(os.sched_getaffinity(0)) - seen["spare"]


class NgramProposer:            # vLLM 0.32's ngram proposer as the skip relies on it: an empty row is not searched
    def __init__(self):
        self.searched = []

    def propose(self, sampled_token_ids):
        valid_ngram_requests = []
        for i, sampled_ids in enumerate(sampled_token_ids):
            num_sampled_ids = len(sampled_ids)
            if not num_sampled_ids:
                continue
            valid_ngram_requests.append(i)
        self.searched.append(valid_ngram_requests)
        return [[7, 7] if i in valid_ngram_requests else [] for i in range(len(sampled_token_ids))]


class SuffixCache:
    def __init__(self):
        self.added, self.speculated, self.active_requests = [], [], {"a", "b", "c"}

    def add_active_response(self, req_id, ids):
        self.added.append(req_id)

    def speculate(self, req_id, pattern, **kwargs):
        self.speculated.append(req_id)
        return SimpleNamespace(token_ids=[9, 9, 9])


class SuffixDecodingProposer:   # ... and its suffix proposer: the response added, then speculate per request id
    def __init__(self):
        self.suffix_cache = SuffixCache()

    def propose(self, req_ids, sampled_token_ids):
        draft_token_ids = []
        for req_id, sampled_ids in zip(req_ids, sampled_token_ids):
            if not sampled_ids:
                draft_token_ids.append([])
                continue
            self.suffix_cache.add_active_response(req_id, sampled_ids)
            draft_token_ids.append(self.suffix_cache.speculate(req_id, [], max_spec_tokens=8).token_ids)
        assert self.suffix_cache.active_requests       # the cache's other attributes reach through
        return draft_token_ids


def runner_class():
    class Runner:               # the model runner's proposal, as vLLM 0.32 dispatches it
        def __init__(self, method, requests):
            self.speculative_config = SimpleNamespace(method=method)
            self.requests = requests
            self.input_batch = SimpleNamespace(req_ids=list(requests))
            self.drafter = NgramProposer() if method == "ngram" else SuffixDecodingProposer()

        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *rest):
            spec_config = self.speculative_config
            if spec_config.method == "ngram":
                return self.drafter.propose(sampled_token_ids)
            elif spec_config.method == "suffix":
                return self.drafter.propose(self.input_batch.req_ids, sampled_token_ids)
    return Runner


def test_a_request_at_k_0_is_not_searched_by_the_ngram_or_suffix_proposer():
    plan = {"method": "ngram", "domains": {"chat": [(1, 8, 0)]}, "default": [(1, 8, 4)]}
    Runner = runner_class()
    assert plugin.enable_proposal_skip(Runner, plan) == [plugin.SKIP_LINE]
    requests = {"a": request(specdec_domain="json"), "b": request(specdec_domain="chat"), "c": request(specdec_k=0)}
    ngram = Runner("ngram", requests)
    sampled = [[1], [2], [3]]
    assert ngram.propose_draft_token_ids(None, sampled, "more") == [[7, 7], [], []]
    assert ngram.drafter.searched == [[0]] and sampled == [[1], [2], [3]]    # the caller's list untouched
    suffix = Runner("suffix", requests)
    assert suffix.propose_draft_token_ids(None, sampled) == [[9, 9, 9], [], []]
    cache = suffix.drafter.suffix_cache
    assert isinstance(cache, SuffixCache)                 # the proposer's own cache back in place
    assert cache.added == ["a", "b", "c"] and cache.speculated == ["a"]   # the tree still learns from b, c
    # nothing at K 0 (or another method): vLLM's proposal as it is
    everyone = Runner("ngram", {"a": request(specdec_k=3), "d": request()})
    assert everyone.propose_draft_token_ids(None, [[1], [2]]) == [[7, 7], [7, 7]]
    assert plugin.enable_proposal_skip(Runner, plan) == []          # wrapped once


def test_a_proposal_that_is_not_the_code_the_skip_expects_is_left_as_it_is(caplog):
    class Other:
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids):
            return [[1]] * len(sampled_token_ids)

    lines = plugin.enable_proposal_skip(Other, None)
    assert "pay the proposer's search" in lines[0] and "spec_config.method" in lines[0]
    assert not getattr(Other.propose_draft_token_ids, "specdec_skip", False)
    # a runner as expected, with a proposer that searches another way: checked at its first
    # proposal, said once, and served as vLLM proposes
    Runner = runner_class()

    class Searching(NgramProposer):
        def propose(self, sampled_token_ids):
            self.searched.append(list(range(len(sampled_token_ids))))
            return [[5]] * len(sampled_token_ids)

    assert plugin.enable_proposal_skip(Runner, None) == [plugin.SKIP_LINE]
    runner = Runner("ngram", {"a": request(specdec_k=0)})
    runner.drafter = Searching()
    with caplog.at_level("WARNING"):
        assert runner.propose_draft_token_ids(None, [[1]]) == [[5]] and runner.drafter.searched == [[0]]
        assert runner.propose_draft_token_ids(None, [[1]]) == [[5]]
    said = [r.getMessage() for r in caplog.records if "pay the proposer's search" in r.getMessage()]
    assert len(said) == 1 and "Searching.propose lacks" in said[0], said
