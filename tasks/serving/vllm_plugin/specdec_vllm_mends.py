"""specdec-rollout's mends of vLLM's CPU build, loaded as a vLLM general plugin.

vLLM runs every function of the `vllm.general_plugins` entry-point group in each process it
starts (the OpenAI server, its engine core, an in-process `LLM`), so once this distribution is
installed in the serving environment, `vllm serve` and `python -m vllm.entrypoints.openai.api_server`
get the mends as they are started, with no flag. Each mend checks vLLM's own code first and
replaces it only where that code fails the check; every mend made is logged on vLLM's logger with
the prefix "specdec mend:" (the pipeline reads those lines from a server's log).

The defects (vLLM 0.32's CPU build; a build that has them fixed passes the checks, and nothing is
replaced):
- expand: the CPU kernel that spreads each request's temperature, top-k and top-p over the draft
  tokens of a speculative round casts to int64 into a temporary and leaves the real output unset,
  so the rejection sampler reads arbitrary sampling parameters. Sampled outputs change
  (measured: chi-square 113-403 against a plain server at draft positions 1-3).
- empty top-k: the CPU top-k mask takes k.max() over a round's draft tokens and fails when the
  round has none; a top-k request whose drafter proposed nothing kills the engine.
- seeded requests: after a step whose sampled tokens are discarded, vLLM rewinds a seeded
  request's generator with `set_offset(get_offset() - 4)`, which a CPU generator refuses ("CPU
  Generator does not use offset"): the engine dies and every later request gets HTTP 500. Mended by
  giving seeded requests a CPU generator that carries the same seeded state and skips the rewind
  (offsets exist only on Philox generators). The draws stay exact draws from the target's
  distribution; what is lost is bit-identical output for the same seed across different
  schedules (the rewind keeps a discarded draw from shifting the stream).

Set SPECDEC_VLLM_MENDS=0 in a server's environment to load vLLM unmended (the sampling test's power
check does, to show it flags the defect).

K per request (not a mend: a feature vLLM lacks, on whatever build). A server started with a
speculative method and its largest K serves each request with the K it asks: `vllm_xargs:
{"specdec_k": 3}` (0: no drafts), or `{"specdec_domain": "json"}`, the K of that domain in the plan
file named by SPECDEC_VLLM_PLAN (read once at start; a domain it does not name gets its
"default", 0 unless it says otherwise). A request that asks nothing is served as vLLM schedules it,
or with the plan's default where a plan is loaded. The cut is made where vLLM's scheduler takes
each request's drafts (`Scheduler.update_draft_token_ids`, and its async-scheduling twin): a
request gets at most its K of the drafts vLLM's proposer made (so never more than vLLM's own
schedule for the batch size), and verification is unchanged, so the output distribution is too.
The scheduler's code is checked first; where it is not the code this cut expects, or the plan file
cannot be read, the server refuses to start with one line saying so. A request at K 0 is also kept
out of an ngram or suffix proposer's host search (enable_proposal_skip), which vLLM runs for the
whole batch before the cut: a suffix request's response still goes into the tree.

A plan (a file, or its JSON itself in the variable): {"method": vLLM's method name, "domains": {NAME:
[[lo, hi, K], ...]}, "default": [[lo, hi, K], ...]} with inclusive batch-size ranges as in vLLM's
`num_speculative_tokens_per_batch_size` (a size in no range: K 0); a bare number is K at every
batch size.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os

import torch     # loaded already: vLLM imports it before it loads its plugins

MARK = "specdec mend:"
OFF_VARIABLE = "SPECDEC_VLLM_MENDS"

EXPAND_MEND = ("vLLM's CPU expand kernel (per-request temperature, top-k and top-p spread over the "
               "draft tokens of a speculative round) wrote them into an int64 copy and left the real "
               "output unset: replaced by one that keeps the dtype")
EMPTY_TOP_K_MEND = ("vLLM's CPU top-k mask failed on a round without draft tokens: a round without "
                    "drafts now passes through unchanged")
SEED_MEND = ("vLLM rewinds a seeded request's generator by offset, which CPU generators refuse "
             "(the engine died): seeded requests get a CPU generator that skips the rewind")


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
    except ImportError:                   # imported outside vLLM (the pipeline's own tests)
        return logging.getLogger("specdec_vllm_mends")
    return init_logger("vllm.specdec_mends")


MADE: list[str] = []      # the mends made in this process, in order


def _said(line: str) -> None:
    MADE.append(line)
    _logger().warning("%s %s", MARK, line)


# --- expand ---------------------------------------------------------------------------------------
def expand_keeping_dtype(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """What vLLM's expand_batch_to_tokens computes, for any dtype: each request's value
    (replace_from read as replace_to) repeated over its draft tokens."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_empty(num_tokens)
    out[: int(ends[-1])] = torch.repeat_interleave(values, counts)
    return out


