"""Cost profiles of the serving engine: vLLM's own decode steps, timed in the serving environment
(`specdec profile measure --engine vllm`), stored as a cost profile like our engine's, so the
planner can say what a config gives *on vLLM* on this hardware.

What is timed, per engine (one vLLM process per speculative config; vLLM does not start twice in
one process), at each profiled batch size, `profile_repeats` times in alternating order of batch
sizes after a warm-up: greedy requests with `ignore_eos`, sent at once, and the decode phase from
vLLM's engine-core timestamps (the batch's last first token to its last token) over the decode
steps taken (tokens after the first, less the drafts accepted).

- target_step(b): the plain engine's seconds per step.
- verify(b, K): the `ngram` engine's at K. Its prompts repeat a cycle of tokens, so n-gram
  matching proposes K tokens in every step whatever the target answers: the step verifies K
  drafts (where it found none, the step was a plain one: the verify step is solved from the
  share of steps that drafted and the plain step). vLLM verifies every proposed token, accepted
  or not, so the step's cost depends on how many were proposed, not on how many are accepted
  (acceptance only changes how many steps a request takes, which is counted): no synthetic
  acceptance is needed (vLLM's synthetic mode is not implemented in its CPU sampler). The ngram search is in this figure, so prompt lookup's own
  draft step is 0.
- draft_step(drafter, b): for every other candidate vLLM serves, one engine at K = `draft_k`:
  (its step - the ngram step at that K), per round for host drafters (suffix), per draft token
  for models (an EAGLE-3 head, a draft model).
- sampled_step(b), sampled_verify(b, K): the same for sampled requests (SAMPLED: temperature 0.7,
  top-p 0.9), timed in the plain engine and the ngram engines at the smallest, middle and largest
  K, at the smallest and largest batch size, in the same engines and alternating with the greedy
  batches; between those, the sampled extra over greedy is linear in K and in the batch size. vLLM's rejection sampler does
  more for a sampled request (the K + 1 positions' distributions, top-p over them): on this CPU a
  sampled ngram step cost 15-20% more than a greedy one while plain steps cost about the same, so
  a greedy-only profile over-predicted half-sampled traffic. The planner and the engine check
  price each request, or a domain's share of sampled requests, with them (CostTable.for_sampling).
- No round overhead apart: vLLM's per-step work outside the forward passes is inside the steps
  timed.

The profile's hardware description names the engine (`details.engine`: name, version, the CPU
sampler mends the engine needed), its name says so (vllm-<version>-<device>), and its check
flags spreads beyond `profile_max_spread` and ngram engines that proposed less than half of K.
It is stored with its key (engine "vllm" and its version, the CPU and threads, the dtype, the
served target's fingerprint; tasks.steps.costs.profile_key) like our engine's; `specdec profile
measure --engine vllm` always measures afresh.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..db.queries_costs import hardware_rows_newest_first
from ..db.store import Store
from ..errors import EngineTimeout, ServingProbeError
from ..registry.config_schema import DrafterSpec
from ..registry.vllm_export import speculative_config
from ..serving import environment as serving_env
from ..paths import check_identifier, home_path
from ..settings import Settings
from ..timeutil import utcnow
from .candidates import HOST_DRAFTERS, candidate_label, parse_candidate
from .costs import (CostTable, _slug, describe_device, load_costs, profile_key, profile_provenance,
                    reusable_profile, reuse_costs, store_costs, timing_lock)

log = logging.getLogger(__name__)

CYCLE = 29              # tokens in the prompts' repeating cycle (ngram always finds a match)
# sampled requests, timed apart: vLLM's rejection sampler does more for them (temperature, top-p
# over the K + 1 positions' distributions); the shipped traffic's commonest sampled setting
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 0}
PROPOSED_FLOOR = 0.5    # an ngram engine that proposed less than this share of K is flagged


def cycle_prompts(vocab_size: int, count: int, length: int, cycle: int = CYCLE) -> list[list[int]]:
    """`count` prompts of `length` tokens, each a cycle of `cycle` distinct ids repeated (a
    different cycle per prompt), from the middle of the vocabulary (ordinary tokens, not the
    special ids at its ends)."""
    rng = np.random.default_rng(0)
    low, high = vocab_size // 8, vocab_size * 7 // 8
    cycle = min(cycle, high - low)
    prompts = []
    for _ in range(count):
        ids = rng.choice(np.arange(low, high), size=cycle, replace=False).tolist()
        prompts.append((ids * (length // cycle + 1))[:length])
    return prompts


def _step_seconds(timings: list[dict], batch_size: int, sampling: str = "greedy"
                  ) -> tuple[float, float, list[float]]:
    """(median seconds per decode step, spread = IQR / median, the per-repeat figures) of the
    batch size's timings under `sampling` (timings without one were greedy)."""
    per_repeat = [t["decode_s"] / t["steps"] for t in timings
                  if t["batch_size"] == batch_size and t.get("sampling", "greedy") == sampling
                  and t["decode_s"] and t["steps"]]
    if not per_repeat:
        raise ServingProbeError(f"the engine timed no decode step at batch size {batch_size}")
    median = float(np.median(per_repeat))
    q1, q3 = np.percentile(per_repeat, [25, 75])
    return median, float((q3 - q1) / median) if median > 0 else 0.0, per_repeat


