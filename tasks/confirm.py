"""Live confirmation: real speculative decoding with the planned config against plain decoding.

On a per-domain subset of the run's sample (batch 1, each request with its own logged sampling
params and up to its logged response length), plain and speculative decoding alternate request by
request (the order flips every request, so drift of the machine hits both alike). Speedup is
decode-phase tokens/s over plain's; end-to-end latency (prefill included) is stored beside it.
A domain whose measured speedup differs from the prediction by more than the tolerance is flagged.
Runs under the timing lock.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, insert, select, update

from .costs import timing_lock
from .db.engine import database_url, ensure_ready
from .db.models import DomainConfig, LiveMeasurement
from .settings import Settings, load_settings
from .timeutil import utcnow

log = logging.getLogger(__name__)


def confirm_domain(run_id: str, domain: str, target, drafters: dict, requests: list,
                   db_url: str | None = None, settings: Settings | None = None,
                   progress: bool = True) -> dict | None:
    """Measure the domain's planned (drafter, K) live; store live_measurements and the measured
    speedup in domain_configs. A domain that is off still has its best candidate measured (the
    prediction is checked either way). Returns the measurement, or None without a plan/requests.
    """
    import torch
    from tqdm.auto import tqdm

    from specdec_core import SpecDecoder, SpecStats

    settings = settings or load_settings()
    engine = ensure_ready(database_url(db_url or settings.database_url))
    with engine.connect() as connection:
        config = connection.execute(select(DomainConfig).where(
            (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain))).mappings().first()
    if config is None or config["drafter"] is None or config["status"] != "ok" or not requests:
        return None
    drafter = drafters[config["drafter"]][1]
    k = int(config["k"])
    subset = requests[: settings.confirm_requests]
    device = next(target.parameters()).device
    spec_decoder = SpecDecoder(target, drafter, k=k)
    plain_stats, spec_stats = SpecStats.empty(0), SpecStats.empty(k)
    plain_latency = spec_latency = 0.0
    with timing_lock():
        for index, request in enumerate(tqdm(subset, desc=f"confirm {domain}", disable=not progress)):
            ids = torch.tensor([list(request.prompt_ids)], dtype=torch.long, device=device)
            new_tokens = min(len(request.response_ids), settings.confirm_max_new_tokens)
            kwargs = dict(max_new_tokens=new_tokens, sampling=request.sampling, seed=index)
            order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
            for which in order:
                if which == "plain":
                    result = spec_decoder.generate_plain(ids, **kwargs)
                    plain_stats = plain_stats.merge(result.stats)
                    plain_latency += result.stats.total_s
                else:
                    result = spec_decoder.generate(ids, **kwargs)
                    spec_stats = spec_stats.merge(result.stats)
                    spec_latency += result.stats.total_s
    plain_tps, spec_tps = plain_stats.decode_tokens_per_s, spec_stats.decode_tokens_per_s
    measured = spec_tps / plain_tps if plain_tps > 0 else None
    predicted = config["predicted_speedup"]
    gap = None
    if measured is not None and predicted:
        gap = abs(measured / predicted - 1.0) > settings.confirm_tolerance
    row = {"run_id": run_id, "domain": domain, "drafter": config["drafter"], "k": k, "batch_size": 1,
           "requests": len(subset), "tokens": int(spec_stats.new_tokens),
           "acceptance_rate": spec_stats.acceptance_rate,
           "mean_accepted_length": spec_stats.mean_accepted_length,
           "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
           "predicted_speedup": predicted, "measured_speedup": measured,
           "plain_latency_s": plain_latency / len(subset), "spec_latency_s": spec_latency / len(subset),
           "gap": gap}
    now = utcnow()
    with engine.begin() as connection:
        connection.execute(delete(LiveMeasurement).where((LiveMeasurement.run_id == run_id)
                                                         & (LiveMeasurement.domain == domain)))
        connection.execute(insert(LiveMeasurement).values(**row, created_at=now))
        connection.execute(update(DomainConfig).where((DomainConfig.run_id == run_id)
                                                      & (DomainConfig.domain == domain))
                           .values(measured_speedup=measured))
    if gap:
        log.warning("run %s, domain %s: measured speedup %.2fx vs predicted %.2fx (tolerance %.0f%%)",
                    run_id, domain, measured, predicted, 100 * settings.confirm_tolerance)
    return row
