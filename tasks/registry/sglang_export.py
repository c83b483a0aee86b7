"""A registered config as SGLang's server takes it: per domain, the `sglang.launch_server` flags of
its speculative decoding (or why there are none).

eagle3 -> EAGLE3, draft_model -> STANDALONE (both a chain: `--speculative-eagle-topk 1`, K steps,
K + 1 tokens verified: at topk 1 SGLang sets num-draft-tokens to num-steps + 1 whatever it is
given, the last verified token counting as one), prompt_lookup -> NGRAM (its chain form: BFS
breadth 1). SGLang takes one K per server, not K by batch size: the export uses the domain's K at
batch size 1 and says so where the plan drafts less (or not at all) at larger batches. suffix,
layer_skip and our EAGLE-1/2-style head have no SGLang equivalent.
"""

from __future__ import annotations

import shlex

from .config_schema import DomainSetting, DrafterSpec, SpecdecConfig

CHAIN = ("--speculative-eagle-topk", "1")      # a chain of drafts, as our drafters and vLLM make


def batch_one_k(setting: DomainSetting) -> int:
    """The K the plan drafts at batch size 1 (a schedule's first range, else the domain's K)."""
    for first, last, k in setting.k_schedule:
        if first <= 1 <= last:
            return int(k)
    return int(setting.k)


def launch_flags(drafter: DrafterSpec, k: int) -> list[str] | None:
    """The speculative flags of one drafter at K tokens per round; None: no SGLang equivalent."""
    chain = ["--speculative-num-steps", str(k), *CHAIN, "--speculative-num-draft-tokens", str(k + 1)]
    if drafter.kind in ("eagle3", "draft_model"):
        algorithm = "EAGLE3" if drafter.kind == "eagle3" else "STANDALONE"
        model = drafter.model_uri or drafter.params.get("model")
        return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(model),
                *chain]
    if drafter.kind == "prompt_lookup":
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1),
                "--speculative-ngram-min-match-window-size", str(int(drafter.params.get("min_ngram", 2))),
                "--speculative-ngram-max-match-window-size", str(int(drafter.params.get("max_ngram", 3))),
                "--speculative-ngram-min-bfs-breadth", "1", "--speculative-ngram-max-bfs-breadth", "1"]
    return None


UNSUPPORTED = {
    "suffix": "suffix decoding is not among SGLang's speculative algorithms",
    "layer_skip": "self-speculation by skipping layers is not among SGLang's speculative algorithms",
    "head": ("SGLang's EAGLE method loads EAGLE checkpoints in their own layout (no final norm of "
             "their own, the target's full vocabulary); our head adds the target's final norm and "
             "may cut the vocabulary"),
}

NOTES = {
    "eagle3": ("the head's checkpoint is in the speculators format (architectures "
               "Eagle3Speculator, the layer as layers.0.*, norm_before_residual and the auxiliary "
               "layer ids in config.json): SGLang must read that format (older SGLang loads only "
               "its own LlamaForCausalLMEagle3 layout, expects the layer as midlayer.*, always takes "
               "the residual before hidden_norm and captures layers [2, N/2, N-3] unless the "
               "config has eagle_config); not run on SGLang here"),
    "draft_model": "the draft model must share the target's tokenizer, as for the estimate",
    "prompt_lookup": ("SGLang's NGRAM drafts from a cache of recent tokens of all the requests it "
                      "served (a trie, recency first), not from this request's own text alone: "
                      "its proposals are not prompt lookup's and the estimate does not score them; "
                      "NGRAM runs on CUDA only"),
}


def launch_command(target: str, flags: list[str] | None) -> str:
    """The `sglang.launch_server` command line that serves `target` with one set of flags."""
    command = f"python -m sglang.launch_server --model-path {shlex.quote(target)}"
    if flags:
        command += " " + " ".join(shlex.quote(flag) for flag in flags)
    return command


def sglang_export(config: SpecdecConfig, target_path: str | None = None) -> dict:
    """Per domain the speculative flags (None: no speculation), the domains whose drafter has no
    SGLang equivalent, notes on what the mapping leaves out, and the deployments: one server
    takes one set of flags, so domains with equal flags share one, each with its command
    (target_path: the model directory the server loads; default: the config's target id)."""
    domains, unsupported, notes = {}, {}, {}
    for name, setting in sorted(config.domains.items()):
        if not setting.enabled or setting.drafter is None:
            domains[name] = None
            continue
        drafter = setting.drafter
        # a schedule that starts with K = 0 (none seen so far): its first K > 0
        k = batch_one_k(setting) or max((int(kk) for _, _, kk in setting.k_schedule), default=1)
        flags = launch_flags(drafter, k)
        if flags is None:
            unsupported[name] = (f"{drafter.kind} has no SGLang equivalent ("
                                 f"{UNSUPPORTED.get(drafter.kind, 'not among its algorithms')}); "
                                 "serve this domain without speculation or with another drafter")
            domains[name] = None
            continue
        said = [NOTES[drafter.kind]] if drafter.kind in NOTES else []
        others = sorted({int(kk) for _, _, kk in setting.k_schedule if kk > 0} - {k})
        differs = [f"K={others} at larger batches"] if others else []
        if setting.max_batch_size:
            differs.append(f"nothing above batch size {setting.max_batch_size}")
        if differs:
            said.append(f"SGLang takes one K per server: K={k} (the plan's at batch size 1) at "
                        f"every batch size, where the plan drafts {' and '.join(differs)}")
        if said:
            notes[name] = "; ".join(said)
        domains[name] = flags
    target = target_path or config.target.id
    groups: dict[tuple, dict] = {}
    for name, flags in domains.items():
        groups.setdefault(tuple(flags or ()), {"domains": [], "flags": flags,
                                               "command": launch_command(target, flags)}
                          )["domains"].append(name)
    return {"target": config.target.id, "run_id": config.run_id, "speculative_flags": domains,
            "deployments": sorted(groups.values(), key=lambda g: g["domains"]),
            "routing": ("one SGLang server takes one speculative algorithm and K: route each "
                        "domain's requests to the deployment that lists it"),
            "unsupported": unsupported, "notes": notes, "default": None}