def _per_step(timings: list[dict], batch_size: int, key: str, sampling: str = "greedy") -> float:
    rows = [t for t in timings if t["batch_size"] == batch_size and t.get("sampling", "greedy") == sampling]
    return sum(t[key] for t in rows) / max(sum(t["steps"] * batch_size for t in rows), 1)


@dataclass
class VllmProfilePlan:
    """What profile_vllm times: the served model, the batch sizes and Ks, the engines in order
    ((label, vLLM config or None, candidate spec or None)), which of them also time sampled
    requests and at which batch sizes, the prompt lookup labels (draft step 0) and the probe's
    request shared by every engine."""
    model_dir: object
    dtype: str
    context: int
    sizes: list[int]
    ks: list[int]
    sampled_ks: list[int]
    sampled_sizes: list[int]
    sampled: set[str]
    runs: list[tuple]
    lookups: set[str]
    base: dict


def profile_vllm(run_id: str, target: str, candidates: list[str] | None,
                 store: Store, name: str | None = None,
                 settings: Settings | None = None, k_max: int | None = None, batch_sizes=None,
                 ks: list[int] | None = None, draft_k: int = 3, max_tokens: int = 96,
                 progress: bool = True) -> dict:
    """Time vLLM's decode steps for `target` in the serving environment and store them as a cost
    profile (see the module's docstring). ks: the K values given an ngram engine (default 1, 2, 4,
    8, ... and k_max; the others are interpolated linearly between measured neighbours);
    candidates: drafters whose vLLM config gets an engine of its own for its draft step.

    Output: {"run_id", "hardware_profile": {name, device, dtype, details}, "costs": rows, "check",
    "seconds", "engines": [{config, start_s, seconds, mends}]}."""
    check_identifier(run_id, "run id")     # it names $SPECDEC_HOME/engine_profiles/<run_id>
    settings = settings or store.settings
    k_max = k_max or settings.plan.k_max
    sizes = sorted(set(batch_sizes or settings.profile.batch_sizes))
    # default: 1, 2, 4, 8, ... and k_max (the rest interpolated): the profile within 10 minutes
    ks = sorted({k for k in (ks or [2 ** i for i in range(k_max.bit_length())]) if 1 <= k <= k_max}
                | {1, k_max})
    plan = _plan_vllm_profile(run_id, target, candidates, settings, k_max, sizes, ks, draft_k,
                              max_tokens)
    started = time.perf_counter()
    answers, engines = _time_engines(run_id, plan, settings, progress)
    table, hardware, version = _vllm_table(run_id, plan, answers, engines, settings, k_max, draft_k,
                                           max_tokens, name)
    # its key (tasks.steps.costs.profile_key): vLLM's version, and the fingerprint written beside
    # the served directory (None for a directory that is not one of ours: never reused)
    store_costs(store, run_id, hardware, table, profile_key(
        hardware, "vllm", version, serving_env.served_fingerprint(plan.model_dir)))
    elapsed = time.perf_counter() - started
    log.info("profile %s: vLLM %s profiled at batch sizes %s in %.0f s (%s)", run_id, version, sizes,
             elapsed, table.check["status"])
    provenance = profile_provenance(run_id, utcnow(), None)
    return {"run_id": run_id, "hardware_profile": hardware, "costs": table.rows(),
            "check": {key: table.check[key] for key in ("status", "reasons", "attempts", "max_spread")},
            "seconds": elapsed, "engines": engines, "profile": provenance}


