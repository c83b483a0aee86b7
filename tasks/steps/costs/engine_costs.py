"""Cost profiles of the serving engine: vLLM's own decode steps, timed in the serving environment
(`specdec profile measure --engine vllm`), stored as a cost profile like our engine's, so the
planner can say what a config gives *on vLLM* on this hardware.

What is timed: one vLLM engine per drafter method (the ngram engine for the plain step and
verify(K); one more per other method a candidate uses), started at its largest K and serving
each request the K it asks (the plugin's K per request). Each figure is a ratio of a pair of
batches timed one right after the other, K 0 and K (the probe's time-paired: greedy or sampled
requests with `ignore_eos`, sent at once, the decode phase from vLLM's engine-core timestamps,
the batch's last first token to its last token, over the decode steps taken), one more pair a
round for each ratio not settled yet, within `profile_engine_budget_s` (docs/evaluation.md).

- target_step(b): the ngram engine's seconds per step at K 0 (the median over its pairs).
- verify(b, K): the `ngram` engine's at K. Its prompts repeat a cycle of tokens, so n-gram
  matching proposes K tokens in every step whatever the target answers: the step verifies K
  drafts (where it found none, the step was a plain one: the verify step is solved from the
  share of steps that drafted and the plain step). vLLM verifies every proposed token, accepted
  or not, so the step's cost depends on how many were proposed: no synthetic acceptance is needed
  (nor implemented in vLLM's CPU sampler). The ngram search is in this figure: prompt lookup's
  own draft step is 0.
- draft_round(drafter, b, K): a host drafter's (suffix) engine times every K as the ngram one
  does; its whole round at K over its own K 0 step prices its rounds (CostTable.round_ratios),
  not verify(K) plus a difference of two processes' ratios (docs/evaluation.md).
- draft_step(drafter, b): another candidate's ratio at `draft_k` less the ngram engine's (0 at
  the least), per round for host drafters, per draft token for models (one engine at draft_k).
- sampled_step(b), sampled_verify(b, K): the same for sampled requests (SAMPLED: temperature 0.7,
  top-p 0.9) in the ngram engine at the smallest and largest K and batch size, alternating with
  the greedy batches; between those, the sampled extra over greedy is linear in K and in the
  batch size. What costs is top-p, which sorts the vocabulary at each verified position: the
  planner and the engine check price each request that samples with top-p, or a domain's share
  of them, with these figures (CostTable.for_sampling), and a request sampling at its
  temperature alone or with top-k only with the greedy ones (pays_sampled_steps: at K 8 and
  batch 1 a round at temperature 0.7 alone cost 1.64 greedy steps, with top-p 0.9 2.65, a
  greedy one 1.61; benchmarks/results/sampled_costs.md).
- No round overhead apart: vLLM's work outside the forward passes is inside the steps timed.

The profile's hardware description names the engine (`details.engine`: name, version, the CPU
sampler mends the engine needed), its name says so (vllm-<version>-<device>), and its check
flags spreads beyond `profile_max_spread` and ngram engines that proposed less than half of K.
It is stored with its key (engine "vllm" and its version, the CPU and threads, the dtype, the
served target's fingerprint; tasks.steps.costs.costs.profile_key) like our engine's; `specdec profile
measure --engine vllm` always measures afresh.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ...db.queries_costs import hardware_rows_newest_first
from ...db.store import Store
from ...errors import EngineTimeout, ServingProbeError
from ...registry.config_schema import DrafterSpec
from ...registry.vllm_export import speculative_config
from ...serving import environment as serving_env
from ...serving.paired_answer import PairedAnswer, PairedTiming
from ...serving.scripts.vllm_probe import clean_pairs, pooled_spread, ratio_interval
from ...paths import check_identifier, home_path
from ...settings import Settings
from ...timeutil import utcnow
from ..drafters.candidates import HOST_DRAFTERS, candidate_label, parse_candidate
from .costs import (CostTable, _slug, load_costs, profile_key, profile_provenance, store_costs,
                    timing_lock)
from .k_ladder import ladder, shaped
from .reuse import reusable_profile, reuse_costs
from .vllm_hardware import engine_threads, served_dtype, vllm_hardware

log = logging.getLogger(__name__)

CYCLE = 29              # tokens in the prompts' repeating cycle (ngram always finds a match)
# sampled requests, timed apart: vLLM's rejection sampler does more for them (temperature, top-p
# over the K + 1 positions' distributions); the shipped traffic's commonest sampled setting
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 0}


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


@dataclass
class VllmProfilePlan:
    """What profile_vllm times: the served model, the batch sizes and Ks, the engines in order
    ((label, vLLM config, candidate spec or None, Ks timed beside K 0)), the batch sizes sampled
    requests are timed at, the prompt lookup labels (draft step 0) and the probe's request shared
    by every engine."""
    model_dir: object
    dtype: str
    context: int
    sizes: list[int]
    ks: list[int]
    sampled_sizes: list[int]
    runs: list[tuple]
    lookups: set[str]
    base: dict
    sampled: dict = field(default_factory=lambda: dict(SAMPLED))


NGRAM = "ngram"          # the label of the n-gram engine: plain (K 0) and verify(K) for every K


def profile_vllm(run_id: str, target: str, candidates: list[str] | None,
                 store: Store, name: str | None = None,
                 settings: Settings | None = None, k_max: int | None = None, batch_sizes=None,
                 ks: list[int] | None = None, draft_k: int = 3, steps: int = 8,
                 progress: bool = True, sampled: dict | None = None) -> dict:
    """Time vLLM's decode steps for `target` in the serving environment and store them as a cost
    profile (see the module's docstring). ks: the K values timed on the ngram engine (default 1,
    2, 4, 8, ... and k_max; the others are interpolated linearly between measured neighbours);
    candidates: drafters whose vLLM config gets an engine of its own for its draft step; steps:
    decode steps per timed batch at every K; sampled: the sampling its sampled steps are timed at
    (default SAMPLED, what pays_sampled_steps prices with them).

    Output: {"run_id", "hardware_profile": {name, device, dtype, details}, "costs": rows, "check",
    "seconds", "engines": [{config, start_s, seconds, mends, repeats, stopped}]}."""
    check_identifier(run_id, "run id")     # it names $SPECDEC_HOME/engine_profiles/<run_id>
    settings = settings or store.settings
    k_max = k_max or settings.plan.k_max
    sizes = sorted(set(batch_sizes or settings.profile.batch_sizes))
    # default: 1, 2, 4, 8, ... and k_max (the rest interpolated)
    ks = sorted({k for k in (ks or [2 ** i for i in range(k_max.bit_length())]) if 1 <= k <= k_max}
                | {1, k_max})
    plan = _plan_vllm_profile(run_id, target, candidates, settings, k_max, sizes, ks, draft_k,
                              steps)
    plan.sampled = dict(sampled or SAMPLED)
    started = time.perf_counter()
    answers, engines = _time_engines(run_id, plan, settings, progress)
    table, hardware, version = _vllm_table(run_id, plan, answers, engines, settings, k_max, draft_k,
                                           steps, name)
    # its key (tasks.steps.costs.costs.profile_key): vLLM's version, and the fingerprint written beside
    # the served directory (None for a directory that is not one of ours: never reused)
    store_costs(store, run_id, hardware, table, profile_key(
        hardware, "vllm", version, serving_env.served_fingerprint(plan.model_dir)))
    elapsed = time.perf_counter() - started
    log.info("profile %s: vLLM %s profiled at batch sizes %s in %.0f s (%s)", run_id, version, sizes,
             elapsed, table.check["status"])
    (log.warning if table.check["status"] == "noisy" else log.info)(
        "profile %s: %s", run_id, "; ".join(table.check["reasons"] + table.check["notes"]) or "settled")
    provenance = profile_provenance(run_id, utcnow(), None)
    return {"run_id": run_id, "hardware_profile": hardware, "costs": table.rows(),
            "check": {key: table.check[key] for key in ("status", "reasons", "attempts", "max_spread",
                                                        "notes")},
            "seconds": elapsed, "engines": engines, "profile": provenance}


def _plan_vllm_profile(run_id: str, target: str, candidates: list[str] | None, settings: Settings,
                       k_max: int, sizes: list[int], ks: list[int], draft_k: int,
                       steps: int) -> VllmProfilePlan:
    """The served model, its prompts and the engines to time: ngram at k_max (K 0, the plain
    step, and every K of `ks`, K per request), and one per candidate with another vLLM method (a
    host drafter's at k_max: K 0, `ks` and draft_k; a model's: K 0 and draft_k); a candidate
    without a vLLM config is left out with a warning."""
    serving_env.serving_python(settings)
    model_dir = serving_env.served_model_dir(target)
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = served_dtype(model_dir)
    longest = steps * (max(k_max, draft_k) + 1) + 1         # tokens of the longest timed batch
    context = min(settings.profile.context_len, int(model_config.get("max_position_embeddings", 2048))
                  - longest - k_max - 8)
    prompts = cycle_prompts(int(model_config["vocab_size"]), max(sizes), context)
    base = {"model": str(model_dir), "prompts": prompts, "batch_sizes": sizes, "steps": steps,
            "dtype": dtype, "max_model_len": context + longest + k_max + 8,
            "halfwidth": settings.profile.ratio_halfwidth, "min_repeats": settings.profile.repeats,
            "dip": settings.profile.verify_dip,
            "contention_cores": settings.profile.contention_cores, "slowed": settings.profile.slowed}
    lookup = {"kind": "prompt_lookup", "params": {"max_ngram": 3, "min_ngram": 1}}
    runs = [(NGRAM, speculative_config(DrafterSpec(**lookup), k_max), None, ks)]
    lookups = {candidate_label({"kind": "prompt_lookup", "params": {}})}
    for text in candidates or []:
        spec = parse_candidate(text)
        if spec["kind"] == "prompt_lookup":
            lookups.add(candidate_label(spec))     # the ngram engine's own search: draft step 0
            continue
        ladder = spec["kind"] in HOST_DRAFTERS      # its own rounds at every K, as it is served
        served = speculative_config(DrafterSpec(kind=spec["kind"], params=spec["params"]),
                                    k_max if ladder else draft_k)
        if served is None:
            log.warning("profile %s: %s has no vLLM equivalent: no draft step measured for it",
                        run_id, text)
            continue
        runs.append((candidate_label(spec), served, spec, sorted(set(ks) | {draft_k}) if ladder else [draft_k]))
    return VllmProfilePlan(model_dir, dtype, context, sizes, ks, sorted({sizes[0], sizes[-1]}),
                           runs, lookups, base)


def _budget_weight(run: tuple) -> float:
    """An engine's share of the timing budget: ngram 3, a host drafter's ladder 2, one K 1."""
    return 3.0 if run[0] == NGRAM else 2.0 if len(run[3]) > 1 else 1.0


def _engine_request(plan: VllmProfilePlan, run: tuple, settings: Settings, spare: int = 0) -> dict:
    """The probe's time-paired request of one engine: its Ks and samplings, and its share of the
    timing budget (_budget_weight)."""
    label, spec, _, ks = run
    weights = [_budget_weight(r) for r in plan.runs]
    budget = settings.profile.engine_budget_s * _budget_weight(run) / sum(weights)
    samplings = {"greedy": {}}
    if label == NGRAM:      # sampled requests at the smallest and largest K (linear between)
        samplings["sampled"] = {**plan.sampled, "batch_sizes": plan.sampled_sizes,
                                "ks": sorted({ks[0], ks[-1]})}
    # never cut before profile_repeats rounds: the ngram engine (it prices every plain step and
    # sampled request), and any engine's batch 1 pairs (the plan turns domains on there)
    return dict(plan.base, speculative_config=spec, ks=ks, samplings=samplings, budget_s=budget,
                min_rounds=settings.profile.repeats if label == NGRAM else 2,
                first_rounds=settings.profile.repeats,
                max_repeats=max(settings.profile.repeats * settings.profile.attempts * 3, 3),
                spare_cores=spare)


def _time_engines(run_id: str, plan: VllmProfilePlan, settings: Settings,
                  progress: bool) -> tuple[dict[str, PairedAnswer], list[dict]]:
    """Start each planned engine in turn (under the timing lock, its threads on the CPUs free
    when the first starts: every engine as many, as a suffix engine's draft step is its step
    less the ngram engine's) and collect its paired timings. Output: (the probe's answer by
    label, read once here into a PairedAnswer, [{config, speculative_config, start_s, seconds,
    mends, repeats, contended, stopped, threads, timings (the probe's JSON, as stored)}])."""
    directory = home_path("engine_profiles", run_id)
    answers, engines = {}, []
    with timing_lock(), tqdm(total=len(plan.runs), disable=not progress, desc="vLLM engines") as bar:
        for run in plan.runs:
            label, spec = run[0], run[1]
            what = f"profile {run_id}: vLLM {label}"
            threads = serving_env.free_cpus(count=len(engines[0]["threads"]["cpus"]) if engines else None)
            log.info("%s: starting (%s) on CPUs %s (other processes used %.2f cores)", what,
                     json.dumps(spec), ",".join(map(str, threads["cpus"])), threads["others"])
            began = time.perf_counter()
            try:
                answer = PairedAnswer.from_json(serving_env.run_engine(
                    _engine_request(plan, run, settings, threads["spare"]), directory / (_slug(label) + ".log"),
                    settings.engine.check_timeout_s, what, settings, command="time-paired",
                    threads=threads["bind"]))
            except (EngineTimeout, ServingProbeError) as exc:
                raise ServingProbeError(f"{exc}") from None
            if answer.refused:
                raise ServingProbeError(f"{what}: vLLM refused the config: {answer.refused}")
            if not answer.k_per_request:
                raise ServingProbeError(f"{what}: the serving environment's vLLM has no K per "
                                        "request (the specdec plugin): run `make serving-env`")
            repeats, contended = answer.repeats, answer.contended_pairs
            engines.append({"config": label, "speculative_config": spec, "start_s": answer.start_s,
                            "seconds": round(time.perf_counter() - began, 1),
                            "mends": answer.mends or [], "repeats": repeats,
                            "contended": contended, "stopped": answer.stopped,
                            # the check's JSON details store the probe's rows as it wrote them
                            "threads": threads, "timings": answer.timings_json()})
            answers[label] = answer
            bar.update(1)
            log.info("%s: %d rounds (%d pairs with other processes on the CPU), %s, in %.0f s (engine "
                     "start %.1f s)", what, repeats, contended, answer.stopped,
                     engines[-1]["seconds"], answer.start_s)
    return answers, engines


def _vllm_table(run_id: str, plan: VllmProfilePlan, answers: dict[str, PairedAnswer], engines: list[dict],
                settings: Settings, k_max: int, draft_k: int, steps: int,
                name: str | None) -> tuple[CostTable, dict, str]:
    """The cost table of the engines' paired timings, its check and the hardware description
    naming vLLM. Output: (table, hardware, vLLM's version)."""
    sizes, ks = plan.sizes, plan.ks
    table, reasons, notes = _table(answers, plan.runs, k_max, sizes, draft_k, settings)
    # an engine a neighbour left fewer CPUs timed a smaller engine's steps (environment.thread_env)
    notes += [f"{e['config']}: {note}" for e in engines if (note := serving_env.fewer_cpus(e.get("threads")))]
    for label in plan.lookups:
        table.draft_step[label] = {b: 0.0 for b in sizes}
    version = answers[NGRAM].vllm
    hardware = vllm_hardware(version, plan.dtype, name, engine_threads(engines))
    table.hardware_profile = hardware["name"]
    hardware = {**hardware, "details": {**hardware["details"], "engine": {
                    "name": "vllm", "version": version, "enforce_eager": True,
                    "mends": sorted({m for e in engines for m in e["mends"]}),
                    "ngram_ks": ks, "sampled_ks": sorted({ks[0], ks[-1]}), "paired": True,
                    "sampled_batch_sizes": plan.sampled_sizes, "sampled": plan.sampled,
                    "draft_k": draft_k, "steps": steps,
                    "context_len": plan.context}}}
    table.check = {"status": "noisy" if reasons else "ok", "reasons": reasons, "notes": notes,
                   "attempts": max((e["repeats"] for e in engines), default=0),
                   "max_spread": max(table.spread.values(), default=0.0),
                   "details": {"paired": True, "max_spread_allowed": settings.profile.max_spread,
                               "ratio_halfwidth": settings.profile.ratio_halfwidth,
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


def vllm_profile_or_reuse(run_id: str, target: str, candidates: list[str] | None,
                          store: Store, settings: Settings | None = None,
                          k_max: int | None = None, new_profile: bool = False,
                          progress: bool = False) -> dict:
    """The run's cost profile of the serving engine: the newest stored vLLM profile of this
    vLLM version, CPU, dtype and served target that passed its checks, is younger than
    profile_max_age_days and covers the run (the candidates vLLM serves), copied under `run_id`
    (tasks.steps.costs.reuse.reuse_costs); else one measured here (profile_vllm). new_profile: measure
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


def _pairs(timings: list[PairedTiming], b: int, sampling: str, k: int,
           slack: float | None = None) -> tuple[list[float], bool]:
    """(verify(K) over the K 0 step timed beside it, per pair; whether contended pairs were
    used): the pairs neither of whose batches was contended (/proc) nor slowed (a step more than
    `slack` over the fastest of its batch size and K: the probe's clean_pairs) where there are
    two or more, else every pair not slowed (a neighbour that stayed is on both sides of each;
    one such pair is priced with the engine's pooled spread), else every pair.
    Timings without a `pair` (an earlier probe's) pair by repeat."""
    rows = [t.to_json() for t in timings]       # the probe's clean_pairs reads its own rows (dicts)
    for contended, slowed, least in ((False, slack, 2), (True, slack, 1), (True, None, 0)):
        pairs = clean_pairs(rows, (b, sampling), k, contended, slowed)
        if len(pairs) >= least:
            return [_verify_ratio(PairedTiming.from_json(at_k), PairedTiming.from_json(plain), k)
                    for at_k, plain in pairs], contended
    return [], True


def _verify_ratio(at_k: PairedTiming, plain: PairedTiming, k: int) -> float:
    """verify(K) over the K 0 step from one pair: a step in which the n-gram search found
    nothing is a plain step, so the measured ratio is share x v + (1 - share), solved for v."""
    ratio = at_k.step_s / plain.step_s
    share = min(at_k.drafted / max(at_k.steps * at_k.batch_size * k, 1), 1.0) if k else 1.0
    return ratio if share >= 1.0 or share <= 0 else max((ratio - (1 - share)) / share, ratio)


def _interval(values: list[float], pooled: tuple[float, int] | None = None) -> tuple[float, float]:
    """(median, 95% half-width) of paired ratios (the probe's ratio_interval: a robust spread, the
    engine's pooled spread where it has one); (nan, inf) for none, (median, inf) for one."""
    return ratio_interval(list(values), pooled)


def _k0_step(timings: list[PairedTiming], b: int, sampling: str) -> float:
    steps = [t.step_s for t in timings
             if t.batch_size == b and t.sampling == sampling and t.k == 0 and t.steps and t.decode_s]
    if not steps:
        raise ServingProbeError(f"the engine timed no decode step at batch size {b}")
    return float(np.median(steps))


def _table(answers: dict[str, PairedAnswer], runs: list, k_max: int, sizes: list[int], draft_k: int,
           settings: Settings) -> tuple[CostTable, list[str], list[str]]:
    """(table, reasons it is noisy, notes) from the engines' paired timings: the ngram engine's
    K 0 step is the target step; verify(K) its paired ratio at K times that step (at every K on
    one line through the Ks timed where it fits them all, else linear between them: k_ladder);
    a host drafter's draft_round(K) its own engine's paired ratio at K times
    that step, likewise; another method's draft step its paired ratio at draft_k less the ngram
    engine's at that K, times the step. Each figure's spread is its ratio's 95% half-width over
    the ratio. A ratio whose half-width is over ratio_halfwidth is a note: the plan's interval
    carries it (a busy machine makes the plan cautious, never silent); a step cheaper at a
    larger K by more than profile_verify_dip beyond both intervals is a reason (noisy)."""
    table = CostTable("", "", {}, {}, {}, {})
    reasons, notes = [], []
    halfwidth = settings.profile.ratio_halfwidth
    ngram = answers[NGRAM].timings
    slack = settings.profile.slowed
    # each engine's spread pooled over its ratios (the probe's rule: its pooled_spread reads the
    # probe's own rows, dicts)
    pooled = {label: pooled_spread(answer.timings_json(), answer.groups(), slack=slack)
              for label, answer in answers.items()}

    def ratio(timings, label, b, sampling, k, component, drafter=None) -> float:
        pairs, contended = _pairs(timings, b, sampling, k, slack)
        mean, half = _interval(pairs, pooled.get(label))
        what = f"{label} K={k}{' sampled' if sampling != 'greedy' else ''} at batch {b}"
        if not np.isfinite(mean):
            raise ServingProbeError(f"profile: {what}: no paired timing")
        relative = half / mean if mean > 0 else float("inf")
        table.spread[(component, drafter, k, b)] = min(relative, 9.99)
        if relative > halfwidth:
            notes.append(f"{what}: {mean:.3f} +- {relative:.0%} ({len(pairs)} pairs; the plan's interval carries it)")
        if contended:
            notes.append(f"{what}: paired over repeats with other processes on the CPU")
        return mean

    lines = []

    def priced(measured: dict, component: str, label: str | None, b: int) -> dict:
        """Seconds at every K from 1 to k_max: one line where it fits the ladder (k_ladder)."""
        at, widths = ladder(measured, {k: table.spread[(component, label, k, b)] for k in measured}, k_max)
        if widths:
            table.spread.update({(component, label, k, b): min(w, 9.99) for k, w in widths.items()})
            lines.append(f"{component}{f' of {label}' if label else ''} at batch {b}")
        return {k: table.target_step[b] * r for k, r in at.items()}

    for b in sizes:
        step = table.target_step[b] = _k0_step(ngram, b, "greedy")
        table.spread[("target_step", None, None, b)] = 0.0
        table.verify[b] = priced(shaped({k: ratio(ngram, NGRAM, b, "greedy", k, "verify") for k in runs[0][3]},
                                         table.spread, "verify", b, notes, settings.profile.verify_dip),
                                 "verify", None, b)
        if any(t.sampling == "sampled" and t.batch_size == b for t in ngram):
            sampled = table.sampled_step[b] = _k0_step(ngram, b, "sampled")
            timed = sorted({t.k for t in ngram if t.sampling == "sampled" and t.batch_size == b} - {0})
            table.sampled_verify[b] = {k: sampled * r for k, r in shaped(
                {k: ratio(ngram, NGRAM, b, "sampled", k, "sampled_verify") for k in timed},
                table.spread, "sampled_verify", b, notes, settings.profile.verify_dip).items()}
        for label, _, spec, timed in runs[1:]:
            timings = answers[label].timings
            own = ratio(timings, label, b, "greedy", draft_k, "draft_step", label)
            extra = max(own - table.verify[b][draft_k] / step, 0.0) * step
            table.draft_step.setdefault(label, {})[b] = extra if spec["kind"] in HOST_DRAFTERS else extra / draft_k
            if len(timed) > 1:      # a host drafter's own rounds, every K in its own engine
                rounds = shaped({k: ratio(timings, label, b, "greedy", k, "draft_round", label) for k in timed},
                                 table.spread, "draft_round", b, notes, settings.profile.verify_dip, label)
                table.draft_round.setdefault(label, {})[b] = priced(rounds, "draft_round", label, b)
    _fill_sampled(table, sizes)
    if lines:
        notes.append("priced on one line through their timed Ks: " + ", ".join(lines))
    return table, reasons, notes


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
