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