def _plan_vllm_profile(run_id: str, target: str, candidates: list[str] | None, settings: Settings,
                       k_max: int, sizes: list[int], ks: list[int], draft_k: int,
                       max_tokens: int) -> VllmProfilePlan:
    """The served model, its prompts and the engines to time: plain, ngram at each K, and one per
    candidate with a vLLM config (at draft_k); a candidate without one is left out with a warning."""
    serving_env.serving_python(settings)
    model_dir = serving_env.served_model_dir(target)
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = served_dtype(model_dir)
    context = min(settings.profile.context_len, int(model_config.get("max_position_embeddings", 2048))
                  - max_tokens - k_max - 8)
    prompts = cycle_prompts(int(model_config["vocab_size"]), max(sizes), context)
    base = {"model": str(model_dir), "prompts": prompts, "batch_sizes": sizes, "max_tokens": max_tokens,
            "repeats": settings.profile.repeats, "dtype": dtype,
            "max_model_len": context + max_tokens + k_max + 8}
    lookup = {"kind": "prompt_lookup", "params": {"max_ngram": 3, "min_ngram": 1}}
    runs = [("plain", None, None)]
    runs += [(f"ngram K={k}", speculative_config(DrafterSpec(**lookup), k), None) for k in ks]
    # sampled requests at the smallest, middle and largest K and the smallest and largest batch
    # size (their extra over greedy linear in K and in the batch size between them)
    sampled_ks = sorted({ks[0], ks[len(ks) // 2], ks[-1]})
    sampled_sizes = sorted({sizes[0], sizes[-1]})
    sampled = {"plain"} | {f"ngram K={k}" for k in sampled_ks}
    lookups = {candidate_label({"kind": "prompt_lookup", "params": {}})}
    for text in candidates or []:
        spec = parse_candidate(text)
        if spec["kind"] == "prompt_lookup":
            lookups.add(candidate_label(spec))     # the ngram engines' own search: draft step 0
            continue
        served = speculative_config(DrafterSpec(kind=spec["kind"], params=spec["params"]), draft_k)
        if served is None:
            log.warning("profile %s: %s has no vLLM equivalent: no draft step measured for it",
                        run_id, text)
            continue
        runs.append((candidate_label(spec), served, spec))
    return VllmProfilePlan(model_dir, dtype, context, sizes, ks, sampled_ks, sampled_sizes, sampled,
                           runs, lookups, base)


def _time_engines(run_id: str, plan: VllmProfilePlan, settings: Settings,
                  progress: bool) -> tuple[dict, list[dict]]:
    """Start each planned engine in turn (under the timing lock) and collect its timings.
    Output: (the probe's answer by label, [{config, speculative_config, start_s, seconds, mends,
    timings}])."""
    directory = home_path("engine_profiles", run_id)
    answers, engines = {}, []
    with timing_lock(), tqdm(total=len(plan.runs), disable=not progress, desc="vLLM engines") as bar:
        for label, spec, _ in plan.runs:
            what = f"profile {run_id}: vLLM {label}"
            log.info("%s: starting (%s)", what, json.dumps(spec) if spec else "no speculation")
            began = time.perf_counter()
            try:
                samplings = {"greedy": {}, **({"sampled": {**SAMPLED, "batch_sizes": plan.sampled_sizes}}
                                              if label in plan.sampled else {})}
                answer = serving_env.run_engine(
                    dict(plan.base, speculative_config=spec, samplings=samplings),
                    directory / (_slug(label) + ".log"),
                    settings.engine.check_timeout_s, what, settings, command="time-steps")
            except (EngineTimeout, ServingProbeError) as exc:
                raise ServingProbeError(f"{exc}") from None
            if answer.get("refused"):
                raise ServingProbeError(f"{what}: vLLM refused the config: {answer['refused']}")
            engines.append({"config": label, "speculative_config": spec, "start_s": answer["start_s"],
                            "seconds": round(time.perf_counter() - began, 1),
                            "mends": answer.get("mends") or [],
                            "timings": answer["timings"]})     # kept: the profile can be re-derived
            answers[label] = answer
            bar.update(1)
            log.info("%s: done in %.0f s (engine start %.1f s); per batch size: %s", what,
                     engines[-1]["seconds"], answer["start_s"], "; ".join(
                         f"{b}: {1000 * _step_seconds(answer['timings'], b)[0]:.1f} ms/step, "
                         f"{_per_step(answer['timings'], b, 'drafted'):.2f} drafted and "
                         f"{_per_step(answer['timings'], b, 'accepted'):.2f} accepted per request-step"
                         for b in plan.sizes))
    return answers, engines


def _vllm_table(run_id: str, plan: VllmProfilePlan, answers: dict, engines: list[dict],
                settings: Settings, k_max: int, draft_k: int, max_tokens: int,
                name: str | None) -> tuple[CostTable, dict, str]:
    """The cost table of the engines' timings, its check and the hardware description naming
    vLLM. Output: (table, hardware, vLLM's version)."""
    sizes, ks = plan.sizes, plan.ks
    table, reasons = _table(answers, plan.runs, ks, k_max, sizes, draft_k, run_id, settings)
    for label in plan.lookups:
        table.draft_step[label] = {b: 0.0 for b in sizes}
    version = answers["plain"]["vllm"]
    hardware = vllm_hardware(version, plan.dtype, name)
    table.hardware_profile = hardware["name"]
    hardware = {**hardware, "details": {**hardware["details"], "engine": {
                    "name": "vllm", "version": version, "enforce_eager": True,
                    "mends": sorted({m for e in engines for m in e["mends"]}),
                    "ngram_ks": ks, "sampled_ks": plan.sampled_ks,
                    "sampled_batch_sizes": plan.sampled_sizes, "sampled": SAMPLED,
                    "draft_k": draft_k, "max_tokens": max_tokens,
                    "context_len": plan.context}}}
    table.check = {"status": "noisy" if reasons else "ok", "reasons": reasons, "attempts": 1,
                   "max_spread": max(table.spread.values(), default=0.0),
                   "details": {"max_spread_allowed": settings.profile.max_spread,
                               "repeats": settings.profile.repeats, "engines": engines,
                               # the setting it was timed under (what reuse compares), and the
                               # context the prompts had (shorter where the model's is)
                               "context_len": settings.profile.context_len,
                               "timed_context": plan.context}}
    return table, hardware, version


def plans_on_vllm(settings: Settings, target: str | None = None) -> bool:
    """Whether a run plans on vLLM's costs (setting plan_engine; auto: where the engine check is
    on, a serving environment exists and it can serve `target`: the embedded default or a
    transformers directory)."""
    if settings.plan.engine != "auto":
        return settings.plan.engine == "vllm"
    return (settings.engine.check and serving_env.available(settings)
            and (target is None or serving_env.servable(target)))


def profile_engine(hardware: dict | None) -> str:
    """Which engine a cost profile's hardware description times: "vllm" or "specdec"."""
    engine = ((hardware or {}).get("details") or {}).get("engine") or {}
    return "vllm" if isinstance(engine, dict) and engine.get("name") == "vllm" else "specdec"


def vllm_hardware(version: str, dtype: str, name: str | None = None) -> dict:
    """The hardware description of a vLLM profile on this CPU: {name (vllm-<version>-<cpu>),
    device ("vLLM <version>, <cpu device>"), dtype, details}."""
    hardware = describe_device("cpu", dtype)
    return {"name": name or _slug(f"vllm-{version}-{hardware['name']}"),
            "device": f"vLLM {version}, {hardware['device']}", "dtype": dtype,
            "details": dict(hardware["details"])}


def served_dtype(model_dir) -> str:
    """The dtype a vLLM engine serves the directory's model in (its config's; float32 otherwise)."""
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(
        str(model_config.get("torch_dtype") or model_config.get("dtype")), "float32")


def vllm_profile_or_reuse(run_id: str, target: str, candidates: list[str] | None,
                          store: Store, settings: Settings | None = None,
                          k_max: int | None = None, new_profile: bool = False,
                          progress: bool = False) -> dict:
    """The run's cost profile of the serving engine: the newest stored vLLM profile of this
    vLLM version, CPU, dtype and served target that passed its checks, is younger than
    profile_max_age_days and covers the run (the candidates vLLM serves), copied under `run_id`
    (tasks.steps.costs.reuse_costs); else one measured here (profile_vllm). new_profile: measure
    whatever is stored. Output: profile_vllm's (or reuse_costs's), with "profile" saying which."""
    settings = settings or store.settings
    k_max = k_max or settings.plan.k_max
    model_dir = serving_env.served_model_dir(target)
    version = serving_env.probe("versions", {}, settings, timeout_s=300)["vllm"]
    hardware = vllm_hardware(version, served_dtype(model_dir))
    key = profile_key(hardware, "vllm", version, serving_env.served_fingerprint(model_dir))
    served = [candidate_label(spec) for spec in map(parse_candidate, candidates or settings.plan.candidates)
              if spec["kind"] != "prompt_lookup"
              and speculative_config(DrafterSpec(kind=spec["kind"], params=spec["params"]), 1) is not None]
    source = None
    if not new_profile:
        source = reusable_profile(run_id, key, settings, store, settings.profile.batch_sizes, k_max, served)
    if source is not None:
        result = reuse_costs(run_id, source, store)
        log.info("run %s: vLLM cost profile %s %s (not measured again; --new-profile to measure)",
                 run_id, source["hardware_profile"], result["profile"]["text"])
        return result
    log.info("run %s: measuring vLLM's cost profile (%s)", run_id,
             "a new profile was asked for" if new_profile else
             f"none stored for vLLM {version}, {hardware['device']}, {hardware['dtype']}, target "
             f"{key['target_fingerprint']} within {settings.profile.max_age_days:g} days")
    return profile_vllm(run_id, target, candidates or list(settings.plan.candidates), store,
                        settings=settings, k_max=k_max, progress=progress)


def _table(answers: dict, runs: list, ks: list[int], k_max: int, sizes: list[int], draft_k: int,
           run_id: str, settings: Settings) -> tuple[CostTable, list[str]]:
    table = CostTable("", run_id, {}, {}, {}, {})
    reasons = []

    def timed(label: str, b: int, component: str, k=None, drafter=None, sampling="greedy") -> float:
        seconds, spread, _ = _step_seconds(answers[label]["timings"], b, sampling)
        table.spread[(component, drafter, k, b)] = spread
        if spread > settings.profile.max_spread:
            reasons.append(f"{label}{' sampled' if sampling != 'greedy' else ''} at batch {b}: "
                           f"spread {spread:.0%} over {settings.profile.repeats} repeats")
        return seconds

    def verify_step(label: str, b: int, k: int, plain: float, component: str, sampling: str) -> float:
        step = timed(label, b, component, k=k, sampling=sampling)
        # a step in which the n-gram search found nothing is a plain step: the measured step
        # is share x verify(K) + (1 - share) x plain step, solved for verify(K)
        share = min(_per_step(answers[label]["timings"], b, "drafted", sampling) / k, 1.0)
        if share < PROPOSED_FLOOR and sampling == "greedy":
            # (sampled requests leave the cycle now and then: their share is lower by nature)
            reasons.append(f"{label} at batch {b}: proposed {share:.0%} of K per step, so its "
                           "verify step is mostly inferred, not timed")
        return step if share >= 1.0 or share <= 0 else max((step - (1 - share) * plain) / share, step)

    def has_sampled(label: str, b: int) -> bool:
        return any(t.get("sampling") == "sampled" and t["batch_size"] == b
                   for t in answers[label]["timings"])

    for b in sizes:
        table.target_step[b] = timed("plain", b, "target_step")
        measured = {k: verify_step(f"ngram K={k}", b, k, table.target_step[b], "verify", "greedy")
                    for k in ks}
        known = sorted(measured)
        table.verify[b] = {k: float(np.interp(k, known, [measured[x] for x in known]))
                           for k in range(1, k_max + 1)}
        if has_sampled("plain", b):
            table.sampled_step[b] = timed("plain", b, "sampled_step", sampling="sampled")
            table.sampled_verify[b] = {
                k: verify_step(f"ngram K={k}", b, k, table.sampled_step[b], "sampled_verify", "sampled")
                for k in ks if has_sampled(f"ngram K={k}", b)}
        for label, _, spec in runs:
            if spec is None:          # plain and the ngram engines
                continue
            step = timed(label, b, "draft_step", drafter=label)
            ngram = table.verify[b][draft_k]
            extra = max(step - ngram, 0.0)
            table.draft_step.setdefault(label, {})[b] = (
                extra if spec["kind"] in HOST_DRAFTERS else extra / draft_k)
    _fill_sampled(table, sizes)
    return table, reasons


def _fill_sampled(table: CostTable, sizes: list[int]) -> None:
    """Sampled steps at the batch sizes not timed with sampled requests: the greedy figure plus the
    sampled extra over it, linear in the batch size between the sizes timed (the nearest beyond)."""
    timed = sorted(table.sampled_step)
    if not timed:
        return
    step_extra = [table.sampled_step[b] - table.target_step[b] for b in timed]
    timed_ks = sorted(set.intersection(*(set(table.sampled_verify.get(b, {})) for b in timed)))
    for b in sizes:
        if b in table.sampled_step:
            continue
        table.sampled_step[b] = table.target_step[b] + float(np.interp(b, timed, step_extra))
        table.sampled_verify[b] = {
            k: table.verify[b][k] + float(np.interp(b, timed, [table.sampled_verify[t][k] - table.verify[t][k]
                                                              for t in timed]))
            for k in timed_ks}


def engine_profile(store: Store, version: str | None, name: str | None = None) -> CostTable | None:
    """The cost profile of the serving engine: `name` if given, else the newest stored profile
    measured on vLLM `version` (None: none stored)."""
    if name:
        return load_costs(name, store)
    for row in hardware_rows_newest_first(store):
        engine = (row.details or {}).get("engine")
        if isinstance(engine, dict) and engine.get("name") == "vllm" and engine.get("version") == version:
            return load_costs(row.name, store)
    return None
