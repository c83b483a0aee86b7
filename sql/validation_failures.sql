-- Question: which losslessness checks failed, in which run, domain and drafter, and on which request?
-- Reads: validations (greedy exact match, sampling test, target fingerprint), newest first.
-- A failed check blocks promotion of that run's config; request_id names the request a greedy
--   mismatch was seen on (requests are named by id, never by prompt text).
SELECT v.created_at AS checked_at, v.run_id, v.domain, v.check_name, v.drafter, v.k,
       v.request_id, v.statistic, v.p_value
FROM validations v
WHERE NOT v.passed
ORDER BY v.created_at DESC, v.id DESC;
