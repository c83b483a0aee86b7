-- Question: does each promoted config do on vLLM what its estimate said, before it is registered?
--   One row per domain that a run planned on: the domain's exported config served by vLLM on the
--   domain's requests (the engine check), newest run first.
-- Reads: engine_checks, domain_configs.
-- Columns: status ok | below (vLLM's mean accepted length under the estimate's interval by more
--   than the tolerance) | refused (vLLM refused the config) | died | timeout | unsupported (no vLLM
--   equivalent; not gated); passed 1 | 0 | NULL (not gated); engine_e / estimate_e: mean accepted
--   length per drafted step (1 + accepted / steps with drafts) on the same requests at the same K,
--   with the estimate's 95% interval; greedy_equal / greedy_checked: greedy requests whose vLLM
--   output equals the log and whose accepted counts equal the estimate's; tokens/s are vLLM's,
--   one request at a time, plain and with the config; enabled: the domain in the run's config
--   after the gate.
SELECT c.run_id, c.domain, c.engine, c.engine_version, c.status,
       CASE WHEN c.passed THEN 1 WHEN NOT c.passed THEN 0 END AS passed,
       c.k, c.requests, c.estimate_e, c.estimate_e_lo, c.estimate_e_hi, c.engine_e,
       c.greedy_equal, c.greedy_checked, c.plain_tokens_per_s, c.spec_tokens_per_s,
       c.spec_tokens_per_s / c.plain_tokens_per_s AS engine_speedup, c.start_s,
       CASE WHEN d.enabled THEN 1 ELSE 0 END AS enabled, c.reason, c.log_path
FROM engine_checks c
LEFT JOIN domain_configs d ON d.run_id = c.run_id AND d.domain = c.domain
ORDER BY c.created_at DESC, c.domain;
