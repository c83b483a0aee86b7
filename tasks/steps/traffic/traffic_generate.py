"""More training data from the target itself: responses generated for logged prompts.

For the logged prompts of a domain (production rows answered by this target, same fingerprint),
the target answers again under each row's own logged sampling parameters (temperature, top-k,
top-p; as many new tokens as the row's max_tokens, else as its logged response, at most
max_new_tokens), with plain decoding in batches of rows that share their parameters
(specdec_core.SpecDecoder.generate_plain). Each answer is stored as a new traffic_requests row
marked as generated: `generated_by` = the generation run id, `generated_from` = the logged
request; the prompt, domain, time and sampling parameters are the logged row's, the response
text is redacted as an import redacts it.

- Count: up to `count` rows per domain and run id, prompts taken in an order seeded by the run
  id (one generation per logged prompt and run). The order hashes the run id with its own salt,
  so it is independent of the held-out split a training of the same id draws
  (specdec_core.estimate.in_heldout hashes the same pair unsalted; ordering by that hash would
  take the held-out prompts first). `heldout=(split key, fraction[, validation fraction])` skips
  the prompts that the training using these rows holds out (and keeps for validation, given its
  share): it would leave their rows out anyway.
- Resumable: each batch is committed as it is done; a re-run of the same run id skips the prompts
  it already answered and generates only what is missing, so an interrupted run continues and a
  finished one does nothing.
- Never production traffic: sampling (evaluations, estimates), suffix indexes and the SQL reports
  read `production_traffic()` only; draft training reads generated rows only when asked
  (train_draft_from_traffic(include_generated=True)), into its training split only, and never a
  row generated from one of its held-out or validation prompts.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from tqdm.auto import tqdm

from specdec_core import SamplingParams, SpecDecoder, load_model
from specdec_core.estimate import in_heldout, in_validation
from specdec_core.validation import fingerprint_id, target_fingerprint

from ...db.queries_traffic import (generated_count, generated_sources, insert_generated, target_domains,
                                   target_rows)
from ...db.store import Store
from ...errors import SampleError, SpecdecTaskError
from ...settings import DEFAULT_MODEL, load_settings
from ...timeutil import utcnow
from ..estimate.offline_estimate import request_token_ids
from .traffic_rows import Normalizer
from .traffic_sample import selection_key

log = logging.getLogger(__name__)


GENERATION_SALT = "generate\x00"     # the prompt order's own hash (never the held-out split's)


class GenerationError(SpecdecTaskError, ValueError):
    """Traffic cannot be generated for this input (bad count, no logged prompts of this target)."""


def generated_id(run_id: str, request_id: str) -> str:
    """The id of the row generated in run `run_id` from logged request `request_id`."""
    return "gen-" + hashlib.sha256(f"{run_id}\x00{request_id}".encode()).hexdigest()[:32]


def generate_traffic(run_id: str, domains, count: int, target: str = DEFAULT_MODEL,
                     store: Store | None = None, window_days: float | None = None,
                     batch_size: int = 8, max_new_tokens: int = 256, device: str | None = None,
                     model=None, tokenizer=None, seed: int = 0, progress: bool = True,
                     heldout: tuple | None = None) -> dict:
    """Generate up to `count` responses per domain for logged prompts (see the module docstring).

    domains: a domain or a list (None: every domain with this target's production traffic).
    heldout: (split key, fraction[, validation fraction]) of the training these rows are for
    (its id, or the id it splits like, its heldout_fraction and validation_fraction): its
    held-out prompts, and with the third its validation prompts, are never answered.
    Output: {"run_id", "generated" (new rows this call), "domains": {domain: {"available"
    (logged prompts, held-out ones excluded), "planned" (min(count, available)), "before" (rows of this run already
    stored), "generated" (new rows), "rows" (this run's rows now)}}}."""
    if not run_id or not isinstance(run_id, str) or len(run_id) > 200:
        raise GenerationError(f"run id {run_id!r}: give a non-empty string of at most 200 characters")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise GenerationError(f"count {count!r}: give the number of rows to generate per domain (>= 0)")
    if batch_size < 1 or max_new_tokens < 1:
        raise GenerationError(f"batch_size {batch_size} / max_new_tokens {max_new_tokens}: both >= 1")
    if heldout is not None and not (isinstance(heldout, (tuple, list)) and len(heldout) in (2, 3)
                                    and isinstance(heldout[0], str)
                                    and all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                            and 0 < f < 1 for f in heldout[1:])):
        raise GenerationError(f"heldout {heldout!r}: give (split key, held-out fraction[, validation "
                              "fraction]), fractions between 0 and 1, of the training that will "
                              "use the rows, or None")
    if store is None:
        raise TypeError("generate_traffic: pass the Store (tasks.db.store.Store.open) to read the "
                        "logged traffic from and store the generated rows in")
    if model is None:
        model, tokenizer = load_model(target, device=device)
    fingerprint = fingerprint_id(target_fingerprint(model))
    if isinstance(domains, str):
        domains = [domains]
    with store.transaction() as tx:
        if not domains:
            domains = target_domains(tx, fingerprint)
        done = generated_sources(tx, run_id)
        sources = {domain: target_rows(tx, domain, fingerprint, window_days)
                   for domain in domains}
    if not any(sources.values()):
        raise GenerationError(
            f"no logged requests answered by this target (fingerprint {fingerprint}) in "
            f"{list(domains) or 'any domain'}: import its traffic first (`specdec traffic import`)")
    redact = _redactor()
    summary, total = {}, 0
    for domain in domains:
        rows = [row for row in sources[domain] if heldout is None or not (
                in_heldout(heldout[0], row.id, heldout[1])
                or (len(heldout) == 3 and in_validation(heldout[0], row.id, heldout[2])))]
        rows.sort(key=lambda row: selection_key(GENERATION_SALT + run_id, row.id))
        planned = rows[:count]
        todo = [row for row in planned if row.id not in done]
        before = len(planned) - len(todo)
        generated = _generate(store, run_id, todo, model, tokenizer, fingerprint, batch_size,
                              max_new_tokens, seed, redact, progress, domain)
        total += generated
        stored = generated_count(store, run_id, domain)
        summary[domain] = {"available": len(rows), "planned": len(planned), "before": before,
                           "generated": generated, "rows": stored}
        log.info("generated %d rows for domain %s (run %s; %d were there)", generated, domain,
                 run_id, before)
    return {"run_id": run_id, "generated": total, "fingerprint": fingerprint, "domains": summary}


def _redactor():
    return Normalizer(load_settings()).redact


def _batches(rows, tokenizer, batch_size: int, max_new_tokens: int):
    """(sampling, budget per row, [(row, prompt ids)]) batches of rows sharing their sampling
    params, in the order given."""
    groups: dict[tuple, list] = {}
    for row in rows:
        try:
            prompt, logged = request_token_ids(row, tokenizer)
        except SampleError as exc:
            raise GenerationError(str(exc)) from None
        if not prompt:
            continue
        key = (row.temperature, row.top_k or 0, row.top_p if row.top_p is not None else 1.0)
        groups.setdefault(key, []).append((row, prompt, min(row.max_tokens or len(logged) or 1,
                                                              max_new_tokens)))
    for (temperature, top_k, top_p), items in groups.items():
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        for start in range(0, len(items), batch_size):
            yield sampling, items[start: start + batch_size]


def _generate(store: Store, run_id, rows, model, tokenizer, fingerprint, batch_size, max_new_tokens,
              seed, redact, progress, domain) -> int:
    if not rows:
        return 0
    decoder = SpecDecoder(model, None)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else (eos if eos is not None else 0)
    written = 0
    bar = tqdm(total=len(rows), desc=f"generate {domain}", disable=not progress)
    for sampling, items in _batches(rows, tokenizer, batch_size, max_new_tokens):
        width = max(len(prompt) for _, prompt, _ in items)
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (_, prompt, _) in enumerate(items):          # left-padded
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        budget = max(n for _, _, n in items)
        batch_seed = seed + int.from_bytes(selection_key(run_id, items[0][0].id)[:4], "big")
        out = decoder.generate_plain(ids, budget, sampling=sampling, seed=batch_seed,
                                     attention_mask=mask, eos_token_id=eos, pad_token_id=pad)
        now, records = utcnow(), []
        for i, (row, prompt, limit) in enumerate(items):
            response = out.tokens[i, : min(out.num_tokens[i], limit)].tolist()
            text = (tokenizer.decode(response, skip_special_tokens=True) if tokenizer is not None
                    else "tokens " + " ".join(map(str, response)))
            text, hits = redact(text)
            records.append({
                "id": generated_id(run_id, row.id), "requested_at": row.requested_at,
                "domain": row.domain, "domain_source": row.domain_source, "prompt": row.prompt,
                "messages": row.messages, "response": text, "temperature": row.temperature,
                "top_k": row.top_k, "top_p": row.top_p, "max_tokens": row.max_tokens,
                "model": row.model, "target_fingerprint": fingerprint,
                "prompt_token_ids": prompt if row.prompt_token_ids else None,
                # token ids of a redacted text would leak it (as on import)
                "response_token_ids": None if hits else response,
                "prompt_chars": len(row.prompt), "response_chars": len(text),
                "prompt_tokens": len(prompt), "response_tokens": len(response),
                "redactions": (row.redactions or 0) + hits,
                "content_hash": hashlib.sha256(
                    f"{run_id}\x00{row.id}\x00{response}".encode()).hexdigest(),
                "source_file": f"generated:{run_id}"[:500], "source_line": 0, "imported_at": now,
                "generated_by": run_id, "generated_from": row.id})
        with store.transaction() as tx:      # one transaction a batch: a re-run resumes here
            insert_generated(tx, records)
        written += len(records)
        bar.update(len(records))
    bar.close()
    return written