def expand_is_broken(expand) -> bool:
    """Whether `expand` loses a float32 value (what vLLM 0.32's CPU kernel does)."""
    probe = torch.tensor([0.7, 0.25], dtype=torch.float32)
    cu = torch.tensor([3, 5], dtype=torch.int32)
    expected = torch.tensor([0.7] * 3 + [0.25] * 2)
    return not torch.allclose(expand(probe, cu, 5), expected)


def mend_expand(module) -> list[str]:
    """Replace module.expand_batch_to_tokens (read from its own module only) when it is broken."""
    if not expand_is_broken(module.expand_batch_to_tokens):
        return []
    module.expand_batch_to_tokens = expand_keeping_dtype
    return [EXPAND_MEND]


# --- empty top-k ----------------------------------------------------------------------------------
def top_k_top_p_allowing_empty(original):
    def apply(logits, k, p):
        return logits if logits.shape[0] == 0 else original(logits, k, p)
    apply.specdec_mended = True
    return apply


def top_k_fails_on_empty(apply) -> bool:
    try:
        apply(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64), None)
    except RuntimeError:
        return True
    return False


def mend_empty_top_k(module) -> list[str]:
    if getattr(module.apply_top_k_top_p, "specdec_mended", False) or not top_k_fails_on_empty(
            module.apply_top_k_top_p):
        return []
    module.apply_top_k_top_p = top_k_top_p_allowing_empty(module.apply_top_k_top_p)
    return [EMPTY_TOP_K_MEND]


# --- seeded requests ------------------------------------------------------------------------------
def cpu_offsets_refused() -> bool:
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def _offset_free_class():
    class OffsetFreeGenerator(torch.Generator):
        """A CPU generator whose offset rewind is skipped (see the module's docstring)."""

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int):
            return self

    return OffsetFreeGenerator


def offset_free_copy(generator):
    """A generator of OffsetFreeGenerator's class in `generator`'s state (the same draws follow)."""
    cls = _offset_free_class() if not hasattr(offset_free_copy, "cls") else offset_free_copy.cls
    offset_free_copy.cls = cls
    if isinstance(generator, cls) or generator.device.type != "cpu":
        return generator
    copy = cls(device="cpu")
    copy.set_state(generator.get_state())
    return copy


