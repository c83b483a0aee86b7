"""Offline acceptance per domain and candidate drafter, from the run's sampled traffic.

Rows are scored under their own logged sampling params (specdec_core.estimate). Rows answered by a
target with another fingerprint are excluded (their responses are not this target's). Results go
to acceptance_estimates, keyed by run id: re-running replaces that run's rows.
"""

from __future__ import annotations

import logging

from specdec_core import SamplingParams
from specdec_core.estimate import LoggedRequest, estimate_acceptance

from ...db.queries_estimates import replace_acceptance_estimates, sampled_requests
from ...db.store import Store
from ...errors import SampleError
from ...settings import Settings
from ...timeutil import utcnow

log = logging.getLogger(__name__)


def request_token_ids(row, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a stored request: its logged ids, else its text tokenized."""
    prompt, response = row.prompt_token_ids, row.response_token_ids
    if prompt and response:
        return list(prompt), list(response)
    if tokenizer is None:
        raise SampleError(f"request {row.id} has no token ids; pass the target's tokenizer")
    if not prompt:
        if row.messages:
            prompt = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True,
                                                   tokenize=True)
            prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
        else:
            prompt = tokenizer(row.prompt, add_special_tokens=True)["input_ids"]
    if not response:
        response = tokenizer(row.response, add_special_tokens=False)["input_ids"]
    return list(prompt), list(response)


def load_sample_requests(run_id: str, store: Store, domains=None, tokenizer=None,
                         fingerprint: str | None = None, limit_per_domain: int | None = None,
                         exclude_ids: set[str] | None = None, indexed_ids: set[str] | None = None,
                         max_tokens: int | None = None, max_prompt_tokens: int | None = None):
    """(requests by domain {domain: [LoggedRequest]}, excluded {"other_fingerprint": [ids], ...}).

    Requests come in the sample's draw order. With `fingerprint`, rows logged with another target
    fingerprint are excluded; rows without one are kept (and counted as "unverified").
    exclude_ids: requests never to score (e.g. the training rows of a draft under evaluation);
    indexed_ids: the same for requests inside a candidate's registered suffix index.
    max_tokens: the target's context (prompt and response tokens together); max_prompt_tokens:
    the prompt's limit (the setting). A request over either, counted in tokens here when no
    token ids were logged, is excluded as "too_long": it is never scored (no estimate, live
    check or sampling test allocates for it).
    """
    by_domain: dict[str, list] = {}
    excluded: dict[str, list[str]] = {"other_fingerprint": [], "too_short": [], "unverified": [],
                                      "trained_on": [], "indexed": [], "too_long": []}
    rows = sampled_requests(store, run_id, domains)
    if not rows:
        raise SampleError(f"run {run_id!r} has no sampled requests{' in ' + str(list(domains)) if domains else ''}; "
                          "run the sample step (`specdec traffic sample RUN_ID`) first")
    for domain, _position, row in rows:
        if exclude_ids and row.id in exclude_ids:
            excluded["trained_on"].append(row.id)
            continue
        if indexed_ids and row.id in indexed_ids:
            excluded["indexed"].append(row.id)
            continue
        if fingerprint is not None:
            if row.target_fingerprint is None:
                excluded["unverified"].append(row.id)
            elif row.target_fingerprint != fingerprint:
                excluded["other_fingerprint"].append(row.id)
                continue
        prompt, response = request_token_ids(row, tokenizer)
        if len(response) < 2:
            excluded["too_short"].append(row.id)
            continue
        if (max_prompt_tokens is not None and len(prompt) > max_prompt_tokens) or (
                max_tokens is not None and len(prompt) + len(response) > max_tokens):
            excluded["too_long"].append(row.id)
            continue
        items = by_domain.setdefault(domain, [])
        if limit_per_domain is not None and len(items) >= limit_per_domain:
            continue
        items.append(LoggedRequest(
            request_id=row.id, prompt_ids=prompt, response_ids=response, domain=domain,
            sampling=SamplingParams(temperature=row.temperature, top_k=row.top_k or 0,
                                    top_p=row.top_p if row.top_p is not None else 1.0)))
    if excluded["too_long"]:
        log.warning("run %s: %d sampled requests are longer than the target's context (%s tokens) "
                    "or the prompt limit max_prompt_tokens (%s) and are excluded (e.g. %s)", run_id,
                    len(excluded["too_long"]), max_tokens, max_prompt_tokens,
                    excluded["too_long"][:3])
    if excluded["other_fingerprint"]:
        log.info("run %s: %d sampled requests were answered by a target with another fingerprint "
                    "and are excluded (e.g. %s)", run_id, len(excluded["other_fingerprint"]),
                    excluded["other_fingerprint"][:3])
    return by_domain, excluded


def estimate_domains(run_id: str, target, drafters: dict, requests_by_domain: dict,
                     store: Store, settings: Settings | None = None,
                     k_max: int | None = None, progress: bool = True) -> dict:
    """Estimate E(K), K = 1..k_max, per domain for every drafter ({label: (spec, drafter)}) and store.

    Output: {domain: {drafter label: {K: DomainEstimate.to_dict()}}}. Replaces the run's rows for
    these domains only (a domain estimated alone, e.g. by a mapped Airflow task, keeps the others).
    Requests are estimated in request-id order, not in the order they were drawn: the same sample
    gives the same batches (padding neighbours), hence the same figures to the last bit.
    """
    settings = settings or store.settings
    k_max = k_max or settings.plan.k_max
    requests = sorted((r for items in requests_by_domain.values() for r in items),
                      key=lambda r: (r.domain, r.request_id))
    vocab = target.get_output_embeddings().weight.shape[0]
    for request in requests:
        top = max(max(request.prompt_ids, default=0), max(request.response_ids, default=0))
        if top >= vocab or min(min(request.prompt_ids, default=0), min(request.response_ids, default=0)) < 0:
            raise SampleError(
                f"request {request.request_id} ({request.domain}): token id {top} outside the target's "
                f"vocabulary of {vocab}: its token ids come from another tokenizer. Re-import it with "
                "the target's token ids (or without them, to tokenize its text) or purge it")
    ks = list(range(1, k_max + 1))
    out: dict[str, dict] = {domain: {} for domain in requests_by_domain}
    rows = []
    now = utcnow()
    for label, (spec, drafter) in drafters.items():
        estimates = estimate_acceptance(target, drafter, requests, ks,
                                        batch_size=settings.plan.estimate_batch_size,
                                        n_boot=settings.plan.bootstrap_samples,
                                        seed=0,
                                        progress=progress)
        for domain, per_k in estimates.items():
            out[domain][label] = {k: e.to_dict() for k, e in per_k.items()}
            for k, e in per_k.items():
                rows.append({
                    "run_id": run_id, "domain": domain, "drafter": label, "drafter_spec": spec,
                    "k": k, "requests": e.requests, "tokens": int(e.tokens), "rounds": e.rounds,
                    "acceptance_rate": min(max(e.acceptance_rate, 0.0), 1.0),
                    "mean_accepted_length": e.expected_tokens_per_round,
                    "mean_accepted_length_lo": e.ci95[0], "mean_accepted_length_hi": e.ci95[1],
                    "conditional_acceptance": e.conditional_acceptance,
                    "conditional_acceptance_ci": e.conditional_acceptance_ci,
                    "draft_width_share": e.width_share, "created_at": now})
    with store.transaction() as tx:
        replace_acceptance_estimates(tx, run_id, list(requests_by_domain), rows)
    log.info("run %s: %d acceptance estimates over %d domains", run_id, len(rows), len(out))
    return out


def estimate_in(context, domain: str, progress: bool = False) -> dict:
    """estimate_domains of one domain with a RunContext (tasks.steps.context): the domain's
    requests and candidates as the run's context gives them, its store and settings (k_max: the
    plan's)."""
    requests, _ = context.domain_requests(domain)
    return estimate_domains(context.run_id, context.model, context.domain_drafters(domain),
                            {domain: requests}, context.store, settings=context.settings,
                            k_max=context.settings.plan.k_max, progress=progress)
