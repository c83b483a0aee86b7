"""Each model step takes the run's RunContext (issue 84): the phases' context-taking entries
(confirm_in, validate_in, validate_run_in, estimate_in, measure_or_reuse_in, engine_check_in,
engine_validate_in) hand the long-form functions the context's fields, and the engine validate
step serves on the run's serving pool (model_steps.serving_pool). No model is loaded: the
long-form functions are replaced by recorders."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tasks.errors import ServingEnvUnavailable
from tasks.serving.server import ServerPool
from tasks.steps import model_steps
from tasks.steps.checks import confirm, engine_check, engine_validate, validate
from tasks.steps.context import RunSpec
from tasks.steps.costs import reuse
from tasks.steps.estimate import offline_estimate


class FakeContext:
    """What a RunContext offers the entries, each value a plain marker."""

    def __init__(self):
        self.spec = RunSpec(run_id="r1", target="the-target")
        self.run_id = "r1"
        self.model = torch.nn.Linear(2, 2)
        self.tokenizer = "tokenizer"
        self.store = "store"
        self.settings = SimpleNamespace(plan=SimpleNamespace(k_max=3))
        self.drafters = {"pl": ("pl-spec", "pl-drafter")}
        self.fingerprint = "fid"
        self.target_fingerprint = {"digest": "fid"}

    def domain_requests(self, domain):
        return [f"request-{domain}"], {"other_fingerprint": []}

    def domain_drafters(self, domain):
        return {f"drafter-{domain}": ("spec", "drafter")}

    def sample_requests(self, domains):
        return {d: [f"request-{d}"] for d in domains}, {"too_long": ["x"]}


def recorder(calls: list, out=None):
    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return out
    return record


def test_the_per_domain_entries_hand_on_the_contexts_requests_drafters_store_and_settings(monkeypatch):
    context, calls = FakeContext(), []
    monkeypatch.setattr(confirm, "confirm_domain", recorder(calls, {"row": 1}))
    monkeypatch.setattr(validate, "validate_domain", recorder(calls, {"validation": "passed"}))
    monkeypatch.setattr(offline_estimate, "estimate_domains", recorder(calls, {}))
    assert confirm.confirm_in(context, "qa") == {"row": 1}
    assert validate.validate_in(context, "qa") == {"validation": "passed"}
    offline_estimate.estimate_in(context, "qa")
    per_domain = ("r1", "qa", context.model, {"drafter-qa": ("spec", "drafter")}, ["request-qa"], "store")
    assert calls[0] == (per_domain, {"settings": context.settings, "progress": False})
    assert calls[1] == (per_domain, {"settings": context.settings})
    assert calls[2] == (("r1", context.model, {"drafter-qa": ("spec", "drafter")}, {"qa": ["request-qa"]},
                         "store"), {"settings": context.settings, "k_max": 3, "progress": False})


def test_the_run_wide_entries_hand_on_the_contexts_fields(monkeypatch):
    context, calls = FakeContext(), []
    monkeypatch.setattr(validate, "validate_run", recorder(calls, {"domains": {}}))
    monkeypatch.setattr(reuse, "measure_or_reuse", recorder(calls, {"profile": {}}))
    monkeypatch.setattr(engine_check, "engine_check", recorder(calls, {"skipped": None}))
    # the planned domains, on or off: a suffix engine's history is every one's traffic
    monkeypatch.setattr(engine_check, "domain_names", lambda store, run_id, status=None: ["json", "qa"])
    assert validate.validate_run_in(context, ["qa"]) == ({"domains": {}}, {"too_long": ["x"]})
    assert validate.validate_run_in(context, []) == ({"domains": {}}, {})
    reuse.measure_or_reuse_in(context, new_profile=True)
    engine_check.engine_check_in(context, ["qa"], pool="pool")
    assert calls[0] == (("r1", context.model, "tokenizer", context.drafters, {"qa": ["request-qa"]}),
                        {"target_id": "the-target", "store": "store", "settings": context.settings,
                         "excluded": {"too_long": ["x"]}, "fingerprint": {"digest": "fid"},
                         "drafters_by_domain": {"qa": {"drafter-qa": ("spec", "drafter")}}})
    assert calls[1][0][4] == {} and calls[1][1]["excluded"] == {} and calls[1][1]["drafters_by_domain"] == {}
    assert calls[2] == (("r1", context.model, {"pl": "pl-drafter"}, "store"),
                        {"settings": context.settings, "k_max": 3, "tokenizer": "tokenizer",
                         "fingerprint": "fid", "new_profile": True})
    assert calls[3] == (("r1", "the-target", context.model, {"qa": {"drafter-qa": ("spec", "drafter")}},
                         {"json": ["request-json"], "qa": ["request-qa"]}, "store"),
                        {"settings": context.settings, "pool": "pool"})


def test_engine_validate_takes_the_planned_domains_requests(monkeypatch):
    context, calls = FakeContext(), []
    monkeypatch.setattr(engine_validate, "domain_names", lambda store, run_id: ["json", "qa"])
    monkeypatch.setattr(engine_validate, "engine_validate_run", recorder(calls, {"domains": {}}))
    engine_validate.engine_validate_in(context, ["qa", "nosuch"], speculative_config={"method": "x"},
                                       mended=False, pool="pool")
    engine_validate.engine_validate_in(context)
    assert calls[0] == (("r1", "the-target", context.model, {"qa": ["request-qa"]}, "store"),
                        {"settings": context.settings, "domains": ["qa", "nosuch"],
                         "speculative_config": {"method": "x"}, "mended": False, "pool": "pool"})
    assert calls[1][0][3] == {"json": ["request-json"], "qa": ["request-qa"]}
    assert calls[1][1]["domains"] is None and calls[1][1]["pool"] is None


def test_the_engine_validate_step_serves_on_the_runs_serving_pool(monkeypatch, tmp_path):
    context, calls = FakeContext(), []
    monkeypatch.setattr(model_steps, "RunContext", SimpleNamespace(build=lambda spec: context))
    monkeypatch.setattr(model_steps, "engine_validate_in", recorder(calls, {"domains": {}, "servers": []}))
    monkeypatch.setattr(model_steps.serving_env, "served_model_dir", lambda target: tmp_path)
    assert model_steps.step_engine_validate(context.spec, ["qa"], mended=False) == {"domains": {}, "servers": []}
    (args, kwargs), = calls
    assert args == (context, ["qa"]) and kwargs["mended"] is False and kwargs["speculative_config"] is None
    pool = kwargs["pool"]
    assert isinstance(pool, ServerPool) and pool.run_id == "r1" and pool.model_dir == str(tmp_path)
    assert pool.dtype == "float32" and pool.settings is context.settings

    # no serving environment: no pool, and engine_validate_run says why (ServingEnvUnavailable)
    def unavailable(target):
        raise ServingEnvUnavailable("no serving environment")
    monkeypatch.setattr(model_steps.serving_env, "served_model_dir", unavailable)
    model_steps.step_engine_validate(context.spec)
    assert calls[1][1]["pool"] is None


def test_the_validate_step_leaves_our_sampling_test_to_vllms_where_that_one_gates(monkeypatch):
    # where the sampling test on vLLM gates (the engine check runs it), the validate step runs
    # none of its own and says so; where it does not, the domain's own test runs
    calls, context = [], FakeContext()
    monkeypatch.setattr(model_steps.RunContext, "build", staticmethod(lambda spec: context))
    monkeypatch.setattr(validate, "validate_domain", lambda *args, **kwargs: calls.append(kwargs) or {
        "validation": "deferred" if kwargs.get("defer") else "passed"})
    monkeypatch.setattr(model_steps, "engine_sampling_gates", lambda settings: True)
    skipped = model_steps.step_validate(context.spec, "qa")
    assert "sampling test on vLLM's OpenAI server gates" in skipped["skipped"]
    monkeypatch.setattr(model_steps, "engine_sampling_gates", lambda settings: False)
    assert model_steps.step_validate(context.spec, "qa") == {"validation": "passed"}
    assert [call.get("defer", False) for call in calls] == [True, False]
