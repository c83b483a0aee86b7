-- Question: is the cost model right, run after run (per domain)?
--   Predicted and measured speedup on the SAME live requests, so what is left is the cost
--   model's error, not sampling noise.
-- Reads: live_measurements (the confirm step's figures).
-- Columns: cost_model_error = measured / predicted_same_requests - 1 (negative: the planner was
--   optimistic; the gap flag fires beyond the tolerance); sampling_error = the confirm subset's
--   offline E / the domain's - 1 (how unlike the domain the few live requests were);
--   greedy_consistent of greedy_checked live greedy requests matched the offline estimate exactly.
SELECT date(created_at) AS day, run_id, domain, drafter, k, requests,
       predicted_same_requests, measured_speedup, cost_model_error,
       subset_expected_tokens, domain_expected_tokens, sampling_error,
       greedy_checked, greedy_consistent,
       CASE WHEN gap THEN 1 WHEN gap IS NULL THEN NULL ELSE 0 END AS gap
FROM live_measurements
ORDER BY created_at, domain;