def mend_seeded_generators(runner_class) -> list[str]:
    """Wrap runner_class._update_states (where new requests get their seeded generators, before
    any draw) so that CPU generators are replaced by offset-free copies."""
    original = runner_class._update_states
    if getattr(original, "specdec_mended", False) or not cpu_offsets_refused():
        return []

    def _update_states(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        generators = self.input_batch.generators
        for index, generator in list(generators.items()):
            generators[index] = offset_free_copy(generator)
        for state in self.requests.values():
            if getattr(state, "generator", None) is not None:
                state.generator = offset_free_copy(state.generator)
        return result

    _update_states.specdec_mended = True
    runner_class._update_states = _update_states
    return [SEED_MEND]


# --- entry point ----------------------------------------------------------------------------------
def check_at_first_call(module, name: str, mend) -> None:
    """Put a wrapper in module.<name> that, at the first call, puts the original back, runs
    mend(module) (which checks it and replaces it only where it fails, logged) and calls whatever
    module.<name> then is."""
    original = getattr(module, name)
    if getattr(original, "specdec_checking", False):
        return

    def checking(*args, **kwargs):
        if getattr(module, name) is checking:
            setattr(module, name, original)
            for line in mend(module):
                _said(line)
        return getattr(module, name)(*args, **kwargs)

    checking.specdec_checking = True
    setattr(module, name, checking)


def mend_all() -> list[str]:
    """Every mend this vLLM's own code shows it needs, made; the lines of those made."""
    from vllm.v1.sample import rejection_sampler

    made = []
    # checked at their first call, when the engine's kernels are loaded (not at plugin load)
    check_at_first_call(rejection_sampler, "expand_batch_to_tokens", mend_expand)
    check_at_first_call(rejection_sampler, "apply_top_k_top_p", mend_empty_top_k)
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:          # a build without it: nothing of this kind to mend
        _logger().info("specdec mends: no GPUModelRunner to check (%s)", exc)
    else:
        made += mend_seeded_generators(GPUModelRunner)
    return made


# --- K per request --------------------------------------------------------------------------------
K_ARG = "specdec_k"                 # a request's vllm_xargs: its K (0: no drafts)
DOMAIN_ARG = "specdec_domain"       # ... or its domain, whose K the plan file gives
PLAN_VARIABLE = "SPECDEC_VLLM_PLAN"
K_MARK = "specdec k-per-request:"
K_PER_REQUEST = "K per request on (vllm_xargs specdec_k, or specdec_domain with a plan file)"


class PlanError(RuntimeError):
    """The plan file, or vLLM's scheduler code, is not what K per request needs: no start."""


def _schedule(value, where: str) -> list[tuple[int, int, int]]:
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise PlanError(f"{where}: a K or a list of [lo, hi, K] triples, not {value!r}")
    if isinstance(value, int):
        value = [[1, 1 << 30, value]]
    triples = []
    for triple in value:
        if (not isinstance(triple, list) or len(triple) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in triple)
                or triple[0] > triple[1]):
            raise PlanError(f"{where}: {triple!r} is not [lo, hi, K] with 0 <= lo <= hi and K >= 0")
        triples.append(tuple(triple))
    return triples


