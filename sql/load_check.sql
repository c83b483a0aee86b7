-- Question: does each promoted schedule pay at the batch sizes it claims, on vLLM's server under load?
--   One row per run, domain and concurrency level of the load check: the domain's requests
--   streamed through vLLM's OpenAI server at that many concurrent requests, plain and with the
--   domain's config, newest run first.
-- Reads: load_check_levels, load_check_domains, domain_configs.
-- Columns: k: the schedule's K at that batch size; plain / spec tokens_per_s: output tokens over
--   the level's wall time; measured_speedup: the config's decode-phase tokens/s over the plain
--   one on the same requests, with its 95% interval (bootstrap over the requests);
--   predicted_speedup: vLLM's cost profile at that batch size; pays 1 | 0 (the interval's lower
--   end clears min_speedup, no request failed); itl / ttft in milliseconds (p50, p95);
--   engine_e: 1 + accepted / drafts from vLLM's /metrics counter deltas; counters_equal: those
--   deltas equal the same requests' per-request metrics summed; domain_status ok | cut | off |
--   died | timeout | failed; max_level_paying: the schedule keeps K > 0 up to this batch size;
--   enabled: the domain in the run's config after the load check.
SELECT l.run_id, l.domain, l.concurrency, l.k, l.requests, l.failed,
       l.plain_tokens_per_s, l.spec_tokens_per_s,
       l.measured_speedup, l.measured_speedup_lo, l.measured_speedup_hi, l.predicted_speedup,
       CASE WHEN l.pays THEN 1 WHEN NOT l.pays THEN 0 END AS pays,
       1000 * l.plain_itl_p50_s AS plain_itl_p50_ms, 1000 * l.plain_itl_p95_s AS plain_itl_p95_ms,
       1000 * l.spec_itl_p50_s AS spec_itl_p50_ms, 1000 * l.spec_itl_p95_s AS spec_itl_p95_ms,
       1000 * l.plain_ttft_p50_s AS plain_ttft_p50_ms, 1000 * l.spec_ttft_p50_s AS spec_ttft_p50_ms,
       l.engine_e,
       CASE WHEN l.counters_equal THEN 1 WHEN NOT l.counters_equal THEN 0 END AS counters_equal,
       d.status AS domain_status, d.max_level_paying,
       CASE WHEN c.enabled THEN 1 ELSE 0 END AS enabled, d.reason, d.spec_log, d.plain_log
FROM load_check_levels l
JOIN load_check_domains d ON d.run_id = l.run_id AND d.domain = l.domain
LEFT JOIN domain_configs c ON c.run_id = l.run_id AND c.domain = l.domain
ORDER BY l.created_at DESC, l.domain, l.concurrency;
