"""The engine check's replay (tasks.steps.checks.engine_check): which requests each engine serves,
as which items (each request and its K 0 twin, a suffix engine's history first), and the engine
served in the serving environment, started again after a request that killed it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specdec_core.estimate import LoggedRequest

from ...errors import EngineTimeout, ServingProbeError
from ...registry.registry import Registry
from ...serving import environment as serving_env
from ...serving.replay_answer import ReplayAnswer
from ...serving.scripts.vllm_probe import PLAIN     # the id prefix of a request's K 0 twin
from ...settings import Settings
from .confirm import truncated


def batch_one_k(spec: dict) -> int:
    """The K a vLLM config drafts at batch size 1 (its schedule's first range, else its K)."""
    for first, last, k in spec.get("num_speculative_tokens_per_batch_size") or []:
        if first <= 1 <= last:
            return int(k)
    return int(spec["num_speculative_tokens"])


def pick_requests(requests: list, confirm_ids: list[str], count: int, max_new_tokens: int) -> list:
    """The confirm requests first, then the sample's next ones in draw order; each cut at
    max_new_tokens (requests of fewer than 2 response tokens have no round to compare)."""
    confirmed = set(confirm_ids)
    usable = [r for r in requests if len(r.response_ids) >= 2]
    chosen = [r for r in usable if r.request_id in confirmed]
    chosen += [r for r in usable if r.request_id not in confirmed][:max(0, count - len(chosen))]
    return [truncated(r, min(len(r.response_ids), max_new_tokens)) for r in chosen[:count]]


def end_slot(request):
    """The request with one slot past its response, so the estimate walks the rounds the way the
    engine does: our rounds keep room for the bonus token inside the response (the last token is
    always the target's), while vLLM drafts up to K tokens whatever is left before max_tokens, so
    the response's last token can be an accepted draft. The slot's token is never drafted nor
    counted as a drafted step; only its own round (no drafts) and its token are added, which E
    per drafted step does not read."""
    response = list(request.response_ids)
    return LoggedRequest(request.request_id, request.prompt_ids, response + response[-1:],
                         request.sampling, request.domain)


def _item(request, index: int) -> dict:
    sampling = request.sampling
    return {"id": request.request_id, "prompt_ids": [int(t) for t in request.prompt_ids],
            "max_tokens": len(request.response_ids), "temperature": float(sampling.temperature),
            "top_k": int(sampling.top_k), "top_p": float(sampling.top_p), "seed": index}


def local_spec(spec: dict | None, registry: Registry | None = None) -> dict | None:
    """The config as the probe's engine loads it: a drafter checkpoint given as a registered
    models:/ URI (draft_model, eagle3) downloaded first -- vLLM reads local directories and
    Hugging Face ids, not MLflow URIs. The export (and the engine check's rows) keep the URI.
    registry: where it is registered (default Registry.open())."""
    if spec is None or not str(spec.get("model") or "").startswith("models:/"):
        return spec
    from ..drafters.draft_training import resolve_model_uri   # imported here: MLflow, for URIs only

    return dict(spec, model=resolve_model_uri(spec["model"], registry))


@dataclass
class EngineRun:
    """One engine of the check: its name (spec-N), the vLLM config it starts with (its
    deployment's: the drafter method at the largest K of its domains), the domains whose
    requests it replays and each domain's own config (its K asked per request)."""
    name: str
    spec: dict | None
    domains: list[str]
    specs: dict[str, dict] = field(default_factory=dict)

    def spec_of(self, domain: str) -> dict | None:
        """The domain's own vLLM config (the engine's where none was given)."""
        return self.specs.get(domain, self.spec)


def paired_items(requests: list[tuple[int, object, int | None]]) -> list[dict]:
    """Each (index, request, K) twice on the config's engine, one after the other: at K (its
    domain's, asked per request; None: the engine's), then at K 0 (its id prefixed PLAIN), each
    item in its domain's group (the replay's budget is shared out by group), so
    that the speedup pairs the same request on the same engine moments apart. The config's
    request comes first: it is then served exactly as it would be alone (a suffix engine's
    tree learns from every response, and a twin served first would hand the other its prompt's
    cached blocks, whose prefill rounds differently); the K 0 twin's
    cached prompt shortens its prefill only, which the decode-phase speedup leaves out."""
    items = []
    for index, request, k in requests:
        spec_item = dict(_item(request, index), group=request.domain, **({} if k is None else {"k": k}))
        items += [spec_item, dict(spec_item, id=PLAIN + spec_item["id"], k=0)]
    return items


def replay_history(run: EngineRun, picked: dict, requests_by_domain: dict,
                   settings: Settings) -> list[dict]:
    """The requests a suffix engine serves before the replay (its tree grows from them): per
    domain of requests_by_domain -- every domain sampled, on or off, as one deployment serving
    all routes sees them --, up to engine_check_history of the sample's requests not replayed,
    each at K 0. vLLM's tree is one for all requests, so a domain's figures would otherwise
    depend on which other domains the plan turned on and at what K their history was drafted
    (a drafted round draws its tokens differently from a plain one)."""
    history = []
    if run.spec is not None and run.spec["method"] == "suffix" and settings.engine.check_history:
        for d in sorted(requests_by_domain):
            replayed = {r.request_id for r in picked.get(d, [])}
            history += [dict(_item(r, i), k=0) for i, r in enumerate(
                [r for r in requests_by_domain[d] if r.request_id not in replayed]
                [:settings.engine.check_history])]
    return history


HISTORY_BATCH = 16   # the most history requests the engine serves at once (not measured)


RESTARTS = 5      # fresh engines after a request killed one, before the rest is left unserved


def serve_replay(serving_env, settings: Settings, what: str, log_path, request: dict) -> ReplayAnswer:
    """One engine's replay; a request that kills the engine is recorded with vLLM's error and a
    fresh engine (a new process: vLLM does not start twice in one) serves the requests after it,
    at most RESTARTS times. Output: the probe's answers read once and summed over the engines
    (ReplayAnswer: died, unserved, left_out, starts, counters), or failed: (status, reason)."""
    history, items = list(request.get("history", [])), list(request["requests"])
    total = ReplayAnswer(starts=0)
    while True:
        threads = serving_env.free_cpus()
        try:
            # the CPUs a neighbour uses are left to it, and it may use them without marking
            # a request contended (spare_cores)
            answer = ReplayAnswer.from_probe(serving_env.run_engine(
                dict(request, history=history, requests=items, spare_cores=threads["spare"]),
                log_path.with_suffix(f".{total.starts}.log") if total.starts else log_path,
                settings.engine.check_timeout_s, what, settings, threads=threads["bind"]))
        except (EngineTimeout, ServingProbeError) as exc:
            return replace(total, failed=("timeout" if isinstance(exc, EngineTimeout) else "died", str(exc)))
        if answer.refused:
            return replace(answer, starts=total.starts + 1, died=total.died, unserved=total.unserved,
                           left_out=total.left_out)
        total = total.then(answer)
        if not answer.died:
            return total
        ids = [str(item["id"]) for item in history + items]
        after = ids.index(answer.died[0]["request"]) + 1
        history, items = history[after:], items[max(0, after - len(history)):]
        if not items:
            return total
        if total.starts > RESTARTS:
            return replace(total, unserved=[str(item["id"]) for item in items])


def dtype_of(model) -> str:
    dtype = next(model.parameters()).dtype
    return str(dtype).removeprefix("torch.")