def read_plan(path: str) -> dict:
    """{"method", "domains": {name: triples}, "default": triples} from a plan file, or from the
    plan itself where SPECDEC_VLLM_PLAN holds the JSON (it starts with "{"); PlanError naming the
    file and what is wrong."""
    try:
        text = path if path.lstrip().startswith("{") else open(path, encoding="utf-8").read()
        if path.lstrip().startswith("{"):
            path = f"given inline in {PLAN_VARIABLE}"
        raw = json.loads(text)
    except (OSError, ValueError) as exc:
        raise PlanError(f"specdec: the plan file {path} ({PLAN_VARIABLE}) cannot be read: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("domains", {}), dict):
        raise PlanError(f"specdec: the plan file {path} is not a plan: an object with \"domains\"")
    domains = {str(name): _schedule(value, f"specdec: the plan file {path}, domain {name!r}")
               for name, value in raw.get("domains", {}).items()}
    return {"method": raw.get("method"), "domains": domains,
            "default": _schedule(raw.get("default", 0), f"specdec: the plan file {path}, default")}


def k_at(triples, batch_size: int) -> int:
    """The K a schedule gives at a batch size (0 in no range)."""
    return next((k for lo, hi, k in triples if lo <= batch_size <= hi), 0)


def request_k(extra_args, plan: dict | None, batch_size: int) -> int | None:
    """The most drafts a request takes this step (None: no cut): its specdec_k, else its domain's
    K in the plan (the plan's default for a domain it does not name, or for a request that names
    none). A specdec_k that is not a whole number >= 0 is served with no drafts."""
    args = extra_args if isinstance(extra_args, dict) else {}
    if K_ARG in args:
        value = args[K_ARG]
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return value if ok else 0
    if plan is None:
        return None
    domain = args.get(DOMAIN_ARG)
    triples = plan["domains"].get(str(domain), plan["default"]) if domain is not None else plan["default"]
    return k_at(triples, batch_size)


def cut_drafts(drafts, k: int | None):
    return drafts if k is None or len(drafts) <= k else drafts[:k]


def _limited(scheduler, draft_token_ids, plan):
    """draft_token_ids with each request's drafts cut to its K (a new object; the same type)."""
    batch = len(getattr(scheduler, "running", ()) or ())
    kept = []
    for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
        request = scheduler.requests.get(req_id)
        params = getattr(request, "sampling_params", None)
        kept.append(cut_drafts(drafts, None if request is None else
                               request_k(getattr(params, "extra_args", None), plan, batch)))
    return dataclasses.replace(draft_token_ids, draft_token_ids=kept)


def scheduler_as_expected(scheduler_class, draft_class) -> str | None:
    """None when vLLM's scheduler takes drafts the way the cut expects; else what differs."""
    fields = {f.name for f in dataclasses.fields(draft_class)} if dataclasses.is_dataclass(draft_class) else set()
    if fields != {"req_ids", "draft_token_ids"}:
        return f"DraftTokenIds has fields {sorted(fields)}, not req_ids and draft_token_ids"
    for name in ("update_draft_token_ids", "update_draft_token_ids_in_output"):
        method = getattr(scheduler_class, name, None)
        if method is None:
            return f"Scheduler has no {name}"
        source = inspect.getsource(method)
        if "draft_token_ids.req_ids" not in source or "self.requests.get(req_id)" not in source:
            return f"Scheduler.{name} does not read drafts by request id"
    return None


def enable_k_per_request(scheduler_class, draft_class, plan: dict | None) -> list[str]:
    """Wrap the scheduler's two draft intakes with the cut (PlanError where its code differs)."""
    if getattr(scheduler_class.update_draft_token_ids, "specdec_k_per_request", False):
        return []
    differs = scheduler_as_expected(scheduler_class, draft_class)
    if differs:
        raise PlanError(f"specdec: K per request cannot be set on this vLLM ({differs}); start "
                        f"it without the specdec plugin, or use a vLLM whose scheduler matches")
    take, take_in_output = (scheduler_class.update_draft_token_ids,
                            scheduler_class.update_draft_token_ids_in_output)

    def update_draft_token_ids(self, draft_token_ids, *args, **kwargs):
        return take(self, _limited(self, draft_token_ids, plan), *args, **kwargs)

    def update_draft_token_ids_in_output(self, draft_token_ids, *args, **kwargs):
        return take_in_output(self, _limited(self, draft_token_ids, plan), *args, **kwargs)

    for wrapper in (update_draft_token_ids, update_draft_token_ids_in_output):
        wrapper.specdec_k_per_request = True
    scheduler_class.update_draft_token_ids = update_draft_token_ids
    scheduler_class.update_draft_token_ids_in_output = update_draft_token_ids_in_output
    where = os.environ.get(PLAN_VARIABLE, "")
    where = "inline" if where.lstrip().startswith("{") else where
    return [K_PER_REQUEST + (f"; plan {where}: domains {sorted(plan['domains'])}" if plan else "")]


# --- a K 0 request skips the proposer's search ------------------------------------------------------
SKIP_LINE = "K 0 requests skip the proposer's host search (ngram, suffix)"
SKIP_VARIABLE = "SPECDEC_VLLM_K0_SKIP"       # "0": K 0 requests are searched as vLLM does (to compare)


class _NoDraft:
    """What the suffix cache's speculate answers for a request at K 0: no tokens."""
    token_ids: list = []


class _SkippingCache:
    """The suffix proposer's cache for one proposal: speculate answers nothing for the requests
    at K 0 (their responses are still added to the tree: a suffix server learns from every
    response it serves); everything else is the cache's own."""

    def __init__(self, cache, skip: set):
        self._cache, self._skip = cache, skip

    def speculate(self, req_id, *args, **kwargs):
        return _NoDraft() if req_id in self._skip else self._cache.speculate(req_id, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def zero_k_rows(runner, plan: dict | None) -> dict[int, str]:
    """{row of the runner's input batch: request id} of the requests whose K is 0 this step (their
    specdec_k, or their domain's K in the plan at this batch size: request_k)."""
    req_ids = list(getattr(runner.input_batch, "req_ids", ()) or ())
    rows = {}
    for i, req_id in enumerate(req_ids):
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        if state is not None and request_k(getattr(params, "extra_args", None), plan, len(req_ids)) == 0:
            rows[i] = req_id
    return rows


RUNNER_NEEDS = ('spec_config.method == "ngram"', 'spec_config.method == "suffix"', "self.drafter.propose(")
PROPOSER_NEEDS = {"ngram": ("if not num_sampled_ids", "valid_ngram_requests.append(i)"),
                  "suffix": ("if not sampled_ids", "self.suffix_cache.add_active_response(",
                             "self.suffix_cache.speculate(")}


def code_lacks(method, needles) -> str | None:
    """None when the method's source holds every needle; else what it lacks."""
    source = inspect.getsource(method)
    missing = [needle for needle in needles if needle not in source]
    return f"{method.__qualname__} lacks {missing[0]!r}" if missing else None


def enable_proposal_skip(runner_class, plan: dict | None) -> list[str]:
    """Wrap the model runner's proposal so that a request at K 0 is not searched: vLLM proposes
    for the whole batch and the cut (enable_k_per_request) comes after, so a K 0 request on an
    ngram or suffix server paid the search a plain server does not. ngram: its row goes to the
    proposer with no sampled tokens (the proposer's own skip, as for a partial prefill); suffix:
    the response is added to the tree as before, and speculate answers nothing for it. Drafts
    of the other requests, and verification, are unchanged. The runner's code is checked now; the
    proposer's at its first proposal (importing vLLM's proposers while plugins load breaks its
    kernel registration), and where it is not the code the skip expects, one line says so and
    K 0 requests pay the search as before."""
    take = runner_class.propose_draft_token_ids
    if getattr(take, "specdec_skip", False):
        return []
    differs = code_lacks(take, RUNNER_NEEDS)
    if differs:
        return [f"K 0 requests pay the proposer's search: vLLM's code is not what the skip expects ({differs})"]
    checked: dict = {}          # proposer class: whether its code is what the skip expects

    def skips(drafter, method) -> bool:
        kind = type(drafter)
        if kind not in checked:
            differs = code_lacks(kind.propose, PROPOSER_NEEDS[method])
            checked[kind] = differs is None
            if differs:
                _logger().warning("%s K 0 requests pay the proposer's search: vLLM's code is not what "
                                  "the skip expects (%s)", K_MARK, differs)
        return checked[kind]

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        method = getattr(self.speculative_config, "method", None)
        skip = ({} if method not in PROPOSER_NEEDS or not isinstance(sampled_token_ids, list)
                else zero_k_rows(self, plan))
        if not skip or not skips(self.drafter, method):
            return take(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if method == "ngram":
            sampled_token_ids = [[] if i in skip else ids for i, ids in enumerate(sampled_token_ids)]
            return take(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        cache = self.drafter.suffix_cache
        self.drafter.suffix_cache = _SkippingCache(cache, set(skip.values()))
        try:
            return take(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        finally:
            self.drafter.suffix_cache = cache

    propose_draft_token_ids.specdec_skip = True
    runner_class.propose_draft_token_ids = propose_draft_token_ids
    return [SKIP_LINE]


def proposal_skip(plan: dict | None) -> list[str]:
    """The skip on vLLM's model runner (enable_proposal_skip)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:
        return [f"K 0 requests pay the proposer's search: no model runner to wrap ({exc})"]
    return enable_proposal_skip(GPUModelRunner, plan)


def k_per_request() -> list[str]:
    """K per request on vLLM's scheduler, with the plan file where one is named, and the
    proposer's search skipped for requests at K 0."""
    where = os.environ.get(PLAN_VARIABLE, "").strip()
    plan = read_plan(where) if where else None
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import DraftTokenIds
    except ImportError as exc:
        raise PlanError(f"specdec: K per request cannot be set on this vLLM (no v1 scheduler: {exc})") from None
    lines = enable_k_per_request(Scheduler, DraftTokenIds, plan)
    if not lines:
        return lines
    if os.environ.get(SKIP_VARIABLE, "1").strip() == "0":
        return lines + [f"K 0 requests pay the proposer's search ({SKIP_VARIABLE}=0)"]
    return lines + proposal_skip(plan)


def register() -> None:
    """vLLM's general-plugin entry point: runs in every vLLM process."""
    for line in k_per_request():
        _logger().warning("%s %s", K_MARK, line)     # not a mend: its own mark
    if os.environ.get(OFF_VARIABLE, "1").strip() == "0":
        _logger().warning("specdec mends: off (%s=0): vLLM runs unmended", OFF_VARIABLE)
        return
    for line in mend_all():
        _said(line)
