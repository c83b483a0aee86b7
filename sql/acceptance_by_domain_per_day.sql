-- Question: how often are drafts accepted, per domain and day, for each drafter and K?
-- Reads: acceptance_estimates (offline, from logged responses) and live_measurements (real
--   speculative decoding on a subset), dated by the day each row was written.
-- Columns: day, domain, source (offline | live), drafter, k, runs, requests, tokens,
--   acceptance_rate (accepted / drafted, token-weighted mean over runs),
--   mean_accepted_length (tokens per round, pooled: total tokens / total rounds).
-- Empty until an evaluation run has written estimates or measurements. Interrupted runs
--   (eval_runs.status 'interrupted') are left out.
SELECT a.day, a.domain, a.source, a.drafter, a.k,
       COUNT(DISTINCT a.run_id) AS runs,
       SUM(a.requests) AS requests,
       SUM(a.tokens) AS tokens,
       SUM(a.acceptance_rate * a.tokens) / NULLIF(SUM(a.tokens), 0) AS acceptance_rate,
       SUM(a.tokens) / NULLIF(SUM(a.tokens / NULLIF(a.mean_accepted_length, 0)), 0) AS mean_accepted_length
FROM (
    SELECT date(e.created_at) AS day, e.run_id, e.domain, 'offline' AS source, e.drafter, e.k,
           e.requests, e.tokens * 1.0 AS tokens, e.acceptance_rate, e.mean_accepted_length
    FROM acceptance_estimates e
    WHERE e.run_id NOT IN (SELECT r.run_id FROM eval_runs r WHERE r.status = 'interrupted')
    UNION ALL
    SELECT date(m.created_at) AS day, m.run_id, m.domain, 'live' AS source, m.drafter, m.k,
           m.requests, m.tokens * 1.0 AS tokens, m.acceptance_rate, m.mean_accepted_length
    FROM live_measurements m
    WHERE m.acceptance_rate IS NOT NULL AND m.mean_accepted_length > 0
      AND m.run_id NOT IN (SELECT r.run_id FROM eval_runs r WHERE r.status = 'interrupted')
) a
GROUP BY a.day, a.domain, a.source, a.drafter, a.k
ORDER BY a.day, a.domain, a.source, a.drafter, a.k;
